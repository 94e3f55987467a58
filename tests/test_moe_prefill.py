"""The MoE prefill path (`triton_ops/moe_prefill.py`) under Triton's CPU interpreter: the batched
expert dequantization bit for bit against the torch dequantization functions, and the MoE forward
through it against the module path (`DeepseekV41MoE._routed_grouped`'s per-expert loop).

Without ``torch._grouped_mm`` (CPU) the new path runs the module path's own GEMMs (``F.linear`` per
expert on the same bf16 operands), the same epilogue ops and a fake-quant kernel bitwise equal to
`fake_quant_fp8`, so the outputs must be bitwise equal.
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402

import deepseek_v41_vl.triton_ops.moe_experts as moe_experts  # noqa: E402
import deepseek_v41_vl.triton_ops.moe_prefill as moe_prefill  # noqa: E402

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig  # noqa: E402
from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41MoE  # noqa: E402
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import (  # noqa: E402
    dequantize_fp4_weight,
    dequantize_fp8_weight,
)
from random_storage import fill_quantized_storage  # noqa: E402
from helpers import with_backends  # noqa: E402

ENV = moe_prefill.ENV_BACKEND
HIDDEN, INTER = 64, 32


def _tiny_moe(fmt: str, limit: float, n_experts: int = 8, top_k: int = 2, seed: int = 0) -> DeepseekV41MoE:
    """Random weights written through uint8 views (fp4 random codes; e8m0 scales ~ fan_in^-0.5,
    spread by +-1 per group so that scales differ)."""
    cfg = DeepseekV41TextConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=n_experts, num_experts_per_tok=top_k,
        swiglu_limit=limit, numerics="fast", expert_weight_dtype=fmt, weight_dtype="bf16" if fmt == "bf16" else "fp8",
    )
    moe = DeepseekV41MoE(cfg, 0).eval()
    gen = torch.Generator().manual_seed(seed)
    fill_quantized_storage(moe, gen)
    moe.gate.weight.data.copy_(torch.randn(moe.gate.weight.shape, generator=gen).bfloat16())
    # a strongly negative bias keeps the last experts unused (0 rows inside a chunk)
    bias = torch.randn(n_experts, generator=gen) * 0.1
    bias[-2:] = -100.0
    moe.gate.bias.data.copy_(bias)
    moe.gate.bias_vl.data.copy_(bias)
    return moe


def _reference_dequant(lin) -> torch.Tensor:
    if lin.weight_dtype == "fp4":
        return dequantize_fp4_weight(lin.weight, lin.scale)
    if lin.weight_dtype == "fp8":
        return dequantize_fp8_weight(lin.weight, lin.scale)
    return lin.weight.detach().clone()


@pytest.mark.parametrize("fmt", ["fp4", "fp8", "bf16"])
def test_batched_dequant_is_bitwise_per_expert(fmt):
    moe = _tiny_moe(fmt, 0.0, n_experts=7, seed=3)
    if fmt == "fp4":
        # scales at the edges of the e8m0 range take the kernel's exact (torch-product) branch
        s = moe.experts[4].w2.scale.data.view(torch.uint8)
        s[0, 0], s[1, 0], s[2, 0] = 0, 1, 250
    elif fmt == "fp8":
        moe.experts[4].w2.scale.data.view(torch.uint8)[0, 0] = 5  # subnormal products: exact branch
    table = moe_experts.build_expert_table(moe.experts)
    ids = torch.arange(7, dtype=torch.int32)
    buf13 = torch.full((3, 2 * INTER, HIDDEN), float("nan"), dtype=torch.bfloat16)
    # a range not starting at 0 and chunks of 3 over 7 experts (the last one short)
    for first in (2, 5):
        count = min(3, 7 - first)
        w13 = moe_prefill.dequantize_experts(table, "w13", ids, first, count, out=buf13)
        w2 = moe_prefill.dequantize_experts(table, "w2", ids, first, count)
        assert w13.shape == (count, 2 * INTER, HIDDEN) and w2.shape == (count, HIDDEN, INTER)
        for g in range(count):
            expert = moe.experts[first + g]
            assert torch.equal(w13[g, :INTER], _reference_dequant(expert.w1))
            assert torch.equal(w13[g, INTER:], _reference_dequant(expert.w3))
            assert torch.equal(w2[g], _reference_dequant(expert.w2))
    # an arbitrary id list: the kernel follows the ids, not positions
    some = torch.tensor([6, 0, 3], dtype=torch.int32)
    w2 = moe_prefill.dequantize_experts(table, "w2", some, 0, 3)
    for g, e in enumerate(some.tolist()):
        assert torch.equal(w2[g], _reference_dequant(moe.experts[e].w2))


@pytest.mark.parametrize("fmt,limit", [("fp4", 0.0), ("fp4", 1.0), ("fp8", 1.0), ("bf16", 1.0)])
def test_moe_forward_prefill_path_is_bitwise_the_module_path(fmt, limit, monkeypatch):
    moe = _tiny_moe(fmt, limit, seed=11)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(1, 40, HIDDEN, generator=gen) * 3).bfloat16()
    calls = []
    real = moe_prefill.moe_routed_prefill
    monkeypatch.setattr(
        "deepseek_v41_vl.modeling.moe_deepseek_v41_vl.moe_routed_prefill",
        lambda *a, **k: calls.append(a[2]) or real(*a, experts_per_chunk=3, **k),
    )
    with_backends(moe, moe_experts="torch", moe_prefill="torch")  # the decode kernels kept out
    with torch.inference_mode():
        ref = moe(x)
    assert calls == []
    with_backends(moe, moe_experts="torch", moe_prefill="triton")
    with torch.inference_mode():
        out = moe(x)
    assert len(calls) == 1
    counts = calls[0]
    assert 0 in counts and sum(1 for c in counts if c) >= 4  # unused experts inside chunks of 3
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert torch.equal(out, ref)
    if limit > 0:
        with torch.inference_mode():
            xs = x.reshape(-1, HIDDEN)
            _, ids = moe.gate(xs)
            g = torch.cat([moe.experts[e].w1(xs) for e in ids.unique().tolist()])
        assert (g.float() > limit).any()  # the clamp bites


def test_prefill_rows_follow_counts_with_chunks_of_one_and_many():
    # direct call: chunk sizes 1 and 16 (> experts used) give the same rows bit for bit
    moe = _tiny_moe("fp4", 1.0, seed=2)
    table = moe_experts.build_expert_table(moe.experts)
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0, 4, 2, 0]
    x = (torch.randn(sum(counts), HIDDEN, generator=gen) * 2).bfloat16()
    w = torch.rand(sum(counts), 1, generator=gen)
    with torch.inference_mode():
        y1 = moe_prefill.moe_routed_prefill(x, w, counts, table, experts_per_chunk=1)
        y16 = moe_prefill.moe_routed_prefill(x, w, counts, table, experts_per_chunk=16)
        start, ref = 0, []
        for e, c in enumerate(counts):
            ref.append(moe.experts[e](x[start : start + c], w[start : start + c]))
            start += c
    assert torch.equal(y1, torch.cat(ref)) and torch.equal(y16, y1)


def test_bad_input_raises():
    moe = _tiny_moe("fp4", 0.0)
    table = moe_experts.build_expert_table(moe.experts)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    w = torch.ones(4, 1)
    err = moe_prefill.MoEPrefillError
    with pytest.raises(err, match="counts"):
        moe_prefill.moe_routed_prefill(x, w, [4, 1] + [0] * 6, table)
    with pytest.raises(err, match="counts"):
        moe_prefill.moe_routed_prefill(x, w, [4], table)
    with pytest.raises(err, match="bf16"):
        moe_prefill.moe_routed_prefill(x.float(), w, [4] + [0] * 7, table)
    with pytest.raises(err, match="w_sorted"):
        moe_prefill.moe_routed_prefill(x, w.bfloat16(), [4] + [0] * 7, table)
    with pytest.raises(err, match="features"):
        moe_prefill.moe_routed_prefill(x[:, :32], w, [4] + [0] * 7, table)
    with pytest.raises(err, match="experts_per_chunk"):
        moe_prefill.moe_routed_prefill(x, w, [4] + [0] * 7, table, experts_per_chunk=0)
    with pytest.raises(err, match="which"):
        moe_prefill.dequantize_experts(table, "w1", torch.arange(8, dtype=torch.int32), 0, 1)
    with pytest.raises(err, match="int32"):
        moe_prefill.dequantize_experts(table, "w2", torch.arange(8), 0, 1)
    with pytest.raises(err, match="outside"):
        moe_prefill.dequantize_experts(table, "w2", torch.arange(8, dtype=torch.int32), 6, 3)
    with pytest.raises(err, match="backend"):
        moe_prefill.use_moe_prefill(x, "fp4", backend="cuda")
    assert not moe_prefill.use_moe_prefill(x, "fp4", backend="torch")
    assert moe_prefill.use_moe_prefill(x, "fp4", backend="triton")
    assert not moe_prefill.use_moe_prefill(x, "fp32", backend="triton")
