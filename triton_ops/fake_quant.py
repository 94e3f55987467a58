"""Activation fake-quantization (quantize, then dequantize back to bf16) in one Triton launch.

`modeling/quantization_deepseek_v41_vl.py: fake_quant_fp8 / fake_quant_fp4` are 12-25 small torch
ops each (casts, amax, the scale's bit tricks, the E2M1 midpoint comparisons, a table lookup). In
a decode step they run on tensors of a few KB several times per layer, inside CUDA graphs, where
every op is a graph node of a few microseconds. These kernels do the same per-group math in one
launch and give the same bits as the torch functions.

Numerics, per group of ``G`` consecutive elements of the last dimension (all in fp32):

- :func:`fake_quant_fp8_triton` (``G = 32``, ue8m0 scales; mirrors `kernel.act_quant(...,
  inplace=True)`): amax floored at 1e-4; ``s = 2^ceil(log2(amax * fp32(1/448)))`` from the
  product's IEEE bits; ``q = e4m3_rne(clamp(x / s, +-448))``; out ``bf16(q * s)``. ``x / s`` is
  ``x * (1/s)``, equal for a power of two (``1/s`` is exact and normal: ``2^-22 <= s <= 2^120``).
- :func:`fake_quant_fp4_triton` (mirrors `kernel.fp4_act_quant(..., inplace=True)`):

  - ``"e4m3"`` scales (the compressed KV, ``G = 16``): amax floored at ``6 * 2^-9``,
    ``s = e4m3_rne(min(amax / 6, 448))``, not a power of two in general, so ``x / s`` is an IEEE
    division (``tl.div_rn``; Triton's ``/`` is an approximate one on NVIDIA);
  - ``"ue8m0"`` scales (the indexer q / k, ``G = 32``): amax floored at ``6 * 2^-126``,
    ``s = 2^ceil(log2(amax * fp32(1/6)))``;

  then ``v = clamp(x / s, +-6)``, rounded to the nearest E2M1 value (magnitudes
  ``0, .5, 1, 1.5, 2, 3, 4, 6``) with ties to the even code, the sign kept (a negative input that
  rounds to 0 gives -0, as torch's signed table lookup), out ``bf16(value * s)``.

Both roundings are an fp32 add and subtract of a power of two: adding ``c`` puts ``|v|`` in ``c``'s
binade, whose fp32 ulp is the target grid's spacing at ``|v|``, so IEEE addition rounds to that
grid, half to even; subtracting ``c`` is exact. For E2M1 (one mantissa bit, smallest normal 1,
spacing 0.5 below 2) ``c = 2^(max(e, 0) + 22)``, ``e`` the unbiased exponent of ``|v|``; its
ties to even are the torch path's (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
5 -> 4). The e4m3 rounding, the power-of-two scale of fp8 and the final bf16 rounding (on the bits:
Triton's interpreter truncates in its casts) are the tested helpers of `quant_linear.py`; the
bf16 input is widened on the bits too (the interpreter's cast garbles bf16 subnormals).

Launch: the input viewed as ``[n_groups, G]`` (copied first if not contiguous); a program owns
``BLOCK_GROUPS`` whole groups (a power of two, up to :data:`MAX_BLOCK_ELEMENTS` elements), so a
decode-sized tensor is a single program. No host synchronisation and only the output allocation:
CUDA-graph capturable after a warm-up call has compiled the kernel.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch functions
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .formats import BLOCK as FP8_GROUP
from .kernel_backend import kernel_interpreted, on_input_device, resolve_backend, triton_available, triton_interpret_mode

if triton is not None:
    from .formats import E2M1_MAX_TL, E4M3_MAX_TL
    from .quant_linear import _pow2_scale, _round_to_e4m3, _to_bf16_rne

ENV_BACKEND = "DEEPSEEK_V41_FAKE_QUANT_BACKEND"
FP4_SCALE_FORMATS = ("e4m3", "ue8m0")
MAX_GROUP = 1024  # the kernel takes power-of-two groups up to this size
MAX_BLOCK_ELEMENTS = 2048  # elements per program (whole groups)


class FakeQuantError(ValueError):
    """Bad arguments to the fake-quant kernels: dtype, shape, group, scale format, device or backend."""


def resolve_fake_quant_backend(backend: str | None, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on `device`; ``None`` / ``"auto"`` read
    ``DEEPSEEK_V41_FAKE_QUANT_BACKEND`` first, then pick Triton on CUDA (`kernel_backend`).

    Raises:
        FakeQuantError: an unknown backend name (argument or environment variable).
    """
    return resolve_backend(backend, device, env_var=ENV_BACKEND, error=FakeQuantError, what="fake quant")


def fp4_group_supported(group: int) -> bool:
    """True when :func:`fake_quant_fp4_triton` takes groups of `group` (a power of two <= 1024)."""
    return isinstance(group, int) and 0 < group <= MAX_GROUP and group & (group - 1) == 0


if triton is not None:

    @triton.jit
    def _bf16_to_fp32(x):
        """bf16 -> fp32 on the bits (exact); the interpreter's cast garbles bf16 subnormals."""
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1_round(v):
        """fp32 with |v| <= 6 -> the nearest E2M1 value (fp32), ties to the even code, sign kept."""
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        # E2M1 spacing at |v|: 2^(e - 1), e = max(unbiased exponent, 0); c = 2^(e + 22) has it as ulp
        expo = tl.maximum(mag >> 23, 127)
        c = ((expo + 22) << 23).to(tl.float32, bitcast=True)
        rounded = (mag.to(tl.float32, bitcast=True) + c) - c
        sign = (bits >> 31) << 31
        return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_scale(amax, E4M3_SCALE: tl.constexpr):
        """Group amax fp32 -> the fp4 group scale s (fp32), as `_fp4_group_scales`."""
        if E4M3_SCALE:
            floored = tl.maximum(amax, 0.01171875)  # 6 * 2^-9
            scale = _round_to_e4m3(tl.minimum(tl.div_rn(floored, tl.full(floored.shape, E2M1_MAX_TL, tl.float32)), E4M3_MAX_TL))
        else:
            # 2^ceil(log2(amax * fp32(1/6))) from the product's bits, as round_scale_pow2
            # floor 6 * 2^-126; fp32(1/6) as torch's constant
            prod = tl.maximum(amax, 7.052966104933725e-38) * (1.0 / E2M1_MAX_TL)
            bits = prod.to(tl.int32, bitcast=True)
            expo = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            scale = (expo << 23).to(tl.float32, bitcast=True)
        return scale

    @triton.jit
    def _fake_quant_kernel(
        x_ptr,
        out_ptr,
        n_groups,
        GROUP: tl.constexpr,
        BLOCK_GROUPS: tl.constexpr,
        IS_FP4: tl.constexpr,
        E4M3_SCALE: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
        offs = rows[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = (rows < n_groups)[:, None] & (offs >= 0)
        x = _bf16_to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
        amax = tl.max(tl.abs(x), axis=1)
        if IS_FP4:
            scale = _fp4_scale(amax, E4M3_SCALE)
            scale_b = tl.broadcast_to(scale[:, None], x.shape)
            v = tl.minimum(tl.maximum(tl.div_rn(x, scale_b), -E2M1_MAX_TL), E2M1_MAX_TL)
            y = _e2m1_round(v) * scale_b
        else:
            scale, inv_scale = _pow2_scale(amax)
            v = tl.minimum(tl.maximum(x * inv_scale[:, None], -E4M3_MAX_TL), E4M3_MAX_TL)
            y = _round_to_e4m3(v) * scale[:, None]
        tl.store(out_ptr + offs, _to_bf16_rne(y), mask=mask)


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_fake_quant_kernel)


def _check_input(x: torch.Tensor, group: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise FakeQuantError(f"{what} takes a bfloat16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.size(-1) % group:
        raise FakeQuantError(
            f"{what}: last dimension {tuple(x.shape)[-1:] or '()'} is not a multiple of the group size {group}"
        )
    if not triton_available():
        raise FakeQuantError(f"{what} needs the triton package, which is not installed")
    if x.device.type != "cuda" and not (_kernel_is_interpreted() and triton_interpret_mode()):
        raise FakeQuantError(
            f"{what} needs a CUDA tensor (got {x.device.type}) or Triton's interpreter "
            "(TRITON_INTERPRET=1 before this module is imported)"
        )


@on_input_device
def _launch(x: torch.Tensor, group: int, is_fp4: bool, e4m3_scale: bool) -> torch.Tensor:
    src = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n_groups = src.numel() // group
    if n_groups == 0:
        return out
    block_groups = min(triton.next_power_of_2(n_groups), max(1, MAX_BLOCK_ELEMENTS // group))
    grid = (triton.cdiv(n_groups, block_groups),)
    _fake_quant_kernel[grid](
        src, out, n_groups, GROUP=group, BLOCK_GROUPS=block_groups, IS_FP4=is_fp4, E4M3_SCALE=e4m3_scale,
        num_warps=4,
    )
    return out


def fake_quant_fp8_triton(x: torch.Tensor) -> torch.Tensor:
    """e4m3 quantize-dequantize per group of 32 along the last dimension, ue8m0 (power-of-two) scales.

    Bitwise equal to `fake_quant_fp8(x, 32, "ue8m0")` of `modeling/quantization_deepseek_v41_vl.py`
    (mirrors `kernel.act_quant(x, 32, "ue8m0", inplace=True)`; numerics in the module docstring).

    Args:
        x: bf16 ``[..., K]``, K a multiple of 32, any strides (copied if not contiguous).

    Returns:
        bf16 ``[..., K]``, a new contiguous tensor on the device of `x`.

    Raises:
        FakeQuantError: non-bf16 input, K not a multiple of 32, Triton missing, or a CPU tensor
            outside Triton's interpreter.
    """
    _check_input(x, FP8_GROUP, "fake_quant_fp8_triton")
    return _launch(x, FP8_GROUP, is_fp4=False, e4m3_scale=False)


def fake_quant_fp4_triton(x: torch.Tensor, group: int = 16, scale_fmt: str = "e4m3") -> torch.Tensor:
    """E2M1 quantize-dequantize per group along the last dimension.

    Bitwise equal to `fake_quant_fp4(x, group, scale_fmt)` of
    `modeling/quantization_deepseek_v41_vl.py` (mirrors `kernel.fp4_act_quant(x, group,
    inplace=True)`): ``(16, "e4m3")`` is the compressed KV, ``(32, "ue8m0")`` the indexer q / k.

    Args:
        x: bf16 ``[..., K]``, K a multiple of `group`, any strides (copied if not contiguous).
        group: elements per scale, a power of two up to 1024.
        scale_fmt: ``"e4m3"`` (scale = e4m3(amax / 6)) or ``"ue8m0"`` (scale = 2^ceil(log2(amax / 6)).

    Returns:
        bf16 ``[..., K]``, a new contiguous tensor on the device of `x`.

    Raises:
        FakeQuantError: an unknown `scale_fmt`, a group that is not a power of two <= 1024,
            non-bf16 input, K not a multiple of `group`, Triton missing, or a CPU tensor outside
            Triton's interpreter.
    """
    if scale_fmt not in FP4_SCALE_FORMATS:
        raise FakeQuantError(f"fp4 scale_fmt must be one of {FP4_SCALE_FORMATS}, got {scale_fmt!r}")
    if not fp4_group_supported(group):
        raise FakeQuantError(f"fake_quant_fp4_triton takes a power-of-two group <= {MAX_GROUP}, got {group!r}")
    _check_input(x, group, "fake_quant_fp4_triton")
    return _launch(x, group, is_fp4=True, e4m3_scale=scale_fmt == "e4m3")


__all__ = [
    "ENV_BACKEND",
    "FP4_SCALE_FORMATS",
    "FakeQuantError",
    "fake_quant_fp4_triton",
    "fake_quant_fp8_triton",
    "fp4_group_supported",
    "resolve_fake_quant_backend",
]
