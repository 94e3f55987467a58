"""The Engram gate in one launch (`triton_ops/engram_gate.py`), run by Triton's CPU interpreter:
close to the reference's torch ops (its sums add in another order), masked tokens passed through
exactly, its errors; and the golden tiny model's Engram layers taking it in fast numerics."""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.triton_ops.engram_gate as engram_gate
from deepseek_v41_vl.triton_ops.engram_gate import EngramGateError, engram_gate_torch, engram_gate_triton
from helpers import rel_l2

EPS, FLOOR = 1e-6, 1e-6


def _args(batch: int, seq: int, hc: int, dim: int, seed: int, mask: bool):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hc, dim, generator=g).bfloat16()
    kv = torch.randn(batch, seq, (hc + 1) * dim, generator=g).bfloat16()
    kv[..., : dim] += hidden[:, :, 0].float().bfloat16() * 3  # copy 0's key matches its stream: a large gate
    q = (torch.rand(hc, dim, generator=g) + 0.5).bfloat16()
    k = (torch.rand(hc, dim, generator=g) + 0.5).bfloat16()
    token_mask = (torch.rand(batch, seq, generator=g) < 0.7) if mask else None
    return hidden, kv, q, k, token_mask


@pytest.mark.parametrize(
    ("batch", "seq", "hc", "dim", "mask"),
    [(1, 1, 4, 256, False), (2, 5, 4, 256, True), (1, 3, 2, 1100, True), (3, 1, 4, 64, False)],
)
def test_equals_the_torch_ops_up_to_the_order_of_the_sums(batch, seq, hc, dim, mask):
    args = _args(batch, seq, hc, dim, seed=dim + seq, mask=mask)
    got = engram_gate_triton(*args, EPS, FLOOR)
    want = engram_gate_torch(*args, EPS, FLOOR)
    assert got.dtype == torch.bfloat16 and got.shape == (batch, seq, hc, dim)
    # one bf16 ulp, now and then; where h and gate * value nearly cancel, ~1e-7 of |value|
    assert rel_l2(got, want) < 2e-3
    value = args[1][..., hc * dim :].float().abs().unsqueeze(-2)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 2**-17 * value).all()
    if mask:
        held = ~args[4]
        assert held.any() and torch.equal(got[held], args[0][held])  # gate 0: the input, exactly


def test_the_gate_is_the_reference_formula_on_one_row():
    """One token, one copy, by hand: rstd of the stream and of the key, the signed square root,
    the sigmoid, then h + gate * value."""
    hidden, kv, q, k, _ = _args(1, 1, 1, 32, seed=3, mask=False)
    h, key, value = hidden[0, 0, 0].double(), kv[0, 0, :32].double(), kv[0, 0, 32:].double()
    logit = (h * q[0].double() * k[0].double() * key).sum() / h.square().mean().add(EPS).sqrt() / key.square().mean().add(EPS).sqrt() / 32**0.5
    gate = torch.sigmoid(torch.sign(logit) * logit.abs().clamp_min(FLOOR).sqrt())
    got = engram_gate_triton(hidden, kv, q, k, None, EPS, FLOOR)[0, 0, 0].double()
    assert torch.allclose(got, (h + gate * value).bfloat16().double(), rtol=2**-7, atol=0)


def test_a_nan_key_gives_nan_where_the_torch_ops_do():
    hidden, kv, q, k, mask = _args(1, 4, 2, 64, seed=6, mask=True)
    kv[0, :, 3] = float("nan")  # copy 0's key of every token
    got = engram_gate_triton(hidden, kv, q, k, mask, EPS, FLOOR)
    want = engram_gate_torch(hidden, kv, q, k, mask, EPS, FLOOR)
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()


def test_strided_inputs_give_the_contiguous_result():
    hidden, kv, q, k, mask = _args(2, 3, 4, 64, seed=5, mask=True)
    wide = torch.zeros(2, 3, 4, 80, dtype=torch.bfloat16)
    wide[..., :64] = hidden
    got = engram_gate_triton(wide[..., :64], kv, q, k, mask, EPS, FLOOR)
    assert torch.equal(got, engram_gate_triton(hidden, kv, q, k, mask, EPS, FLOOR))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "hidden": a["hidden"].float()}, "must be bf16"),
        (lambda a: {**a, "hidden": a["hidden"][0]}, r"\[B, S, hc, D\]"),
        (lambda a: {**a, "kv": a["kv"][..., :-1]}, "hc keys and the value"),
        (lambda a: {**a, "q": a["q"][:1]}, "q_weight and k_weight must be"),
        (lambda a: {**a, "mask": a["mask"].long()}, "token_mask must be bool"),
        (lambda a: {**a, "mask": a["mask"][:, :1]}, "token_mask must be bool"),
        (lambda a: {**a, "kv": [1.0]}, "must be tensors"),
        (lambda a: {k: (v.to("meta") if v is not None else v) for k, v in a.items()}, "runs on CUDA"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    hidden, kv, q, k, mask = _args(2, 3, 4, 64, seed=0, mask=True)
    a = change({"hidden": hidden, "kv": kv, "q": q, "k": k, "mask": mask})
    args = (a["hidden"], a["kv"], a["q"], a["k"], a["mask"])
    assert not engram_gate.kernel_runs(*args)
    with pytest.raises(EngramGateError, match=message):
        engram_gate_triton(*args, EPS, FLOOR)


def test_the_golden_tiny_model_takes_it_in_every_engram_layer(golden, monkeypatch):
    """Prefill and decode steps of the golden fp8 tiny model (image prompt: masked image
    positions) with the gate kernel against the torch ops: one launch per Engram layer and
    forward, the same greedy tokens, close logits."""
    from golden_models import golden_model, run_inputs

    import deepseek_v41_vl.modeling.engram_deepseek_v41_vl as engram
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
    from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import apply_numerics
    from helpers import with_backends

    model = golden_model(golden, "model_tiny_fp8", "fast")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "vl")
    calls = []
    kernel = engram.engram_gate_triton
    monkeypatch.setattr(engram, "engram_gate_triton", lambda *a: calls.append(1) or kernel(*a))
    layers = sum(layer.engram is not None for layer in model.layers)
    plan, runs = model.numerics, {}
    try:
        for backend in ("torch", "triton"):
            with_backends(model, engram_gate=backend)
            cache = DeepseekV41Cache(model.config, max_cache_len=inputs["input_ids"].size(1) + 8)
            calls.clear()
            with torch.no_grad():
                out = model(**inputs, cache=cache, logits_to_keep=0).logits
                logits, tokens = [out], []
                token = out[:, -1:].argmax(-1)
                for _ in range(4):
                    logits.append(model(token, cache=cache).logits)
                    token = logits[-1].argmax(-1)
                    tokens.append(token)
            runs[backend] = (logits, torch.cat(tokens, 1), len(calls))
    finally:
        apply_numerics(model, plan)
    assert layers > 0 and runs["triton"][2] == 5 * layers and runs["torch"][2] == 0
    assert torch.equal(runs["triton"][1], runs["torch"][1])
    for ours, theirs in zip(runs["triton"][0], runs["torch"][0]):
        assert rel_l2(ours, theirs) < 1e-2
