"""Chunked prefill: a prompt prefilled in several chunks gives the logits of one prefill.

The reference only prefills from position 0 in one call; a chunk of S > 1 tokens after position 0
continues the sequence here (window ring + chunk rows, the ratio-2 compressor's parked partial
group, visibility j < (t + 1) // ratio, the indexer over every compressed position so far, the
Engram history). Images: `get_image_span_embeddings` encodes each image once; every chunk gets the
rows of the span positions it holds, so a chunk boundary may fall inside an image span.

Against the golden one-shot prefill (numerics="exact", CPU):

- **Bit for bit** when the cache knows the prompt length (`cache.attention.prefill_length`) and
  every chunk holds a multiple of 8 rows (B x S): logits at every position, the compressed KV and
  index keys left in the cache, and the 12 golden decode steps that follow.
- **Without the prompt length** the chunks pick the same compressed positions except at exact
  ties of the bf16 index scores: `torch.topk` (CPU, `sorted=False`) breaks ties depending on the
  width it ranks, and a chunk ranks fewer (not yet existing) positions than one prefill. The
  first position where a chunked run differs must be one of the ties the golden meta lists
  (`finite_boundary_ties`); past it the tiny model's chaos (README "Tolerances") applies, so the
  logits are held to the end-to-end bounds (`golden_bits.logits_rel_l2` / `argmax_agreement`).
- **Chunks of 5-7 rows (mod 8)**: torch's vectorized CPU `sigmoid` rounds some elements of a
  partial trailing vector differently, so the mHC mixes of such a chunk (a ``[B, S, hc]``
  sigmoid) can differ by an ulp from the one-shot's: a kernel whose rounding depends on the number
  of rows. Held per block (every block output) and end to end within those bounds.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41AttentionCache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import (
    DeepseekV41AttentionState,
    chunk_window_idxs,
    window_topk_idxs,
)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.debug_deepseek_v41_vl import capture_intermediates

from golden_bits import (
    CHAIN_REL_L2,
    LOCAL_REL_L2,
    argmax_agreement,
    assert_golden,
    fixture_cpu,
    logits_rel_l2,
    record_deviation,
)
from golden_models import DECODE_STEPS, VARIANTS, golden_model, run_inputs
from helpers import rel_l2

# README "Recommendations", 3: end to end without bit-exactness (on the fixture CPU; golden_bits)
ARGMAX_AGREEMENT = 0.93
# per block: the README's +-1 ulp probe moves block_out.7 by rel L2 0.025 (bf16) / 0.044 (fp8)
BLOCK_REL_L2 = 0.05

# VL run (S = 160): image 0 spans [20, 82), image 1 [87, 134)
VL_PLANS = {
    "inside_both_images": [0, 48, 96, 160],
    "every_16": list(range(0, 161, 16)),
    "uneven": [0, 8, 24, 88, 160],  # 88: one position into image 1's span
}
TEXT_PLANS = {"8_16": [0, 8, 24], "4_8_12": [0, 4, 12, 24]}  # batch 2: 8, 16, 24 rows per chunk


# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prefill_in_chunks(model, inputs: dict, bounds: list[int], prompt_length_known: bool, capture: bool = False):
    """Prefill `inputs` in the chunks [bounds[i], bounds[i+1]); returns (logits at every position,
    the cache, the captured boundaries concatenated over the chunks (when `capture`))."""
    cache = DeepseekV41Cache(model.config)
    if prompt_length_known:
        cache.attention.prefill_length = bounds[-1]
    ids, marks = inputs["input_ids"], inputs.get("mm_token_type_ids")
    span_rows = None
    if "pixel_values" in inputs:
        with torch.no_grad():
            span_rows = model.get_image_span_embeddings(inputs["pixel_values"], inputs["image_grid_thw"])
        assert span_rows.size(0) == int(marks.sum())
    used, logits, captures = 0, [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        kwargs = {}
        if marks is not None:
            kwargs["mm_token_type_ids"] = marks[:, start:end]
            n_rows = int(marks[:, start:end].sum())
            if n_rows:
                kwargs["image_span_embeds"] = span_rows[used : used + n_rows]
            used += n_rows
        with torch.no_grad(), capture_intermediates(model) as captured:
            logits.append(model(ids[:, start:end], cache=cache, logits_to_keep=0, **kwargs).logits)
        captures.append(dict(captured))
    blocks = {}
    if capture:
        blocks = {k: torch.cat([c[k] for c in captures], dim=1) for k in captures[0] if k.startswith("block_out.")}
    return torch.cat(logits, dim=1), cache, blocks


def _tie_rows(golden, variant: str, run: str) -> set[int]:
    meta = json.loads((golden / variant / "meta.json").read_text())
    ties = meta[f"{run}_run"]["topk_analysis"]["finite_boundary_ties"]
    return {t["row"] for t in ties if t["where"].startswith("prefill")}


def _plans():
    for name, bounds in VL_PLANS.items():
        yield "vl", name, bounds
    for name, bounds in TEXT_PLANS.items():
        yield "text", name, bounds


@pytest.mark.parametrize("run,plan,bounds", list(_plans()), ids=[f"{r}-{p}" for r, p, _ in _plans()])
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_is_bit_exact(golden, variant, run, plan, bounds):
    model = golden_model(golden, variant)
    tensors, inputs = run_inputs(golden, variant, run)
    assert bounds[-1] == inputs["input_ids"].size(1)
    logits, cache, _ = prefill_in_chunks(model, inputs, bounds, prompt_length_known=True)
    assert_golden(logits, tensors["prefill.logits"], "chunked prefill logits", rel_l2=CHAIN_REL_L2)
    assert cache.get_seq_length() == bounds[-1]
    text_config = model.config.text_config
    for source in text_config.kv_source_layer_ids:
        layer_cache = cache.attention.layer(source)
        rows = bounds[-1] // text_config.compress_ratios[source]
        assert_golden(layer_cache.compressed_kv.rows(rows), tensors[f"prefill.compress_kv_cache.{source}"],
                      f"layer {source} compressed KV", rel_l2=CHAIN_REL_L2)
        assert_golden(layer_cache.index_k.rows(rows), tensors[f"prefill.index_k_cache.{source}"],
                      f"layer {source} index keys", rel_l2=CHAIN_REL_L2)
    # decoding continues from the chunked cache exactly as from the reference's (golden tokens fed)
    token = tensors["prefill.next_token"]
    for step in range(DECODE_STEPS):
        with torch.no_grad():
            out = model(token.view(-1, 1), cache=cache).logits[:, -1]
        assert_golden(out, tensors["decode.logits"][step], f"decode step {step} logits", rel_l2=CHAIN_REL_L2)
        token = tensors["decode.token"][step]


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunks_without_the_prompt_length_differ_only_from_a_top_k_tie_on(golden, variant):
    """No `prefill_length`: a chunk ranks the positions that exist so far, so exact ties of the
    index scores may resolve otherwise than in one prefill (see the module doc)."""
    model = golden_model(golden, variant)
    tensors, inputs = run_inputs(golden, variant, "vl")
    want = tensors["prefill.logits"]
    ties = _tie_rows(golden, variant, "vl")
    for bounds in (VL_PLANS["inside_both_images"], VL_PLANS["every_16"]):
        logits, _, blocks = prefill_in_chunks(model, inputs, bounds, prompt_length_known=False, capture=True)
        differing = (logits != want).any(-1)[0].nonzero().flatten().tolist()
        if differing and fixture_cpu():
            assert differing[0] in ties, f"first differing position {differing[0]} is not a top-k tie {sorted(ties)}"
        elif differing and differing[0] not in ties:
            # off the fixture CPU the one-shot prefill itself differs from the golden (golden_bits.py)
            record_deviation(f"first differing position {differing[0]}, not a top-k tie: not checked on this CPU")
        assert rel_l2(logits, want) < logits_rel_l2()
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= argmax_agreement(ARGMAX_AGREEMENT)
        for name, got in blocks.items():
            assert rel_l2(got, tensors[f"prefill.{name}"]) < BLOCK_REL_L2, name


@pytest.mark.parametrize("run", ["vl", "text"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunks_of_row_dependent_rounding_stay_within_bounds(golden, variant, run):
    """Chunks of 7 tokens: rows 5-7 (mod 8) of a chunk, where CPU `sigmoid` rounds a partial
    trailing vector differently (see the module doc). Per block and end to end within bounds."""
    model = golden_model(golden, variant)
    tensors, inputs = run_inputs(golden, variant, run)
    seqlen = inputs["input_ids"].size(1)
    want = tensors["prefill.logits"]
    for step in (7,):
        bounds = list(range(0, seqlen, step)) + [seqlen]
        logits, _, blocks = prefill_in_chunks(model, inputs, bounds, prompt_length_known=True, capture=True)
        assert set(blocks) == {f"block_out.{i}" for i in range(model.config.text_config.num_hidden_layers)}
        for name, got in blocks.items():
            assert rel_l2(got, tensors[f"prefill.{name}"]) < BLOCK_REL_L2, (step, name)
        assert rel_l2(logits, want) < logits_rel_l2(), step
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= argmax_agreement(ARGMAX_AGREEMENT), step


def test_image_span_rows_are_the_merged_embeddings(golden):
    """`get_image_span_embeddings` holds exactly the vectors the one-shot merge writes."""
    model = golden_model(golden, "model_tiny_bf16")
    tensors, inputs = run_inputs(golden, "model_tiny_bf16", "vl")
    with torch.no_grad():
        rows = model.get_image_span_embeddings(inputs["pixel_values"], inputs["image_grid_thw"])
    marks = inputs["mm_token_type_ids"][0].bool()
    assert_golden(rows, tensors["prefill.embed.merged"][0][marks], "image span rows", rel_l2=LOCAL_REL_L2)


def test_chunk_inputs_are_checked_and_refusals_leave_no_trace(golden):
    model = golden_model(golden, "model_tiny_bf16")
    tensors, inputs = run_inputs(golden, "model_tiny_bf16", "vl")
    ids, marks = inputs["input_ids"], inputs["mm_token_type_ids"]
    bounds = VL_PLANS["every_16"][:2] + [48, 96, 160]
    with torch.no_grad():
        rows = model.get_image_span_embeddings(inputs["pixel_values"], inputs["image_grid_thw"])
        cache = DeepseekV41Cache(model.config)
        cache.attention.prefill_length = 160
        logits = [model(ids[:, :16], cache=cache, mm_token_type_ids=marks[:, :16], logits_to_keep=0).logits]
        chunk = {"mm_token_type_ids": marks[:, 16:48]}  # span positions 20..47: 28 rows
        with pytest.raises(DeepseekV41ModelError, match=r"image_span_embeds must be \[28, D\]"):
            model(ids[:, 16:48], cache=cache, image_span_embeds=rows[:3], **chunk)
        with pytest.raises(DeepseekV41ModelError, match="no pixel_values"):
            model(ids[:, 16:48], cache=cache, **chunk)
        # pixel_values need whole spans: a chunk holding part of one takes image_span_embeds
        with pytest.raises(DeepseekV41ModelError, match="marks 28 image-span positions"):
            model(ids[:, 16:48], cache=cache, pixel_values=inputs["pixel_values"],
                  image_grid_thw=inputs["image_grid_thw"], **chunk)
        with pytest.raises(DeepseekV41ModelError, match="without mm_token_type_ids"):
            model(ids[:, 16:48], cache=cache, image_span_embeds=rows[:28])
        with pytest.raises(DeepseekV41ModelError, match="carry image_token_id"):
            model(ids[:, 12:44], cache=cache, image_span_embeds=rows[:28], **chunk)
        # the refused calls changed nothing: the prefill goes on to the golden logits
        used = 0
        for start, end in zip(bounds[1:-1], bounds[2:]):
            n_rows = int(marks[:, start:end].sum())
            out = model(ids[:, start:end], cache=cache, mm_token_type_ids=marks[:, start:end],
                        image_span_embeds=rows[used : used + n_rows], logits_to_keep=0)
            logits.append(out.logits)
            used += n_rows
    assert_golden(torch.cat(logits, dim=1), tensors["prefill.logits"], "chunked prefill logits", rel_l2=CHAIN_REL_L2)
    # a chunk after position 0 needs the state of a prefill
    fresh = DeepseekV41Cache(model.config)
    fresh.record_tokens(4)
    fresh.engram_history = cache.engram_history
    with pytest.raises(DeepseekV41AttentionError, match="before any prefill"), torch.no_grad():
        model(ids[:, 4:8], cache=fresh)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_numerics_chunked_prefill_is_close(golden, variant):
    """numerics="fast" (the default; what generation runs): chunked vs its own one prefill."""
    model = golden_model(golden, variant, "fast")
    tensors, inputs = run_inputs(golden, variant, "vl")
    with torch.no_grad():
        want = model(**inputs, logits_to_keep=0).logits
    for bounds in (list(range(0, 160, 7)) + [160],):
        logits, _, _ = prefill_in_chunks(model, inputs, bounds, prompt_length_known=False)
        assert rel_l2(logits, want) < logits_rel_l2()
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= argmax_agreement(ARGMAX_AGREEMENT)


# ------------------------------------------------------------------ attention-level semantics


def test_chunk_window_rows_follow_the_one_shot_layout():
    # window 4; a chunk of 3 at position 5: ring slots (position % 4) for 2..4, then rows 4.. = 5..7
    idxs = chunk_window_idxs(4, 1, 3, 5)
    assert idxs[0].tolist() == [[2 % 4, 3 % 4, 4 % 4, 4], [3, 0, 4, 5], [0, 4, 5, 6]]
    # a chunk at position 1 (ring not yet full): columns ascend from position 0, -1 after the query
    assert chunk_window_idxs(4, 1, 2, 1)[0].tolist() == [[0 % 4, 4, -1], [0, 4, 5]]
    # at position 0 it is the reference's prefill layout; `span` widens to one prefill's width
    assert torch.equal(chunk_window_idxs(3, 2, 5, 0), window_topk_idxs(3, 2, 5, 0))
    assert chunk_window_idxs(4, 1, 2, 0, span=10)[0].tolist() == [[0, -1, -1, -1], [0, 1, -1, -1]]
    # left padding: row 1 has 2 pads, its window starts at its first real token (column 2)
    padded = chunk_window_idxs(4, 2, 4, 0, torch.tensor([0, 2]))
    assert padded[1].tolist() == [[-1] * 4, [-1] * 4, [2, -1, -1, -1], [2, 3, -1, -1]]
    assert padded[0].tolist() == chunk_window_idxs(4, 1, 4, 0)[0].tolist()


def _attention_stack():
    from test_attention import _random_layers, _tiny_config

    # window-only, ratio-2 kv/index source, ratio-1 kv source + candidate source, candidate user, reuse
    config = _tiny_config([0, 2, 1, 1, 1], [1, 2], [1, 2, 3], 2, index_topk=4, candidate_blocks=3)
    return config, _random_layers(config)


def _run_chunks(layers, xs, bounds, pad_offsets=None, prefill_length=None):
    cache = DeepseekV41AttentionCache()
    cache.prefill_length = prefill_length
    outs = [[] for _ in layers]
    for start, end in zip(bounds[:-1], bounds[1:]):
        state = DeepseekV41AttentionState(start_pos=start, cache=cache, pad_offsets=pad_offsets)
        for i, (layer, x) in enumerate(zip(layers, xs)):
            outs[i].append(layer(x[:, start:end], state))
    return [torch.cat(o, dim=1) for o in outs], cache


@pytest.mark.parametrize("length_known", [True, False])
@pytest.mark.parametrize("bounds", [[0, 3, 8, 13, 29], [0, 2, 29], [0, 1, 9, 29], [0, 16, 29]])
def test_compressed_state_continues_across_chunks(bounds, length_known):
    """The compressed KV, index keys, window ring and parked partial group after chunks (odd
    boundaries split ratio-2 groups) equal one prefill's, bit for bit (they do not depend on any
    top-k). With the prompt length known, every layer's output too; without, the layers whose
    queries have no choice to make (the random scores here tie often: relu zeros)."""
    config, layers = _attention_stack()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 29, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in layers]
    want, want_cache = _run_chunks(layers, xs, [0, 29])
    got, cache = _run_chunks(layers, xs, bounds, prefill_length=29 if length_known else None)
    for source in config.kv_source_layer_ids:
        a, b = cache.layer(source), want_cache.layer(source)
        assert a.compressed_kv.length == b.compressed_kv.length == 29 // config.compress_ratios[source]
        assert torch.equal(a.compressed_kv.rows(a.compressed_kv.length), b.compressed_kv.rows(b.compressed_kv.length))
        assert torch.equal(a.index_k.rows(a.index_k.length), b.index_k.rows(b.index_k.length))
        assert torch.equal(a.window_kv, b.window_kv)
    # position 28 is parked (slot 0) for the next forward
    assert torch.equal(cache.layer(1).compressor_kv[:, :1], want_cache.layer(1).compressor_kv[:, :1])
    assert torch.equal(cache.layer(1).compressor_score[:, :1], want_cache.layer(1).compressor_score[:, :1])
    assert torch.equal(got[0], want[0])  # window only: no top-k
    assert torch.equal(got[1][:, :8], want[1][:, :8])  # <= index_topk positions visible: no choice
    if length_known:
        for i in range(len(layers)):
            assert torch.equal(got[i], want[i]), i
