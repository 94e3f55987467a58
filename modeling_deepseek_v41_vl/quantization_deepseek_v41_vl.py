"""Quantization numerics of DeepSeek-V4.1-Flash: fp8 / fp4 quantizers, weight dequantization and the
quantized `Linear`.

Everything here reproduces, bit for bit on CPU, what the reference computes through its kernels
(`inference/kernel.py`, ported to torch as `kernel_cpu.py`; REFERENCE.md sections 2 and 18):

- :func:`act_quant` / :func:`fake_quant_fp8`: per-32 e4m3 activation quantization with power-of-two
  ("ue8m0") scales. Mirrors `kernel.act_quant` (and its `inplace=True` quantize-dequantize form).
- :func:`fake_quant_fp4`: E2M1 quantize-dequantize, either groups of 16 with e4m3 scales (compressed
  KV) or groups of 32 with e8m0 scales (indexer q/k). Mirrors `kernel.fp4_act_quant(inplace=True)`.
- :func:`fp8_block_gemm` / :func:`fp4_block_gemm`: the per-32-K-block fp32 GEMMs. Mirrors
  `kernel.fp8_gemm` / `kernel.fp4_gemm`.
- :class:`DeepseekV41Linear`: `inference/model.py: Linear` + `linear()`, weights named exactly like
  the checkpoint (`<mod>.weight`, `<mod>.scale`).

Numerics modes (the model's plan, `numerics_deepseek_v41_vl.py`):

- ``"exact"``: the reference's op sequence; results are bitwise equal on CPU.
- ``"fast"``: the same activation fake-quant, then a plain bf16 matmul against the dequantized weight
  (dequantization is exact, only the accumulation order differs: about 1 bf16 ulp).

Storage conventions:

- fp8 weight: ``float8_e4m3fn [out, in]`` + ``scale float8_e8m0fnu [ceil(out/32), ceil(in/32)]``.
- fp4 weight: ``float4_e2m1fn_x2 [out, in/2]`` (two E2M1 codes per byte, the *even* element in the
  low nibble, bit 3 of a code is the sign) + ``scale float8_e8m0fnu [out, in/32]``. The checkpoint
  stores these bytes as int8; :class:`DeepseekV41Linear` re-views int8/uint8 on `load_state_dict`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.quant_linear import quantized_linear_triton, use_quant_linear_kernel
from ..triton_ops.dequant import ENV_BACKEND as _DEQUANT_ENV_BACKEND
from ..triton_ops.dequant import dequantize_fp4_triton, dequantize_fp8_triton
from ..triton_ops.kernel_backend import resolve_backend
from ..triton_ops.fake_quant import ENV_BACKEND as _FAKE_QUANT_ENV_BACKEND
from ..triton_ops.fake_quant import FP4_SCALE_FORMATS as FP4_KERNEL_SCALE_FORMATS
from ..triton_ops.fake_quant import FP8_GROUP as FP8_KERNEL_GROUP
from ..triton_ops.fake_quant import fake_quant_fp4_triton, fake_quant_fp8_triton, fp4_group_supported
# the formats' one definition (`triton_ops/formats.py`), under this module's names: one scale per 32
# activations / per 32x32 fp8 weight block / per 32 fp4 weights; e4m3's and E2M1's largest values; e8m0's bias
from ..triton_ops.formats import BLOCK as QUANT_BLOCK
from ..triton_ops.formats import E2M1_MAX as FP4_E2M1_MAX
from ..triton_ops.formats import E4M3_MAX as FP8_E4M3_MAX
from ..triton_ops.formats import E8M0_BIAS
from .load_checks_deepseek_v41_vl import E8M0_FIRST_REFUSED
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, as_numerics


# The kernels multiply by the reciprocal held as an fp32 constant, not divide by the max.
_INV_FP8_MAX = torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)
_INV_FP4_MAX = torch.tensor(1.0 / FP4_E2M1_MAX, dtype=torch.float32)

# E2M1 magnitude of each 3-bit code, and the signed 16-entry table (bit 3 = sign).
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1_TABLE = torch.cat([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])
# Midpoints between neighbouring magnitudes. An exact tie rounds to the even code, i.e. up only
# across the midpoints 0.75, 1.75 and 3.5 (codes 2, 4, 6 above them are even).
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_TIE_ROUNDS_UP = torch.tensor([False, True, False, True, False, True, False])

_DEVICE_CONSTANTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on_device(constant: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level constant table on `device`, copied once per device: a copy from host
    memory on every call would wait for the device's queue (and cannot be graph-captured)."""
    if constant.device == device:
        return constant
    key = (id(constant), device)
    if key not in _DEVICE_CONSTANTS:
        _DEVICE_CONSTANTS[key] = constant.to(device)
    return _DEVICE_CONSTANTS[key]


# Floors of a group's amax, so that an all-zero group still gets a finite, non-zero scale.
FP8_AMAX_FLOOR = 1e-4
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9
FP4_E8M0_AMAX_FLOOR = 6 * 2.0**-126

WEIGHT_DTYPES = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp4": torch.float4_e2m1fn_x2,
}


class DeepseekV41QuantizationError(ValueError):
    """A tensor handed to a quantizer or a quantized linear has the wrong dtype or shape."""


def _check_groups(x: torch.Tensor, group: int, what: str) -> None:
    if x.dim() == 0 or x.size(-1) % group:
        raise DeepseekV41QuantizationError(
            f"{what}: last dimension {tuple(x.shape)[-1:] or '()'} is not a multiple of the group size {group}"
        )


def _check_bf16(x: torch.Tensor, what: str) -> None:
    # The kernels are compiled for bf16 input only; another dtype would change the rounding points.
    if x.dtype != torch.bfloat16:
        raise DeepseekV41QuantizationError(f"{what} takes bfloat16 input, got {x.dtype}")


def round_scale_pow2(amax: torch.Tensor, inv_max: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale 2^ceil(log2(amax * inv_max)), fp32, via the IEEE-754 bits.

    Mirrors `kernel.fast_round_scale`: the product is formed in fp32, its exponent field is taken
    and bumped by one when the mantissa is non-zero. `amax` must be positive and normal after the
    multiplication (the callers floor it).
    """
    prod = (amax.float() * inv_max).contiguous()
    bits = prod.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    return ((exponent + has_mantissa.to(torch.int32)) << 23).view(torch.float32)


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448 (a plain cast gives NaN)."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _fp8_group_scales(x: torch.Tensor, block: int, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    if scale_fmt == "ue8m0":
        scale = round_scale_pow2(amax, _INV_FP8_MAX)
    elif scale_fmt is None:
        scale = amax * _INV_FP8_MAX
    else:
        raise DeepseekV41QuantizationError(f"scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    return groups, scale


def act_quant(
    x: torch.Tensor,
    block: int = QUANT_BLOCK,
    scale_fmt: str | None = "ue8m0",
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-`block` e4m3 quantization of the last dimension.

    Mirrors `kernel.act_quant(x, block, scale_fmt, scale_dtype)`: per group, amax floored at 1e-4,
    scale s = 2^ceil(log2(amax/448)) for ``"ue8m0"`` (amax/448 for ``None``), q = e4m3(clamp(x/s)).

    Args:
        x: bf16 ``[..., K]``, K a multiple of `block`.
        block: group size along K.
        scale_fmt: ``"ue8m0"`` (power-of-two scales) or ``None``.
        scale_dtype: dtype of the returned scales (fp32 or ``float8_e8m0fnu``, exact for pow2).

    Returns:
        ``(q, s)``: q float8_e4m3fn ``[..., K]``; s ``[..., K/block]`` in `scale_dtype`.

    Raises:
        DeepseekV41QuantizationError: non-bf16 input or K not a multiple of `block`.
    """
    _check_bf16(x, "act_quant")
    _check_groups(x, block, "act_quant")
    groups, scale = _fp8_group_scales(x, block, scale_fmt)
    q = cast_to_e4m3(groups / scale.unsqueeze(-1))
    return q.flatten(-2), scale.to(scale_dtype)


def _fake_quant_use_triton(x: torch.Tensor, backend: str | None) -> bool:
    # the kernels give the torch functions' bits, so this only picks the faster path; reads the
    # device only (no synchronisation)
    return "triton" == resolve_backend(
        backend, x.device, env_var=_FAKE_QUANT_ENV_BACKEND, error=DeepseekV41QuantizationError, what="fake quant"
    )


def fake_quant_fp8(
    x: torch.Tensor, block: int = QUANT_BLOCK, scale_fmt: str | None = "ue8m0", backend: str | None = None
) -> torch.Tensor:
    """Quantize to e4m3 as :func:`act_quant` and dequantize back; bf16 ``[..., K]`` out, new tensor.

    Mirrors `kernel.act_quant(..., inplace=True)` (the window-KV fake-quant, REFERENCE.md 6.2).
    ``(32, "ue8m0")`` with `backend` ``"triton"`` (None / ``"auto"``: ``DEEPSEEK_V41_FAKE_QUANT_BACKEND``,
    else Triton on CUDA; the model passes its plan's choice) runs as one Triton kernel,
    `triton_ops/fake_quant.py: fake_quant_fp8_triton`, bitwise equal to the torch ops.

    Raises:
        DeepseekV41QuantizationError: non-bf16 input, K not a multiple of `block`, unknown format
            or backend name.
    """
    _check_bf16(x, "fake_quant_fp8")
    _check_groups(x, block, "fake_quant_fp8")
    if block == FP8_KERNEL_GROUP and scale_fmt == "ue8m0" and _fake_quant_use_triton(x, backend):
        return fake_quant_fp8_triton(x)
    return _fake_quant_fp8_torch(x, block, scale_fmt)


def _fake_quant_fp8_torch(x: torch.Tensor, block: int, scale_fmt: str | None) -> torch.Tensor:
    groups, scale = _fp8_group_scales(x, block, scale_fmt)
    scale = scale.unsqueeze(-1)
    q = cast_to_e4m3(groups / scale)
    return (q.float() * scale).flatten(-2).to(x.dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> 4-bit E2M1 codes (uint8, bit 3 = sign), nearest, ties to even code."""
    mids, tie_up = _on_device(_E2M1_MIDPOINTS, x.device), _on_device(_E2M1_TIE_ROUNDS_UP, x.device)
    mag = x.abs().unsqueeze(-1)
    code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values in [-6, 6] -> the nearest E2M1 value (fp32), ties to the even code, sign kept."""
    return _on_device(E2M1_TABLE, x.device)[e2m1_codes(x).long()]


def _fp4_group_scales(x: torch.Tensor, group: int, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    groups = x.float().unflatten(-1, (-1, group))
    amax = groups.abs().amax(dim=-1)
    if scale_fmt == "e4m3":
        scale = cast_to_e4m3(amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_E2M1_MAX).float()
    elif scale_fmt == "ue8m0":
        scale = round_scale_pow2(amax.clamp_min(FP4_E8M0_AMAX_FLOOR), _INV_FP4_MAX)
    else:
        raise DeepseekV41QuantizationError(f"fp4 scale_fmt must be 'e4m3' or 'ue8m0', got {scale_fmt!r}")
    return groups, scale


def fake_quant_fp4(x: torch.Tensor, group: int = 16, scale_fmt: str = "e4m3", backend: str | None = None) -> torch.Tensor:
    """E2M1 quantize-dequantize of the last dimension in groups; bf16 out, new tensor.

    Mirrors `kernel.fp4_act_quant(x, group, inplace=True, scale_dtype)`:

    - ``(16, "e4m3")``, the compressed KV: amax floored at 6*2^-9, s = e4m3(amax / 6);
    - ``(32, "ue8m0")``, the indexer q and k: amax floored at 6*2^-126, s = 2^ceil(log2(amax/6)).

    Then y = E2M1(clamp(x / s, +-6)) * s, cast to bf16.

    With `backend` ``"triton"`` (None / ``"auto"``: ``DEEPSEEK_V41_FAKE_QUANT_BACKEND``, else Triton
    on CUDA) this is one Triton kernel, `triton_ops/fake_quant.py: fake_quant_fp4_triton`, bitwise
    equal to the torch ops.

    Raises:
        DeepseekV41QuantizationError: non-bf16 input, K not a multiple of `group`, unknown format
            or backend name.
    """
    _check_bf16(x, "fake_quant_fp4")
    _check_groups(x, group, "fake_quant_fp4")
    if scale_fmt in FP4_KERNEL_SCALE_FORMATS and fp4_group_supported(group) and _fake_quant_use_triton(x, backend):
        return fake_quant_fp4_triton(x, group, scale_fmt)
    return _fake_quant_fp4_torch(x, group, scale_fmt)


def _fake_quant_fp4_torch(x: torch.Tensor, group: int, scale_fmt: str) -> torch.Tensor:
    groups, scale = _fp4_group_scales(x, group, scale_fmt)
    scale = scale.unsqueeze(-1)
    v = (groups / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    return (e2m1_round(v) * scale).flatten(-2).to(x.dtype)


def quant_fp4(x: torch.Tensor, group: int = QUANT_BLOCK, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 quantization to packed codes. Mirrors `kernel.fp4_act_quant(inplace=False)`.

    Returns:
        ``(packed, s)``: float4_e2m1fn_x2 ``[..., K/2]`` and scales ``[..., K/group]`` as
        ``float8_e8m0fnu`` (``"ue8m0"``) or ``float8_e4m3fn`` (``"e4m3"``).
    """
    _check_bf16(x, "quant_fp4")
    _check_groups(x, group, "quant_fp4")
    groups, scale = _fp4_group_scales(x, group, scale_fmt)
    v = (groups / scale.unsqueeze(-1)).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
    scale_dtype = torch.float8_e8m0fnu if scale_fmt == "ue8m0" else torch.float8_e4m3fn
    return pack_fp4(e2m1_codes(v).flatten(-2)), scale.to(scale_dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 ``[..., K]`` -> float4_e2m1fn_x2 ``[..., K/2]``, even element in the low nibble."""
    _check_groups(codes, 2, "pack_fp4")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 ``[..., K/2]`` (float4_e2m1fn_x2, int8 or uint8 view) -> fp32 values ``[..., K]``.

    The low nibble of each byte is the even element. Mirrors `kernel.unpack_fp4`.

    Raises:
        DeepseekV41QuantizationError: a dtype that is not one byte per pair.
    """
    if packed.dtype not in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8):
        raise DeepseekV41QuantizationError(f"unpack_fp4 takes float4_e2m1fn_x2/int8/uint8, got {packed.dtype}")
    raw = packed.view(torch.uint8)
    table = _on_device(E2M1_TABLE, raw.device)
    low, high = table[(raw & 0x0F).long()], table[(raw >> 4).long()]
    return torch.stack([low, high], dim=-1).flatten(-2)


def _expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    s = scale.float()
    if block_rows > 1:
        s = s.repeat_interleave(block_rows, dim=0)
    return s.repeat_interleave(block_cols, dim=1)[:rows, :cols]


def dequantize_fp8_weight(
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: int = QUANT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    row_block: int | None = None,
) -> torch.Tensor:
    """fp8 e4m3 ``[out, in]`` x e8m0 block scales -> `dtype` ``[out, in]``.

    Scales are per (row_block x block) tile: ``[ceil(out/row_block), ceil(in/block)]``. Linear
    weights use 32 x 32 tiles (`row_block` defaults to `block`); the Engram table has one scale per
    row and 32 columns (``row_block=1``, `inference/model.py: ParallelEngramEmbedding`). The product
    is formed in fp32; for power-of-two scales the bf16 result is exact. This is also how the
    reference's converter produces `wo_a` (REFERENCE.md 2).

    Raises:
        DeepseekV41QuantizationError: dtype or scale shape mismatch.
    """
    row_block = block if row_block is None else row_block
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise DeepseekV41QuantizationError(f"fp8 weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    expected = (-(-rows // row_block), -(-cols // block))
    if tuple(scale.shape) != expected:
        raise DeepseekV41QuantizationError(f"fp8 weight {tuple(weight.shape)} needs scale {expected}, got {tuple(scale.shape)}")
    return (weight.float() * _expand_block_scale(scale, rows, cols, row_block, block)).to(dtype)


def dequantize_fp4_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: int = QUANT_BLOCK, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Packed fp4 ``[out, in/2]`` x e8m0 scales ``[out, in/block]`` -> `dtype` ``[out, in]`` (exact in bf16).

    Raises:
        DeepseekV41QuantizationError: dtype or scale shape mismatch.
    """
    values = unpack_fp4(weight)
    if values.dim() != 2:
        raise DeepseekV41QuantizationError(f"fp4 weight must be 2-D, got {tuple(weight.shape)}")
    rows, cols = values.shape
    if cols % block or tuple(scale.shape) != (rows, cols // block):
        raise DeepseekV41QuantizationError(
            f"fp4 weight {tuple(weight.shape)} (= [{rows}, {cols}] values) needs scale {(rows, cols // block)}, "
            f"got {tuple(scale.shape)}"
        )
    return (values * _expand_block_scale(scale, rows, cols, 1, block)).to(dtype)


def _block_scaled_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, block: int
) -> torch.Tensor:
    """sum over K blocks of (A_k @ B_k^T) * a_scale[:, k] * b_scale[:, k], fp32, blocks added in K order.

    a: fp32 ``[M, K]``; a_scale: fp32 ``[M, K/block]``; b: fp32 ``[N, K]``; b_scale: fp32 ``[N, K/block]``.
    The products of fp8 x fp8 / fp8 x fp4 values are exact in fp32, so only the order of additions
    matters; it is the reference's: one fp32 matmul per block, then scale, then accumulate.
    """
    out = torch.zeros(a.size(0), b.size(0), dtype=torch.float32, device=a.device)
    for k in range(a.size(1) // block):
        cols = slice(k * block, (k + 1) * block)
        partial = a[:, cols] @ b[:, cols].T
        out += partial * a_scale[:, k : k + 1] * b_scale[:, k].unsqueeze(0)
    return out


def fp8_block_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = QUANT_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """C = A @ W^T with per-block scales, returned in bf16 ``[..., N]``. Mirrors `kernel.fp8_gemm`.

    Args:
        a: float8_e4m3fn ``[..., K]`` from :func:`act_quant`; a_scale ``[..., K/block]``.
        weight: float8_e4m3fn ``[N, K]``; weight_scale ``[ceil(N/block), K/block]`` (e8m0 or fp32).
        out_dtype: bf16 (the reference's), or fp32: the sums before that rounding.
    """
    k = a.size(-1)
    n = weight.size(0)
    b_rows = weight_scale.float().repeat_interleave(block, dim=0)[:n]
    out = _block_scaled_matmul(a.reshape(-1, k).float(), a_scale.reshape(-1, k // block).float(), weight.float(), b_rows, block)
    return out.to(out_dtype).view(*a.shape[:-1], n)


def fp4_block_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = QUANT_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """C = A_fp8 @ W_fp4^T with per-32 scales, bf16 ``[..., N]`` out. Mirrors `kernel.fp4_gemm`.

    Args:
        a: float8_e4m3fn ``[..., K]``; a_scale ``[..., K/block]`` (block = 32, the weight group).
        weight: packed fp4 ``[N, K/2]``; weight_scale ``[N, K/32]``.
        out_dtype: bf16 (the reference's), or fp32: the sums before that rounding.
    """
    k = a.size(-1)
    n = weight.size(0)
    out = _block_scaled_matmul(
        a.reshape(-1, k).float(), a_scale.reshape(-1, k // block).float(), unpack_fp4(weight), weight_scale.float(), block
    )
    return out.to(out_dtype).view(*a.shape[:-1], n)


# e8m0 exponents a fresh scale may take: from the byte 0 (2^-127) up to the last byte the load
# check accepts (2^119: from `E8M0_FIRST_REFUSED` on it refuses a scale)
_E8M0_LOWEST = -E8M0_BIAS
_E8M0_HIGHEST = E8M0_FIRST_REFUSED - 1 - E8M0_BIAS


def e8m0_scale_byte(std: float) -> int:
    """The e8m0 byte of the power of two nearest `std` (in log2; 2^-127 for ``std <= 0``), clamped
    to the scales the load check accepts (2^119 at most).

    Raises:
        DeepseekV41QuantizationError: `std` is NaN or infinite (an ``initializer_range`` that is
            not a number: no scale is nearest it).
    """
    if not math.isfinite(std):
        raise DeepseekV41QuantizationError(
            f"the std of fresh quantized weights must be a finite number (the config's initializer_range), got {std!r}"
        )
    exponent = round(math.log2(std)) if std > 0 else _E8M0_LOWEST
    return min(max(exponent, _E8M0_LOWEST), _E8M0_HIGHEST) + E8M0_BIAS


def _is_fresh(tensor: torch.Tensor) -> bool:
    # transformers marks what a checkpoint filled (`_is_hf_initialized`); `transformers.initialization`
    # writes only unmarked tensors, and so does this module
    return not getattr(tensor, "_is_hf_initialized", False)


@torch.no_grad()
def init_quantized_storage(weight: torch.Tensor, scale: torch.Tensor, std: float) -> None:
    """Fresh, valid values for block-quantized storage (a :class:`DeepseekV41Linear` in fp8 / fp4,
    an Engram table): the weight dequantizes to about ``N(0, std)``, as a bf16 linear is drawn.

    - weight float8_e4m3fn: ``N(0, 1)`` samples cast to e4m3 (never a NaN code: |x| << 448);
    - weight float4_e2m1fn_x2 ``[out, in/2]``: ``N(0, 1)`` samples clamped to +-6, rounded to the
      nearest E2M1 value and packed (every E2M1 code is finite);
    - scale float8_e8m0fnu (any shape): every byte :func:`e8m0_scale_byte` of `std`.

    Each tensor is written only when it carries no ``_is_hf_initialized`` flag (what
    `transformers.initialization` does), so a weight or scale a checkpoint provided keeps its bytes.
    The weight is drawn from the global generator of its device (one ``randn`` of its logical shape).
    The pair is one unit: `from_pretrained` refuses a checkpoint holding only one of the two
    (`load_checks_deepseek_v41_vl.refuse_a_half_loaded_pair`), so both are fresh or neither is.

    Args:
        weight: written in place. float8_e4m3fn: a linear's ``[out, in]`` or an Engram table's
            ``[num_embeddings, head_dim]``; float4_e2m1fn_x2: ``[out, in/2]`` (two E2M1 codes a byte).
        scale: written in place, float8_e8m0fnu, any shape (fp8 linear ``[ceil(out/32), ceil(in/32)]``,
            fp4 linear ``[out, in/32]``, Engram table ``[num_embeddings, head_dim/32]``).
        std: the standard deviation the dequantized weight should have (the config's
            ``initializer_range``); a finite float.

    Raises:
        DeepseekV41QuantizationError: `weight` is not fp8 / packed fp4, `scale` is not e8m0, or `std`
            is NaN / infinite (checked before anything is written).
    """
    if weight.dtype not in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2) or scale.dtype != torch.float8_e8m0fnu:
        raise DeepseekV41QuantizationError(
            f"init_quantized_storage takes an fp8 / packed fp4 weight and an e8m0 scale, got {weight.dtype} and {scale.dtype}"
        )
    scale_byte = e8m0_scale_byte(std)
    if _is_fresh(weight):
        if weight.dtype == torch.float8_e4m3fn:
            codes = cast_to_e4m3(torch.randn(weight.shape, device=weight.device))
        else:
            values = torch.randn(*weight.shape[:-1], 2 * weight.shape[-1], device=weight.device)
            codes = pack_fp4(e2m1_codes(values.clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)))
        weight.view(torch.uint8).copy_(codes.view(torch.uint8))  # bytes: no 1-byte float kernel needed
    if _is_fresh(scale):
        scale.view(torch.uint8).fill_(scale_byte)


def fp32_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in fp32 without a rounding of the output (`x`, `weight` bf16 or fp32:
    every product is exact in fp32 for bf16 values). On CUDA the bf16 GEMM with an fp32 output
    where torch has it (``torch.mm(..., out_dtype=)``); else an fp32 GEMM."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        try:
            return torch.mm(x.reshape(-1, x.size(-1)), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        except (TypeError, NotImplementedError):  # a torch without ``out_dtype`` for this GEMM
            pass
    return F.linear(x.float(), weight.float())


class DeepseekV41Linear(nn.Linear):
    """Bias-free linear whose GEMM follows the weight's storage dtype. Mirrors `inference/model.py:
    Linear` and `linear()`.

    An `nn.Linear` subclass (with ``bias = None``), so PEFT's LoRA and other tools that target
    linear layers accept it: LoRA adds its bf16/fp32 adapter to this layer's output, and the
    straight-through gradient below reaches the adapter's input side.

    - ``"bf16"`` / ``"fp32"``: ``F.linear(x, weight)`` in the weight's dtype, no activation quant
      (x must already have that dtype, as in the reference).
    - ``"fp8"`` / ``"fp4"``: the bf16 activation is quantized per 32 to e4m3 with power-of-two
      scales, then ``"exact"``: :func:`fp8_block_gemm` / :func:`fp4_block_gemm`; ``"fast"``:
      ``F.linear(fake_quant_fp8(x), dequantized weight)`` in bf16.

    Parameters (names as the checkpoint): ``weight`` and, for fp8/fp4, ``scale`` (float8_e8m0fnu).
    fp8: weight ``[out, in]``, scale ``[ceil(out/32), ceil(in/32)]``; fp4: weight float4_e2m1fn_x2
    ``[out, in/2]``, scale ``[out, in/32]``.

    Args:
        in_features, out_features: logical shape.
        weight_dtype: ``"bf16"``, ``"fp32"``, ``"fp8"`` or ``"fp4"`` (or the torch dtype).
        numerics: the model's :class:`DeepseekV41Numerics` plan, or a mode name (``"fast"`` /
            ``"exact"``, backends from the environment).

    Raises:
        DeepseekV41QuantizationError: unknown dtype, or fp4 with `in_features` not a multiple of
            32; at call time, non-bf16 input to a quantized weight.
        DeepseekV41NumericsError: an unknown numerics mode.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight_dtype: str | torch.dtype = "bf16",
        numerics: DeepseekV41Numerics | str = "fast",
    ):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate (and initialise) a float weight
        self.register_parameter("bias", None)
        if isinstance(weight_dtype, torch.dtype):
            names = {v: k for k, v in WEIGHT_DTYPES.items()}
            if weight_dtype not in names:
                raise DeepseekV41QuantizationError(f"unsupported weight dtype {weight_dtype}")
            weight_dtype = names[weight_dtype]
        if weight_dtype not in WEIGHT_DTYPES:
            raise DeepseekV41QuantizationError(f"weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got {weight_dtype!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight_dtype = weight_dtype
        self.numerics = as_numerics(numerics)
        dtype = WEIGHT_DTYPES[weight_dtype]
        if weight_dtype == "fp4":
            if in_features % QUANT_BLOCK:
                raise DeepseekV41QuantizationError(f"fp4 in_features {in_features} is not a multiple of {QUANT_BLOCK}")
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=dtype), requires_grad=False)
            self.scale = nn.Parameter(
                torch.empty(out_features, in_features // QUANT_BLOCK, dtype=torch.float8_e8m0fnu), requires_grad=False
            )
        elif weight_dtype == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            self.scale = nn.Parameter(
                torch.empty(-(-out_features // QUANT_BLOCK), -(-in_features // QUANT_BLOCK), dtype=torch.float8_e8m0fnu),
                requires_grad=False,
            )
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)

    @property
    def is_quantized(self) -> bool:
        return self.weight_dtype in ("fp8", "fp4")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the output: bf16 for quantized weights (PEFT reads it to place adapters,
        as for bitsandbytes layers), else the weight's."""
        return torch.bfloat16 if self.is_quantized else self.weight.dtype

    def reset_parameters(self) -> None:
        """No-op: the weights come from a checkpoint or the model's `_init_weights` (nn.Linear's init
        cannot fill fp8 / fp4; :func:`init_quantized_storage` does)."""

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16, backend: str | None = None) -> torch.Tensor:
        """The logical ``[out, in]`` weight in `dtype` (exact in bf16 for fp8/fp4 storage).

        `backend` (fp8/fp4 storage, bf16 `dtype`): ``"triton"`` runs one kernel per weight
        (`triton_ops/dequant.py`, bitwise equal to :func:`dequantize_fp8_weight` /
        :func:`dequantize_fp4_weight`), ``"torch"`` those functions; ``None`` / ``"auto"`` reads
        ``DEEPSEEK_V41_DEQUANT_BACKEND``, else Triton for CUDA weights. Other dtypes use torch.

        Raises:
            DeepseekV41QuantizationError: an unknown backend name.
            DequantizationError: ``"triton"`` where Triton cannot run (CPU without its interpreter).
        """
        if self.weight_dtype not in ("fp8", "fp4"):
            return self.weight.to(dtype)
        use_triton = dtype == torch.bfloat16 and "triton" == resolve_backend(
            backend, self.weight.device, env_var=_DEQUANT_ENV_BACKEND, error=DeepseekV41QuantizationError,
            what="weight dequantization",
        )
        if self.weight_dtype == "fp8":
            if use_triton:
                return dequantize_fp8_triton(self.weight, self.scale)
            return dequantize_fp8_weight(self.weight, self.scale, dtype=dtype)
        if use_triton:
            return dequantize_fp4_triton(self.weight, self.scale)
        return dequantize_fp4_weight(self.weight, self.scale, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., in]`` -> ``[..., out]`` (bf16 for quantized weights, else the weight's dtype).

        With a quantized weight and an `x` that needs a gradient (fine-tuning what feeds this
        layer: the aligner, the tower, LoRA adapters), the values are the same and the gradient
        w.r.t. `x` is the straight-through one: as if the activation quantization were the
        identity, ``grad_x = grad_y @ W`` with the dequantized weight (the weight stays frozen).
        """
        if not self.is_quantized:
            return F.linear(x, self.weight)
        if x.size(-1) != self.in_features:
            raise DeepseekV41QuantizationError(f"input has {x.size(-1)} features, the linear expects {self.in_features}")
        if torch.is_grad_enabled() and x.requires_grad:
            return _StraightThroughQuantizedLinear.apply(x, self)
        return self._quantized_forward(x)

    def _quantized_forward(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        if self.numerics.exact:
            q, s = act_quant(x)
            gemm = fp8_block_gemm if self.weight_dtype == "fp8" else fp4_block_gemm
            return gemm(q, s, self.weight, self.scale, out_dtype=out_dtype)
        _check_bf16(x, "DeepseekV41Linear")  # the same error on both paths below
        plan = self.numerics
        if use_quant_linear_kernel(x, plan.backend("quant_linear", x.device)):
            # decode-size inputs (a few rows) on CUDA: reads fp8/fp4 in place, fused fake-quant
            # (`triton_ops/quant_linear.py`); equal to the line below up to fp32 summation order
            return quantized_linear_triton(x, self.weight, self.scale, self.weight_dtype, out_dtype=out_dtype)
        activation = fake_quant_fp8(x, backend=plan.backend("fake_quant", x.device))
        weight = self.dequantized_weight(torch.bfloat16, plan.backend("dequant", x.device))
        return F.linear(activation, weight) if out_dtype == torch.bfloat16 else fp32_sums(activation, weight)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[..., out]``: :meth:`forward`'s sums before its output is rounded to bf16 (the
        same products, added in fp32). A rank's share of a row-parallel linear
        (`parallel_deepseek_v41_vl`): the ranks add their shares and round once, as one process
        rounds its one sum. No gradient flows through it.

        Raises:
            DeepseekV41QuantizationError: as :meth:`forward`.
        """
        if x.size(-1) != self.in_features:
            raise DeepseekV41QuantizationError(f"input has {x.size(-1)} features, the linear expects {self.in_features}")
        if not self.is_quantized:
            return fp32_sums(x, self.weight)
        return self._quantized_forward(x, torch.float32)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The checkpoint stores packed fp4 as int8; re-view it so the dtype check passes.
        key = prefix + "weight"
        if self.weight_dtype == "fp4" and key in state_dict and state_dict[key].dtype in (torch.int8, torch.uint8):
            state_dict[key] = state_dict[key].view(torch.float4_e2m1fn_x2)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight_dtype={self.weight_dtype}, numerics={self.numerics.mode}"


class _StraightThroughQuantizedLinear(torch.autograd.Function):
    """The quantized GEMM's values, the straight-through estimator's gradient w.r.t. the input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: DeepseekV41Linear) -> torch.Tensor:
        ctx.linear = linear
        with torch.no_grad():
            return linear._quantized_forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.linear.dequantized_weight(torch.float32)
        return (grad.float() @ weight).to(grad.dtype), None


__all__ = [
    "DeepseekV41Linear",
    "DeepseekV41QuantizationError",
    "act_quant",
    "cast_to_e4m3",
    "dequantize_fp4_weight",
    "dequantize_fp8_weight",
    "e2m1_codes",
    "e2m1_round",
    "e8m0_scale_byte",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "fp4_block_gemm",
    "fp8_block_gemm",
    "fp32_sums",
    "init_quantized_storage",
    "pack_fp4",
    "quant_fp4",
    "round_scale_pow2",
    "unpack_fp4",
]
