"""The vision 2D RoPE op (`triton_ops/vision_rope.py`): the Triton kernel, run by Triton's CPU
interpreter, against the torch fallback on odd grids; the fallback against an independent
complex-number rotation; and the tiny vision tower run with each backend against the golden.
"""

from __future__ import annotations



import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import deepseek_v41_vl.triton_ops.vision_rope as vision_rope  # noqa: E402
from deepseek_v41_vl.modeling.debug_deepseek_v41_vl import capture_boundaries  # noqa: E402
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, apply_numerics  # noqa: E402
from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import vision_rope_tables  # noqa: E402
from deepseek_v41_vl.triton_ops.vision_rope import VisionRopeError, apply_vision_rope, resolve_backend  # noqa: E402

from golden_bits import LOCAL_REL_L2, assert_golden  # noqa: E402
from test_vision import GOLDEN_OUTPUT_BOUNDARIES, golden_inputs, load_golden_tower  # noqa: E402

GRIDS = [(1, 1), (1, 6), (5, 1), (5, 7)]


def fused_qkv(n: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q, k as the model sees them: strided views of one fused [N, 3 * H * hd] projection, with
    values spread over many binades (rounding to bf16 is exercised everywhere)."""
    g = torch.Generator().manual_seed(seed)
    width = heads * head_dim
    scale = torch.logspace(-8, 3, 3 * width, dtype=torch.float64).float()
    qkv = (torch.randn(n, 3 * width, generator=g) * scale[torch.randperm(3 * width, generator=g)]).to(dtype)
    q, k, _ = (t.view(n, heads, head_dim) for t in qkv.chunk(3, dim=-1))
    return q, k


@pytest.mark.parametrize("n_h,n_w", GRIDS)
@pytest.mark.parametrize("heads,head_dim", [(2, 64), (3, 16), (1, 12), (5, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_equals_fallback(n_h, n_w, heads, head_dim, dtype):
    cos, sin = vision_rope_tables(n_h, n_w, head_dim // 2, 10000.0, torch.device("cpu"))
    q, k = fused_qkv(n_h * n_w, heads, head_dim, dtype)
    assert n_h * n_w == 1 or q.stride(0) == 3 * heads * head_dim  # strided views, read in place
    q_ref, k_ref = apply_vision_rope(q, k, cos, sin, backend="torch")
    q_tri, k_tri = apply_vision_rope(q, k, cos, sin, backend="triton")
    for ours, ref in ((q_tri, q_ref), (k_tri, k_ref)):
        assert ours.dtype == dtype and ours.shape == ref.shape and ours.is_contiguous()
        assert torch.equal(ours, ref), f"max diff {(ours.double() - ref.double()).abs().max():.3g}"


def test_triton_bf16_rounding_ties_and_specials():
    # With cos = sin = 1 the first half is x1 - x2 and the second x2 + x1, exact in fp32. The
    # pairs below put that fp32 value exactly halfway between two bf16 numbers (ties to even:
    # down, up, and up into inf) or make it inf / nan. Triton's interpreter cast truncates; the
    # kernel must round like torch.
    bf16_max = torch.finfo(torch.bfloat16).max
    pairs = [
        (1.0, -(2**-8)),  # 1 + 2^-8: tie, even neighbour 1.0
        (1.0 + 2**-6, 2**-8),  # 1 + 3 * 2^-8: tie, even neighbour 1 + 2^-6
        (-1.0, 2**-8),
        (bf16_max, -(2**119)),  # tie between the largest bf16 and 2^128: inf
        (float("inf"), 0.0),
        (float("nan"), 1.0),
        (3.0, 0.25),
    ]
    x1 = torch.tensor([p[0] for p in pairs], dtype=torch.bfloat16)
    x2 = torch.tensor([p[1] for p in pairs], dtype=torch.bfloat16)
    x = torch.cat([x1, x2]).view(1, 1, -1)
    ones = torch.ones(1, 1, len(pairs))
    got, _ = apply_vision_rope(x, x.clone(), ones, ones, backend="triton")
    want, _ = apply_vision_rope(x, x.clone(), ones, ones, backend="torch")
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[0, 0, 0].item() == 1.0 and got[0, 0, 1].item() == 1.0 + 2**-6
    assert got[0, 0, 3].item() == float("inf")


def test_fallback_is_half_split_complex_rotation():
    # dim i pairs with i + hd/2 and turns by the angle of frequency slot i: (x1 + i x2) * e^{i a}
    n_h, n_w, heads, head_dim = 3, 4, 2, 16
    cos, sin = vision_rope_tables(n_h, n_w, head_dim // 2, 10000.0, torch.device("cpu"))
    q, k = fused_qkv(n_h * n_w, heads, head_dim, torch.float32, seed=3)
    rq, _ = apply_vision_rope(q, k, cos, sin, backend="torch")
    z = torch.complex(q[..., : head_dim // 2].double(), q[..., head_dim // 2 :].double())
    rotated = z * torch.complex(cos.double(), sin.double())
    want = torch.cat([rotated.real, rotated.imag], dim=-1)
    assert torch.allclose(rq.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_triton_backward_matches_fallback_autograd():
    cos, sin = vision_rope_tables(5, 7, 8, 10000.0, torch.device("cpu"))
    grads = {}
    for backend in ("torch", "triton"):
        q, k = (t.detach().clone().requires_grad_() for t in fused_qkv(35, 2, 16, torch.bfloat16, seed=1))
        rq, rk = apply_vision_rope(q, k, cos, sin, backend=backend)
        weight = torch.linspace(-2, 2, rq.numel()).view_as(rq).bfloat16()
        ((rq.float() * weight.float()).sum() + (rk.float() * weight.float().flip(0)).sum()).backward()
        grads[backend] = (q.grad, k.grad)
    for ours, ref in zip(grads["triton"], grads["torch"]):
        # autograd sums the two fp32 contributions in its own order: allow one bf16 ulp
        assert torch.allclose(ours.float(), ref.float(), rtol=2**-7, atol=1e-6)


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv(vision_rope.ENV_BACKEND, raising=False)
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("TORCH", torch.device("cuda")) == "torch"
    monkeypatch.setenv(vision_rope.ENV_BACKEND, "triton")
    assert resolve_backend(None, torch.device("cpu")) == "triton"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"  # the argument wins
    monkeypatch.setenv(vision_rope.ENV_BACKEND, "fast")
    with pytest.raises(VisionRopeError, match="backend must be one of"):
        resolve_backend(None, torch.device("cpu"))


def test_environment_variable_routes_calls_to_the_kernel(monkeypatch):
    calls = []
    real = vision_rope._rotate_pair_triton
    monkeypatch.setattr(vision_rope, "_rotate_pair_triton", lambda *a: calls.append(1) or real(*a))
    cos, sin = vision_rope_tables(2, 2, 8, 10000.0, torch.device("cpu"))
    q, k = fused_qkv(4, 1, 16, torch.bfloat16)
    monkeypatch.setenv(vision_rope.ENV_BACKEND, "torch")
    apply_vision_rope(q, k, cos, sin)
    assert calls == []
    monkeypatch.setenv(vision_rope.ENV_BACKEND, "triton")
    apply_vision_rope(q, k, cos, sin)
    assert calls == [1]


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = vision_rope_tables(1, 2, 4, 10000.0, torch.device("cpu"))
    q, k = fused_qkv(2, 1, 8, torch.bfloat16)
    with pytest.raises(VisionRopeError, match="needs CUDA tensors"):
        apply_vision_rope(q, k, cos, sin, backend="triton")


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, c, s: (q, k[:, :1], c, s), "q and k must both be"),
        (lambda q, k, c, s: (q, k, c.double(), s), "cos must be float32"),
        (lambda q, k, c, s: (q, k, c, s[:1]), r"sin must be \[2, 1, 4\]"),
        (lambda q, k, c, s: (q, k.float(), c, s), "share one floating dtype"),
        (lambda q, k, c, s: (q[..., :7], k[..., :7], c, s), "head_dim must be even"),
    ],
)
def test_bad_arguments_raise(change, match):
    cos, sin = vision_rope_tables(1, 2, 4, 10000.0, torch.device("cpu"))
    q, k = fused_qkv(2, 2, 8, torch.bfloat16)
    with pytest.raises(VisionRopeError, match=match):
        apply_vision_rope(*change(q, k, cos, sin), backend="torch")


def test_tiny_tower_with_the_kernel_equals_fallback_and_golden(golden):
    tower = load_golden_tower(golden)
    pixel_values, grids = golden_inputs(golden)
    outputs = load_file(golden / "vision_tiny" / "outputs.safetensors")
    runs = {}
    for backend in ("torch", "triton"):
        apply_numerics(tower, DeepseekV41Numerics.resolve("exact", vision_rope=backend))
        with torch.inference_mode(), capture_boundaries(tower) as records:
            runs[backend] = tower(torch.cat(pixel_values), grids)
        for image in (0, 1):
            for name in GOLDEN_OUTPUT_BOUNDARIES:
                assert_golden(records[name][image], outputs[f"image{image}.{name}"], f"{backend} image{image}.{name}",
                              rel_l2=LOCAL_REL_L2)
    assert torch.equal(runs["triton"], runs["torch"])
