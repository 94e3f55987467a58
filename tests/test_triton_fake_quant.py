"""The fake-quant kernels (`triton_ops/fake_quant.py`), run by Triton's CPU interpreter, against the
torch functions of `modeling/quantization_deepseek_v41_vl.py`, bit for bit (compared as int16
patterns, so +0 and -0 differ).

The formats: ``fp8`` = `fake_quant_fp8(x, 32, "ue8m0")`; ``fp4/e4m3`` = `fake_quant_fp4(x, 16,
"e4m3")` (compressed KV); ``fp4/ue8m0`` = `fake_quant_fp4(x, 32, "ue8m0")` (indexer q / k).
Inputs: every finite bf16 value at a few magnifications, grouped by neighbouring bit patterns
(groups of similar magnitude: tiny amax, floors, subnormal results) and shuffled (one large value
sets the scale for small ones); all-zero groups; one huge value per group; exact ties of the E2M1
and e4m3 roundings; negative zeros; several shapes and non-contiguous views; bad arguments.
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402

import deepseek_v41_vl.modeling.quantization_deepseek_v41_vl as quant_module  # noqa: E402
import deepseek_v41_vl.triton_ops.fake_quant as fake_quant  # noqa: E402


# q * s overflowing fp32 for the largest bf16 inputs (as in torch) makes numpy warn in the interpreter
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

FakeQuantError = fake_quant.FakeQuantError
DeepseekV41QuantizationError = quant_module.DeepseekV41QuantizationError

FORMATS = {  # name: (kernel, torch function)
    "fp8": (fake_quant.fake_quant_fp8_triton, lambda x: quant_module._fake_quant_fp8_torch(x, 32, "ue8m0")),
    "fp4/e4m3": (
        lambda x: fake_quant.fake_quant_fp4_triton(x, 16, "e4m3"),
        lambda x: quant_module._fake_quant_fp4_torch(x, 16, "e4m3"),
    ),
    "fp4/ue8m0": (
        lambda x: fake_quant.fake_quant_fp4_triton(x, 32, "ue8m0"),
        lambda x: quant_module._fake_quant_fp4_torch(x, 32, "ue8m0"),
    ),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _assert_bitwise(fmt: str, x: torch.Tensor) -> torch.Tensor:
    kernel, reference = FORMATS[fmt]
    ours, ref = kernel(x), reference(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    mismatch = _bits(ours) != _bits(ref)
    assert not mismatch.any(), (
        f"{fmt}: {int(mismatch.sum())} of {x.numel()} differ, e.g. x={x.contiguous()[mismatch][:4].tolist()} "
        f"kernel={ours[mismatch][:4].tolist()} torch={ref.contiguous()[mismatch][:4].tolist()}"
    )
    return ours


def _finite_bf16() -> torch.Tensor:
    """Every finite bf16 value (65280 of them), in bit-pattern order."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return values[torch.isfinite(values.float())]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(
    "magnify,shuffled", [(1.0, False), (1.0, True), (2.0**-100, False), (2.0**100, True), (0.7, True)]
)
def test_every_finite_bf16_value_is_bitwise_equal(fmt, magnify, shuffled):
    x = (_finite_bf16().float() * magnify).to(torch.bfloat16)
    x = x[torch.isfinite(x.float())]
    x = x[: x.numel() // 32 * 32]
    if shuffled:
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(len(fmt)))]
    ours = _assert_bitwise(fmt, x.reshape(-1, 128))
    assert (_bits(ours) == _bits(torch.tensor(-0.0, dtype=torch.bfloat16))).any()  # signed zeros reached


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zero_groups_huge_values_and_negative_zeros(fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    x[0] = 0.0  # all-zero groups: the amax floors
    x[1] = -0.0
    x[2, :16] = torch.tensor([0.0, -0.0] * 8)
    x[3, 5] = 3.3895313892515355e38  # bf16's largest: the largest scales, q * s overflowing fp32
    x[3, 40] = -3.3895313892515355e38
    x[4, ::16] = 1e30  # one huge value per group: every other value rounds to a signed zero
    x[5] *= 2.0**-130  # bf16 subnormals only
    x = x.to(torch.bfloat16)
    ours = _assert_bitwise(fmt, x)
    negzero = _bits(torch.tensor(-0.0, dtype=torch.bfloat16))
    assert (_bits(ours[1]) == negzero).all() and (_bits(ours[0]) == 0).all()
    assert (_bits(ours[4])[x[4] < 0] == negzero).all()  # negative inputs rounded to 0 keep the sign


def test_e2m1_ties_round_to_the_even_code():
    """Every E2M1 midpoint and its bf16 neighbours; a 6 in the group makes the scale exactly 1 in
    both formats (fp32(6 * fp32(1/6)) = 1; e4m3(6 / 6) = 1), so the outputs are the E2M1 values."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rounded = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # ties to the even code
    ulp = 2.0 ** (torch.floor(torch.log2(mids)) - 7)  # bf16 spacing at each midpoint
    vals = torch.cat([mids, mids - ulp, mids + ulp, torch.tensor([5.875, 0.125, 0.0]), torch.zeros(6)])
    vals = torch.cat([vals, -vals]).reshape(4, 15)  # positives, then negatives from index 32
    groups = torch.cat([vals, torch.full((4, 1), 6.0)], dim=1)  # a 6 in every group of 16
    x = groups.flatten().repeat(2, 1).to(torch.bfloat16)  # [2, 64]
    assert torch.equal(x.float()[0], groups.flatten())  # the midpoints are bf16 values
    for fmt in ("fp4/e4m3", "fp4/ue8m0"):
        ours = _assert_bitwise(fmt, x).float()
        assert torch.equal(ours[0, :7], rounded) and torch.equal(ours[0, 32:39], -rounded)


def test_e4m3_ties_round_to_even():
    """Midpoints between all neighbouring positive e4m3 values (subnormals included), and their
    negatives; 448 in each group makes the ue8m0 scale exactly 1 (448 * fp32(1/448) = 1)."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (e4m3[1:] + e4m3[:-1]) / 2
    vals = torch.cat([mids, -mids])
    groups = vals[: vals.numel() // 31 * 31].reshape(-1, 31)
    x = torch.cat([groups, torch.full((groups.size(0), 1), 448.0)], dim=1).to(torch.bfloat16)
    assert torch.equal(x[:, :31].float(), groups)  # the midpoints are bf16 values
    ours = _assert_bitwise("fp8", x.reshape(-1, 64)).reshape(-1, 32).float()
    # half to even: the result's e4m3 code is even
    codes = ours[:, :31].to(torch.float8_e4m3fn).view(torch.uint8) & 0x7F
    assert ((codes & 1) == 0).all()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_shapes_and_non_contiguous_views(fmt):
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        scale = torch.logspace(-6, 6, shape[-1] // 32).repeat_interleave(32)
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    _assert_bitwise(fmt, rand(3, 5, 64))
    _assert_bitwise(fmt, rand(1, 1, 32))
    _assert_bitwise(fmt, rand(1, 1, 32, 128))
    _assert_bitwise(fmt, rand(2, 0, 64))  # empty
    base = rand(4, 6, 96)
    _assert_bitwise(fmt, base[:, ::2, :64])  # strided rows
    _assert_bitwise(fmt, base[:, 1:5, 32:])  # offset slice
    _assert_bitwise(fmt, rand(4, 64).t().contiguous().t())  # last dimension not unit-stride
    # many programs (more than one block of groups)
    _assert_bitwise(fmt, rand(33, 1024))


def test_modeling_functions_dispatch_to_the_kernels(monkeypatch):
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * 10).to(torch.bfloat16)
    calls = []
    for name in ("fake_quant_fp8_triton", "fake_quant_fp4_triton"):
        real = getattr(quant_module, name)
        monkeypatch.setattr(quant_module, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    # CPU tensors take the torch ops unless the backend is forced
    monkeypatch.delenv(fake_quant.ENV_BACKEND, raising=False)
    ref8, ref4 = quant_module.fake_quant_fp8(x), quant_module.fake_quant_fp4(x, 16, "e4m3")
    ref4u = quant_module.fake_quant_fp4(x, 32, "ue8m0")
    assert calls == []
    monkeypatch.setenv(fake_quant.ENV_BACKEND, "triton")
    assert torch.equal(_bits(quant_module.fake_quant_fp8(x)), _bits(ref8))
    assert torch.equal(_bits(quant_module.fake_quant_fp4(x, 16, "e4m3")), _bits(ref4))
    assert torch.equal(_bits(quant_module.fake_quant_fp4(x, 32, "ue8m0")), _bits(ref4u))
    assert calls == ["fake_quant_fp8_triton", "fake_quant_fp4_triton", "fake_quant_fp4_triton"]
    # formats the kernels do not take stay on the torch ops
    quant_module.fake_quant_fp8(x, 32, None)
    quant_module.fake_quant_fp8(x, 16, "ue8m0")
    assert len(calls) == 3
    with pytest.raises(DeepseekV41QuantizationError, match="scale_fmt"):
        quant_module.fake_quant_fp4(x, 16, "e5m2")
    monkeypatch.setenv(fake_quant.ENV_BACKEND, "cuda-magic")
    with pytest.raises(DeepseekV41QuantizationError, match="backend"):
        quant_module.fake_quant_fp8(x)


def test_bad_arguments_raise():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(FakeQuantError, match="bfloat16"):
        fake_quant.fake_quant_fp8_triton(x.float())
    with pytest.raises(FakeQuantError, match="bfloat16"):
        fake_quant.fake_quant_fp4_triton(x.half(), 16, "e4m3")
    with pytest.raises(FakeQuantError, match="multiple of the group size 32"):
        fake_quant.fake_quant_fp8_triton(x[:, :16])
    with pytest.raises(FakeQuantError, match="multiple of the group size 16"):
        fake_quant.fake_quant_fp4_triton(x[:, :24], 16, "e4m3")
    with pytest.raises(FakeQuantError, match="multiple of the group size"):
        fake_quant.fake_quant_fp8_triton(torch.tensor(1.0, dtype=torch.bfloat16))
    with pytest.raises(FakeQuantError, match="scale_fmt"):
        fake_quant.fake_quant_fp4_triton(x, 16, "e5m2")
    with pytest.raises(FakeQuantError, match="power-of-two group"):
        fake_quant.fake_quant_fp4_triton(x, 24, "e4m3")
    with pytest.raises(FakeQuantError, match="backend"):
        fake_quant.resolve_fake_quant_backend("cuda-magic", x.device)
    assert issubclass(FakeQuantError, ValueError)
