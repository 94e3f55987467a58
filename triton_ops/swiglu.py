"""The vision MLP's SwiGLU in one Triton launch (fast numerics).

`inference/vision.py: MLP` computes ``F.silu(gate) * up`` on the two halves of `w1`'s bf16 output:
two torch kernels, each reading a strided half of a ``[N, 2I]`` tensor and writing a full bf16
intermediate (at the largest image, 8649 x 2816, about 0.3 ms of copies per block). This kernel
reads each half once and writes the product once, with torch's two roundings::

    s = bf16( g / (1 + exp(-g)) )        (fp32 inside, g widened; exp = CUDA's expf, IEEE division)
    y = bf16( float(s) * float(u) )

On the GPU that is the torch ops' arithmetic (their silu computes ``x / (1 + exp(-x))`` in fp32
with the accurate ``expf``, the product in fp32, each rounded to bf16 once); Triton's interpreter
takes numpy's exp instead, so there it may differ in the last bit.

Launch: grid ``(N, cdiv(I, BLOCK))``; bf16 on the bits (the interpreter's casts truncate). No host
synchronisation, only the output allocation: CUDA-graph capturable once compiled.

The language model's experts (`inference/model.py: Expert.forward`) take their SwiGLU in fp32, with
the clamp and the optional routing weight, and round once: :func:`expert_swiglu_triton`::

    g = float(w1(x)), u = float(w3(x));  u = clamp(u, -limit, limit), g = min(g, limit)  (limit > 0)
    h = bf16( [w *] ( (g / (1 + exp(-g))) * u ) )

one launch for the seven torch kernels of `DeepseekV41Expert.forward` between its linears. On the
GPU it is those ops' arithmetic bit for bit (silu's ``expf`` and IEEE division, separate products,
one rounding); the interpreter's exp is numpy's.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device, triton_interpret_mode, unrunnable

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .quant_linear import _to_bf16_rne

ENV_BACKEND = "DEEPSEEK_V41_SWIGLU_BACKEND"
_BLOCK = 1024


class SwiGLUKernelError(ValueError):
    """Bad arguments to :func:`swiglu_triton`: dtype, shape or device."""


if triton is not None:

    @triton.jit
    def _swiglu_kernel(h_ptr, out_ptr, inter, stride_h, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = _bf16_to_fp32(tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0))
        u = _bf16_to_fp32(tl.load(h_ptr + row * stride_h + inter + cols, mask=ok, other=0.0))
        if INTERPRET:
            e = tl.exp(-g)  # the interpreter has no libdevice
        else:
            e = libdevice.exp(-g)  # CUDA's expf, as torch's silu kernel
        s = _bf16_to_fp32(_to_bf16_rne(tl.div_rn(g, 1.0 + e)))
        tl.store(out_ptr + row * inter + cols, _to_bf16_rne(s * u), mask=ok)

    @triton.jit
    def _expert_swiglu_kernel(
        g_ptr, u_ptr, w_ptr, out_ptr, inter, stride_g, stride_u, limit,
        HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, INTERPRET: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        g = _bf16_to_fp32(tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0))
        u = _bf16_to_fp32(tl.load(u_ptr + row * stride_u + cols, mask=ok, other=0.0))
        if HAS_LIMIT:
            u = tl.minimum(tl.maximum(u, -limit), limit)
            g = tl.minimum(g, limit)
        if INTERPRET:
            e = tl.exp(-g)  # the interpreter has no libdevice
        else:
            e = libdevice.exp(-g)  # CUDA's expf, as torch's silu kernel
        h = tl.div_rn(g, 1.0 + e) * u
        if HAS_WEIGHT:
            h = tl.load(w_ptr + row) * h
        tl.store(out_ptr + row * inter + cols, _to_bf16_rne(h), mask=ok)


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_swiglu_kernel)


def _runnable(name: str, device: torch.device) -> bool:
    """Whether the kernels run interpreted, after checking they can run on `device` at all.

    Raises:
        SwiGLUKernelError: Triton missing, or a CPU tensor outside Triton's interpreter.
    """
    problem = unrunnable(device, _kernel_is_interpreted(), name)
    if problem is not None:
        raise SwiGLUKernelError(problem)
    return _kernel_is_interpreted() and triton_interpret_mode()


@on_input_device
def swiglu_triton(h: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = h.chunk(2, -1)``, in one launch (module docstring).

    Args:
        h: bf16 ``[..., 2I]`` (w1's output), unit stride along the last dimension (copied if not).

    Returns:
        bf16 ``[..., I]``, a new contiguous tensor on the device of `h`.

    Raises:
        SwiGLUKernelError: h not bf16, an odd last dimension, Triton missing, or a CPU tensor
            outside Triton's interpreter.
    """
    if h.dtype != torch.bfloat16:
        raise SwiGLUKernelError(f"swiglu_triton takes bf16, got {h.dtype}")
    if h.dim() == 0 or h.size(-1) % 2:
        raise SwiGLUKernelError(f"the last dimension of h {tuple(h.shape)} must hold gate | up (even)")
    interpreted = _runnable("swiglu_triton", h.device)
    inter = h.size(-1) // 2
    out = torch.empty(*h.shape[:-1], inter, dtype=torch.bfloat16, device=h.device)
    if out.numel() == 0:
        return out
    rows = h.reshape(-1, 2 * inter)  # a view for the tensors the model passes
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    _swiglu_kernel[(rows.size(0), triton.cdiv(inter, _BLOCK))](
        rows, out, inter, rows.stride(0), INTERPRET=interpreted, BLOCK=_BLOCK, num_warps=4
    )
    return out


@on_input_device
def expert_swiglu_triton(
    gate: torch.Tensor, up: torch.Tensor, limit: float, routing_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """An expert's ``bf16([w *] silu(g) * u)`` from its w1 / w3 outputs, clamped by `limit`, in one
    launch (module docstring). Mirrors `inference/model.py: Expert.forward` between its linears.

    Args:
        gate, up: bf16 ``[n, I]`` (w1's and w3's outputs), unit stride along I (copied if not).
        limit: ``swiglu_limit``; ``0`` (or less) disables the clamp.
        routing_weights: fp32 ``[n, 1]`` (or ``[n]``), or None (the shared expert).

    Returns:
        bf16 ``[n, I]``, a new contiguous tensor on the device of `gate`.

    Raises:
        SwiGLUKernelError: dtypes, shapes or devices that do not match, Triton missing, or CPU
            tensors outside Triton's interpreter.
    """
    if gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16:
        raise SwiGLUKernelError(f"expert_swiglu_triton takes bf16 gate and up, got {gate.dtype} and {up.dtype}")
    if gate.dim() != 2 or gate.shape != up.shape:
        raise SwiGLUKernelError(f"gate and up must both be [n, I], got {tuple(gate.shape)} and {tuple(up.shape)}")
    if routing_weights is not None and (
        routing_weights.dtype != torch.float32 or routing_weights.numel() != gate.size(0)
    ):
        raise SwiGLUKernelError(
            f"routing_weights must be fp32 with one weight per row ({gate.size(0)}), got "
            f"{routing_weights.dtype} {tuple(routing_weights.shape)}"
        )
    if not all(t.device == gate.device for t in (up, routing_weights) if t is not None):
        raise SwiGLUKernelError("gate, up and routing_weights must be on one device")
    interpreted = _runnable("expert_swiglu_triton", gate.device)
    n, inter = gate.shape
    out = torch.empty(n, inter, dtype=torch.bfloat16, device=gate.device)
    if out.numel() == 0:
        return out
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    weights = gate if routing_weights is None else routing_weights.reshape(-1).contiguous()
    _expert_swiglu_kernel[(n, triton.cdiv(inter, _BLOCK))](
        gate, up, weights, out, inter, gate.stride(0), up.stride(0), float(limit),
        HAS_LIMIT=limit > 0, HAS_WEIGHT=routing_weights is not None, INTERPRET=interpreted, BLOCK=_BLOCK,
        num_warps=4,
    )
    return out


__all__ = ["ENV_BACKEND", "SwiGLUKernelError", "expert_swiglu_triton", "swiglu_triton"]
