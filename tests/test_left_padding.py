"""Left-padded batches give each row the logits it has alone.

With an attention mask (0 on the left padding), every row runs as if it started at its first real
token: RoPE positions, the window's lower bound, the ratio-2 compressor's groups (pairs of
positions counted from the row's first token: an odd pad count shifts them), the visibility of
compressed positions, the indexer's ranking (exact numerics: over the row's own positions), the
reference's "last publisher" of index keys (per row), and the Engram look-back (pads are DEAD).
Pad positions' outputs are don't-care and never read by a real row.

Against the rows run alone (numerics="exact", CPU):

- **prefill: bit for bit**, also prefilled in chunks (a row may be all padding in a chunk). A row
  whose length is not a multiple of 8, run alone, ends in a partial trailing vector of the mHC
  mixes' ``[B, S, hc]`` sigmoid, which torch's vectorized CPU kernels may round differently (see
  test_chunked_prefill.py); its last ``length % 8`` positions are held to the end-to-end logits bound
  (`golden_bits.logits_rel_l2`), the
  others compared bit for bit;
- **decode steps: bit for bit against the same rows in an unpadded batch of the same size**.
  Against a row decoded alone (batch 1) the step logits differ in the last bits because CPU GEMM
  kernels round differently for 1 and 2 rows (fp32 and bf16 matmuls take another kernel for a
  single row; the reference itself would differ the same way), so those are held per step to the
  end-to-end logits bound instead.
"""

from __future__ import annotations

import pytest
import torch

from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41AttentionCache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import (
    DeepseekV41AttentionState,
    left_padding_offsets,
)
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

from golden_bits import CHAIN_REL_L2, argmax_agreement, assert_golden, logits_rel_l2
from golden_models import DECODE_STEPS, VARIANTS, golden_model, run_inputs
from test_fast_numerics import TINY_BUDGET
from helpers import rel_l2

import deepseek_v41_vl.modeling.numerics_deepseek_v41_vl as numerics_module

PAD_ID = 2
ARGMAX_AGREEMENT = 0.9  # on the fixture CPU (golden_bits.argmax_agreement)


# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def left_pad(rows: list[torch.Tensor], pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D id rows -> (ids [B, S], attention mask [B, S]), padded on the left."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - row.numel() :] = row
        mask[b, width - row.numel() :] = 1
    return ids, mask


def _alone(model, row: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(row[None], cache=DeepseekV41Cache(model.config), logits_to_keep=0).logits[0]


def _text_rows(golden, variant):
    tensors, _ = run_inputs(golden, variant, "text")
    return tensors["input_ids"][0], tensors["input_ids"][1], tensors["decode.token"]


def assert_row_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit up to the row's last whole 8 positions, the rest within the end-to-end logits bound.
    (Off the fixture CPU, golden_bits.py, the batch's GEMMs may block differently from the row's.)"""
    whole = got.size(0) - got.size(0) % 8
    assert_golden(got[:whole], want[:whole], what, rel_l2=CHAIN_REL_L2)
    if whole < got.size(0):
        assert rel_l2(got[whole:], want[whole:]) < logits_rel_l2(), what


@pytest.mark.parametrize("lengths", [(24, 19), (11, 24), (24, 16)])  # pads 5 (odd), 13, 8
@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_text_rows_prefill_like_their_rows_alone(golden, variant, lengths):
    model = golden_model(golden, variant)
    first, second, _ = _text_rows(golden, variant)
    rows = [first[: lengths[0]], second[: lengths[1]]]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=DeepseekV41Cache(model.config), logits_to_keep=0).logits
    for b, row in enumerate(rows):
        assert_row_matches(logits[b, ids.size(1) - row.numel() :], _alone(model, row), f"row {b}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_image_row_next_to_a_padded_text_row(golden, variant):
    """The golden VL prompt (160 positions, two images) batched with a text row padded by 136."""
    model = golden_model(golden, variant)
    vl, vl_inputs = run_inputs(golden, variant, "vl")
    _, text_row, _ = _text_rows(golden, variant)
    ids, mask = left_pad([vl["input_ids"][0], text_row])
    marks = torch.zeros_like(ids)
    marks[0] = vl_inputs["mm_token_type_ids"][0]
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, mm_token_type_ids=marks, pixel_values=vl_inputs["pixel_values"],
                       image_grid_thw=vl_inputs["image_grid_thw"], cache=cache, logits_to_keep=0).logits
    assert_golden(logits[0], vl["prefill.logits"][0], "VL row logits", rel_l2=CHAIN_REL_L2)
    assert_golden(logits[1, -text_row.numel() :], _alone(model, text_row), "text row logits", rel_l2=CHAIN_REL_L2)
    # each row's compressed KV and index keys sit at its own group indices
    alone = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(text_row[None], cache=alone)
    text_config = model.config.text_config
    for source in text_config.kv_source_layer_ids:
        ratio = text_config.compress_ratios[source]
        mine, its = cache.attention.layer(source), alone.attention.layer(source)
        assert_golden(mine.compressed_kv.rows(160 // ratio)[0], vl[f"prefill.compress_kv_cache.{source}"][0],
                      f"layer {source} compressed KV", rel_l2=CHAIN_REL_L2)
        assert_golden(mine.index_k.rows(160 // ratio)[0], vl[f"prefill.index_k_cache.{source}"][0],
                      f"layer {source} index keys", rel_l2=CHAIN_REL_L2)
        n = text_row.numel() // ratio
        assert torch.equal(mine.compressed_kv.rows(n)[1], its.compressed_kv.rows(n)[0])
        assert torch.equal(mine.index_k.rows(n)[1], its.index_k.rows(n)[0])


def _decode(model, cache, tokens: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Teacher-forced steps: tokens [steps, B] -> per step logits [B, V]."""
    out = []
    with torch.no_grad():
        for step in range(tokens.size(0)):
            if mask is not None:
                mask = torch.cat([mask, torch.ones(mask.size(0), 1, dtype=mask.dtype)], dim=1)
            out.append(model(tokens[step].view(-1, 1), attention_mask=mask, cache=cache).logits[:, -1])
    return out


@pytest.mark.parametrize("lengths", [(24, 19)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_decode_steps(golden, variant, lengths):
    """Decode after a padded prefill: each step's two rows group their ratio-2 pairs at different
    steps (odd pad count), so the per-row compressor state and index-key publisher are exercised.
    The twin batch's first row is compared (the second ends in the partial trailing vector)."""
    model = golden_model(golden, variant)
    first, second, golden_tokens = _text_rows(golden, variant)
    rows = [first[: lengths[0]], second[: lengths[1]]]
    tokens = golden_tokens[:DECODE_STEPS]  # [steps, 2], fed to both runs
    ids, mask = left_pad(rows)
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    padded = _decode(model, cache, tokens, mask)
    for b, row in enumerate(rows):
        # the row twice: an unpadded batch of the same size (the same GEMM row counts)
        twin = DeepseekV41Cache(model.config)
        with torch.no_grad():
            model(torch.stack([row, row]), cache=twin)
        twin_steps = _decode(model, twin, tokens[:, b : b + 1].expand(-1, 2), None)
        single = DeepseekV41Cache(model.config)
        with torch.no_grad():
            model(row[None], cache=single)
        single_steps = _decode(model, single, tokens[:, b : b + 1], None)
        for step in range(DECODE_STEPS):
            assert torch.equal(padded[step][b], twin_steps[step][0]), (b, step)
            assert rel_l2(padded[step][b], single_steps[step][0]) < logits_rel_l2(), (b, step)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pad_tokens_do_not_leak_into_real_rows(golden, variant):
    model = golden_model(golden, variant)
    first, second, _ = _text_rows(golden, variant)
    ids, mask = left_pad([first, second[:13]])
    with torch.no_grad():
        want = model(ids, attention_mask=mask, logits_to_keep=0).logits[:, -13:]
        for pads in (torch.zeros(11, dtype=torch.long), torch.randint(9, 499, (11,), generator=torch.Generator().manual_seed(0))):
            other = ids.clone()
            other[1, :11] = pads
            got = model(other, attention_mask=mask, logits_to_keep=0).logits[:, -13:]
            assert torch.equal(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batch_prefilled_in_chunks(golden, variant):
    """Chunks of a padded batch (the text row is all padding in the first chunks) equal its one
    prefill; with the prompt length known, bit for bit (see test_chunked_prefill.py)."""
    model = golden_model(golden, variant)
    vl, vl_inputs = run_inputs(golden, variant, "vl")
    _, text_row, _ = _text_rows(golden, variant)
    ids, mask = left_pad([vl["input_ids"][0], text_row])
    marks = torch.zeros_like(ids)
    marks[0] = vl_inputs["mm_token_type_ids"][0]
    with torch.no_grad():
        want = model(ids, attention_mask=mask, mm_token_type_ids=marks, pixel_values=vl_inputs["pixel_values"],
                     image_grid_thw=vl_inputs["image_grid_thw"], logits_to_keep=0).logits
        span_rows = model.get_image_span_embeddings(vl_inputs["pixel_values"], vl_inputs["image_grid_thw"])
    for bounds in ([0, 64, 128, 144, 160], [0, 40, 136, 160]):
        cache = DeepseekV41Cache(model.config)
        cache.attention.prefill_length = 160
        used, logits = 0, []
        with torch.no_grad():
            for start, end in zip(bounds[:-1], bounds[1:]):
                n_rows = int(marks[:, start:end].sum())
                out = model(ids[:, start:end], attention_mask=mask[:, :end], mm_token_type_ids=marks[:, start:end],
                            image_span_embeds=span_rows[used : used + n_rows], cache=cache, logits_to_keep=0)
                used += n_rows
                logits.append(out.logits)
        logits = torch.cat(logits, dim=1)
        assert torch.equal(logits[0], want[0]), bounds
        assert torch.equal(logits[1, 136:], want[1, 136:]), bounds


@pytest.mark.parametrize("budget", [None, TINY_BUDGET])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fast_numerics_padded_rows_are_close_to_their_rows_alone(golden, monkeypatch, variant, budget):
    if budget is not None:
        monkeypatch.setattr(numerics_module, "FAST_MAX_ELEMENTS", budget)
    model = golden_model(golden, variant, "fast")
    first, second, _ = _text_rows(golden, variant)
    rows = [first, second[:19]]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, logits_to_keep=0).logits
    for b, row in enumerate(rows):
        got, want = logits[b, ids.size(1) - row.numel() :], _alone(model, row)
        assert rel_l2(got, want) < logits_rel_l2()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= argmax_agreement(ARGMAX_AGREEMENT)


def test_left_padding_offsets():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert left_padding_offsets(mask, 0, 4).tolist() == [2, 0]
    assert left_padding_offsets(mask, 3, 1).tolist() == [2, 0]  # a decode step's mask covers the past
    assert left_padding_offsets(torch.ones(2, 4, dtype=torch.long), 0, 4) is None
    assert left_padding_offsets(None, 0, 4) is None
    assert left_padding_offsets(torch.tensor([[0, 0, 0, 0]]), 0, 4).tolist() == [4]  # all padding so far
    with pytest.raises(DeepseekV41AttentionError, match="left padding"):
        left_padding_offsets(torch.tensor([[1, 1, 0, 0]]), 0, 4)
    with pytest.raises(DeepseekV41AttentionError, match="past \\+ seq"):
        left_padding_offsets(mask, 2, 4)
    with pytest.raises(DeepseekV41AttentionError, match="only 0"):
        left_padding_offsets(mask * 2, 0, 4)


# ------------------------------------------------------------------ attention-level semantics


def _attention_stack():
    from test_attention import _random_layers, _tiny_config

    # window-only, ratio-2 kv/index source, ratio-1 kv source + candidate source, candidate user, reuse
    config = _tiny_config([0, 2, 1, 1, 1], [1, 2], [1, 2, 3], 2, index_topk=4, candidate_blocks=3)
    return config, _random_layers(config)


def _attend(layers, xs, bounds, steps, pad_offsets=None):
    """Prefill chunks [bounds[i], bounds[i+1]) (the prompt length known), then one-token steps;
    per layer outputs [B, T, D]."""
    cache = DeepseekV41AttentionCache()
    cache.prefill_length = bounds[-1]
    outs = [[] for _ in layers]
    points = list(zip(bounds[:-1], bounds[1:])) + [(t, t + 1) for t in range(bounds[-1], bounds[-1] + steps)]
    for start, end in points:
        state = DeepseekV41AttentionState(start_pos=start, cache=cache, pad_offsets=pad_offsets)
        for i, (layer, x) in enumerate(zip(layers, xs)):
            outs[i].append(layer(x[:, start:end], state))
    return [torch.cat(o, dim=1) for o in outs], cache


@pytest.mark.parametrize("bounds", [[0, 29], [0, 4, 10, 29]])  # row 1 is all padding in [0, 4)
def test_attention_rows_left_padded_like_alone(bounds):
    """Rows of 29 and 22 real tokens (7 pads: odd, so row 1's ratio-2 groups fall on the other
    parity of the batch's columns), prefill then 6 steps (the rows complete groups at different
    steps, so on a step where only one does, the other's ratio-2 indexer reads the ratio-1 keys:
    the reference's "last publisher", per row). Each row equals itself alone, run twice in an
    unpadded batch (the same GEMM row counts): outputs, compressed KV and index keys at the row's
    own group indices, bit for bit."""
    config, layers = _attention_stack()
    gen = torch.Generator().manual_seed(6)
    steps, pads = 6, torch.tensor([0, 7])
    total = bounds[-1] + steps
    rows = [torch.randn(total, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in range(2)]
    xs = [torch.stack([row.roll(i, 0) for row in rows]) for i in range(len(layers))]  # per layer inputs
    for x in xs:
        x[1, :7] = torch.randn(7, config.hidden_size, generator=gen).to(torch.bfloat16)  # pad garbage
    got, cache = _attend(layers, xs, bounds, steps, pads)
    for b in range(2):
        own = [x[b, pads[b] :].expand(2, -1, -1) for x in xs]
        want, want_cache = _attend(layers, own, [0, bounds[-1] - int(pads[b])], steps)
        for i in range(len(layers)):
            assert torch.equal(got[i][b, pads[b] :], want[i][0]), (b, i)
        for source in config.kv_source_layer_ids:
            n = (total - int(pads[b])) // config.compress_ratios[source]
            mine, its = cache.layer(source), want_cache.layer(source)
            assert torch.equal(mine.compressed_kv.rows(n)[b], its.compressed_kv.rows(n)[0]), (b, source)
            assert torch.equal(mine.index_k.rows(n)[b], its.index_k.rows(n)[0]), (b, source)
