"""RMSNorm of the language model in one Triton launch (fast numerics).

`modeling/attention_deepseek_v41_vl.py: DeepseekV41RMSNorm` is eight torch ops (widen to fp32,
square, mean, add eps, rsqrt, two products, the cast back), each a kernel of a microsecond or two on
the few rows of a decode step, and each a node of the step's CUDA graph (whose launch costs host
time per node). This kernel does the same per row in one launch::

    y = bf16( float(w) * (x * rsqrt(mean(x^2) + eps)) )      (fp32 inside, x widened to fp32)

with the reference's operation order (`inference/model.py: RMSNorm`; the vision tower's
`inference/vision.py: RMSNorm` is the same formula with an fp32 weight, which the kernel reads as
it is). It is not bitwise equal to
the torch ops: the mean's summation order and the GPU's rsqrt differ in the last fp32 bits, which
moves an output by one bf16 ulp now and then, so only ``numerics="fast"`` uses it (exact numerics
keep the reference's op sequence).

Launch: one program per row, the whole row in one block (rows of up to :data:`MAX_COLS` elements);
bf16 in and out on the bits (the interpreter's casts truncate and garble subnormals). No host
synchronisation and only the output allocation: CUDA-graph capturable after a warm-up call has
compiled the kernel.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device, triton_available, triton_interpret_mode

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .quant_linear import _to_bf16_rne

ENV_BACKEND = "DEEPSEEK_V41_RMSNORM_BACKEND"
MAX_COLS = 16384  # the model's rows: 5120 (hidden), 1280 (q_lora), 512 (latent), 128 (index keys)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


class RMSNormKernelError(ValueError):
    """Bad arguments to :func:`rms_norm_triton`: dtype, shape, device or backend."""


if triton is not None:

    @triton.jit
    def _rms_norm_row(x, w_ptr, cols, ok, n_cols, eps, W_FP32: tl.constexpr):
        # One row's norm: x fp32 [BLOCK] (0 where not ok) -> bf16 [BLOCK]. Also the body of
        # `hc_fused._hc_pre_rms_norm_kernel`, so both compute the same operations in one order.
        mean = tl.sum(x * x, axis=0) / n_cols
        scaled = x * tl.div_rn(1.0, tl.sqrt_rn(mean + eps))  # 1/sqrt, each IEEE-rounded
        if W_FP32:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        else:
            w = _bf16_to_fp32(tl.load(w_ptr + cols, mask=ok, other=0.0))
        return _to_bf16_rne(w * scaled)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, W_FP32: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = _bf16_to_fp32(tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0))
        tl.store(out_ptr + row * n_cols + cols, _rms_norm_row(x, w_ptr, cols, ok, n_cols, eps, W_FP32), mask=ok)


def _launch_shape(n_cols: int) -> tuple[int, int]:
    # (BLOCK, num_warps) of a row of `n_cols` elements: the layout, and so the order in which the
    # mean's sum is taken, of this kernel and of the fused collapse + norm (`hc_fused.py`)
    block = triton.next_power_of_2(n_cols)
    return block, 8 if block >= 4096 else 4


def _check_weight(weight: torch.Tensor, n_cols: int, error: type[ValueError] = RMSNormKernelError) -> None:
    # a weight the kernel's body (`_rms_norm_row`) takes for rows of `n_cols` elements, or `error`
    # (the caller's documented class; also `hc_fused.hc_pre_rms_norm_triton`'s check)
    if weight.dtype not in WEIGHT_DTYPES:
        raise error(f"the norm kernel takes a bf16 or fp32 weight, got {weight.dtype}")
    if tuple(weight.shape) != (n_cols,):
        raise error(f"weight {tuple(weight.shape)} must be [D] for rows of D = {n_cols} elements")
    if n_cols > MAX_COLS:
        raise error(f"rows of {n_cols} elements are past the kernel's {MAX_COLS}")


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_rms_norm_kernel)


@on_input_device
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one launch (numerics in the module docstring).

    Args:
        x: bf16 ``[..., D]``, any strides (copied if not contiguous), D <= :data:`MAX_COLS`.
        weight: bf16 or fp32 ``[D]`` (the LLM's norms hold bf16, the vision tower's fp32).
        eps: added to the mean of squares.

    Returns:
        bf16 ``[..., D]``, a new contiguous tensor on the device of `x`.

    Raises:
        RMSNormKernelError: x not bf16, a weight not bf16 / fp32, not ``[D]`` or on another
            device, D past the limit,
            Triton missing, or a CPU tensor outside Triton's interpreter.
    """
    if x.dtype != torch.bfloat16 or x.dim() == 0:
        raise RMSNormKernelError(f"rms_norm_triton takes bf16 x [..., D], got {x.dtype} {tuple(x.shape)}")
    _check_weight(weight, x.size(-1))
    if weight.device != x.device:
        raise RMSNormKernelError(f"weight is on {weight.device}, x on {x.device}")
    if not triton_available():
        raise RMSNormKernelError("rms_norm_triton needs the triton package, which is not installed")
    if x.device.type != "cuda" and not (_kernel_is_interpreted() and triton_interpret_mode()):
        raise RMSNormKernelError(
            f"rms_norm_triton needs a CUDA tensor (got {x.device.type}) or Triton's interpreter "
            "(TRITON_INTERPRET=1 before this module is imported)"
        )
    src = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n_cols = x.size(-1)
    n_rows = src.numel() // n_cols if n_cols else 0
    if n_rows == 0:
        return out
    block, num_warps = _launch_shape(n_cols)
    _rms_norm_kernel[(n_rows,)](
        src, weight.contiguous(), out, n_cols, float(eps), W_FP32=weight.dtype == torch.float32, BLOCK=block,
        num_warps=num_warps,
    )
    return out


__all__ = ["ENV_BACKEND", "MAX_COLS", "WEIGHT_DTYPES", "RMSNormKernelError", "rms_norm_triton"]
