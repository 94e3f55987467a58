"""The weight dequantization kernels (`triton_ops/dequant.py`), run by Triton's CPU interpreter, bit
for bit against the torch functions `dequantize_fp8_weight` / `dequantize_fp4_weight`.

Dequantization is exact except where a product lands among bf16 subnormals (rounded to nearest
even), overflows (infinity) or is NaN, so the comparison is on the bf16 bit patterns: +0 and -0
differ, and NaNs must sit at the same positions (their payloads are left free: torch's own NaN
bits depend on its code path). Inputs cover every weight byte (e4m3fn NaN codes 0x7F / 0xFF
included) under every scale byte (0 = 2^-127, an fp32 subnormal; 255 = NaN), on both the kernels'
common path (a program's scales all mid-range) and their exact path (a program holding an extreme
scale), plus ragged edge tiles, strided views, the ``out=`` buffer and the errors.
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402

import deepseek_v41_vl.modeling.quantization_deepseek_v41_vl as quant_module  # noqa: E402
import deepseek_v41_vl.triton_ops.dequant as dequant  # noqa: E402

from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import (  # noqa: E402
    DeepseekV41Linear,
    DeepseekV41QuantizationError,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
)

DequantizationError = dequant.DequantizationError
dequantize_fp8_triton = dequant.dequantize_fp8_triton
dequantize_fp4_triton = dequant.dequantize_fp4_triton

# numpy warns when an fp32 product overflows to inf (scale bytes near 255): expected here
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# scale bytes of the kernels' common path (see the module docstring); others take the exact path
FP8_COMMON = (10, 246)
FP4_COMMON = (2, 240)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"NaN positions differ at {(got.isnan() != nan).nonzero()[:5].tolist()}"
    got_bits, want_bits = got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
    bad = (got_bits != want_bits).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} values differ, e.g. bits {got_bits[bad[:4]].tolist()} vs {want_bits[bad[:4]].tolist()}"
    )


def _every_byte(n: int, generator: torch.Generator) -> torch.Tensor:
    """n // 256 shuffled copies of all 256 byte values, uint8 [n]."""
    assert n % 256 == 0
    return torch.cat([torch.randperm(256, generator=generator) for _ in range(n // 256)]).to(torch.uint8)


def _fp8(w_bytes: torch.Tensor, s_bytes: torch.Tensor):
    return w_bytes.view(torch.float8_e4m3fn), s_bytes.view(torch.float8_e8m0fnu)


def _fp4(w_bytes: torch.Tensor, s_bytes: torch.Tensor):
    return w_bytes.view(torch.float4_e2m1fn_x2), s_bytes.view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------- fp8


def test_fp8_every_code_under_every_scale():
    # 16 x 16 tiles of 32 x 32, tile (i, j) scaled by byte 16 i + j, each tile holding all 256
    # codes four times: programs over mid-range tiles run the common path, the rest the exact one
    g = torch.Generator().manual_seed(0)
    tiles = torch.stack([_every_byte(1024, g).view(32, 32) for _ in range(256)]).view(16, 16, 32, 32)
    w_bytes = tiles.permute(0, 2, 1, 3).reshape(512, 512).contiguous()
    s_bytes = torch.arange(256, dtype=torch.uint8).view(16, 16)
    weight, scale = _fp8(w_bytes, s_bytes)
    want = dequantize_fp8_weight(weight, scale)
    assert want.isnan().sum() == 256 * 8 + 1024 - 8 and want.isinf().any() and (want.view(torch.int16) == -32768).any()
    _assert_same_bits(dequantize_fp8_triton(weight, scale), want)


def test_fp8_exact_path_for_every_scale():
    # every program's first scale column is byte 0, so every program takes the exact path; the
    # other columns run through all 256 scale bytes
    groups = dequant.LAUNCH_CONFIG["fp8"]["groups"]
    assert groups >= 2
    rows = -(-256 // (groups - 1))
    s_bytes = torch.zeros(rows, groups, dtype=torch.uint8)
    s_bytes[:, 1:] = (torch.arange(rows * (groups - 1)) % 256).view(rows, groups - 1).to(torch.uint8)
    g = torch.Generator().manual_seed(1)
    w_bytes = _every_byte(32 * rows * 32 * groups, g).view(32 * rows, 32 * groups)
    weight, scale = _fp8(w_bytes, s_bytes)
    _assert_same_bits(dequantize_fp8_triton(weight, scale), dequantize_fp8_weight(weight, scale))


@pytest.mark.parametrize("byte", [FP8_COMMON[0] - 1, FP8_COMMON[0], FP8_COMMON[1], FP8_COMMON[1] + 1, 0, 255])
def test_fp8_uniform_scale_at_the_path_bounds(byte):
    # one scale byte everywhere: just inside the common range the common path must be exact on its
    # own; just outside, the exact path takes over
    g = torch.Generator().manual_seed(byte)
    weight, scale = _fp8(_every_byte(64 * 64, g).view(64, 64), torch.full((2, 2), byte, dtype=torch.uint8))
    _assert_same_bits(dequantize_fp8_triton(weight, scale), dequantize_fp8_weight(weight, scale))


@pytest.mark.parametrize("shape", [(40, 70), (1, 1), (33, 300), (64, 32), (31, 257)])
@pytest.mark.parametrize("scales", ["common", "any"])
def test_fp8_ragged_edges(shape, scales):
    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k)
    lo, hi = FP8_COMMON if scales == "common" else (0, 255)
    w_bytes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    s_bytes = torch.randint(lo, hi + 1, (-(-n // 32), -(-k // 32)), dtype=torch.uint8, generator=g)
    weight, scale = _fp8(w_bytes, s_bytes)
    _assert_same_bits(dequantize_fp8_triton(weight, scale), dequantize_fp8_weight(weight, scale))


# ---------------------------------------------------------------------------------------------- fp4


def test_fp4_every_byte_under_every_scale():
    # row r scaled by byte r throughout, each row holding all 256 bytes (512 values, 16 groups):
    # programs over mid-range rows run the common path, the rest the exact one
    g = torch.Generator().manual_seed(2)
    w_bytes = _every_byte(256 * 256, g).view(256, 256)
    s_bytes = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous()
    weight, scale = _fp4(w_bytes, s_bytes)
    want = dequantize_fp4_weight(weight, scale)
    assert want.isnan().sum() == 512 and want.isinf().any() and (want.view(torch.int16) == -32768).any()
    _assert_same_bits(dequantize_fp4_triton(weight, scale), want)


def test_fp4_exact_path_for_every_scale():
    # one program column (groups = the program's width); group 0 of every row has scale byte 0, so
    # every program takes the exact path; the other groups carry scale byte = row
    groups = dequant.LAUNCH_CONFIG["fp4"]["groups"]
    assert groups >= 2
    s_bytes = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, groups)
    s_bytes[:, 0] = 0
    g = torch.Generator().manual_seed(3)
    w_bytes = _every_byte(256 * 16 * groups, g).view(256, 16 * groups)
    weight, scale = _fp4(w_bytes, s_bytes)
    _assert_same_bits(dequantize_fp4_triton(weight, scale), dequantize_fp4_weight(weight, scale))


@pytest.mark.parametrize("byte", [FP4_COMMON[0] - 1, FP4_COMMON[0], FP4_COMMON[1], FP4_COMMON[1] + 1, 0, 255])
def test_fp4_uniform_scale_at_the_path_bounds(byte):
    g = torch.Generator().manual_seed(byte)
    weight, scale = _fp4(_every_byte(16 * 256, g).view(16, 256), torch.full((16, 16), byte, dtype=torch.uint8))
    _assert_same_bits(dequantize_fp4_triton(weight, scale), dequantize_fp4_weight(weight, scale))


@pytest.mark.parametrize("shape", [(5, 64), (40, 96), (1, 32), (33, 352)])
@pytest.mark.parametrize("scales", ["common", "any"])
def test_fp4_ragged_edges(shape, scales):
    n, k = shape
    g = torch.Generator().manual_seed(n * 1000 + k + 1)
    lo, hi = FP4_COMMON if scales == "common" else (0, 255)
    w_bytes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s_bytes = torch.randint(lo, hi + 1, (n, k // 32), dtype=torch.uint8, generator=g)
    weight, scale = _fp4(w_bytes, s_bytes)
    _assert_same_bits(dequantize_fp4_triton(weight, scale), dequantize_fp4_weight(weight, scale))


@pytest.mark.parametrize("view", [torch.int8, torch.uint8])
def test_fp4_accepts_byte_views(view):
    g = torch.Generator().manual_seed(4)
    w_bytes = torch.randint(0, 256, (7, 32), dtype=torch.uint8, generator=g)
    s_bytes = torch.randint(100, 150, (7, 2), dtype=torch.uint8, generator=g)
    weight, scale = _fp4(w_bytes, s_bytes)
    _assert_same_bits(dequantize_fp4_triton(w_bytes.view(view), scale), dequantize_fp4_weight(weight, scale))


# ------------------------------------------------------------------------------- layouts and out=


def test_strided_inputs_and_out_buffer():
    g = torch.Generator().manual_seed(5)
    # fp8: a column slice of a wider weight and of its scales, written into a column slice of a
    # wider buffer whose other columns must stay untouched
    w_wide = torch.randint(0, 256, (45, 128), dtype=torch.uint8, generator=g)
    s_wide = torch.randint(0, 256, (2, 4), dtype=torch.uint8, generator=g)
    weight, scale = _fp8(w_wide[:, :70], s_wide[:, :3])
    buf = torch.full((45, 100), 3.0, dtype=torch.bfloat16)
    got = dequantize_fp8_triton(weight, scale, out=buf[:, 10:80])
    assert got.data_ptr() == buf[:, 10:80].data_ptr()
    _assert_same_bits(got, dequantize_fp8_weight(weight.contiguous(), scale.contiguous()))
    assert (buf[:, :10] == 3.0).all() and (buf[:, 80:] == 3.0).all()

    # fp4: the same with a row-strided weight and a reused, previously filled buffer
    w_wide = torch.randint(0, 256, (9, 80), dtype=torch.uint8, generator=g)
    s_wide = torch.randint(0, 256, (9, 5), dtype=torch.uint8, generator=g)
    weight, scale = _fp4(w_wide[:, :48], s_wide[:, :3])
    out = torch.full((9, 96), float("nan"), dtype=torch.bfloat16)
    for _ in range(2):
        assert dequantize_fp4_triton(weight, scale, out=out) is out
        _assert_same_bits(out, dequantize_fp4_weight(weight.contiguous(), scale.contiguous()))


def test_empty_weight():
    weight, scale = _fp8(torch.empty(0, 70, dtype=torch.uint8), torch.empty(0, 3, dtype=torch.uint8))
    assert dequantize_fp8_triton(weight, scale).shape == (0, 70)
    weight, scale = _fp4(torch.empty(4, 0, dtype=torch.uint8), torch.empty(4, 0, dtype=torch.uint8))
    assert dequantize_fp4_triton(weight, scale).shape == (4, 0)


# ------------------------------------------------------------------------------------------ errors


def _errors():
    w8, s8 = _fp8(torch.zeros(40, 70, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))
    w4, s4 = _fp4(torch.zeros(8, 32, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8))
    return [
        (dequantize_fp8_triton, (w8.to(torch.bfloat16), s8), {}, "float8_e4m3fn"),
        (dequantize_fp8_triton, (w8[0], s8), {}, "2-D"),
        (dequantize_fp8_triton, (w8, s8.float()), {}, "float8_e8m0fnu"),
        (dequantize_fp8_triton, (w8, s8[:1]), {}, "needs scale"),
        (dequantize_fp8_triton, (w8.t(), torch.zeros(3, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)), {}, "contiguous"),
        (dequantize_fp8_triton, (w8, s8), {"out": torch.empty(40, 70)}, "bfloat16"),
        (dequantize_fp8_triton, (w8, s8), {"out": torch.empty(40, 71, dtype=torch.bfloat16)}, "bfloat16"),
        (dequantize_fp8_triton, (w8, s8), {"out": torch.empty(70, 40, dtype=torch.bfloat16).t()}, "contiguous"),
        (dequantize_fp8_triton, (w8, s8.to("meta")), {}, "is on meta"),
        (dequantize_fp4_triton, (w4.view(torch.uint8).view(torch.float8_e4m3fn), s4), {}, "float4_e2m1fn_x2"),
        (dequantize_fp4_triton, (w4[:, :8], s4[:, :1]), {}, "not a multiple of 32"),
        (dequantize_fp4_triton, (w4, s4[:, :1]), {}, "needs scale"),
        (dequantize_fp4_triton, (w4, s4.view(torch.uint8)), {}, "float8_e8m0fnu"),
        (dequantize_fp4_triton, (w4, s4), {"out": torch.empty(8, 32, dtype=torch.bfloat16)}, "bfloat16"),
    ]


@pytest.mark.parametrize("case", range(len(_errors())))
def test_errors(case):
    fn, args, kwargs, message = _errors()[case]
    with pytest.raises(DequantizationError, match=message) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------- DeepseekV41Linear


def _linear(kind: str, in_features: int, out_features: int, seed: int) -> DeepseekV41Linear:
    lin = DeepseekV41Linear(in_features, out_features, kind)
    g = torch.Generator().manual_seed(seed)
    lin.weight.data.view(torch.uint8).copy_(torch.randint(0, 256, lin.weight.shape, dtype=torch.uint8, generator=g))
    lin.scale.data.view(torch.uint8).copy_(torch.randint(0, 256, lin.scale.shape, dtype=torch.uint8, generator=g))
    return lin


@pytest.mark.parametrize("kind,in_features,out_features", [("fp8", 70, 40), ("fp4", 96, 40)])
def test_linear_backends(kind, in_features, out_features, monkeypatch):
    lin = _linear(kind, in_features, out_features, seed=in_features)
    name = f"dequantize_{kind}_triton"
    calls = []

    def spy(*args, **kwargs):
        calls.append(name)
        return getattr(dequant, name)(*args, **kwargs)

    monkeypatch.setattr(quant_module, name, spy)
    monkeypatch.delenv(dequant.ENV_BACKEND, raising=False)
    want = lin.dequantized_weight(backend="torch")
    assert not calls
    _assert_same_bits(lin.dequantized_weight(backend="triton"), want)
    assert len(calls) == 1
    lin.dequantized_weight()  # auto on a CPU weight: torch
    assert len(calls) == 1
    monkeypatch.setenv(dequant.ENV_BACKEND, "triton")  # the variable forces the kernel
    _assert_same_bits(lin.dequantized_weight(), want)
    assert len(calls) == 2
    # other dtypes keep the torch functions (the kernel writes bf16 only)
    exact = lin.dequantized_weight(torch.float32)
    assert len(calls) == 2 and exact.dtype == torch.float32
    monkeypatch.setenv(dequant.ENV_BACKEND, "cuda")
    with pytest.raises(DeepseekV41QuantizationError, match="backend"):
        lin.dequantized_weight()
