"""A decode step's window-KV row in one Triton launch: ``kv_norm``, RoPE, fp8 fake-quant, ring write.

`modeling/attention_deepseek_v41_vl.py: DeepseekV41Attention.window_kv_rows` followed by the ring
write of a decode step is four launches on the few hundred elements of a row::

    rms_norm_triton(kv) -> apply_rotary_triton(...) -> fake_quant_fp8_triton(...) -> ring.index_copy_(1, slot, ...)

This kernel runs the same three bodies in one program per batch row, one after the other on the
row, and writes the result straight into the ring slot. Each phase is the arithmetic of its own
kernel, so the row written is bit for bit the four launches' (tested under Triton's interpreter
and on the GPU):

1. the norm: `rms_norm._rms_norm_row`, with the layout of `rms_norm_triton` for a row of that
   width (`rms_norm._launch_shape`: block and warps fix the order of the mean's sum);
2. RoPE of the last ``rd`` dims, interleaved pairs, as `rope._rope_kernel` computes it
   (``real = a*c - b*d``, ``imag = a*d + b*c``, each product rounded on its own: `hc_mix._mul_rn`,
   where the RoPE kernel disables FP contraction for the whole launch), rounded to bf16 to nearest
   even on the bits;
3. the e4m3 fake-quant of groups of 32 with power-of-two scales, as
   `fake_quant._fake_quant_kernel` (`quant_linear._pow2_scale`, `quant_linear._fake_quant_scaled`).

The phases hand the row over through the ring slot itself (global memory, the row's own ~1 KB),
separated by CTA barriers: a pair's partner and a group's other elements are read by other threads
than those that wrote them. Keeping each phase's values in memory, not in registers, also keeps
each phase's layout (and so the norm's summation order) that of its own kernel.

Launch: grid ``(B,)``; no host synchronisation, the slot read on the device: CUDA-graph
capturable after a warm-up call has compiled the kernel. Mirrors `inference/model.py:
Attention.forward`'s ``kv = self.kv_norm(self.wkv(x))``, ``apply_rotary_emb``, ``act_quant`` and
the window cache write, at ``start_pos > 0``.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the separate ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .formats import BLOCK as FP8_GROUP
from .kernel_backend import kernel_interpreted, on_input_device, unrunnable

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .hc_mix import _mul_rn
    from .quant_linear import _fake_quant_scaled, _pow2_scale, _to_bf16_rne
    from .rms_norm import _launch_shape, _rms_norm_row

MAX_COLS = 2048  # the model's window-KV rows: head_dim 512 (the tests' 64)


class WindowKVRowError(ValueError):
    """Bad arguments to :func:`window_kv_row_triton`: dtypes, shapes, devices."""


if triton is not None:

    @triton.jit
    def _window_kv_row_kernel(
        kv_ptr, w_ptr, f_ptr, ring_ptr, slot_ptr,
        n_cols, eps, rot_start, window,
        fs_b, fs_i, rs_b, rs_s,
        BLOCK: tl.constexpr, ROT: tl.constexpr, GROUP: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr)
        live = (slot >= 0) & (slot < window)  # a slot outside the ring: nothing written
        dest = ring_ptr + b * rs_b + tl.where(live, slot, 0) * rs_s
        cols = tl.arange(0, BLOCK)
        ok = (cols < n_cols) & (tl.zeros_like(cols) + live.to(tl.int32) != 0)  # stores

        # 1. kv_norm (the body of `_rms_norm_kernel`)
        in_row = cols < n_cols
        x = _bf16_to_fp32(tl.load(kv_ptr + b * n_cols + cols, mask=in_row, other=0.0))
        tl.store(dest + cols, _rms_norm_row(x, w_ptr, cols, in_row, n_cols, eps, False), mask=ok)
        tl.debug_barrier()

        # 2. RoPE of dims rot_start.. (as `_rope_kernel`, one head, in place)
        col = rot_start + tl.arange(0, ROT)
        j = col - rot_start
        odd = (j & 1) == 1
        partner = tl.where(odd, col - 1, col + 1)
        f_row = f_ptr + b * fs_b + (j >> 1) * fs_i
        c = tl.load(f_row)
        d = tl.load(f_row + 1)
        sd = tl.where(odd, d, -d)
        xf = _bf16_to_fp32(tl.load(dest + col))
        pf = _bf16_to_fp32(tl.load(dest + partner))
        y = _to_bf16_rne(_mul_rn(xf, c, INTERPRET) + _mul_rn(pf, sd, INTERPRET))
        tl.debug_barrier()  # every partner read before any is overwritten
        tl.store(dest + col, y, mask=tl.zeros_like(col) + live.to(tl.int32) != 0)
        tl.debug_barrier()

        # 3. e4m3 fake-quant per group of GROUP (as `_fake_quant_kernel`, fp8)
        groups = tl.arange(0, BLOCK // GROUP)
        offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        g_ok = offs < n_cols
        v = _bf16_to_fp32(tl.load(dest + offs, mask=g_ok, other=0.0))
        scale, inv_scale = _pow2_scale(tl.max(tl.abs(v), axis=1))
        q = _fake_quant_scaled(v, scale[:, None], inv_scale[:, None])
        tl.debug_barrier()  # the group's reads done (the same threads may not hold the same cells)
        tl.store(dest + offs, q, mask=g_ok & (tl.zeros_like(offs) + live.to(tl.int32) != 0))


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_window_kv_row_kernel)


def _problem(kv, weight, freqs_cis, ring, slot) -> str | None:
    # what keeps `window_kv_row_triton` from taking these arguments (None: nothing); one rule for
    # `kernel_runs` (which then leaves them to the separate kernels) and the call (which raises)
    tensors = {"kv": kv, "weight": weight, "freqs_cis": freqs_cis, "ring": ring, "slot": slot}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
    if kv.dtype != torch.bfloat16 or ring.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"kv, ring and weight must be bf16, got {kv.dtype}, {ring.dtype}, {weight.dtype}"
    if kv.dim() != 3 or kv.size(1) != 1 or ring.dim() != 3 or ring.size(0) != kv.size(0) or ring.size(2) != kv.size(2):
        return f"kv [B, 1, D] and ring [B, W, D] do not match: {tuple(kv.shape)}, {tuple(ring.shape)}"
    n_cols = kv.size(2)
    if n_cols % FP8_GROUP or n_cols > MAX_COLS or tuple(weight.shape) != (n_cols,):
        return f"rows of {n_cols} (a multiple of {FP8_GROUP} up to {MAX_COLS}) and weight {tuple(weight.shape)}"
    if freqs_cis.dtype != torch.complex64:
        return f"freqs_cis must be complex64, got {freqs_cis.dtype}"
    table = freqs_cis if freqs_cis.dim() == 3 else freqs_cis.unsqueeze(0)
    half = table.size(-1)
    if table.dim() != 3 or table.size(1) != 1 or table.size(0) not in (1, kv.size(0)) or half == 0 \
            or 2 * half > n_cols or half & (half - 1):
        return (f"freqs_cis {tuple(freqs_cis.shape)} is not one entry of rd/2 pairs (a power of two, rd at "
                f"most D) per row of {tuple(kv.shape)}")
    if slot.dtype != torch.int64 or slot.numel() != 1:
        return f"slot must be one int64 value, got {slot.dtype} {tuple(slot.shape)}"
    if ring.size(1) == 0:
        return "the ring has no slots (W = 0)"
    if ring.stride(2) != 1 or (ring.size(0) > 1 and ring.stride(0) == 0):
        return "the ring's last dim must be contiguous and its batch rows distinct (not an expanded view)"
    if len({kv.device, weight.device, table.device, ring.device, slot.device}) != 1:
        return "kv, weight, freqs_cis, ring and slot must be on one device"
    if torch.is_grad_enabled() and (kv.requires_grad or ring.requires_grad or weight.requires_grad):
        return "autograd records these tensors: the kernel has no backward"
    return unrunnable(kv.device, _kernel_is_interpreted(), "window_kv_row_triton")


def kernel_runs(kv, weight, freqs_cis, ring, slot) -> bool:
    """Whether :func:`window_kv_row_triton` takes these arguments (else it raises, naming why):
    the separate kernels' callers ask first and otherwise run them."""
    return _problem(kv, weight, freqs_cis, ring, slot) is None


def window_kv_row_triton(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor
) -> None:
    """Write ``fake_quant_fp8(rope(rms_norm(kv)))`` of each batch row into ``ring[:, slot]``.

    Args:
        kv: bf16 ``[B, 1, D]``, the ``wkv`` output of a one-token step (any strides; copied if not
            contiguous), D a multiple of 32 up to :data:`MAX_COLS`.
        weight: bf16 ``[D]``, the ``kv_norm`` weight; eps: its epsilon.
        freqs_cis: complex64 ``[B, 1, rd/2]`` or ``[1, rd/2]`` (shared), each row's RoPE entry; rd
            a power of two, at most D.
        ring: bf16 ``[B, W, D]``, the window ring, last dim contiguous, batch rows distinct;
            written in place at row ``slot`` of every batch row.
        slot: int64 ``[1]`` on the ring's device, the slot, read on the device: a value outside
            ``[0, W)`` writes nothing (no device check can raise without a host sync; the
            decode step's slot is ``column % W``).

    Raises:
        WindowKVRowError: a non-tensor argument, wrong dtypes, shapes or devices, D or rd out of
            range, an expanded ring, autograd recording, Triton missing or CPU tensors outside
            Triton's interpreter.
    """
    problem = _problem(kv, weight, freqs_cis, ring, slot)
    if problem is not None:
        raise WindowKVRowError(problem)
    _launch(kv, weight, eps, freqs_cis, ring, slot)


def window_kv_row_if_runs(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, freqs_cis: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor
) -> bool:
    """:func:`window_kv_row_triton` where :func:`kernel_runs` holds, the arguments checked once
    (a decode step asks at every layer); else nothing written. Returns whether it wrote the row."""
    if _problem(kv, weight, freqs_cis, ring, slot) is not None:
        return False
    _launch(kv, weight, eps, freqs_cis, ring, slot)
    return True


@on_input_device
def _launch(kv, weight, eps, freqs_cis, ring, slot) -> None:
    # arguments that `_problem` accepted
    bsz, n_cols = kv.size(0), kv.size(2)
    table = freqs_cis if freqs_cis.dim() == 3 else freqs_cis.unsqueeze(0)
    half = table.size(-1)
    real = torch.view_as_real(table.resolve_conj())  # fp32 [B or 1, 1, half, 2]
    block, num_warps = _launch_shape(n_cols)
    _window_kv_row_kernel[(bsz,)](
        kv.contiguous(), weight.contiguous(), real, ring, slot,
        n_cols, float(eps), n_cols - 2 * half, ring.size(1),
        real.stride(0) if real.size(0) > 1 else 0, real.stride(2), ring.stride(0), ring.stride(1),
        BLOCK=block, ROT=2 * half, GROUP=FP8_GROUP, INTERPRET=_kernel_is_interpreted(), num_warps=num_warps,
    )


__all__ = ["MAX_COLS", "WindowKVRowError", "kernel_runs", "window_kv_row_if_runs", "window_kv_row_triton"]
