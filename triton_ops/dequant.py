"""Weight dequantization on the GPU: fp8 / fp4 storage with e8m0 scales -> bf16, one launch per weight.

The fast-numerics path of `modeling/quantization_deepseek_v41_vl.py: DeepseekV41Linear` multiplies
by the dequantized bf16 weight; in torch that is about ten ops with fp32 temporaries per weight
(`dequantize_fp8_weight` / `dequantize_fp4_weight`), and the MoE prefill does it for every routed
expert at every forward. These kernels read the stored bytes once and write the bf16 weight once.

Storage (REFERENCE.md section 2):

- fp8: weight float8_e4m3fn ``[N, K]``, scale float8_e8m0fnu ``[ceil(N/32), ceil(K/32)]``, one
  scale per 32 x 32 tile (edge tiles may be partial);
- fp4: weight float4_e2m1fn_x2 ``[N, K/2]`` (int8 / uint8 views accepted), the even element in the
  low nibble, bit 3 of a code the sign, magnitudes ``[0, .5, 1, 1.5, 2, 3, 4, 6]``; scale
  float8_e8m0fnu ``[N, K/32]``.

Exactness. An e8m0 byte ``b`` is ``2^(b-127)`` (``b = 0`` is ``2^-127``, an fp32 subnormal;
``b = 255`` is NaN), so the torch functions form ``value * 2^(b-127)`` in fp32 (exact: at most 4
significant bits, none below ``2^-144``; infinite past the fp32 range) and round it once to bf16,
which rounds only where the product lands among bf16 subnormals (below ``2^-126``). The kernels
give the same bits (NaN payloads aside: torch's own depend on its code path). Both paths first
rearrange the code bits into an fp16 whose value is the weight value times ``2^-8`` (fp8) or
``2^-14`` (fp4), so e4m3 / e2m1 subnormals land on fp16 subnormals and fp16 -> fp32 is exact, and
an e4m3fn NaN code becomes an fp16 NaN. Then, uniformly per program:

- common path, when every scale byte of the program's tile lies where no product can leave the
  normal bf16 range (fp8: ``10 <= b <= 246``; fp4: ``2 <= b <= 240``): one fp32 multiply by the
  scale times ``2^8`` / ``2^14`` (a normal number; the product normal and exact) and a cast to
  bf16, exact whatever the rounding or denormal mode. Real checkpoints (scales near ``2^0``) only
  take this path;
- exact path, for a tile holding any other scale byte: torch's product itself, ``w * scale`` in
  fp32 with the e8m0 subnormal and NaN decoded as torch does, then round-to-nearest-even to bf16 on
  the integer bits. It relies on IEEE fp32 multiplies keeping subnormals, which is what Triton
  emits on NVIDIA (``FMUL``, no flush-to-zero) and what numpy does under the interpreter; the
  rounding is not left to the cast because the interpreter's fp32 -> bf16 cast does not round
  subnormals (or ties) like the hardware.

No fp8 dtype is used in the kernels: the interpreter's e4m3 conversion does not know e4m3fn's NaN,
and bit handling keeps interpreter and GPU in agreement.

Also here, for the decode kernels (`moe_experts.py`, `quant_linear.py`) on the GPU only (inline PTX,
which the interpreter cannot run): :func:`fp4_pairs_to_bf16_ptx` and :func:`e4m3_scaled_to_bf16_ptx`
decode weight bytes and their scales to the dequantized bf16 values with integer and bf16x2
instructions. For every kernel,
interpreted or compiled: :func:`e8m0_to_fp32` and :func:`e8m0_to_bf16` turn scale bytes into the
scale itself (a kernel that folds the scale into another power of 2, the ``(b + 14) << 23`` factors
here and in `moe_prefill.py`, builds its exponent field directly).

Tiles: fp8 programs own 32 rows (one scale row) x ``groups`` 32-column scale blocks, loaded as a
``[32, groups, 32]`` tile so each scale broadcasts along its own axis; fp4 programs own
``rows x groups`` scales, loaded as ``[rows, groups, 16]`` bytes and written, nibbles interleaved
(``tl.join``), as ``[rows, groups, 32]`` bf16. Both are contiguous along the last axis (16-byte
vector loads and stores; checked in the sm_90 SASS). No host synchronisation and no allocation
besides the output: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch functions
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

# fp8: 32 x 32 tile per scale; fp4: 32 consecutive values of a row per scale
from .formats import BLOCK as SCALE_BLOCK
from .kernel_backend import on_input_device, triton_interpret_mode

if triton is not None:
    from .formats import E8M0_BIAS_TL, bf16_rne

__all__ = ["DequantizationError", "ENV_BACKEND", "dequantize_fp4_triton", "dequantize_fp8_triton"]

# The variable `DeepseekV41Linear.dequantized_weight` reads through `kernel_backend.resolve_backend`.
ENV_BACKEND = "DEEPSEEK_V41_DEQUANT_BACKEND"

# Launch shapes, read at each call (benchmarks/dequant.py --sweep tries others). fp8: [32 rows,
# groups * 32 columns] per program; fp4: [rows, groups * 32 values]. Both defaults give 32 values
# per thread and 16-byte accesses: fp8 47 registers, fp4 48 (sm_90, Triton 3.9).
LAUNCH_CONFIG = {
    "fp8": {"groups": 8, "num_warps": 8},
    "fp4": {"rows": 32, "groups": 8, "num_warps": 8},
}


class DequantizationError(ValueError):
    """A weight, scale or output buffer with the wrong dtype, shape, layout or device."""


if triton is not None:

    @triton.jit
    def e8m0_to_fp32(sb):
        """e8m0 bytes (any integer type) -> fp32 ``2^(b-127)``: b = 0 is the subnormal 2^-127, 255 is
        NaN (as torch). The one fp32 form of the rule for every kernel of this package.

        The NaN is the GPU's canonical one (all payload bits set), so the interpreter exercises the
        NaN guards of the bf16 roundings the way the hardware would.
        """
        sb = sb.to(tl.int32)
        bits = tl.where(sb == 0, 0x00400000, tl.where(sb == 255, 0x7FFFFFFF, sb << 23))
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_scaled_f32(v):
        # fp16 with the e4m3 exponent and mantissa bits in place is the value times 2^-8, e4m3
        # subnormals landing on fp16 subnormals; fp16 -> fp32 is exact
        low7 = v & 0x7F
        h = ((v & 0x80) << 8) | (low7 << 7)
        h = tl.where(low7 == 0x7F, 0x7FFF, h)  # e4m3fn NaN -> fp16 NaN
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def e8m0_to_bf16(sb):
        """e8m0 bytes (int32) -> bf16 ``2^(b-127)`` (the exponent field is b; b = 0 is the
        subnormal 2^-127, 255 is NaN). bf16 has fp32's exponent range, so every scale is exact."""
        bits = tl.where(sb == 0, 0x0040, tl.where(sb == 255, 0x7FFF, sb << 7))
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)

    def _ptx_lanes(dst, src, mag_shift, mag_mask, sign_shift):
        # PTX: two bytes spread over the 16-bit halves of `src` (0x00BB00AA) -> `dst`, each half a
        # bf16 bit pattern: the byte's magnitude bits shifted into `mag_mask`, its sign to bit 15
        return (f"shl.b32 m, {src}, {mag_shift};\n    and.b32 m, m, {mag_mask};\n"
                f"    shl.b32 s, {src}, {sign_shift};\n    and.b32 s, s, 0x80008000;\n    or.b32 {dst}, m, s;\n    ")

    # Four packed E2M1 bytes ($4) and their four bf16 scales ($5, $6: two per register) -> the
    # even (low-nibble) values ($0, $1) and the odd (high-nibble) values ($2, $3), two bf16 per
    # register, element 0 in the low half. Each nibble's three magnitude bits go to bf16 bits 6..8
    # and its sign to bit 15: that bf16 is the E2M1 value times 2^-126 (code 1, 0.5, lands on the
    # subnormal 2^-127). Multiplying by 2^126 and then by the scale is exact in bf16 (an E2M1 value
    # has two significant bits; bf16 subnormals reach 2^-133), so the result equals
    # bf16(value * scale) computed in fp32. fma with -0.0 (an exact multiply that keeps the sign
    # of zero) runs on sm_80; mul.bf16x2 would need sm_90. The scales are copied first because an
    # output may share a register with an input (the bytes are read before any output is written).
    _FP4_PTX = tl.constexpr(
        """
    {
    .reg .b32 x01, x23, sa, sb, z, m, s, t0, t1, t2, t3, bias, nz;
    mov.b32 sa, $5;
    mov.b32 sb, $6;
    mov.b32 z, 0;
    mov.b32 bias, 0x7E807E80;
    mov.b32 nz, 0x80008000;
    prmt.b32 x01, $4, z, 0x4140;
    prmt.b32 x23, $4, z, 0x4342;
    """
        + _ptx_lanes("t0", "x01", 6, "0x01C001C0", 12)  # low nibbles of bytes 0, 1
        + _ptx_lanes("t1", "x23", 6, "0x01C001C0", 12)
        + _ptx_lanes("t2", "x01", 2, "0x01C001C0", 8)  # high nibbles
        + _ptx_lanes("t3", "x23", 2, "0x01C001C0", 8)
        + """fma.rn.bf16x2 t0, t0, bias, nz;
    fma.rn.bf16x2 t1, t1, bias, nz;
    fma.rn.bf16x2 t2, t2, bias, nz;
    fma.rn.bf16x2 t3, t3, bias, nz;
    fma.rn.bf16x2 $0, t0, sa, nz;
    fma.rn.bf16x2 $1, t1, sb, nz;
    fma.rn.bf16x2 $2, t2, sa, nz;
    fma.rn.bf16x2 $3, t3, sb, nz;
    }
    """
    )

    @triton.jit
    def fp4_pairs_to_bf16_ptx(packed, scale):
        """Packed E2M1 bytes `packed` (uint8, the even element in the low nibble) and a bf16 scale
        per byte `scale` (broadcast to packed's shape) -> (even, odd) bf16 values, each of packed's
        shape, equal to `dequantize_fp4_weight`'s values (NaN payloads aside). Integer and bf16x2
        instructions only (inline PTX, sm_80+): the fp16 -> fp32 -> bf16 conversions of the
        portable decode run at a quarter of the integer rate and bounded the decode GEMV. GPU only:
        the interpreter cannot run PTX."""
        return tl.inline_asm_elementwise(
            _FP4_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )

    # Two e4m3 bytes ($1) and their bf16 scales ($2, two per register) -> bf16 value * scale ($0,
    # element 0 in the low half). Each byte's seven exponent / mantissa bits go to bf16 bits 4..10
    # and its sign to bit 15: that bf16 is the e4m3 value times 2^-120 (e4m3 subnormals land on
    # bf16 subnormals); one exact multiply by 2^120 (fma with -0.0, as `_FP4_PTX`) restores the
    # value, a second multiplies by the scale, rounded once, as bf16(value * scale) in fp32. NaN
    # bytes (0x7F, 0xFF) come out finite. Replaces Triton's e4m3 -> fp16 -> bf16 conversion, whose
    # fp16 -> bf16 step runs at a quarter of the integer rate. The inputs are read before the
    # output is written.
    _E4M3_SCALED_PTX = tl.constexpr(
        """
    {
    .reg .b32 x01, z, m, s, bias, nz, v;
    mov.b32 z, 0;
    mov.b32 bias, 0x7B807B80;
    mov.b32 nz, 0x80008000;
    prmt.b32 x01, $1, z, 0x4140;
    """
        + _ptx_lanes("m", "x01", 4, "0x07F007F0", 8)
        + """fma.rn.bf16x2 v, m, bias, nz;
    fma.rn.bf16x2 $0, v, $2, nz;
    }
    """
    )

    @triton.jit
    def e4m3_scaled_to_bf16_ptx(raw, scale):
        """e4m3 bytes `raw` (uint8) and a bf16 power-of-two scale per byte `scale` (raw's shape) ->
        bf16 ``value * scale``, equal to `dequantize_fp8_weight`'s values (NaN bytes unspecified).
        Integer and bf16x2 instructions only (inline PTX, sm_80+); GPU only."""
        return tl.inline_asm_elementwise(
            _E4M3_SCALED_PTX, "=r,r,r", [raw, scale], dtype=tl.bfloat16, is_pure=True, pack=2
        )

    @triton.jit
    def fp4_tile_to_bf16(u, sb, ROWS: tl.constexpr, GROUPS: tl.constexpr):
        """Packed E2M1 bytes `u` (int32 ``[ROWS, GROUPS, 16]``, the even element in the low nibble)
        and their e8m0 scale bytes `sb` (int32 ``[ROWS, GROUPS]``) -> bf16 ``[ROWS, GROUPS, 32]``,
        bitwise `dequantize_fp4_weight`. Shared with `moe_prefill.py`."""
        # fp16 with the e2m1 bits in place is the value times 2^-14 (0.5 lands on an fp16 subnormal)
        x_lo = (((u & 0x08) << 12) | ((u & 0x07) << 9)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        x_hi = (((u & 0x80) << 8) | ((u & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        if (tl.min(tl.min(sb, axis=1), axis=0) >= 2) & (tl.max(tl.max(sb, axis=1), axis=0) <= 240):
            # 2^(b-127) * 2^14 is a normal fp32 and every product a normal bf16: one exact multiply
            factor = ((sb + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
            lo = (x_lo * factor).to(tl.bfloat16)
            hi = (x_hi * factor).to(tl.bfloat16)
        else:
            # torch's own product, value * scale.float(), then round to nearest even
            scale = e8m0_to_fp32(sb)[:, :, None]
            lo = bf16_rne((x_lo * 16384.0) * scale)
            hi = bf16_rne((x_hi * 16384.0) * scale)
        return tl.reshape(tl.join(lo, hi), (ROWS, GROUPS, 32))  # even element (low nibble) first

    @triton.jit
    def _dequant_fp8_kernel(
        w_ptr,
        s_ptr,
        o_ptr,
        n_rows,
        n_cols,
        n_scale_cols,
        stride_w,
        stride_s,
        stride_o,
        GROUPS: tl.constexpr,
    ):
        row0 = tl.program_id(0) * 32
        group0 = tl.program_id(1) * GROUPS
        r = tl.arange(0, 32)[:, None, None]
        c = tl.arange(0, 32)[None, None, :]
        col = (group0 + tl.arange(0, GROUPS)[None, :, None]) * 32 + c
        ok = (row0 + r < n_rows) & (col < n_cols)

        s_cols = group0 + tl.arange(0, GROUPS)
        # masked scales read as 127 (2^0): inside the common range, never stored
        sb = tl.load(s_ptr + tl.program_id(0).to(tl.int64) * stride_s + s_cols, mask=s_cols < n_scale_cols, other=E8M0_BIAS_TL)
        sb = sb.to(tl.int32)
        v = tl.load(w_ptr + row0.to(tl.int64) * stride_w + r * stride_w + col, mask=ok, other=0).to(tl.int32)

        x = _e4m3_scaled_f32(v)
        if (tl.min(sb, axis=0) >= 10) & (tl.max(sb, axis=0) <= 246):
            # 2^(b-127) * 2^8 is a normal fp32 and every product a normal bf16: one exact multiply
            factor = ((sb + 8) << 23).to(tl.float32, bitcast=True)
            out = (x * factor[None, :, None]).to(tl.bfloat16)
        else:
            # torch's own product, w.float() * scale.float(), then round to nearest even
            out = bf16_rne((x * 256.0) * e8m0_to_fp32(sb)[None, :, None])
        tl.store(o_ptr + row0.to(tl.int64) * stride_o + r * stride_o + col, out, mask=ok)

    @triton.jit
    def _dequant_fp4_kernel(
        w_ptr,
        s_ptr,
        o_ptr,
        n_rows,
        n_groups,
        stride_w,
        stride_s,
        stride_o,
        ROWS: tl.constexpr,
        GROUPS: tl.constexpr,
    ):
        row0 = tl.program_id(0) * ROWS
        group0 = tl.program_id(1) * GROUPS
        r2 = tl.arange(0, ROWS)[:, None]
        g2 = group0 + tl.arange(0, GROUPS)[None, :]
        s_ok = (row0 + r2 < n_rows) & (g2 < n_groups)
        # masked scales read as 127 (2^0): inside the common range, never stored
        sb = tl.load(s_ptr + row0.to(tl.int64) * stride_s + r2 * stride_s + g2, mask=s_ok, other=E8M0_BIAS_TL).to(tl.int32)

        r = r2[:, :, None]
        g = g2[:, :, None]
        byte = tl.arange(0, 16)[None, None, :]
        ok = s_ok[:, :, None] & (byte < 16)
        u = tl.load(w_ptr + row0.to(tl.int64) * stride_w + r * stride_w + g * 16 + byte, mask=ok, other=0).to(tl.int32)
        out = fp4_tile_to_bf16(u, sb, ROWS, GROUPS)
        col = g * 32 + tl.arange(0, 32)[None, None, :]
        out_ok = s_ok[:, :, None] & (col >= 0)
        tl.store(o_ptr + row0.to(tl.int64) * stride_o + r * stride_o + col, out, mask=out_ok)


def _check_runnable(weight: torch.Tensor) -> None:
    if triton is None:
        raise DequantizationError("the Triton dequantization kernels need the triton package, which is not installed")
    if not weight.is_cuda and not triton_interpret_mode():
        raise DequantizationError(
            f"Triton dequantization of a {weight.device} tensor needs CUDA, or Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported)"
        )


def _check_scale(scale: torch.Tensor, expected: tuple[int, int], what: str, weight: torch.Tensor) -> None:
    if scale.dtype != torch.float8_e8m0fnu:
        raise DequantizationError(f"{what} scale must be float8_e8m0fnu, got {scale.dtype}")
    if tuple(scale.shape) != expected:
        raise DequantizationError(f"{what} weight {tuple(weight.shape)} needs scale {expected}, got {tuple(scale.shape)}")
    if scale.device != weight.device:
        raise DequantizationError(f"{what} scale is on {scale.device}, the weight on {weight.device}")
    if scale.numel() and scale.stride(-1) != 1:
        raise DequantizationError(f"{what} scale must be contiguous along its last dim, got strides {scale.stride()}")


def _output(out: torch.Tensor | None, shape: tuple[int, int], weight: torch.Tensor, what: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=weight.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != shape:
        raise DequantizationError(f"{what} out must be bfloat16 {shape}, got {out.dtype} {tuple(out.shape)}")
    if out.device != weight.device:
        raise DequantizationError(f"{what} out is on {out.device}, the weight on {weight.device}")
    if out.numel() and out.stride(-1) != 1:
        raise DequantizationError(f"{what} out must be contiguous along its last dim, got strides {out.stride()}")
    return out


@on_input_device
def dequantize_fp8_triton(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 e4m3 ``[N, K]`` x e8m0 32 x 32 block scales -> bf16 ``[N, K]``, one kernel launch.

    Bitwise equal to `modeling/quantization_deepseek_v41_vl.py: dequantize_fp8_weight` (bf16 output,
    32 x 32 tiles), NaN payloads aside; mirrors the reference converter's fp8 dequantization
    (REFERENCE.md 2).

    Args:
        weight: float8_e4m3fn ``[N, K]``, unit stride along K; CUDA (or CPU under TRITON_INTERPRET=1).
        scale: float8_e8m0fnu ``[ceil(N/32), ceil(K/32)]`` on the same device, unit stride along K.
        out: optional bf16 ``[N, K]`` buffer (unit stride along K) to write into and return.

    Returns:
        bf16 ``[N, K]`` (``out`` when given).

    Raises:
        DequantizationError: a wrong dtype, shape, device or layout, or no way to run Triton here.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise DequantizationError(f"fp8 weight must be 2-D float8_e4m3fn, got {weight.dtype} {tuple(weight.shape)}")
    n_rows, n_cols = weight.shape
    n_scale_cols = -(-n_cols // SCALE_BLOCK)
    _check_scale(scale, (-(-n_rows // SCALE_BLOCK), n_scale_cols), "fp8", weight)
    if weight.numel() and weight.stride(-1) != 1:
        raise DequantizationError(f"fp8 weight must be contiguous along its last dim, got strides {weight.stride()}")
    out = _output(out, (n_rows, n_cols), weight, "fp8")
    if weight.numel() == 0:
        return out
    _check_runnable(weight)
    cfg = LAUNCH_CONFIG["fp8"]
    grid = (triton.cdiv(n_rows, SCALE_BLOCK), triton.cdiv(n_scale_cols, cfg["groups"]))
    _dequant_fp8_kernel[grid](
        weight.view(torch.uint8),
        scale.view(torch.uint8),
        out,
        n_rows,
        n_cols,
        n_scale_cols,
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        GROUPS=cfg["groups"],
        num_warps=cfg["num_warps"],
    )
    return out


@on_input_device
def dequantize_fp4_triton(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed fp4 e2m1 ``[N, K/2]`` x e8m0 per-32 scales ``[N, K/32]`` -> bf16 ``[N, K]``, one launch.

    Bitwise equal to `modeling/quantization_deepseek_v41_vl.py: dequantize_fp4_weight` (bf16
    output), NaN payloads aside. Mirrors `inference/kernel.py`'s fp4 unpacking: the even element
    is the low nibble of each byte.

    Args:
        weight: float4_e2m1fn_x2 (or an int8 / uint8 view) ``[N, K/2]``, unit stride along K;
            CUDA (or CPU under TRITON_INTERPRET=1).
        scale: float8_e8m0fnu ``[N, K/32]`` on the same device, unit stride along K.
        out: optional bf16 ``[N, K]`` buffer (unit stride along K) to write into and return.

    Returns:
        bf16 ``[N, K]`` (``out`` when given).

    Raises:
        DequantizationError: a wrong dtype, shape, device or layout (K must be a multiple of 32),
            or no way to run Triton here.
    """
    if weight.dtype not in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8) or weight.dim() != 2:
        raise DequantizationError(
            f"fp4 weight must be 2-D float4_e2m1fn_x2 (or int8/uint8), got {weight.dtype} {tuple(weight.shape)}"
        )
    n_rows, n_bytes = weight.shape
    n_cols = 2 * n_bytes
    if n_cols % SCALE_BLOCK:
        raise DequantizationError(
            f"fp4 weight {tuple(weight.shape)} holds {n_cols} values per row, not a multiple of {SCALE_BLOCK}"
        )
    n_groups = n_cols // SCALE_BLOCK
    _check_scale(scale, (n_rows, n_groups), "fp4", weight)
    if weight.numel() and weight.stride(-1) != 1:
        raise DequantizationError(f"fp4 weight must be contiguous along its last dim, got strides {weight.stride()}")
    out = _output(out, (n_rows, n_cols), weight, "fp4")
    if weight.numel() == 0:
        return out
    _check_runnable(weight)
    cfg = LAUNCH_CONFIG["fp4"]
    grid = (triton.cdiv(n_rows, cfg["rows"]), triton.cdiv(n_groups, cfg["groups"]))
    _dequant_fp4_kernel[grid](
        weight.view(torch.uint8),
        scale.view(torch.uint8),
        out,
        n_rows,
        n_groups,
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        ROWS=cfg["rows"],
        GROUPS=cfg["groups"],
        num_warps=cfg["num_warps"],
    )
    return out
