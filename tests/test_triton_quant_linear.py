"""The decode quantized linear (`triton_ops/quant_linear.py`), run by Triton's CPU interpreter, against
the torch fast path ``F.linear(fake_quant_fp8(x), dequantized W)``.

The e4m3 rounding helper is checked alone, exhaustively over bf16 inputs and every tie, against
torch's cast. Then three kinds of comparison of whole linears:

- exact by construction: a weight with one non-zero per row (a signed, scaled permutation) makes
  every output one product, ``fake_quant_fp8(x)[p(n)] * w[n]``, plus exact zeros. The kernel must
  then equal the fallback bit for bit: this pins the fused activation fake-quant (zero groups, the
  1e-4 floor, e4m3 subnormals and ties, q = -448, the scale's exponent bump), the fp8 / fp4
  decoding (nibble order, sign) and both scale layouts;
- exact by range: small-integer activations and weights whose products and partial sums are all
  representable in fp32, so any summation order gives the same sum and the outputs must agree
  bitwise;
- random dense: the sums differ in order only. Each result is the bf16 rounding of an fp32 sum
  within ``K * 2^-24 * sum|x_k w_k|`` of the exact sum, so each is within half a bf16 ulp of the
  float64 value plus that; the two can straddle a rounding boundary, hence: at most one bf16 ulp
  apart (of the larger magnitude) plus twice the fp32 bound.
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import deepseek_v41_vl.modeling.quantization_deepseek_v41_vl as quant_module  # noqa: E402
import deepseek_v41_vl.triton_ops.quant_linear as quant_linear  # noqa: E402

from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, apply_numerics  # noqa: E402
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import (  # noqa: E402
    DeepseekV41Linear,
    DeepseekV41QuantizationError,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    fake_quant_fp8,
    pack_fp4,
)
from helpers import with_backends  # noqa: E402

QuantLinearConfig = quant_linear.QuantLinearConfig
QuantLinearError = quant_linear.QuantLinearError
quantized_linear_triton = quant_linear.quantized_linear_triton

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _fallback(x, weight, scale, kind):
    deq = dequantize_fp8_weight(weight, scale) if kind == "fp8" else dequantize_fp4_weight(weight, scale)
    return F.linear(fake_quant_fp8(x), deq)


def _hard_activation(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """bf16 [m, k] whose 32-groups span the awkward cases of the fake-quant."""
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k // 32).repeat_interleave(32)
    x[0, :32] = 0.0  # all-zero group: amax floored at 1e-4
    # amax below the 1e-4 floor, so s = 2^-22 and x / s lands among the e4m3 subnormals (grid
    # 2^-9); odd multiples of 2^-32 are exact ties there
    tiny = (2 * torch.randint(0, 8, (32,), generator=g) + 1) * 2.0**-32
    tiny[::2] = torch.randn(16, generator=g) * 1e-9
    x[-1, 32:64] = tiny * (1 - 2 * torch.randint(0, 2, (32,), generator=g))
    x[:, -32:] *= 1e25  # large values, scale far above 1
    x[0, -32:] = torch.randn(32, generator=g).clamp(-3, 3) * 2.0**80
    # the group's amax: 448 * fp32(1/448) is exactly 1, so s = 2^80 (no bump) and q = -448; the
    # value 0.75 * 2^-9 * s then rounds to the e4m3 subnormal 2^-9 (to 0 with a scale bumped to 2^81)
    x[0, -1] = -448.0 * 2.0**80
    x[0, -2] = 0.75 * 2.0**-9 * 2.0**80
    return x.to(torch.bfloat16)


def _signed_permutation(n: int, k: int, kind: str, g: torch.Generator):
    """A weight with one non-zero per row (column perm[n], random sign/magnitude and scale); every
    column is used once before any is used twice (all of them when n >= k)."""
    perm = torch.randperm(k, generator=g).repeat(-(-n // k))[:n]
    if kind == "fp8":
        mags = torch.tensor([1.0, 1.5, 0.75, 2.0**-9, 448.0, 3.0])  # 2^-9: an e4m3 subnormal
        vals = mags[torch.randint(0, len(mags), (n,), generator=g)] * (1 - 2 * torch.randint(0, 2, (n,), generator=g))
        dense = torch.zeros(n, k)
        dense[torch.arange(n), perm] = vals
        weight = dense.to(torch.float8_e4m3fn)
        scale = _e8m0(torch.randint(-3, 4, (-(-n // 32), -(-k // 32)), generator=g))
    else:
        codes = torch.zeros(n, k, dtype=torch.uint8)
        codes[torch.arange(n), perm] = torch.randint(1, 16, (n,), generator=g).to(torch.uint8)
        codes[codes == 8] = 9  # -0 would be a zero row
        weight = pack_fp4(codes)
        scale = _e8m0(torch.randint(-3, 4, (n, k // 32), generator=g))
    return weight, scale


def _random_weight(n: int, k: int, kind: str, g: torch.Generator):
    if kind == "fp8":
        weight = (torch.randn(n, k, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = _e8m0(torch.randint(-12, -4, (-(-n // 32), -(-k // 32)), generator=g))
    else:
        weight = pack_fp4(torch.randint(0, 16, (n, k), generator=g).to(torch.uint8))
        scale = _e8m0(torch.randint(-8, -2, (n, k // 32), generator=g))
    return weight, scale


CASES = [  # kind, m, n, k, launch config (None: the default, `default_config`: the GEMV at one row)
    ("fp8", 1, 40, 64, None),
    ("fp8", 3, 40, 96, QuantLinearConfig(block_n=16, split_k=2, groups_per_iter=1)),  # a scale row spans 2 programs
    ("fp8", 3, 40, 384, QuantLinearConfig(block_n=16, split_k=3, groups_per_iter=4)),  # 3 ranges of one 4-group tile
    ("fp8", 3, 100, 96, None),
    ("fp8", 17, 40, 128, QuantLinearConfig(block_n=16, split_k=4, groups_per_iter=1)),  # 2 x 3 tiles, 4 ranges
    ("fp4", 1, 40, 64, None),
    ("fp4", 3, 40, 96, QuantLinearConfig(block_n=32, split_k=2, groups_per_iter=1)),
    ("fp4", 2, 40, 320, QuantLinearConfig(block_n=32, split_k=2, groups_per_iter=4)),  # the last tile overruns K
    ("fp4", 3, 104, 96, None),
    # one program per row, products summed on the CUDA cores (the default at one row)
    ("fp8", 3, 40, 384, QuantLinearConfig(gemv=True, block_n=16, split_k=3, groups_per_iter=4)),
    ("fp8", 2, 100, 96, QuantLinearConfig(gemv=True, block_n=32, groups_per_iter=2)),  # the last tile overruns K
    ("fp4", 3, 40, 320, QuantLinearConfig(gemv=True, block_n=16, split_k=2, groups_per_iter=4)),
    ("fp4", 2, 104, 96, QuantLinearConfig(gemv=True, block_n=32, groups_per_iter=1)),
]


@pytest.mark.parametrize("kind,m,n,k,config", CASES)
def test_one_product_per_output_is_bitwise_equal(kind, m, n, k, config):
    g = torch.Generator().manual_seed(100 * m + n + k + len(kind))
    x = _hard_activation(m, k, g)
    weight, scale = _signed_permutation(n, k, kind, g)
    y = quantized_linear_triton(x, weight, scale, kind, config=config)
    ref = _fallback(x, weight, scale, kind)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert ref.abs().max() > 1e25 and (ref == 0).any()  # the large and the zero groups are reached
    # torch.equal: values bit for bit, except that +0 and -0 (one exact zero sum) count as equal
    assert torch.equal(y, ref)


@pytest.mark.parametrize("kind,m,n,k,config", CASES)
def test_exactly_summable_inputs_are_bitwise_equal(kind, m, n, k, config):
    g = torch.Generator().manual_seed(7 + k + n)
    # integers up to 15 with a 15 in every group: scale 1/16 and q = 16 x, so the fake-quant is
    # the identity; products are integers * 2^[-3, 3], their sums < 2^20 in steps of 2^-3
    x = torch.randint(-15, 16, (m, k), generator=g).float()
    x[:, ::32] = 15.0
    x = x.to(torch.bfloat16)
    if kind == "fp8":
        weight = torch.randint(-15, 16, (n, k), generator=g).float().to(torch.float8_e4m3fn)
        scale = _e8m0(torch.randint(-3, 4, (-(-n // 32), k // 32), generator=g))
    else:
        weight = pack_fp4(torch.randint(0, 16, (n, k), generator=g).to(torch.uint8))
        scale = _e8m0(torch.randint(-3, 4, (n, k // 32), generator=g))
    assert torch.equal(fake_quant_fp8(x), x)
    y = quantized_linear_triton(x, weight, scale, kind, config=config)
    ref = _fallback(x, weight, scale, kind)
    assert ref.abs().max() > 256  # integer sums above bf16's integer range: rounding is exercised
    assert torch.equal(y, ref)


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-126))) - 7)


def _assert_summation_order_only(y, x, weight, scale, kind):
    """y against the fallback and the float64 value, within the bounds of the module docstring."""
    x2d = x.reshape(-1, x.size(-1))
    y = y.reshape(x2d.size(0), -1).double()
    ref = _fallback(x2d, weight, scale, kind).double()
    xq = fake_quant_fp8(x2d).double()
    deq = (dequantize_fp8_weight(weight, scale) if kind == "fp8" else dequantize_fp4_weight(weight, scale)).double()
    exact = xq @ deq.T
    fp32_bound = x2d.size(-1) * 2.0**-24 * (xq.abs() @ deq.abs().T)
    assert ((y - exact).abs() <= _bf16_ulp(exact) + fp32_bound).all()
    assert ((y - ref).abs() <= _bf16_ulp(torch.maximum(y.abs(), ref.abs())) + 2 * fp32_bound).all()
    return exact


@pytest.mark.parametrize("kind,m,n,k,config", CASES)
def test_random_dense_within_one_bf16_ulp(kind, m, n, k, config):
    g = torch.Generator().manual_seed(1000 + m * k + n)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    x[0, :32] = 0.0
    weight, scale = _random_weight(n, k, kind, g)
    y = quantized_linear_triton(x, weight, scale, kind, config=config)
    exact = _assert_summation_order_only(y, x, weight, scale, kind)
    assert (y.double() - exact).abs().max() > 0  # not vacuous: the outputs are rounded


def test_split_k_is_deterministic_and_matches_unsplit():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 256, generator=g)).to(torch.bfloat16)
    weight, scale = _random_weight(48, 256, "fp4", g)
    one = quantized_linear_triton(x, weight, scale, "fp4", config=QuantLinearConfig(split_k=1))
    four = quantized_linear_triton(x, weight, scale, "fp4", config=QuantLinearConfig(split_k=4, groups_per_iter=1))
    again = quantized_linear_triton(x, weight, scale, "fp4", config=QuantLinearConfig(split_k=4, groups_per_iter=1))
    assert torch.equal(four, again)
    _assert_summation_order_only(one, x, weight, scale, "fp4")
    _assert_summation_order_only(four, x, weight, scale, "fp4")
    # the last program of each tile summed the ranges and reset its counter for the next launch
    assert not quant_linear._TILE_COUNTERS[("cpu", None, None)].any()


@pytest.mark.parametrize("gemv", [False, True])
def test_split_k_tile_limit(gemv):
    # the GEMV's tiles are N / block_n per row: two rows of half the features reach the limit too
    rows, blocks = (2, quant_linear.MAX_SPLIT_TILES // 2 + 1) if gemv else (1, quant_linear.MAX_SPLIT_TILES + 1)
    x = torch.zeros(rows, 256, dtype=torch.bfloat16)
    weight = torch.zeros(16 * blocks, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.full((-(-weight.size(0) // 32), 8), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(QuantLinearError, match="output tiles"):
        quantized_linear_triton(x, weight, scale, "fp8", config=QuantLinearConfig(block_n=16, split_k=2, gemv=gemv))


def test_gemv_row_limit():
    x = torch.zeros(65536, 32, dtype=torch.bfloat16)
    weight = torch.zeros(16, 32, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(QuantLinearError, match="at most 65535 rows"):
        quantized_linear_triton(x, weight, scale, "fp8", config=QuantLinearConfig(block_n=16, gemv=True))


@pytest.mark.parametrize("kind,m,n,k,gemv", [
    ("fp4", 1, 2304, 5120, True),
    ("fp4", 1, 5120, 2304, True),
    ("fp8", 1, 1280, 5120, True),
    ("fp8", 1, 4096, 4096, True),  # 16M weights: the largest fp8 weight on the GEMV
    ("fp8", 1, 4096, 4128, False),
    ("fp8", 1, 32768, 1280, False),
    ("fp4", 2, 2304, 5120, False),
    ("fp8", 2, 512, 5120, False),
])
def test_default_config_picks_the_kernel(kind, m, n, k, gemv):
    config = quant_linear.default_config(m, n, k, kind, torch.device("cpu"))
    assert config.gemv == gemv
    assert config.block_n == (16 if gemv else 128)
    assert quant_linear.default_config(m, n, k, kind, torch.device("cpu"), gemv=not gemv).gemv == (not gemv)
    with pytest.raises(QuantLinearError, match="weight_dtype"):
        quant_linear.default_config(m, n, k, "fp6", torch.device("cpu"))


@pytest.mark.parametrize("m,launched", [(1, "_quant_gemv_kernel"), (2, "_quant_linear_kernel")])
def test_the_chosen_kernel_is_the_one_launched(m, launched, monkeypatch):
    # a config's kernel reaches the launch (the two kernels give close results, so the values
    # alone would not tell a GEMV config that fell back to the tile kernel)
    calls = []
    interpreted = quant_linear._kernel_is_interpreted()
    monkeypatch.setattr(quant_linear, "_kernel_is_interpreted", lambda: interpreted)  # it reads a kernel's type
    for name in ("_quant_gemv_kernel", "_quant_linear_kernel"):
        kernel = getattr(quant_linear, name)

        class _Spy:
            def __getitem__(self, grid, name=name, kernel=kernel):
                calls.append((name, grid))
                return kernel[grid]

        monkeypatch.setattr(quant_linear, name, _Spy())
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(m, 64, generator=g)).to(torch.bfloat16)
    weight, scale = _random_weight(40, 64, "fp4", g)
    quantized_linear_triton(x, weight, scale, "fp4")
    assert [c[0] for c in calls] == [launched]
    assert calls[0][1][2] == (m if launched == "_quant_gemv_kernel" else 1)  # the rows' grid axis


def test_leading_dims_and_int8_fp4_view():
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 1, 64, generator=g)).to(torch.bfloat16)
    weight, scale = _signed_permutation(40, 64, "fp4", g)
    y = quantized_linear_triton(x, weight.view(torch.int8), scale, "fp4")
    assert y.shape == (2, 1, 40)
    ref = _fallback(x.reshape(2, 64), weight, scale, "fp4").view(2, 1, 40)
    assert torch.equal(y, ref)


def _linear(kind: str, n: int, k: int, g: torch.Generator) -> DeepseekV41Linear:
    lin = DeepseekV41Linear(k, n, kind, numerics="fast")
    weight, scale = _random_weight(n, k, kind, g)
    lin.load_state_dict({"weight": weight, "scale": scale})
    return lin


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_linear_module_dispatch(kind, monkeypatch):
    g = torch.Generator().manual_seed(5)
    lin = _linear(kind, 40, 96, g)
    calls = []
    real = quant_module.quantized_linear_triton

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(quant_module, "quantized_linear_triton", spy)
    x = (torch.randn(2, 3, 96, generator=g) * 2).to(torch.bfloat16)
    ref = with_backends(lin, quant_linear="torch")(x)
    assert calls == []
    y = with_backends(lin, quant_linear="triton")(x)
    assert calls == [(2, 3, 96)]
    assert y.shape == ref.shape == (2, 3, 40)
    _assert_summation_order_only(y, x, lin.weight, lin.scale, kind)
    # more rows than QUANT_LINEAR_MAX_ROWS: today's path, even when Triton is forced
    big = (torch.randn(quant_linear.QUANT_LINEAR_MAX_ROWS + 1, 96, generator=g)).to(torch.bfloat16)
    out = lin(big)
    assert len(calls) == 1
    assert torch.equal(out, with_backends(lin, quant_linear="torch")(big))
    # exact numerics never take the kernel
    apply_numerics(lin, DeepseekV41Numerics.resolve("exact", quant_linear="triton"))
    lin(x)
    assert len(calls) == 1


def test_dispatch_rule(monkeypatch):
    monkeypatch.delenv(quant_linear.ENV_BACKEND, raising=False)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not quant_linear.use_quant_linear_kernel(x)  # auto on CPU: torch
    assert quant_linear.use_quant_linear_kernel(x, backend="triton")
    assert not quant_linear.use_quant_linear_kernel(torch.zeros(17, 64, dtype=torch.bfloat16), backend="triton")
    monkeypatch.setenv(quant_linear.ENV_BACKEND, "cuda")
    with pytest.raises(QuantLinearError, match="backend"):
        quant_linear.use_quant_linear_kernel(x)


def test_errors(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w8, s8 = _random_weight(40, 64, "fp8", g)
    w4, s4 = _random_weight(40, 64, "fp4", g)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(QuantLinearError, match="bfloat16"):
        quantized_linear_triton(x.float(), w8, s8, "fp8")
    with pytest.raises(QuantLinearError, match="features"):
        quantized_linear_triton(torch.zeros(1, 96, dtype=torch.bfloat16), w8, s8, "fp8")
    with pytest.raises(QuantLinearError, match="multiple of the group"):
        quantized_linear_triton(torch.zeros(1, 48, dtype=torch.bfloat16), w8[:, :48].contiguous(), s8, "fp8")
    with pytest.raises(QuantLinearError, match="scale of shape"):
        quantized_linear_triton(x, w8, s4, "fp8")
    with pytest.raises(QuantLinearError, match="scale of shape"):
        quantized_linear_triton(x, w4, s8, "fp4")
    with pytest.raises(QuantLinearError, match="float8_e4m3fn"):
        quantized_linear_triton(x, w4, s8, "fp8")
    with pytest.raises(QuantLinearError, match="float4_e2m1fn_x2"):
        quantized_linear_triton(x, w8.float(), s4, "fp4")
    with pytest.raises(QuantLinearError, match="e8m0"):
        quantized_linear_triton(x, w8, s8.float(), "fp8")
    with pytest.raises(QuantLinearError, match="weight_dtype"):
        quantized_linear_triton(x, w8, s8, "int8")
    with pytest.raises(QuantLinearError, match="contiguous"):
        wide = torch.zeros(40, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
        quantized_linear_triton(x, wide[:, ::2], s8, "fp8")
    with pytest.raises(QuantLinearError, match="block_n"):
        quantized_linear_triton(x, w8, s8, "fp8", config=QuantLinearConfig(block_n=48))
    with pytest.raises(QuantLinearError, match="split_k"):
        quantized_linear_triton(x, w8, s8, "fp8", config=QuantLinearConfig(split_k=0))
    # the module raises the project's error for a non-bf16 activation whichever path it takes
    lin = with_backends(DeepseekV41Linear(64, 40, "fp8"), quant_linear="triton")
    with pytest.raises(DeepseekV41QuantizationError, match="bfloat16"):
        lin(torch.zeros(1, 64))


def test_e4m3_rounding_helper_exhaustive():
    """`_round_to_e4m3` against torch's cast: every bf16 value in [-448, 448], and every midpoint
    between neighbouring e4m3 values (the ties) with its two fp32 neighbours."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst + offs, quant_linear._round_to_e4m3(tl.load(src + offs, mask=ok, other=0.0)), mask=ok)

    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[bf16.abs() <= 448]
    grid = torch.arange(0, 256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9))])
    values = torch.cat([bf16, near, -near])
    out = torch.empty_like(values)
    round_kernel[(triton.cdiv(values.numel(), 4096),)](values, out, values.numel(), BLOCK=4096)
    ref = values.to(torch.float8_e4m3fn).float()
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("kind,m,n,k,config", [CASES[0], CASES[2], CASES[6], CASES[9], CASES[11]])
def test_fp32_output_is_the_sums_before_rounding(kind, m, n, k, config):
    """``out_dtype=torch.float32`` (a row-parallel rank's share, `DeepseekV41Linear.partial`):
    with one exact product per output the fp32 sums are that product, and rounded to bf16 they
    are the bf16 output, split launches included."""
    g = torch.Generator().manual_seed(3 * n + k)
    x = _hard_activation(m, k, g)
    weight, scale = _signed_permutation(n, k, kind, g)
    sums = quantized_linear_triton(x, weight, scale, kind, config=config, out_dtype=torch.float32)
    assert sums.dtype == torch.float32 and sums.shape == (m, n)
    deq = dequantize_fp8_weight(weight, scale) if kind == "fp8" else dequantize_fp4_weight(weight, scale)
    assert torch.equal(sums, F.linear(fake_quant_fp8(x).float(), deq.float()))
    assert torch.equal(sums.to(torch.bfloat16), quantized_linear_triton(x, weight, scale, kind, config=config))
    with pytest.raises(QuantLinearError, match="out_dtype"):
        quantized_linear_triton(x, weight, scale, kind, out_dtype=torch.float16)


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("mode, backend", [("fast", "torch"), ("fast", "triton"), ("exact", "torch")])
def test_linear_partial_rounds_to_forward(kind, mode, backend):
    """`DeepseekV41Linear.partial` on every path (exact block GEMM, the fast torch path, the
    kernel): fp32, the forward's products summed in fp32; rounded once it is the forward's
    output up to the fp32 summation order (a bf16 ulp where a sum straddles a boundary)."""
    g = torch.Generator().manual_seed(11)
    lin = _linear(kind, 40, 96, g)
    apply_numerics(lin, DeepseekV41Numerics.resolve(mode, quant_linear=backend))
    x = (torch.randn(3, 96, generator=g) * 2).to(torch.bfloat16)
    sums, out = lin.partial(x), lin(x)
    assert sums.dtype == torch.float32 and out.dtype == torch.bfloat16
    diff = (sums.to(torch.bfloat16).float() - out.float()).abs()
    assert (diff <= _bf16_ulp(out.float())).all() and (sums.to(torch.bfloat16) == out).float().mean() > 0.9
    assert (sums != sums.to(torch.bfloat16).float()).any()  # not rounded
