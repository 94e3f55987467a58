"""The Engram n-gram hash in one launch (`triton_ops/engram_hash.py`), run by Triton's CPU
interpreter: bit for bit the torch ops (integers only) for the tiny and the released layouts,
chunks continuing a history, DEAD ids anywhere; its errors; and the golden tiny model hashing
with it in exact numerics, the logits unchanged."""

from __future__ import annotations

import json

import pytest
import torch

import deepseek_v41_vl.triton_ops.engram_hash as engram_hash
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import DeepseekV41EngramLayout
from deepseek_v41_vl.triton_ops.engram_hash import DEAD, EngramHashError, ngram_hash_torch, ngram_hash_triton

from conftest import REPO_ROOT


def _layout(name: str) -> DeepseekV41EngramLayout:
    config = DeepseekV41Config(**json.loads((REPO_ROOT / "configs" / f"{name}.json").read_text()))
    return DeepseekV41EngramLayout.from_config(config.text_config)


def _constants(layout: DeepseekV41EngramLayout):
    return (torch.tensor(layout.multipliers()), torch.tensor(layout.primes), torch.tensor(layout.offsets()))


def _ids(batch: int, length: int, span: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    ids = torch.where(torch.rand(batch, length, generator=g) < 0.15, DEAD, ids)  # images, padding
    history = torch.randint(0, vocab, (batch, span), generator=g)
    history[0] = DEAD  # a row starting its sequence
    return ids, history


@pytest.mark.parametrize("config", ["tiny_vl", "deepseek_v41_flash"])
@pytest.mark.parametrize(("batch", "length"), [(1, 1), (3, 1), (2, 7), (1, 40)])
def test_equals_the_torch_ops_bit_for_bit(config, batch, length):
    layout = _layout(config)
    multipliers, primes, offsets = _constants(layout)
    ids, history = _ids(batch, length, layout.history_len, layout.compressed_vocab_size, seed=length + batch)
    pad = 7
    got = ngram_hash_triton(ids, history, pad, multipliers, primes, offsets)
    want = ngram_hash_torch(ids, history, pad, multipliers, primes, offsets)
    assert got.dtype == torch.int64 and got.shape == want.shape == (batch, length, *offsets.shape)
    assert torch.equal(got, want)
    assert (got >= offsets).all() and (got < offsets + primes.flatten(1)).all()  # each in its bucket range


def test_a_chunk_continues_its_history_as_one_call():
    layout = _layout("tiny_vl")
    constants = _constants(layout)
    ids, history = _ids(2, 9, layout.history_len, layout.compressed_vocab_size, seed=3)
    whole = ngram_hash_triton(ids, history, 5, *constants)
    span = layout.history_len
    head, tail = ids[:, :4], ids[:, 4:]
    carried = torch.cat([history, head], dim=1)[:, -span:]
    parts = torch.cat([ngram_hash_triton(head, history, 5, *constants), ngram_hash_triton(tail, carried, 5, *constants)], dim=1)
    assert torch.equal(whole, parts)


def test_strided_ids_and_history():
    layout = _layout("tiny_vl")
    constants = _constants(layout)
    ids, history = _ids(3, 5, layout.history_len, layout.compressed_vocab_size, seed=4)
    wide_ids = torch.zeros(3, 8, dtype=torch.int64)
    wide_ids[:, :5] = ids
    wide_hist = torch.zeros(3, 6, dtype=torch.int64)
    wide_hist[:, : layout.history_len] = history
    got = ngram_hash_triton(wide_ids[:, :5], wide_hist[:, : layout.history_len], 5, *constants)
    assert torch.equal(got, ngram_hash_torch(ids, history, 5, *constants))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "ids": a["ids"].int()}, "must be int64"),
        (lambda a: {**a, "ids": a["ids"][0]}, r"\[B, L\]"),
        (lambda a: {**a, "history": a["history"][:1]}, r"\[B, L\]"),
        (lambda a: {**a, "multipliers": a["multipliers"][:, :-1]}, "multipliers must be"),
        (lambda a: {**a, "primes": a["primes"][:, :1]}, "primes must be"),
        (lambda a: {**a, "offsets": a["offsets"][:, :-1]}, "offsets must be"),
        (lambda a: {**a, "pad": -1}, "pad_id must be"),
        (lambda a: {**a, "pad": 1.0}, "pad_id must be"),
        (lambda a: {**a, "ids": [1]}, "must be tensors"),
        (lambda a: {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in a.items()}, "runs on CUDA"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    layout = _layout("tiny_vl")
    multipliers, primes, offsets = _constants(layout)
    ids, history = _ids(2, 3, layout.history_len, layout.compressed_vocab_size, seed=0)
    a = change({"ids": ids, "history": history, "pad": 5, "multipliers": multipliers, "primes": primes, "offsets": offsets})
    args = (a["ids"], a["history"], a["pad"], a["multipliers"], a["primes"], a["offsets"])
    assert not engram_hash.kernel_runs(*args)
    with pytest.raises(EngramHashError, match=message):
        ngram_hash_triton(*args)


def test_the_golden_tiny_model_hashes_with_it_in_exact_numerics(golden, monkeypatch):
    """A prefill (image positions cut the n-grams) and decode steps of the golden fp8 tiny model
    in exact numerics, hashing with the kernel: one launch per forward, the same logits bit for
    bit as the torch ops."""
    from golden_models import golden_model, run_inputs

    import deepseek_v41_vl.modeling.engram_deepseek_v41_vl as engram
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
    from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import apply_numerics
    from helpers import with_backends

    model = golden_model(golden, "model_tiny_fp8", "exact")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "vl")
    calls = []
    kernel = engram.ngram_hash_triton
    monkeypatch.setattr(engram, "ngram_hash_triton", lambda *a: calls.append(1) or kernel(*a))
    plan, runs = model.numerics, {}
    try:
        for backend in ("torch", "triton"):
            with_backends(model, engram_hash=backend)
            cache = DeepseekV41Cache(model.config, max_cache_len=inputs["input_ids"].size(1) + 4)
            calls.clear()
            with torch.no_grad():
                logits = [model(**inputs, cache=cache, logits_to_keep=0).logits]
                for _ in range(3):
                    logits.append(model(logits[-1][:, -1:].argmax(-1), cache=cache).logits)
            runs[backend] = (logits, len(calls))
    finally:
        apply_numerics(model, plan)
    assert runs["triton"][1] == 4 and runs["torch"][1] == 0
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(runs["triton"][0], runs["torch"][0]))
