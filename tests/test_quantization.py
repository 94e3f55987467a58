"""Quantizers, weight dequantization and the quantized Linear, against independent expectations.

The expectations are built from first principles (float64 arithmetic, the e4m3 / E2M1 grids
enumerated from their bit patterns), never by calling the code under test a second way.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, DeepseekV41NumericsError, apply_numerics
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import (
    DeepseekV41Linear,
    DeepseekV41QuantizationError,
    act_quant,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    e2m1_codes,
    fake_quant_fp4,
    fake_quant_fp8,
    fp4_block_gemm,
    fp8_block_gemm,
    pack_fp4,
    quant_fp4,
    round_scale_pow2,
    unpack_fp4,
)


def _e4m3_grid() -> torch.Tensor:
    """All finite non-negative e4m3 values in code order, float64 (from the bit patterns)."""
    vals = []
    for code in range(0x7F):  # 0x7F is NaN
        exp, man = code >> 3, code & 7
        vals.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return torch.tensor(vals, dtype=torch.float64)


def _round_e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value of float64 v (saturating at 448), ties to the even code."""
    grid = _e4m3_grid()
    mag = v.abs().clamp(max=448.0).flatten()
    out = torch.empty_like(mag)
    for i, m in enumerate(mag.tolist()):
        hi = int(torch.searchsorted(grid, torch.tensor(m, dtype=torch.float64)))
        if hi < len(grid) and grid[hi] == m:
            out[i] = m
            continue
        lo = hi - 1
        dl, dh = m - grid[lo].item(), grid[hi].item() - m
        out[i] = grid[lo] if dl < dh or (dl == dh and lo % 2 == 0) else grid[hi]
    return (out * torch.sign(v.flatten())).view_as(v)


def _pow2_ceil_scale(amax: float, fmax: float) -> float:
    prod = float(torch.tensor(amax, dtype=torch.float32) * torch.tensor(1.0 / fmax, dtype=torch.float32))
    mant, exp = math.frexp(prod)  # prod = mant * 2**exp, mant in [0.5, 1)
    return 2.0 ** (exp - 1) if mant == 0.5 else 2.0**exp


def test_round_scale_pow2_matches_ceil_log2():
    gen = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.rand(500, generator=gen) * 1000 + 1e-4, torch.tensor([448.0, 224.0, 1.0, 896.0, 1e-4])])
    got = round_scale_pow2(amax, torch.tensor(1 / 448, dtype=torch.float32))
    want = torch.tensor([_pow2_ceil_scale(a, 448.0) for a in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    assert got[-5].item() == 1.0 and got[-4].item() == 0.5 and got[-2].item() == 2.0


def test_act_quant_against_float64_rne():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 96, generator=gen) * torch.logspace(-3, 3, 96)).to(torch.bfloat16)
    x[0, :32] = 0  # all-zero group: amax floor 1e-4
    q, s = act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (3, 3)
    groups = x.double().view(3, 3, 32)
    amax = groups.abs().amax(-1).clamp_min(1e-4)
    want_s = torch.tensor([_pow2_ceil_scale(a, 448.0) for a in amax.flatten().tolist()], dtype=torch.float64).view(3, 3)
    assert torch.equal(s.double(), want_s)
    want_q = _round_e4m3_rne(groups / want_s.unsqueeze(-1)).view(3, 96)
    assert torch.equal(q.double(), want_q)
    # e8m0 scales carry the same powers of two
    _, s8 = act_quant(x, scale_dtype=torch.float8_e8m0fnu)
    assert s8.dtype == torch.float8_e8m0fnu and torch.equal(s8.float(), s)


def test_fake_quant_fp8_is_dequantized_act_quant():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 5, 64, generator=gen) * 7).to(torch.bfloat16)
    q, s = act_quant(x)
    want = (q.double().view(2, 5, 2, 32) * s.double().unsqueeze(-1)).view_as(x).to(torch.bfloat16)
    y = fake_quant_fp8(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert not torch.equal(y, x)  # quantization is not the identity on random data
    # saturation instead of NaN: the group max maps to at most 448 * s
    assert torch.isfinite(y.float()).all()


E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _round_e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude of |v| (float64), ties to the even code, with v's sign."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    out = []
    for m in v.abs().flatten().tolist():
        d = (grid - m).abs()
        tied = torch.nonzero(d == d.min()).flatten().tolist()
        out.append(grid[[c for c in tied if c % 2 == 0][0] if len(tied) > 1 else tied[0]].item())
    return torch.tensor(out, dtype=torch.float64).view_as(v) * torch.sign(v)


def test_e2m1_rounding_half_even_on_code():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 6.0, -0.75, -5.0, -0.0])
    codes = e2m1_codes(v)
    grid = torch.tensor(E2M1_GRID)
    values = grid[(codes & 7).long()] * torch.where((codes & 8) > 0, -1.0, 1.0)
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 6.0, -1.0, -4.0, -0.0])
    assert torch.equal(values, want)
    assert torch.equal(values, _round_e2m1_rne(v.double()).float())
    assert codes[-1].item() == 8  # negative zero keeps its sign bit


def test_fake_quant_fp4_ue8m0_group32_known_values():
    row = torch.zeros(32)
    row[:9] = torch.tensor([6.0, 0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5.0, -0.75])
    x = torch.stack([row, row * 4, torch.zeros(32)]).to(torch.bfloat16)
    y = fake_quant_fp4(x, 32, "ue8m0")
    want_row = torch.zeros(32)
    want_row[:9] = torch.tensor([6.0, 1.0, 2.0, 4.0, 0.0, 1.0, 2.0, 4.0, -1.0])  # scale 1: amax 6 -> 2^0
    assert torch.equal(y[0].float(), want_row)
    assert torch.equal(y[1].float(), want_row * 4)  # scale 4 exactly
    assert torch.equal(y[2].float(), torch.zeros(32))


def test_fake_quant_fp4_e4m3_group16_scale_not_pow2():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 64, generator=gen) * 3).to(torch.bfloat16)
    x[1, :16] = 0
    y = fake_quant_fp4(x, 16, "e4m3")
    g = x.double().view(4, 4, 16)
    amax = g.abs().amax(-1).clamp_min(6 * 2.0**-9)
    s = _round_e4m3_rne((amax.float() / 6.0).double())  # amax/6 in fp32, then e4m3
    v = (g.float() / s.float().unsqueeze(-1)).clamp(-6, 6).double()
    nearest = _round_e2m1_rne(v)
    want = (nearest * s.unsqueeze(-1)).view(4, 64).to(torch.bfloat16)
    assert torch.equal(y, want)
    assert torch.equal(y[1, :16].float(), torch.zeros(16))


def test_pack_unpack_fp4_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8, 7, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (1, 3)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x8F, 0x07]]
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, -6.0, -0.0, 6.0, 0.0]]
    assert unpack_fp4(packed.view(torch.int8)).tolist() == [[0.5, 1.0, -6.0, -0.0, 6.0, 0.0]]
    q, s = quant_fp4(torch.tensor([[6.0, 0.75] + [0.0] * 30], dtype=torch.bfloat16))
    assert s.dtype == torch.float8_e8m0fnu and s.float().item() == 1.0
    assert unpack_fp4(q)[0, :2].tolist() == [6.0, 1.0]


def test_dequantize_fp8_weight_blocks_and_ragged_edge():
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(40, 70, generator=gen) * 100).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 134, (2, 3), generator=gen, dtype=torch.uint8)
    scale = exps.view(torch.float8_e8m0fnu)
    got = dequantize_fp8_weight(w, scale)
    for r in (0, 31, 32, 39):
        for c in (0, 31, 32, 63, 64, 69):
            want = w[r, c].double() * 2.0 ** (int(exps[r // 32, c // 32]) - 127)
            assert got[r, c].double().item() == want.item()
    with pytest.raises(DeepseekV41QuantizationError):
        dequantize_fp8_weight(w, scale[:1])
    # per-row scales (the Engram table layout): [rows, cols/32]
    row_exps = torch.randint(120, 134, (40, 3), generator=gen, dtype=torch.uint8)
    per_row = dequantize_fp8_weight(w, row_exps.view(torch.float8_e8m0fnu), row_block=1)
    for r in (0, 17, 39):
        for c in (0, 40, 69):
            assert per_row[r, c].double().item() == w[r, c].double().item() * 2.0 ** (int(row_exps[r, c // 32]) - 127)


def test_dequantize_fp4_weight():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 4)  # [2, 64]
    packed = pack_fp4(codes)
    scale = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequantize_fp4_weight(packed, scale)
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = torch.tensor([grid[c & 7] * (-1 if c & 8 else 1) for c in range(16)] * 4)
    want = torch.stack([vals * torch.tensor([1.0] * 32 + [2.0] * 32), vals * torch.tensor([0.5] * 32 + [8.0] * 32)])
    assert torch.equal(got.float(), want)


def _exactly_summable_operands(m: int, n: int, k: int, seed: int):
    """Quantized operands whose per-block dot products are exact in fp32 (small integers), with
    scales spread over many octaves so that the order of the K-block accumulation matters."""
    gen = torch.Generator().manual_seed(seed)
    a_int = torch.randint(-15, 16, (m, k), generator=gen).float()
    w_int = torch.randint(-15, 16, (n, k), generator=gen).float()
    a_exp = torch.randint(-12, 12, (m, k // 32), generator=gen)
    return a_int, w_int, a_exp


def test_fp8_block_gemm_accumulates_k_blocks_in_order():
    m, n, k = 5, 64, 160
    a_int, w_int, a_exp = _exactly_summable_operands(m, n, k, 5)
    gen = torch.Generator().manual_seed(6)
    w_exp = torch.randint(-10, 10, (n // 32, k // 32), generator=gen)
    a_s = torch.pow(2.0, a_exp.float())
    w_s = torch.pow(2.0, w_exp.float())
    got = fp8_block_gemm(a_int.to(torch.float8_e4m3fn), a_s, w_int.to(torch.float8_e4m3fn), w_s.to(torch.float8_e8m0fnu))
    # float64 partials are exact; emulate the fp32 accumulation block by block
    acc = torch.zeros(m, n, dtype=torch.float32)
    for kb in range(k // 32):
        part = (a_int[:, kb * 32 : (kb + 1) * 32].double() @ w_int[:, kb * 32 : (kb + 1) * 32].double().T).float()
        ws = w_s[:, kb].repeat_interleave(32)
        acc = acc + (part * a_s[:, kb : kb + 1]) * ws.unsqueeze(0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, acc.to(torch.bfloat16))
    full = (a_int.double() * a_s.repeat_interleave(32, 1).double()) @ (
        w_int.double() * w_s.repeat_interleave(32, 0).repeat_interleave(32, 1).double()
    ).T
    assert torch.allclose(got.double(), full, rtol=1e-2, atol=1e-6)


def test_fp4_block_gemm_matches_float64():
    m, n, k = 3, 8, 96
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    w_s = torch.randint(124, 130, (n, k // 32), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    a_int = torch.randint(-15, 16, (m, k), generator=gen).float()
    a_s = torch.pow(2.0, torch.randint(-6, 6, (m, k // 32), generator=gen).float())
    got = fp4_block_gemm(a_int.to(torch.float8_e4m3fn), a_s, pack_fp4(codes), w_s)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    w = grid[codes.long()].double() * w_s.float().double().repeat_interleave(32, 1)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for kb in range(k // 32):
        sl = slice(kb * 32, (kb + 1) * 32)
        part = (a_int[:, sl].double() @ grid[codes.long()][:, sl].double().T).float()
        acc = acc + (part * a_s[:, kb : kb + 1]) * w_s.float()[:, kb].unsqueeze(0)
    assert torch.equal(got, acc.to(torch.bfloat16))
    full = (a_int.double() * a_s.double().repeat_interleave(32, 1)) @ w.T
    assert torch.allclose(got.double(), full, rtol=1e-2, atol=1e-6)


def test_linear_modes_and_dtypes(golden):
    ck = load_file(golden / "model_tiny_fp8" / "model.safetensors")
    bf = load_file(golden / "model_tiny_bf16" / "model.safetensors")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 7, 256, generator=gen).to(torch.bfloat16)

    fp8 = DeepseekV41Linear(256, 64, "fp8", numerics="exact")
    fp8.load_state_dict({"weight": ck["layers.0.attn.wq_a.weight"], "scale": ck["layers.0.attn.wq_a.scale"]})
    assert fp8.scale.shape == (2, 8) and fp8.scale.dtype == torch.float8_e8m0fnu
    exact = fp8(x)
    q, s = act_quant(x)
    assert torch.equal(exact, fp8_block_gemm(q, s, fp8.weight, fp8.scale))
    apply_numerics(fp8, DeepseekV41Numerics.resolve("fast"))
    fast = fp8(x)
    assert fast.dtype == torch.bfloat16 and fast.shape == (2, 7, 64)
    ref = fake_quant_fp8(x).double() @ dequantize_fp8_weight(fp8.weight, fp8.scale).double().T
    for out in (exact, fast):
        assert ((out.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()
    # the fp8 weights are quantizations of the bf16 master weights
    master = bf["layers.0.attn.wq_a.weight"].double()
    deq = fp8.dequantized_weight(torch.float64)
    assert ((deq - master).abs() <= master.abs() * 2**-3 + 1e-6).all()

    fp4 = DeepseekV41Linear(256, 32, "fp4", numerics="exact")
    fp4.load_state_dict(
        {"weight": ck["layers.0.ffn.experts.0.w1.weight"], "scale": ck["layers.0.ffn.experts.0.w1.scale"]}
    )  # int8 in the file
    assert fp4.weight.dtype == torch.float4_e2m1fn_x2 and fp4.weight.shape == (32, 128)
    exact4 = fp4(x)
    apply_numerics(fp4, DeepseekV41Numerics.resolve("fast"))
    fast4 = fp4(x)
    ref4 = fake_quant_fp8(x).double() @ fp4.dequantized_weight(torch.float64).T
    for out in (exact4, fast4):
        assert ((out.double() - ref4).abs() <= ref4.abs() * 2**-7 + 1e-6).all()
    master4 = bf["layers.0.ffn.experts.0.w1.weight"].double()
    step = fp4.scale.float().double().repeat_interleave(32, 1)
    assert ((fp4.dequantized_weight(torch.float64) - master4).abs() <= step).all()

    lin = DeepseekV41Linear(256, 8, "bf16")
    lin.load_state_dict({"weight": bf["layers.1.attn.indexer.weights_proj.weight"]})
    assert lin.scale is None and torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    f32 = DeepseekV41Linear(256, 64, "fp32")
    assert f32.weight.dtype == torch.float32


def test_errors():
    with pytest.raises(DeepseekV41QuantizationError):
        act_quant(torch.zeros(4, 32))  # fp32 input
    with pytest.raises(DeepseekV41QuantizationError):
        act_quant(torch.zeros(4, 40, dtype=torch.bfloat16))
    with pytest.raises(DeepseekV41QuantizationError):
        fake_quant_fp4(torch.zeros(4, 32, dtype=torch.bfloat16), 16, "e5m2")
    with pytest.raises(DeepseekV41QuantizationError):
        DeepseekV41Linear(4, 4, "int8")
    with pytest.raises(DeepseekV41QuantizationError):
        DeepseekV41Linear(48, 4, "fp4")
    with pytest.raises(DeepseekV41NumericsError, match="numerics must be one of"):
        DeepseekV41Linear(32, 4, "fp8", numerics="approx")
    with pytest.raises(DeepseekV41QuantizationError):
        DeepseekV41Linear(64, 32, "fp8")(torch.zeros(1, 64))  # fp32 activation into a quantized GEMM
    with pytest.raises(DeepseekV41QuantizationError):
        unpack_fp4(torch.zeros(3, dtype=torch.float32))
