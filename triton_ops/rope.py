"""The language model's rotary embedding in one Triton launch (fast numerics).

Mirrors `inference/model.py: apply_rotary_emb`, whose torch form is
`modeling/rope_deepseek_v41_vl.py: apply_rotary`: the last ``rd = 2 * half`` dims of each vector
are ``half`` interleaved pairs ``(a, b) = (x[2i], x[2i + 1])``, read as the complex number
``a + ib``, multiplied in fp32 by the table entry ``c + id`` (its conjugate with `inverse`) and
rounded back to x's dtype::

    real = a*c - b*d          imag = a*d + b*c          (fp32, each product rounded)

The torch form takes four or five kernels per call (widen, complex multiply, narrow, then a
concatenation or an in-place slice copy), about six calls per layer; here one launch reads x once
and writes the result once: with `inplace` only the rotated dims of x, otherwise a new tensor
holding the first ``D - rd`` dims copied and the rotated dims.

Numerics: the products and sums are rounded apart (fp contraction into FMA is disabled), in the
order of torch's vectorized CPU complex multiply, and fp32 -> bf16 rounds to nearest even on the
bits (the interpreter's cast truncates; on the GPU this equals ``cvt.rn.bf16.f32``). Measured
under Triton's interpreter against torch's `apply_rotary` on the CPU:

- bitwise equal wherever torch's complex multiply runs its vectorized loop: every call of the
  model (contiguous tables, rd = 64; the tests' rd = 16), bf16 and fp32 x, 3-D and 4-D, shared
  and per-row tables, both directions, in place or not;
- torch's scalar loop (a strided table, and the loop tails of some widths, e.g. rd/2 = 7 or 31)
  contracts ``a*c - b*d`` into an FMA: there the two differ by one rounding of a product, which
  measured at most 1 bf16 ulp on bf16 x (1 value in 217k); on fp32 x that is 1 ulp of the
  product, more ulps of the result where the two products cancel.

On the GPU torch's complex multiply may contract to FMA too, so GPU bitwise equality with torch
is not claimed (the same one-rounding difference). Exact numerics never run this kernel.

Launch: grid ``(B * S, cdiv(H, BLOCK_H))``; one program rotates a block of heads of one token,
loading that token's table row once. No host synchronisation and no data-dependent shapes:
CUDA-graph capturable once compiled.

Backend choice: :func:`resolve_backend` (``DEEPSEEK_V41_ROPE_BACKEND``, else Triton on CUDA); the
model reads it once into its numerics plan (op ``"rope"``) and `apply_rotary(..., fused=True)`
dispatches here. On the CPU the kernel runs only under Triton's interpreter
(``TRITON_INTERPRET=1``); it is decorated lazily, at its first use, one JIT object per interpreter
mode, so that variable may be set after `triton` was imported (which is why the bf16 widening and
rounding are written inline rather than taken from `formats.py`).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import on_input_device, triton_available, triton_interpret_mode
from .kernel_backend import resolve_backend as _resolve_backend

ENV_BACKEND = "DEEPSEEK_V41_ROPE_BACKEND"
DTYPES = (torch.bfloat16, torch.float32)  # the x dtypes the kernel takes
_TILE_ELEMENTS = 4096  # elements of x one program handles, at most (heads x padded dims)


class RopeKernelError(ValueError):
    """Bad arguments to :func:`apply_rotary_triton`: dtypes, shapes, devices or backend name."""


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The concrete backend (``"triton"`` or ``"torch"``) for tensors on `device`; ``None`` or
    ``"auto"`` consult ``DEEPSEEK_V41_ROPE_BACKEND`` first (see `kernel_backend.resolve_backend`).

    Raises:
        RopeKernelError: an unknown backend name (argument or environment variable).
    """
    return _resolve_backend(backend, device, env_var=ENV_BACKEND, error=RopeKernelError, what="RoPE")


if triton is not None:

    def _rope_kernel(
        x_ptr, f_ptr, out_ptr,
        seqlen, n_heads, rot_start, width,
        xs_b, xs_s, xs_h, xs_d,
        fs_b, fs_s, fs_i,
        os_b, os_s, os_h, os_d,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        COPY: tl.constexpr, INVERSE: tl.constexpr, BF16: tl.constexpr,
    ):
        # One program = BLOCK_H heads of one token (b, s). With COPY the tile spans all `width`
        # dims (the first `rot_start` copied), otherwise only the rotated dims rot_start.. width.
        row = tl.program_id(0).to(tl.int64)
        b = row // seqlen
        s = row % seqlen
        heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[:, None].to(tl.int64)
        if COPY:
            col = tl.arange(0, BLOCK_D)[None, :]
        else:
            col = rot_start + tl.arange(0, BLOCK_D)[None, :]
        in_row = col < width
        j = col - rot_start  # position in the rotated slice; negative for copied dims
        rotated = in_row & (j >= 0)
        ok = (heads < n_heads) & in_row
        rot_ok = (heads < n_heads) & rotated
        odd = (j & 1) == 1  # the imaginary half of a pair
        partner = tl.where(odd, col - 1, col + 1)
        pair = tl.where(rotated, j >> 1, 0)

        # table entry c + id of each pair (the fp32 view of complex64: real, then imag)
        f_row = f_ptr + b * fs_b + s * fs_s + pair * fs_i
        c = tl.load(f_row, mask=rotated, other=0.0)
        d = tl.load(f_row + 1, mask=rotated, other=0.0)
        # real = a*c + b*(-d), imag = b*c + a*d: the same roundings as a*c - b*d and a*d + b*c
        sd = tl.where(odd, d, -d)
        if INVERSE:
            sd = -sd

        x_row = x_ptr + b * xs_b + s * xs_s + heads * xs_h
        xv = tl.load(x_row + col * xs_d, mask=ok, other=0.0)
        xp = tl.load(x_row + partner * xs_d, mask=rot_ok, other=0.0)
        if BF16:
            # bf16 -> fp32 on the bits (exact; the interpreter's cast garbles bf16 subnormals)
            xf = (xv.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            pf = (xp.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            y = xf * c + pf * sd
            # fp32 -> bf16 round-to-nearest-even on the bits, as torch does; NaN -> quiet NaN
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            bits = tl.where(y != y, 0x7FC0, bits)
            y_out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            y_out = xv * c + xp * sd
        y_out = tl.where(rotated, y_out, xv)

        out_row = out_ptr + b * os_b + s * os_s + heads * os_h
        tl.store(out_row + col * os_d, y_out, mask=ok)


# Decorated lazily, one JIT object per interpreter mode (see the module docstring).
_KERNELS: dict[bool, object] = {}


def _kernel():
    interpret = triton_interpret_mode()
    if interpret not in _KERNELS:
        _KERNELS[interpret] = triton.jit(_rope_kernel)
    return _KERNELS[interpret]


def kernel_runs(x: torch.Tensor, freqs_cis: torch.Tensor) -> bool:
    """Whether :func:`apply_rotary_triton` can take these tensors: Triton installed, x of a
    dtype in :data:`DTYPES` (bf16, fp32), a complex64 table with at least one pair, both on one
    device, which is CUDA or the CPU under Triton's interpreter, and no autograd recording (the
    kernel has no backward). Shapes are not checked here."""
    return (
        triton_available()
        and not (torch.is_grad_enabled() and (x.requires_grad or freqs_cis.requires_grad))
        and x.dtype in DTYPES
        and freqs_cis.dtype == torch.complex64
        and freqs_cis.dim() > 0
        and freqs_cis.size(-1) > 0
        and x.device == freqs_cis.device
        and (x.device.type == "cuda" or triton_interpret_mode())
    )


def _check(x: torch.Tensor, freqs_cis: torch.Tensor) -> None:
    if x.dtype not in DTYPES:
        raise RopeKernelError(f"the RoPE kernel takes bf16 or float32 x, got {x.dtype}")
    if freqs_cis.dtype != torch.complex64:
        raise RopeKernelError(f"freqs_cis must be complex64, got {freqs_cis.dtype}")
    if freqs_cis.dim() not in (2, 3) or freqs_cis.size(-1) == 0:
        raise RopeKernelError(f"freqs_cis must be [S, rd/2] or [B, S, rd/2] with rd > 0, got {tuple(freqs_cis.shape)}")
    rd = 2 * freqs_cis.size(-1)
    if x.dim() not in (3, 4) or x.size(-1) < rd:
        raise RopeKernelError(f"cannot rotate the last {rd} dims of a tensor shaped {tuple(x.shape)}")
    table = freqs_cis if freqs_cis.dim() == 3 else freqs_cis.unsqueeze(0)
    if table.size(1) != x.size(1) or table.size(0) not in (1, x.size(0)):
        raise RopeKernelError(
            f"rotation table {tuple(freqs_cis.shape)} does not match a tensor shaped {tuple(x.shape)}"
        )
    if x.device != freqs_cis.device:
        raise RopeKernelError(f"x and freqs_cis must be on one device, got {x.device} and {freqs_cis.device}")
    if torch.is_grad_enabled() and (x.requires_grad or freqs_cis.requires_grad):
        raise RopeKernelError("the RoPE kernel has no backward; use the torch ops where autograd records")
    if not triton_available():
        raise RopeKernelError("the RoPE kernel needs the triton package, which is not installed")
    if x.device.type != "cuda" and not triton_interpret_mode():
        raise RopeKernelError(f"the RoPE kernel needs CUDA tensors (got {x.device.type}) or TRITON_INTERPRET=1")


@on_input_device
def apply_rotary_triton(
    x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False, inplace: bool = False
) -> torch.Tensor:
    """Rotate the last ``2 * freqs_cis.size(-1)`` dims of x in one launch; the contract of
    `modeling/rope_deepseek_v41_vl.py: apply_rotary` (module docstring for the arithmetic).

    Mirrors `inference/model.py: apply_rotary_emb` (fp32 complex product, rounded to x.dtype).

    Args:
        x: bf16 or float32 ``[B, S, D]`` or ``[B, S, H, D]``, any strides (read in place, no
            copy). With `inplace`, x must not overlap itself (no broadcast / expanded views).
        freqs_cis: complex64 ``[S, rd/2]`` (shared by the batch) or ``[B, S, rd/2]``, any strides;
            a conjugate view is resolved first (a copy).
        inverse: rotate by the conjugate (removes the rotation).
        inplace: write the rotated dims into x and return x; otherwise x is left unchanged.

    Returns:
        x itself with `inplace`; otherwise a new contiguous tensor of x's shape and dtype: the
        first ``D - rd`` dims copied from x, the last ``rd`` rotated.

    Raises:
        RopeKernelError: x not bf16 / float32, freqs_cis not complex64 or without pairs, x too
            narrow or not 3-D / 4-D, a table that does not match x's batch or sequence length,
            tensors on two devices, autograd recording (no backward), Triton missing, or CPU
            tensors outside Triton's interpreter.
    """
    _check(x, freqs_cis)
    half = freqs_cis.size(-1)
    width = x.size(-1)
    rot_start = width - 2 * half
    out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x4 = x if x.dim() == 4 else x.unsqueeze(2)
    o4 = out if out.dim() == 4 else out.unsqueeze(2)
    bsz, seqlen, n_heads, _ = x4.shape
    table = torch.view_as_real(freqs_cis.resolve_conj())  # fp32 [(B,) S, half, 2]
    if table.dim() == 3:
        table = table.unsqueeze(0)
    fs_b = table.stride(0) if table.size(0) > 1 else 0
    block_d = triton.next_power_of_2(width if not inplace else 2 * half)
    block_h = max(1, min(triton.next_power_of_2(n_heads), _TILE_ELEMENTS // block_d))
    _kernel()[(bsz * seqlen, triton.cdiv(n_heads, block_h))](
        x4, table, o4,
        seqlen, n_heads, rot_start, width,
        *x4.stride(),
        fs_b, table.stride(1), table.stride(2),
        *o4.stride(),
        BLOCK_H=block_h, BLOCK_D=block_d,
        COPY=not inplace, INVERSE=bool(inverse), BF16=x.dtype == torch.bfloat16,
        num_warps=max(1, min(4, block_h * block_d // 256)),
        enable_fp_fusion=False,  # products rounded apart from the sums, as torch's complex multiply
    )
    return out


__all__ = ["DTYPES", "ENV_BACKEND", "RopeKernelError", "apply_rotary_triton", "kernel_runs", "resolve_backend"]
