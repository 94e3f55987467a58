"""The fused RMSNorm kernel (`triton_ops/rms_norm.py`), run by Triton's CPU interpreter, against the
torch ops of `DeepseekV41RMSNorm` (the reference's order): the same fp32 formula, the mean summed
in another order, so outputs agree to one bf16 ulp (and mostly bit for bit). Also: which numerics
take it, and bad arguments.
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402

import deepseek_v41_vl.triton_ops.rms_norm as rms_norm  # noqa: E402
from deepseek_v41_vl.modeling.layers_deepseek_v41_vl import DeepseekV41RMSNorm  # noqa: E402
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41NumericsError  # noqa: E402


RMSNormKernelError = rms_norm.RMSNormKernelError


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = DeepseekV41RMSNorm(x.size(-1), eps, numerics="exact")
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between same-signed values (bit patterns as integers)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize(
    "shape, eps",
    [((1, 1, 5120), 1e-6), ((3, 1280), 1e-6), ((2, 5, 512), 1e-20), ((7, 128), 1e-6), ((4, 100), 1e-6)],
)
def test_kernel_agrees_with_the_torch_ops(shape, eps):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(torch.bfloat16)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(torch.bfloat16)
    ours = rms_norm.rms_norm_triton(x, weight, eps)
    ref = _torch_rms_norm(x, weight, eps)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    assert int(_ulps(ours, ref).max()) <= 1
    assert (ours == ref).float().mean().item() >= 0.99


def test_fp32_weight_as_the_vision_tower_holds_it():
    """The vision tower's norms keep an fp32 weight (not bf16 values): the kernel reads it as fp32,
    as the torch ops promote it, and the vision norm module takes the kernel in fast numerics."""
    from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import DeepseekV41VisionRMSNorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 1024, generator=g) * 4).to(torch.bfloat16)
    norm = DeepseekV41VisionRMSNorm(1024, 1e-6, numerics="exact")
    with torch.no_grad():
        norm.weight.copy_(torch.rand(1024, generator=g) + 0.5)  # fp32 values, most not bf16
        ref = norm(x)
        ours = rms_norm.rms_norm_triton(x, norm.weight, 1e-6)
    assert norm.weight.dtype == torch.float32
    assert int(_ulps(ours, ref).max()) <= 1 and (ours == ref).float().mean().item() >= 0.99
    # a bf16 copy of the weight would give other outputs: the fp32 values are the ones read
    assert not torch.equal(rms_norm.rms_norm_triton(x, norm.weight.to(torch.bfloat16), 1e-6), ours)


def test_non_contiguous_rows_and_zero_rows():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 2, 256, generator=g).to(torch.bfloat16)
    x = base[:, 1]  # every other row
    weight = torch.ones(256, dtype=torch.bfloat16)
    assert int(_ulps(rms_norm.rms_norm_triton(x, weight, 1e-6), _torch_rms_norm(x, weight, 1e-6)).max()) <= 1
    zeros = torch.zeros(2, 256, dtype=torch.bfloat16)
    assert torch.equal(rms_norm.rms_norm_triton(zeros, weight, 1e-6), zeros)  # 0 * rsqrt(eps), no NaN
    assert rms_norm.rms_norm_triton(torch.zeros(0, 256, dtype=torch.bfloat16), weight, 1e-6).shape == (0, 256)


def test_fast_numerics_take_the_kernel_exact_numerics_never(monkeypatch):
    calls = []
    real = rms_norm.rms_norm_triton

    def counting(*args):
        calls.append(1)
        return real(*args)

    import deepseek_v41_vl.modeling.layers_deepseek_v41_vl as layers

    monkeypatch.setattr(layers, "rms_norm_triton", counting)
    monkeypatch.setenv(rms_norm.ENV_BACKEND, "triton")  # on the CPU: the interpreter
    x = torch.randn(2, 64).to(torch.bfloat16)
    DeepseekV41RMSNorm(64, 1e-6, numerics="exact")(x)
    DeepseekV41RMSNorm(64, 1e-6, numerics="fast")(x.float())  # fp32 rows: the torch ops
    assert calls == []
    fast = DeepseekV41RMSNorm(64, 1e-6, numerics="fast")
    with torch.no_grad():
        assert torch.equal(fast(x), real(x, fast.weight, 1e-6)) and calls == [1]
    # with autograd recording (fine-tuning) the torch ops run: the kernel has no backward
    fast(x).float().sum().backward()
    assert calls == [1] and fast.weight.grad is not None
    # the variable is read once, when the plan is made: a later change does not reach a built module
    monkeypatch.setenv(rms_norm.ENV_BACKEND, "torch")
    with torch.no_grad():
        fast(x)
        assert calls == [1, 1]
        DeepseekV41RMSNorm(64, 1e-6, numerics="fast")(x)
    assert calls == [1, 1]
    monkeypatch.setenv(rms_norm.ENV_BACKEND, "fastest")
    with pytest.raises(DeepseekV41NumericsError, match="DEEPSEEK_V41_RMSNORM_BACKEND.*backend must be one of"):
        DeepseekV41RMSNorm(64, 1e-6, numerics="fast")


def test_bad_arguments_are_refused():
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RMSNormKernelError, match="bf16"):
        rms_norm.rms_norm_triton(torch.zeros(2, 64), w, 1e-6)
    with pytest.raises(RMSNormKernelError, match="weight is on meta"):
        rms_norm.rms_norm_triton(torch.zeros(2, 64, dtype=torch.bfloat16), w.to("meta"), 1e-6)
    with pytest.raises(RMSNormKernelError, match="bf16 or fp32 weight"):
        rms_norm.rms_norm_triton(torch.zeros(2, 64, dtype=torch.bfloat16), w.half(), 1e-6)
    with pytest.raises(RMSNormKernelError, match="must be \\[D\\]"):
        rms_norm.rms_norm_triton(torch.zeros(2, 32, dtype=torch.bfloat16), w, 1e-6)
    with pytest.raises(RMSNormKernelError, match="past the kernel"):
        big = rms_norm.MAX_COLS * 2
        rms_norm.rms_norm_triton(torch.zeros(1, big, dtype=torch.bfloat16), torch.ones(big, dtype=torch.bfloat16), 1e-6)
