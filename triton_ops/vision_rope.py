"""2D rotary embedding of the vision tower, applied to q and k in one pass.

Mirrors `inference/vision.py: apply_rotary` (called on q, then on k, in `Attention.forward`):
half-split ("rotate-half") rotation computed in fp32 and cast back to the input dtype::

    x1, x2 = x[..., :D/2], x[..., D/2:]          (as fp32)
    out    = cat([x1*cos - x2*sin, x2*cos + x1*sin]).to(x.dtype)

Two implementations with identical semantics:

- ``"torch"``: the eager fallback, the reference's op sequence (bit-exact to it on any device).
- ``"triton"``: one kernel launch for q and k together; each program rotates every head of one
  token, loading that token's cos/sin once. Products and sums are rounded separately (fp
  contraction into FMA is disabled), so its fp32 values, hence its bf16 output, equal the
  fallback's.

Choosing one, from strongest to weakest:

1. the ``backend`` argument of :func:`apply_vision_rope` (the vision tower passes its numerics
   plan's ``vision_rope`` backend, which read ``DEEPSEEK_V41_VISION_ROPE_BACKEND`` once when the
   model was built);
2. when that is ``None`` or ``"auto"`` (a direct call), the environment variable
   ``DEEPSEEK_V41_VISION_ROPE_BACKEND``, read at each call;
3. ``"auto"``: Triton for CUDA tensors when Triton is installed, the torch fallback elsewhere.

On the CPU the Triton kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``); the
kernel is decorated lazily, at its first use, so that variable may be set after `triton` was
imported.
"""

from __future__ import annotations


import torch

try:  # Triton is a Linux-only dependency; the fallback works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import BACKENDS, on_input_device, triton_available, triton_interpret_mode
from .kernel_backend import resolve_backend as _resolve_backend

ENV_BACKEND = "DEEPSEEK_V41_VISION_ROPE_BACKEND"


class VisionRopeError(ValueError):
    """Bad arguments to :func:`apply_vision_rope`: shapes, dtypes, devices or backend name."""


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The concrete backend (``"triton"`` or ``"torch"``) for tensors on `device`; ``None`` or
    ``"auto"`` consult ``DEEPSEEK_V41_VISION_ROPE_BACKEND`` first (see `kernel_backend.resolve_backend`).

    Raises:
        VisionRopeError: an unknown backend name (argument or environment variable).
    """
    return _resolve_backend(backend, device, env_var=ENV_BACKEND, error=VisionRopeError, what="vision RoPE")


# ---------------------------------------------------------------------------------------------
# torch fallback
# ---------------------------------------------------------------------------------------------
def rotate_half_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate one tensor; the reference op sequence (`inference/vision.py: apply_rotary`).

    Args:
        x: [N, H, D] in any float dtype (bf16 in the model).
        cos, sin: fp32 [N, 1, D/2], broadcast over heads.

    Returns:
        [N, H, D] contiguous, dtype of `x`.
    """
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------
if triton is not None:

    def _vision_rope_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
        n_heads, head_dim, half,
        q_stride_n, q_stride_h, q_stride_d,
        k_stride_n, k_stride_h, k_stride_d,
        cs_stride_n, cs_stride_d,
        out_stride_n, out_stride_h,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr,
    ):
        # One program = one token: a [2 (q, k), heads, head_dim] tile; cos/sin loaded once.
        row = tl.program_id(0).to(tl.int64)
        pair = tl.arange(0, 2)[:, None, None]
        heads = tl.arange(0, BLOCK_H)[None, :, None]
        dims = tl.arange(0, BLOCK_D)[None, None, :]
        dim_ok = dims < head_dim
        mask = (pair < 2) & (heads < n_heads) & dim_ok
        # Half-split: dim d pairs with d +- half. out = x*cos + partner*(-+sin), which rounds
        # exactly like the reference's x1*cos - x2*sin and x2*cos + x1*sin.
        first = dims < half
        partner = tl.where(first, dims + half, dims - half)
        freq = tl.where(first, dims, dims - half)
        cos = tl.load(cos_ptr + row * cs_stride_n + freq * cs_stride_d, mask=dim_ok, other=0.0)
        sin = tl.load(sin_ptr + row * cs_stride_n + freq * cs_stride_d, mask=dim_ok, other=0.0)
        sin = tl.where(first, -sin, sin)

        q_row = q_ptr + row * q_stride_n + heads * q_stride_h
        k_row = k_ptr + row * k_stride_n + heads * k_stride_h
        x = tl.load(tl.where(pair == 0, q_row + dims * q_stride_d, k_row + dims * k_stride_d), mask=mask, other=0.0)
        xp = tl.load(
            tl.where(pair == 0, q_row + partner * q_stride_d, k_row + partner * k_stride_d), mask=mask, other=0.0
        )
        y = x.to(tl.float32) * cos + xp.to(tl.float32) * sin

        out_off = row * out_stride_n + heads * out_stride_h + dims
        out_ptrs = tl.where(pair == 0, q_out_ptr + out_off, k_out_ptr + out_off)
        if ROUND_BF16:
            # fp32 -> bf16 round-to-nearest-even on the bits, as torch does: Triton's CPU
            # interpreter truncates instead, and on the GPU this equals cvt.rn.bf16.f32.
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            bits = tl.where(y != y, 0x7FC00000, bits)  # NaN stays a quiet NaN
            tl.store(out_ptrs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(out_ptrs, y.to(q_out_ptr.dtype.element_ty), mask=mask)


# Decorated lazily, one JIT object per interpreter mode (see the module docstring).
_KERNELS: dict[bool, object] = {}


def _kernel():
    interpret = triton_interpret_mode()
    if interpret not in _KERNELS:
        _KERNELS[interpret] = triton.jit(_vision_rope_kernel)
    return _KERNELS[interpret]


@on_input_device
def _rotate_pair_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n, n_heads, head_dim = q.shape
    half = head_dim // 2
    q_out = torch.empty((n, n_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, n_heads, head_dim), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    cos2, sin2 = cos.reshape(n, half), sin.reshape(n, half)
    if cos2.stride() != sin2.stride():
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    _kernel()[(n,)](
        q, k, cos2, sin2, q_out, k_out,
        n_heads, head_dim, half,
        *q.stride(), *k.stride(),
        *cos2.stride(),
        q_out.stride(0), q_out.stride(1),
        BLOCK_H=triton.next_power_of_2(n_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROUND_BF16=q.dtype == torch.bfloat16,
        enable_fp_fusion=False,  # keep x1*cos and x2*sin rounded apart, as in eager torch
    )
    return q_out, k_out


class _TritonVisionRope(torch.autograd.Function):
    """Autograd wrapper: the rotation is orthogonal, so the backward pass is the same kernel
    with `sin` negated (gradients are rounded to the input dtype, as the fallback's are)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_pair_triton(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        gq, gk = _rotate_pair_triton(grad_q, grad_k, cos, -sin)
        return gq, gk, None, None


# ---------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------
def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise VisionRopeError(f"q and k must both be [N, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    n, _, head_dim = q.shape
    if head_dim % 2:
        raise VisionRopeError(f"head_dim must be even for the half-split rotation, got {head_dim}")
    want = (n, 1, head_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise VisionRopeError(f"{name} must be {list(want)}, got {list(t.shape)}")
        if t.dtype != torch.float32:
            raise VisionRopeError(f"{name} must be float32 (the rotation runs in fp32), got {t.dtype}")
    if not (q.device == k.device == cos.device == sin.device):
        raise VisionRopeError("q, k, cos and sin must be on one device")
    if q.dtype != k.dtype or not q.is_floating_point():
        raise VisionRopeError(f"q and k must share one floating dtype, got {q.dtype} and {k.dtype}")


def apply_vision_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the vision tower's 2D RoPE to q and k.

    Mirrors `inference/vision.py: apply_rotary` applied to q and to k.

    Args:
        q, k: [N, heads, head_dim] (bf16 in the model; any strides, e.g. views of the fused qkv).
        cos, sin: fp32 [N, 1, head_dim / 2], from the vision rotary embedding: angles of the
            height frequencies, then the width frequencies.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; `None` reads
            ``DEEPSEEK_V41_VISION_ROPE_BACKEND`` (default ``"auto"``).

    Returns:
        (q_rot, k_rot), contiguous [N, heads, head_dim] in the dtypes of q and k.

    Raises:
        VisionRopeError: mismatched shapes, non-fp32 tables, mixed devices, an unknown backend,
            or ``"triton"`` asked for where it cannot run (Triton missing; CPU tensors outside
            ``TRITON_INTERPRET=1``).
    """
    _check(q, k, cos, sin)
    chosen = resolve_backend(backend, q.device)
    if chosen == "torch":
        return rotate_half_torch(q, cos, sin), rotate_half_torch(k, cos, sin)
    if not triton_available():
        raise VisionRopeError("vision RoPE backend 'triton' asked for, but Triton is not installed")
    if q.device.type != "cuda" and not triton_interpret_mode():
        raise VisionRopeError(
            f"vision RoPE backend 'triton' needs CUDA tensors (got {q.device.type}) or TRITON_INTERPRET=1"
        )
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _TritonVisionRope.apply(q, k, cos, sin)
    return _rotate_pair_triton(q, k, cos, sin)  # inference: skip the autograd bookkeeping


__all__ = [
    "BACKENDS",
    "ENV_BACKEND",
    "VisionRopeError",
    "apply_vision_rope",
    "resolve_backend",
    "rotate_half_torch",
    "triton_available",
    "triton_interpret_mode",
]
