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


def _torch_expert_swiglu(gate, up, limit, weights=None):
    # `DeepseekV41Expert.forward` between its linears
    g, u = gate.float(), up.float()
    if limit > 0:
        u = u.clamp(min=-limit, max=limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weights is not None:
        h = weights * h
    return h.to(torch.bfloat16)


@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_expert_swiglu_agrees_with_the_expert_ops(limit, weighted):
    g = torch.Generator().manual_seed(int(limit) + weighted)
    n, inter = 5, 1500
    gate = (torch.randn(n, inter, generator=g) * 8).to(torch.bfloat16)  # beyond the clamp both ways
    up = (torch.randn(n, inter, generator=g) * 8).to(torch.bfloat16)
    gate[0, :4] = torch.tensor([0.0, 30.0, -30.0, 10.0])
    weights = torch.rand(n, 1, generator=g) if weighted else None
    ours = swiglu.expert_swiglu_triton(gate, up, limit, weights)
    ref = _torch_expert_swiglu(gate, up, limit, weights)
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    assert int(_ulps(ours, ref).max()) <= 1
    assert (ours == ref).float().mean().item() >= 0.99
    # the clamp is applied: with the limit, a gate of 30 gives silu(10) * u, not silu(30) * u
    if limit > 0:
        assert float(up[0, 1]) != 0.0 and ours[0, 1] != _torch_expert_swiglu(gate, up, 0.0, weights)[0, 1]


def test_expert_swiglu_strided_inputs_no_rows_and_errors():
    g = torch.Generator().manual_seed(2)
    both = (torch.randn(3, 2, 64, generator=g) * 4).to(torch.bfloat16)
    gate, up = both[:, 0], both[:, 1]  # row stride 128
    assert int(_ulps(swiglu.expert_swiglu_triton(gate, up, 10.0), _torch_expert_swiglu(gate, up, 10.0)).max()) <= 1
    assert swiglu.expert_swiglu_triton(gate[:0], up[:0], 10.0).shape == (0, 64)
    with pytest.raises(swiglu.SwiGLUKernelError, match="bf16"):
        swiglu.expert_swiglu_triton(gate.float(), up, 10.0)
    with pytest.raises(swiglu.SwiGLUKernelError, match=r"\[n, I\]"):
        swiglu.expert_swiglu_triton(gate, up[:, :32], 10.0)
    with pytest.raises(swiglu.SwiGLUKernelError, match="one weight per row"):
        swiglu.expert_swiglu_triton(gate, up, 10.0, torch.ones(2, 1))


def test_the_lm_expert_takes_it_in_fast_numerics_without_autograd(monkeypatch):
    from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41Expert
    import deepseek_v41_vl.modeling.moe_deepseek_v41_vl as moe_module

    calls = []
    real = swiglu.expert_swiglu_triton
    monkeypatch.setattr(moe_module, "expert_swiglu_triton", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setenv(swiglu.ENV_BACKEND, "triton")
    torch.manual_seed(0)
    exact = DeepseekV41Expert(32, 48, "bf16", 10.0, numerics="exact").to(torch.bfloat16)
    with torch.no_grad():
        for p in exact.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    fast = DeepseekV41Expert(32, 48, "bf16", 10.0, numerics="fast").to(torch.bfloat16)
    fast.load_state_dict(exact.state_dict())
    x = (torch.randn(3, 32) * 4).to(torch.bfloat16)
    w = torch.rand(3, 1)
    with torch.no_grad():
        ref = exact(x, w)
        assert calls == []
        ours = fast(x, w)
    assert calls == [(3, 48)]
    assert int(_ulps(ours, ref).max()) <= 1
    fast(x).float().sum().backward()  # autograd: the torch ops
    assert calls == [(3, 48)] and fast.w1.weight.grad is not None
