"""The text RoPE kernel (`triton_ops/rope.py`), run by Triton's CPU interpreter, against the torch
ops of `apply_rotary` (bit for bit); its errors; the numerics plan's "rope" op; and attention
layers run with each backend.
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.triton_ops.rope as rope
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import (
    BITWISE_OPS,
    KERNEL_ENV,
    DeepseekV41Numerics,
    DeepseekV41NumericsError,
    apply_numerics,
)
from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import DeepseekV41RopeError, DeepseekV41RotaryEmbedding, apply_rotary
from deepseek_v41_vl.triton_ops.rope import RopeKernelError, apply_rotary_triton

from helpers import with_backends
from test_attention import _random_layers, _tiny_config

YARN = {"factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def _table(rd: int, positions: torch.Tensor) -> torch.Tensor:
    return DeepseekV41RotaryEmbedding(rd, 160000.0, YARN)(positions)


def _x(shape, dtype, seed=0):
    """Values over many binades (rounding exercised everywhere), a few bf16 subnormals included."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    scale = torch.logspace(-40, 20, d, dtype=torch.float64).float()[torch.randperm(d, generator=g)]
    return (torch.randn(shape, generator=g) * scale).to(dtype)


CASES = [  # x shape, rotated dims, per-row table
    ((2, 3, 40), 16, False),  # 3-D, shared table
    ((2, 3, 40), 16, True),  # 3-D, one table per batch row
    ((2, 1, 5, 24), 16, False),  # 4-D decode step, 5 heads (padded head block)
    ((3, 4, 2, 16), 16, True),  # 4-D, whole head rotated
]


@pytest.mark.parametrize("shape,rd,per_row", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_equals_torch_bitwise(shape, rd, per_row, dtype, inverse):
    bsz, seqlen = shape[:2]
    positions = torch.randint(0, 70000, (bsz, seqlen), generator=torch.Generator().manual_seed(1))
    freqs = _table(rd, positions if per_row else positions[0])
    x = _x(shape, dtype)
    before = x.clone()
    want = apply_rotary(x.clone(), freqs, inverse=inverse)
    got = apply_rotary_triton(x, freqs, inverse=inverse)
    assert torch.equal(x, before)  # not in place: x untouched
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))
    # in place: returns x, rotated dims written, the others untouched
    inplace = x.clone()
    out = apply_rotary_triton(inplace, freqs, inverse=inverse, inplace=True)
    assert out is inplace
    assert torch.equal(_bits(inplace), _bits(want))
    assert torch.equal(_bits(inplace[..., :-rd]), _bits(before[..., :-rd]))
    # and through the dispatch of apply_rotary
    assert torch.equal(_bits(apply_rotary(x.clone(), freqs, inverse=inverse, backend="triton")), _bits(want))


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply")  # inf * 0, by design
def test_bf16_ties_and_specials():
    # With the table 1 + i the pair (a, b) becomes (a - b, a + b), exact in fp32; these put a - b
    # halfway between two bf16 numbers: ties go to the even one (the interpreter's cast truncates)
    x = torch.tensor([[[1.0, -(2**-8), 1.0 + 2**-7, -(2**-8), -1.0, 2**-8]]], dtype=torch.bfloat16)
    ones = torch.full((1, 3), 1 + 1j, dtype=torch.complex64)
    want = apply_rotary(x.clone(), ones)
    got = apply_rotary_triton(x, ones)
    assert torch.equal(_bits(got), _bits(want))
    assert got[0, 0, 0].item() == 1.0 and got[0, 0, 2].item() == 1.0 + 2**-6  # ties: down, up
    assert got[0, 0, 4].item() == -1.0
    specials = torch.tensor([[[float("inf"), 0.0, float("nan"), 1.0]]], dtype=torch.bfloat16)
    two = _table(4, torch.arange(1))
    got, want = apply_rotary_triton(specials, two), apply_rotary(specials.clone(), two)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_strided_inputs_are_read_in_place():
    freqs = _table(16, torch.arange(5) + 3)
    base = _x((2, 5, 3, 48), torch.bfloat16, seed=3)
    views = [
        base[..., 8:40],  # a slice of the last dim (row stride 48)
        base.transpose(0, 1).contiguous().transpose(0, 1),  # batch and sequence strides swapped
        _x((2, 5, 3, 64), torch.bfloat16, seed=4)[..., ::2],  # last dim strided
    ]
    for x in views:
        want = apply_rotary(x.clone(), freqs)
        assert torch.equal(_bits(apply_rotary_triton(x, freqs)), _bits(want))
        apply_rotary_triton(x, freqs, inplace=True)
        assert torch.equal(_bits(x), _bits(want))
    # a strided (sliced) table, and a conjugate view of it; the torch reference takes a contiguous
    # copy (with a strided table torch's complex multiply runs its scalar loop, which contracts
    # a*c - b*d into an FMA: the module docstring)
    table = _table(16, torch.arange(10)).t().contiguous().t()[::2]
    x = _x((1, 5, 24), torch.float32, seed=5)
    assert torch.equal(apply_rotary_triton(x, table), apply_rotary(x.clone(), table.contiguous()))
    want = apply_rotary(x.clone(), table.contiguous(), inverse=True)
    assert torch.equal(apply_rotary_triton(x, table.conj()), want)


def test_empty_tensors():
    freqs = _table(16, torch.arange(0))
    x = torch.zeros(2, 0, 3, 16, dtype=torch.bfloat16)
    assert apply_rotary_triton(x, freqs).shape == x.shape
    assert apply_rotary_triton(x, freqs, inplace=True) is x


def test_bad_arguments_are_refused():
    freqs = _table(16, torch.arange(3))
    x = torch.zeros(2, 3, 24, dtype=torch.bfloat16)
    bad = [
        (x.half(), freqs, "bf16 or float32"),
        (x, freqs.to(torch.complex128), "complex64"),
        (x, torch.view_as_real(freqs), "complex64"),
        (x[..., :8], freqs, "cannot rotate the last 16 dims"),
        (x[0], freqs, "cannot rotate"),
        (x[:, :2], freqs, "does not match"),
        (x, freqs.unsqueeze(0).expand(3, 3, 8), "does not match"),
        (x, freqs.to("meta"), "one device"),
        (x, freqs[:, :0], "rd > 0"),
    ]
    for xx, ff, match in bad:
        with pytest.raises(RopeKernelError, match=match):
            apply_rotary_triton(xx, ff)
    with pytest.raises(RopeKernelError, match="no backward"):
        apply_rotary_triton(x.float().requires_grad_(), freqs)
    with pytest.raises(RopeKernelError, match="backend must be one of"):
        rope.resolve_backend("cuda", torch.device("cpu"))
    assert issubclass(RopeKernelError, ValueError)
    # the dispatch keeps its own shape errors, fused or not
    with pytest.raises(DeepseekV41RopeError, match="backend"):
        apply_rotary(x, freqs, backend="cuda")
    with pytest.raises(DeepseekV41RopeError, match="does not match"):
        apply_rotary(x[:, :2], freqs, backend="triton")
    # ... and takes the torch ops where the kernel cannot run (dtype, autograd)
    assert not rope.kernel_runs(x.half(), freqs)
    assert torch.equal(apply_rotary(x.half(), freqs, backend="triton"), apply_rotary(x.half(), freqs))
    leaf = x.float().requires_grad_()
    apply_rotary(leaf, freqs, backend="triton").sum().backward()
    assert leaf.grad is not None


def test_numerics_plan_knows_rope(monkeypatch):
    assert KERNEL_ENV["rope"] == rope.ENV_BACKEND == "DEEPSEEK_V41_ROPE_BACKEND"
    assert "rope" not in BITWISE_OPS  # the GPU may round one ulp apart from torch
    monkeypatch.setenv(rope.ENV_BACKEND, "Triton")
    plan = DeepseekV41Numerics.resolve("fast")
    assert plan.choice("rope") == "triton" and plan.backend("rope", torch.device("cpu")) == "triton"
    assert plan.replace(mode="exact").backend("rope", torch.device("cuda")) == "torch"
    assert plan.replace(rope="torch").backend("rope", torch.device("cuda")) == "torch"
    monkeypatch.delenv(rope.ENV_BACKEND)
    assert DeepseekV41Numerics.resolve("fast").backend("rope", torch.device("cpu")) == "torch"
    monkeypatch.setenv(rope.ENV_BACKEND, "cuda")
    with pytest.raises(DeepseekV41NumericsError, match="DEEPSEEK_V41_ROPE_BACKEND.*backend must be one of"):
        DeepseekV41Numerics.resolve("fast")


def test_attention_layers_with_the_kernel_equal_the_torch_ops(monkeypatch):
    """A tiny stack (window-only, ratio-2 source with its indexer, ratio-1 candidate source, its
    user, a reuse layer) in fast numerics, prefill then decode steps, once per rope backend: the
    kernel is bitwise the torch ops on the CPU, so the outputs are equal."""
    config = _tiny_config([0, 2, 1, 1, 1], [1, 2], [1, 2, 3], 2, index_topk=4, candidate_blocks=2)
    config.numerics = "fast"
    layers = _random_layers(config)
    calls = []
    real = rope.apply_rotary_triton

    def counting(*args, **kwargs):
        calls.append(kwargs.get("inverse", False))
        return real(*args, **kwargs)

    monkeypatch.setattr("deepseek_v41_vl.modeling.rope_deepseek_v41_vl.apply_rotary_triton", counting)
    gen = torch.Generator().manual_seed(2)
    b, s, steps = 2, 9, 2
    xs = [torch.randn(b, s + steps, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in layers]
    results = {}
    for backend in ("torch", "triton"):
        calls.clear()
        for layer in layers:
            with_backends(layer, rope=backend)
        state = DeepseekV41AttentionState()
        with torch.no_grad():
            outs = [layer(x[:, :s], state) for layer, x in zip(layers, xs)]
            for t in range(s, s + steps):
                step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
                outs += [layer(x[:, t : t + 1], step) for layer, x in zip(layers, xs)]
        results[backend] = outs, len(calls), any(calls)
    (ref, ref_calls, _), (out, n_calls, saw_inverse) = results["torch"], results["triton"]
    assert ref_calls == 0 and n_calls > 0 and saw_inverse
    for want, got in zip(ref, out):
        assert torch.equal(got, want)
    # exact numerics never take the kernel
    calls.clear()
    for layer in layers:
        apply_numerics(layer, layer.numerics.replace(mode="exact", rope="triton"))
    with torch.no_grad():
        state = DeepseekV41AttentionState()
        for layer, x in zip(layers, xs):
            layer(x[:, :s], state)
    assert calls == []
