"""The vision MLP's fused SwiGLU (`triton_ops/swiglu.py`), run by Triton's CPU interpreter, against
the reference's two torch ops (``F.silu(gate) * up``): the same two bf16 roundings, so outputs
agree to one bf16 ulp (the interpreter's exp is numpy's; on the GPU `test_gpu.py` asks for every
bit). Also: which numerics and modes take it, and bad arguments.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import deepseek_v41_vl.triton_ops.swiglu as swiglu
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41VisionConfig
from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import DeepseekV41VisionMLP


def _torch_swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("shape", [(3, 2 * 2816), (2, 5, 2 * 40), (1, 2 * 1500), (4, 2)])
def test_kernel_agrees_with_the_torch_ops(shape):
    g = torch.Generator().manual_seed(sum(shape))
    # gates over many binades: silu's saturation (large |g|), its linear part (small |g|) and 0
    h = (torch.randn(*shape, generator=g) * torch.logspace(-4, 1.5, shape[-1])[torch.randperm(shape[-1], generator=g)])
    h = h.to(torch.bfloat16)
    h.view(-1)[:1] = 0.0
    ours, ref = swiglu.swiglu_triton(h), _torch_swiglu(h)
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16 and ours.is_contiguous()
    same_sign = (ours.view(torch.int16) < 0) == (ref.view(torch.int16) < 0)
    assert bool((same_sign | (ours == ref)).all())
    assert int(_ulps(ours, ref)[same_sign].max()) <= 1
    assert (ours == ref).float().mean().item() >= 0.99


def test_strided_rows_and_no_rows():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 2, 128, generator=g).to(torch.bfloat16)
    h = base[:, 1]  # every other row: a row stride of 256
    assert int(_ulps(swiglu.swiglu_triton(h), _torch_swiglu(h)).max()) <= 1
    assert swiglu.swiglu_triton(torch.zeros(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert swiglu.swiglu_triton(torch.zeros(3, 0, dtype=torch.bfloat16)).shape == (3, 0)


def test_the_vision_mlp_takes_it_in_fast_numerics_without_autograd(monkeypatch):
    calls = []
    real = swiglu.swiglu_triton

    def counting(h):
        calls.append(tuple(h.shape))
        return real(h)

    import deepseek_v41_vl.modeling.vision_deepseek_v41_vl as vision

    monkeypatch.setattr(vision, "swiglu_triton", counting)
    monkeypatch.setenv(swiglu.ENV_BACKEND, "triton")  # on the CPU: the interpreter
    config = DeepseekV41VisionConfig(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_hidden_layers=1)
    torch.manual_seed(0)
    exact = DeepseekV41VisionMLP(config, numerics="exact").to(torch.bfloat16)
    fast = DeepseekV41VisionMLP(config, numerics="fast").to(torch.bfloat16)
    fast.load_state_dict(exact.state_dict())
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.no_grad():
        ref = exact(x)
        assert calls == []
        ours = fast(x)
    assert calls == [(3, 96)]
    assert int(_ulps(ours, ref).max()) <= 1
    # autograd recording (fine-tuning): the torch ops, so gradients reach w1
    fast(x).float().sum().backward()
    assert calls == [(3, 96)] and fast.w1.weight.grad is not None
    with torch.no_grad():  # fp32 rows: the torch ops
        fast.float()(x.float())
    assert calls == [(3, 96)]


def test_bad_arguments_are_refused():
    with pytest.raises(swiglu.SwiGLUKernelError, match="takes bf16"):
        swiglu.swiglu_triton(torch.zeros(2, 64))
    with pytest.raises(swiglu.SwiGLUKernelError, match="even"):
        swiglu.swiglu_triton(torch.zeros(2, 63, dtype=torch.bfloat16))
