"""End-to-end parity of the V4.1 VL backbone with the reference, bit for bit (numerics="exact").

For both tiny golden models (`model_tiny_bf16`, `model_tiny_fp8`) and both runs (the VL run with
two images, the batch-2 text run) this checks, with `torch.equal`:

- prefill: `embed.lookup`, `embed.merged`, `image{k}.aligner_out`, `engram_hash_ids`, per block
  `pre_mix_in`, `block_in` (Engram layers), `attn_out`, `indexer.topk_idxs`, `gate.*`,
  `block_out`, then `final_hc_collapsed`, `head_in`, the full `logits`, the returned last-position
  logits and the first generated token;
- 12 greedy decode steps through :class:`DeepseekV41Cache`: `engram_hash_ids`, `gate.*`,
  `indexer.*.topk_idxs`, `logits`, `token`;
- each block alone, teacher-forced with the golden block input and pre-mix (localizes a failure
  to one block).

A failure names the FIRST boundary (in dataflow order) that differs.
"""

from __future__ import annotations



import json
from pathlib import Path

import pytest
import torch

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41CacheError
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41Transformer
from deepseek_v41_vl.modeling.debug_deepseek_v41_vl import capture_intermediates
from deepseek_v41_vl.modeling.image_spans_deepseek_v41_vl import image_token_roles
from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import DeepseekV41VisionInputError

from golden_bits import CHAIN_REL_L2, LOCAL_MISMATCH, LOCAL_REL_L2, assert_golden, fixture_cpu, record_deviation
from golden_models import (
    DECODE_STEPS,
    RUNS,
    VARIANTS,
    checkpoint_to_module_dtypes,
    golden_checkpoint,
    golden_model,
    run_inputs,
)

# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


_RESULTS: dict[tuple[str, str], dict] = {}


def run_reference_sequence(golden: Path, variant: str, run: str) -> dict:
    """Prefill then 12 decode steps fed the golden tokens; every boundary captured."""
    key = (variant, run)
    if key in _RESULTS:
        return _RESULTS[key]
    model = golden_model(golden, variant)
    tensors, inputs = run_inputs(golden, variant, run)
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad(), capture_intermediates(model) as prefill:
        out = model(**inputs, cache=cache, logits_to_keep=0)
    prefill = dict(prefill, logits=out.logits)
    with torch.no_grad():
        # what the default logits_to_keep=1 computes: the head GEMM over [B, D]
        prefill["logits_last_returned"] = model.head(out.last_hidden_state[:, -1])
    prefill["next_token"] = prefill["logits_last_returned"].argmax(-1)
    # what the KV sources left in the cache for the decode steps (RoPE'd fp4 latents, index keys)
    seqlen = inputs["input_ids"].size(1)
    text_config = model.config.text_config
    for source in text_config.kv_source_layer_ids:
        layer_cache = cache.attention.layer(source)
        rows = seqlen // text_config.compress_ratios[source]
        prefill[f"compress_kv_cache.{source}"] = layer_cache.compressed_kv.rows(rows).clone()
        prefill[f"index_k_cache.{source}"] = layer_cache.index_k.rows(rows).clone()
    decode: dict[str, list[torch.Tensor]] = {}
    token = tensors["prefill.next_token"]
    for step in range(DECODE_STEPS):
        with torch.no_grad(), capture_intermediates(model) as captured:
            out = model(token.view(-1, 1), cache=cache)
        captured["logits"] = out.logits[:, -1]
        captured["token"] = captured["logits"].argmax(-1)
        for name, value in captured.items():
            decode.setdefault(name, []).append(value)
        token = tensors["decode.token"][step]  # teacher-forced, so one divergence does not cascade
    _RESULTS[key] = {"tensors": tensors, "prefill": prefill, "decode": decode, "cache": cache}
    return _RESULTS[key]


# --------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------


def prefill_boundaries(n_layers: int, tensors: dict) -> list[str]:
    """Golden prefill names the port must reproduce, in dataflow order."""
    names = ["embed.lookup"]
    names += sorted(k.removeprefix("prefill.") for k in tensors if k.endswith(".aligner_out"))
    names += ["embed.merged", "engram_hash_ids"]
    for i in range(n_layers):
        names += [f"pre_mix_in.{i}", f"block_in.{i}", f"attn_out.{i}", f"indexer.{i}.topk_idxs"]
        names += [f"gate.{i}.biased_scores", f"gate.{i}.indices", f"gate.{i}.weights", f"block_out.{i}"]
    names += ["final_hc_collapsed", "head_in", "logits", "logits_last_returned", "next_token"]
    names += sorted(k.removeprefix("prefill.") for k in tensors if "_cache." in k)
    return [n for n in names if f"prefill.{n}" in tensors]


def describe(ours: torch.Tensor, ref: torch.Tensor) -> str:
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        return f"ours {ours.dtype}{tuple(ours.shape)} vs golden {ref.dtype}{tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs()
    return f"{int((diff > 0).sum())} of {diff.numel()} elements differ, max abs {diff.max().item():.3g}"


def first_mismatches(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor]]) -> list[str]:
    bad = []
    for name, ours, ref in pairs:
        if ours is None:
            bad.append(f"{name}: not captured")
        elif not (ours.dtype == ref.dtype and ours.shape == ref.shape and torch.equal(ours, ref)):
            bad.append(f"{name}: {describe(ours, ref)}")
    return bad


def assert_all_equal(pairs, what: str, *, rel_l2: float, mismatch: float | None) -> None:
    """Every boundary bit for bit, naming the FIRST one that differs. Off the fixture CPU
    (golden_bits.py) each float boundary must instead stay within `rel_l2`, and each id boundary
    within `mismatch`; `mismatch=None`: ids picked after the chaos has grown (a handful of top-k
    picks can all flip) are recorded, not bounded."""
    bad = first_mismatches(pairs)
    if not bad:
        return
    if fixture_cpu() or any(ours is None for _, ours, _ in pairs):
        raise AssertionError(
            f"{what}: FIRST differing boundary is {bad[0]}; {len(bad)} of {len(pairs)} differ: " + "; ".join(bad[:8])
        )
    for name, ours, ref in pairs:
        if ref.is_floating_point():
            assert_golden(ours, ref, f"{what} {name}", rel_l2=rel_l2)
        elif mismatch is not None:
            assert_golden(ours, ref, f"{what} {name}", mismatch=mismatch)
        elif not torch.equal(ours, ref):
            record_deviation(f"{what} {name}: {describe(ours, ref)}, not bounded on this CPU")


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_is_a_strict_state_dict(golden, variant):
    model = golden_model(golden, variant)
    config = model.config
    state = checkpoint_to_module_dtypes(golden_checkpoint(golden, variant), config)
    ours = model.state_dict()
    # every checkpoint tensor lands under its own name and module dtype; only the token map is extra
    assert set(ours) - set(state) == {"engram_hash.token_map"}
    assert set(state) <= set(ours)
    for name, tensor in state.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
    del state["layers.0.hc_attn_fn"]
    fresh = DeepseekV41Transformer(config)
    with pytest.raises(RuntimeError, match="layers.0.hc_attn_fn"):
        fresh.load_state_dict(state, strict=True)


def test_image_roles_rebuild_the_reference_token_types(golden):
    tensors, inputs = run_inputs(golden, "model_tiny_bf16", "vl")
    roles = image_token_roles(inputs["mm_token_type_ids"], inputs["image_grid_thw"], 3)
    assert torch.equal(roles, tensors["token_types"])


def test_image_roles_reject_spans_that_do_not_fit(golden):
    _, inputs = run_inputs(golden, "model_tiny_bf16", "vl")
    mm, grid = inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    with pytest.raises(DeepseekV41ModelError, match="needs a span of"):
        image_token_roles(mm, grid.flip(0), 3, error=DeepseekV41ModelError)
    with pytest.raises(DeepseekV41ModelError, match="more image spans"):
        image_token_roles(mm, grid[:1], 3, error=DeepseekV41ModelError)
    with pytest.raises(DeepseekV41ModelError, match="image_grid_thw has 3 rows"):
        image_token_roles(mm, torch.cat([grid, grid[:1]]), 3, error=DeepseekV41ModelError)
    with pytest.raises(DeepseekV41ModelError, match="only 0"):
        image_token_roles(mm * 2, grid, 3, error=DeepseekV41ModelError)
    model = golden_model(golden, "model_tiny_bf16")
    with pytest.raises(DeepseekV41ModelError, match="no pixel_values"):
        model(inputs["input_ids"], inputs["mm_token_type_ids"])
    shifted = dict(inputs, mm_token_type_ids=inputs["mm_token_type_ids"].roll(1, dims=1))
    with pytest.raises(DeepseekV41ModelError, match="image_token_id 500"):
        model(**shifted)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_is_bit_exact(golden, variant, run):
    result = run_reference_sequence(golden, variant, run)
    tensors, ours = result["tensors"], result["prefill"]
    n_layers = golden_model(golden, variant).config.text_config.num_hidden_layers
    names = prefill_boundaries(n_layers, tensors)
    # the ones the port must cover, present in both runs
    required = ("embed.lookup", "engram_hash_ids", "block_out.0", "pre_mix_in.7", "gate.7.weights", "logits")
    for name in required + ("compress_kv_cache.1", "index_k_cache.4"):
        assert name in names
    if run == "vl":
        assert {"embed.merged", "image0.aligner_out", "image1.aligner_out", "attn_out.0"} <= set(names)
    assert_all_equal([(n, ours.get(n), tensors[f"prefill.{n}"]) for n in names], f"{variant} {run} prefill",
                     rel_l2=CHAIN_REL_L2, mismatch=None)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_is_bit_exact(golden, variant, run):
    result = run_reference_sequence(golden, variant, run)
    tensors, decode = result["tensors"], result["decode"]
    names = [k.removeprefix("decode.") for k in tensors if k.startswith("decode.")]
    # dataflow order within a step: hashes, then layer by layer, then the output
    def position(name: str) -> float:
        if name in ("logits", "token"):
            return float("inf") if name == "token" else 1e9
        parts = name.split(".")
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1

    names.sort(key=position)
    assert {"logits", "token", "engram_hash_ids", "gate.0.indices", "indexer.6.topk_idxs"} <= set(names)
    pairs = []
    for step in range(DECODE_STEPS):
        for n in names:
            ours = decode[n][step] if n in decode else None
            pairs.append((f"step {step} {n}", ours, tensors[f"decode.{n}"][step]))
    assert_all_equal(pairs, f"{variant} {run} decode", rel_l2=CHAIN_REL_L2, mismatch=None)
    assert result["cache"].get_seq_length() == tensors["input_ids"].size(1) + DECODE_STEPS


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_block_teacher_forced(golden, variant, run):
    """Block i fed the golden input and pre-mix (blocks in order, sharing one attention state)."""
    model = golden_model(golden, variant)
    tensors, inputs = run_inputs(golden, variant, run)
    index = json.loads((golden / variant / "meta.json").read_text())["hidden_state_index"]
    image_mask = inputs["mm_token_type_ids"].bool() if run == "vl" else None
    state = DeepseekV41AttentionState(start_pos=0)
    pairs = []
    with torch.no_grad(), capture_intermediates(model) as captured:
        for i, layer in enumerate(model.layers):
            x = tensors[index[str(i)]["entering_block"]]
            out, _ = layer.block(x, tensors[f"prefill.pre_mix_in.{i}"], state, image_mask)
            names = [f"attn_out.{i}", f"indexer.{i}.topk_idxs", f"gate.{i}.indices", f"gate.{i}.weights"]
            pairs += [(n, captured.get(n), tensors[f"prefill.{n}"]) for n in names if f"prefill.{n}" in tensors]
            pairs.append((f"block_out.{i}", out, tensors[f"prefill.block_out.{i}"]))
    assert len(pairs) >= 3 * len(model.layers)
    assert_all_equal(pairs, f"{variant} {run} teacher-forced blocks", rel_l2=LOCAL_REL_L2, mismatch=LOCAL_MISMATCH)


def test_a_filled_cache_takes_left_padded_chunks_and_later_images(golden):
    model = golden_model(golden, "model_tiny_bf16")
    tensors, inputs = run_inputs(golden, "model_tiny_bf16", "vl")
    cache = DeepseekV41Cache(model.config)
    ids = tensors["input_ids"][:, :8]
    with torch.no_grad():
        model(ids, cache=cache)
        # a multi-token call on a filled cache is a prefill chunk; its mask must be left padding
        with pytest.raises(ValueError, match="left padding"):
            model(tensors["input_ids"][:, 8:10], cache=cache, attention_mask=torch.tensor([[1] * 9 + [0]]))
        # images may come in any turn: whole spans with their pixel_values continue the cache
        model(**inputs, cache=cache)
        assert cache.get_seq_length() == 8 + inputs["input_ids"].size(1)
    # a cache made without max_crop keeps no history to rewind: crop names the length it stays at
    with pytest.raises(DeepseekV41CacheError, match=rf"keeps no history.*smallest length it can crop to is {8 + inputs['input_ids'].size(1)}"):
        cache.crop(1)


def test_the_image_token_typed_as_text_is_refused(golden):
    # robustness: the image id in a prompt without an image span was embedded as a plain token
    model = golden_model(golden, "model_tiny_fp8")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "text")
    ids = inputs["input_ids"][:1, :6].clone()
    ids[0, 2] = model.config.image_token_id
    with torch.no_grad(), pytest.raises(DeepseekV41ModelError, match=r"image_token_id 500 outside an image span \(batch row 0, position 2\)"):
        model(ids)


def test_a_one_dimensional_image_grid_is_refused_with_the_expected_shape(golden):
    # robustness: `get_image_features(pv, grid[0])` raised a bare TypeError
    model = golden_model(golden, "model_tiny_fp8")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "vl")
    with torch.no_grad(), pytest.raises(DeepseekV41VisionInputError, match=r"\[n_images, 3\].*for one image pass \[\[1, h, w\]\]"):
        model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"][0])
    with torch.no_grad(), pytest.raises(DeepseekV41ModelError, match=r"must hold integers"):
        model(**dict(inputs, image_grid_thw=inputs["image_grid_thw"].float()))
