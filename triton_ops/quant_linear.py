"""Decode-size quantized linear: ``y = fake_quant_fp8(x) @ W^T`` reading fp8 / fp4 weights in place.

The fast-numerics path of `modeling/quantization_deepseek_v41_vl.py: DeepseekV41Linear` computes
``F.linear(fake_quant_fp8(x), dequantized W)``: it writes the whole bf16 weight to memory on every
call, which dominates a decode step. This kernel reads the stored weight bytes and their e8m0
scales directly and fuses the activation fake-quant, so a call moves the weight bytes once.

Storage (as `DeepseekV41Linear` holds it; REFERENCE.md section 2):

- ``"fp8"``: weight float8_e4m3fn ``[N, K]``, scale float8_e8m0fnu ``[ceil(N/32), ceil(K/32)]``
  (one power of two per 32 x 32 tile);
- ``"fp4"``: weight float4_e2m1fn_x2 ``[N, K/2]`` (the even element in the low nibble; int8 / uint8
  views accepted), scale float8_e8m0fnu ``[N, K/32]``.

Numerics, equal to the torch fast path up to the order of the fp32 additions:

- activation, per group of 32 along K (mirrors `kernel.act_quant(..., inplace=True)`, i.e.
  `fake_quant_fp8`): amax floored at 1e-4, ``s = 2^ceil(log2(amax * fp32(1/448)))`` from the
  product's IEEE bits, ``q = e4m3_rne(clamp(x / s, +-448))``, value ``q * s`` in bf16. ``x / s`` is
  taken as ``x * (1/s)`` (both exact for a power of two). The e4m3 rounding is one fp32 add and
  subtract of a power of two (:func:`_round_to_e4m3`), bit-exact against torch's cast on every
  device: Triton's fp8 cast is not used because the interpreter's truncates;
- weight: each code becomes its dequantized bf16 value ``bf16(value * s_w)``, the value
  `dequantize_fp8_weight` / `dequantize_fp4_weight` give (one rounding, which only a subnormal
  product needs). On the GPU: integer / bf16x2 instructions (`dequant.e4m3_scaled_to_bf16_ptx`,
  `dequant.fp4_pairs_to_bf16_ptx`); in the interpreter an E2M1 code is re-encoded as the e4m3 byte
  of ``value * 2^-6`` (sign, then the 3 magnitude bits two places up), Triton's exact fp8 cast
  decodes it, and the product with the scale (times 2^6 for fp4) is rounded on the bits;
- products of those bf16 values are exact in fp32, each equal to the fast path's product. A
  ``tl.dot`` per loop step sums them in fp32 into the accumulator; the result is rounded to bf16
  (half to even, on the bits: the interpreter's cast truncates). This is the fast path's sum of
  ``x_val * (w * s_w)`` in another order.

Non-finite activations or weights give unspecified values (torch propagates NaN differently).

Kernel design (see :func:`default_config`): program ``(n_block, k_split, m_block)`` owns
``BLOCK_N`` (default 128) output features x 16 rows (``tl.dot`` needs 16; decode pads the rows)
and one contiguous K range. Each loop step handles a tile of ``groups_per_iter`` (G) groups of
32 K: it loads the activations ``[G, 32, 16]`` and fake-quantizes them per group (re-done by every
program: they are tiny and L2-resident, so a wide ``BLOCK_N`` amortises the work over more
weight bytes), loads the weight bytes ``[BLOCK_N, G, 32]`` (fp4: ``[BLOCK_N, G, 16]``, low and
high nibbles dotted against the even and odd activations) and their scales ``[BLOCK_N, G]``,
decodes them to dequantized bf16, and adds one ``dot(w [BLOCK_N, G*32], x_q^T [G*32, 16])`` to
the fp32 accumulator: one load of ``BLOCK_N x G x 32`` weight bytes per step keeps many bytes
in flight per program. When there are too few N blocks to fill the GPU (small N, large K) K is
split, still in one launch: every split writes
its fp32 partials to a workspace ``[S, M, N]`` and takes a ticket from its output tile's counter;
the program that takes the last ticket adds the S partials in split order (0, 1, ...), stores the
bf16 result and resets the counter. The sum is the same whichever program finishes last, so
results are deterministic (the atomics only count). The counters (one int32 per output tile, zero
between launches) belong to a (device, stream): launches on one stream run one after another, so
they never share a tile's counter with a concurrent launch; a CUDA graph uses those of the stream
it was captured on (made, if new, inside the capture: one memset node), so graphs of one capture
stream are assumed to replay one after another, as their shared memory pool already requires. No
host synchronisation and only shape-dependent allocations: CUDA-graph capturable after a warm-up
call has compiled the kernel.

One row (``QuantLinearConfig.gemv``, the default up to :data:`GEMV_MAX_ROWS` rows): a 16-row
``tl.dot`` tile would be 15/16 padding, and its weight operand a round trip through shared
memory. `_quant_gemv_kernel`'s program ``(n_block, k_split, row)`` instead multiplies the decoded
weight tile ``[BLOCK_N, G, 32]`` (fp4: the even and odd halves, ``[BLOCK_N, G, 16]`` each) by the
row's fake-quantized values elementwise on the CUDA cores (the same exact fp32 products), adds them
into an fp32 tile and sums the tile once, after its K range; split-K and the final rounding are
shared with the tile kernel. The two kernels add the products in different orders, so a row
computed alone can round one bf16 ulp apart from the same row among 2-16 rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

try:  # Triton is optional: CPU-only installs use the torch fallback
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .formats import BLOCK as GROUP  # activation group / weight scale block along K
from .kernel_backend import kernel_interpreted, on_input_device, resolve_backend, unrunnable

ENV_BACKEND = "DEEPSEEK_V41_QUANT_LINEAR_BACKEND"
# Rows (tokens) up to which DeepseekV41Linear uses the kernel: one 16-row MMA tile. Beyond that the
# weight bytes are amortised over many rows and the dequantize + cuBLAS path is likely the better
# one (the kernel is correct for any M, tiling rows by 16, but re-reads W per 16 rows).
QUANT_LINEAR_MAX_ROWS = 16
_BLOCK_M = 16  # tl.dot's smallest tile side
# programs per SM the split-K heuristic aims for, and the fewest K groups a split may get
_PROGRAMS_PER_SM = 4
# Rows up to which the default config is the CUDA-core GEMV (`QuantLinearConfig.gemv`): for fp4
# weights, and fp8 weights of at most GEMV_MAX_FP8_WEIGHT elements (the larger ones read faster
# through the tile kernel); its defaults per format and the programs per SM its split-K aims for.
# Measured on an H100 (graph replay, one row; `benchmarks/quant_linear.py`): the defaults are the
# sweep's fastest or within 0.5 us of it at each release shape
GEMV_MAX_ROWS = 1
GEMV_MAX_FP8_WEIGHT = 16 << 20
_GEMV_DEFAULTS = {
    "fp8": {"block_n": 16, "groups_per_iter": 4, "num_warps": 4, "num_stages": 1},
    "fp4": {"block_n": 16, "groups_per_iter": 8, "num_warps": 2, "num_stages": 1},
}
_GEMV_PROGRAMS_PER_SM = 8
_MAX_GRID_ROWS = 65535  # the GEMV's rows are grid axis 2
_MIN_GROUPS_PER_SPLIT = 4
# output tiles a split launch may have: one int32 counter each, per device
MAX_SPLIT_TILES = 4096

_WEIGHT_FORMATS = ("fp8", "fp4")


class QuantLinearError(ValueError):
    """Bad arguments to the quantized-linear kernel: dtypes, shapes, devices, config or backend."""


@dataclass(frozen=True)
class QuantLinearConfig:
    """Launch parameters of :func:`quantized_linear_triton`.

    Attributes:
        block_n: output features per program, a power of two >= 16.
        groups_per_iter: groups of 32 K per loop step (unrolled), >= 1.
        split_k: K ranges computed by separate programs, >= 1 (reduced to the number of non-empty
            ranges); the last program of an output tile to finish adds them in range order. A
            split launch may have at most :data:`MAX_SPLIT_TILES` output tiles (N / block_n x
            M / 16, or M with ``gemv``).
        num_warps, num_stages: passed to the launch (num_stages: software-pipelining depth).
        gemv: one program per activation row, products summed on the CUDA cores
            (`_quant_gemv_kernel`) instead of 16-row ``tl.dot`` tiles, which at one row are
            mostly padding. At most 65535 rows (a grid axis).
    """

    block_n: int = 128
    groups_per_iter: int = 4
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    gemv: bool = False


def resolve_quant_linear_backend(backend: str | None, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on `device`; ``None`` / ``"auto"`` read
    ``DEEPSEEK_V41_QUANT_LINEAR_BACKEND`` first, then pick Triton on CUDA (`kernel_backend`).

    Raises:
        QuantLinearError: an unknown backend name (argument or environment variable).
    """
    return resolve_backend(backend, device, env_var=ENV_BACKEND, error=QuantLinearError, what="quantized linear")


def use_quant_linear_kernel(x: torch.Tensor, backend: str | None = "auto") -> bool:
    """True when a quantized linear on `x` ``[..., K]`` should run :func:`quantized_linear_triton`:
    the backend resolves to Triton and there are at most :data:`QUANT_LINEAR_MAX_ROWS` rows.

    Reads only shapes and the device (no synchronisation).

    Raises:
        QuantLinearError: an unknown backend name.
    """
    chosen = resolve_quant_linear_backend(backend, x.device)
    if x.dim() == 0 or x.size(-1) == 0:
        return False
    return chosen == "triton" and x.numel() // x.size(-1) <= QUANT_LINEAR_MAX_ROWS


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_quant_linear_kernel)


if triton is not None:
    from .dequant import e4m3_scaled_to_bf16_ptx, e8m0_to_bf16, e8m0_to_fp32, fp4_pairs_to_bf16_ptx
    from .formats import E4M3_MAX_TL, E8M0_BIAS_TL

    @triton.jit
    def _pow2_scale(amax):
        """amax fp32 -> (s, 1/s): s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))), as round_scale_pow2."""
        prod = tl.maximum(amax, 1e-4) * (1.0 / E4M3_MAX_TL)
        bits = prod.to(tl.int32, bitcast=True)
        expo = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (expo << 23).to(tl.float32, bitcast=True)
        # 1/s exactly: s is at least 2^-22 (the floor) and at most 2^120 (bf16 max / 448)
        inv_scale = ((254 - expo) << 23).to(tl.float32, bitcast=True)
        return scale, inv_scale

    @triton.jit
    def _round_to_e4m3(v):
        """fp32 with |v| <= 448 -> the nearest float8_e4m3fn value (fp32), ties to even, sign kept.

        The e4m3 grid spacing at |v| is 2^(e - 130) (e: v's biased fp32 exponent, at least 121,
        e4m3's smallest normal 2^-6; below it the subnormal spacing 2^-9). Adding c = 2^(e - 107)
        puts |v| + c in c's binade, whose fp32 ulp is exactly that spacing, so the IEEE addition
        rounds |v| to the grid, half to even; subtracting c is exact. About 10 operations where
        Triton's own fp8 cast is not usable: the interpreter's truncates.
        """
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        expo = tl.maximum(mag >> 23, 121)
        c = ((expo + 20) << 23).to(tl.float32, bitcast=True)
        rounded = (mag.to(tl.float32, bitcast=True) + c) - c
        sign = (bits >> 31) << 31
        return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _fake_quant_scaled(x, scale, inv_scale):
        """x fp32 and its groups' s and 1/s (broadcastable to x) -> q * s as bf16 (`fake_quant_fp8`)."""
        v = x * inv_scale
        v = tl.minimum(tl.maximum(v, -E4M3_MAX_TL), E4M3_MAX_TL)
        return (_round_to_e4m3(v) * scale).to(tl.bfloat16)

    @triton.jit
    def _fake_quant_groups(x, scale, inv_scale):
        """x fp32 [G, L, BM] (per group g, L values of each of BM rows) -> q * s as bf16, with the
        scale of group g and row m."""
        return _fake_quant_scaled(x, scale[:, None, :], inv_scale[:, None, :])

    @triton.jit
    def _to_bf16_rne(v):
        """fp32 -> bf16, round half to even, on the bits: the interpreter's cast truncates."""
        bits = v.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.where(v == v, rounded, v.to(tl.bfloat16))  # NaN kept as NaN

    @triton.jit
    def _dot(a, b, DOT_FP32: tl.constexpr):
        """a @ b for bf16 tiles, fp32 out. The products are exact either way; fp32 operands only
        for the interpreter, whose dot multiplies bf16 tiles as their raw 16-bit integers."""
        if DOT_FP32:
            out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _fp8_tile(w8, s_byte, PTX_DECODE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        """e4m3 bytes [BLOCK_N, GROUPS, 32] and their e8m0 scale bytes [BLOCK_N, GROUPS] -> the
        dequantized bf16 values, ``bf16(value * s_w)``."""
        if PTX_DECODE:
            w_scale = tl.broadcast_to(e8m0_to_bf16(s_byte.to(tl.int32))[:, :, None], (BLOCK_N, GROUPS, 32))
            w = e4m3_scaled_to_bf16_ptx(w8, w_scale)
        else:
            w_val = w8.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16).to(tl.float32)
            w = _to_bf16_rne(w_val * e8m0_to_fp32(s_byte)[:, :, None])
        return w

    @triton.jit
    def _fp4_tile(packed, s_byte, PTX_DECODE: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
        """Packed E2M1 bytes [BLOCK_N, GROUPS, 16] (even element in the low nibble) and their e8m0
        scale bytes [BLOCK_N, GROUPS] -> the dequantized bf16 values of the even and of the odd
        elements, [BLOCK_N, GROUPS, 16] each."""
        if PTX_DECODE:
            w_scale = tl.broadcast_to(e8m0_to_bf16(s_byte.to(tl.int32))[:, :, None], (BLOCK_N, GROUPS, 16))
            w_lo, w_hi = fp4_pairs_to_bf16_ptx(packed, w_scale)
        else:
            # E2M1 code c -> e4m3 byte of c's value * 2^-6: sign to bit 7, magnitude << 2
            u = packed.to(tl.int32)
            lo = (((u << 4) & 0x80) | ((u << 2) & 0x1C)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            hi = ((u & 0x80) | ((u >> 2) & 0x1C)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
            w_scale = (e8m0_to_fp32(s_byte) * 64.0)[:, :, None]
            w_lo = _to_bf16_rne(lo.to(tl.bfloat16).to(tl.float32) * w_scale)
            w_hi = _to_bf16_rne(hi.to(tl.bfloat16).to(tl.float32) * w_scale)
        return w_lo, w_hi

    @triton.jit
    def _scale_bytes(s_ptr, offs_n, gi, stride_sn, s_mask, IS_FP4: tl.constexpr):
        """The e8m0 scale bytes [BLOCK_N, G] of output features `offs_n` and K groups `gi`: fp4
        weights hold one scale row per feature, fp8 ones one per 32 features (a [32, 32] block);
        masked-off entries read as scale 1."""
        if IS_FP4:
            rows = offs_n
        else:
            rows = offs_n // 32
        return tl.load(s_ptr + rows[:, None] * stride_sn + gi[None, :], mask=s_mask, other=E8M0_BIAS_TL)

    @triton.jit
    def _store_tile(acc, offs_n, offs_m, n_ok, m_ok, tile, pid_k, M, N, n_splits, out_ptr, ws_ptr, count_ptr,
                    stride_om, SPLIT: tl.constexpr, OUT_FP32: tl.constexpr):
        """Stores the fp32 sums `acc` [BLOCK_N, BLOCK_M] of output features `offs_n` and rows
        `offs_m`, or with SPLIT this K range's share of them: its partials go to the workspace
        [S, M, N] fp32 (contiguous), then it takes a ticket from the tile's counter (the barrier
        orders every thread's stores before the release increment) and the last ticket's program
        adds the ranges in order, stores the result and resets the counter."""
        out_mask = n_ok[:, None] & m_ok[None, :]
        out_offs = offs_m[None, :] * stride_om + offs_n[:, None]
        if SPLIT:
            tile_offs = offs_m[None, :] * N + offs_n[:, None]
            tl.store(ws_ptr + pid_k * (M * N) + tile_offs, acc, mask=out_mask)
            tl.debug_barrier()
            ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == n_splits - 1:
                total = tl.load(ws_ptr + tile_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
                for r in range(1, n_splits):
                    total += tl.load(ws_ptr + r * (M * N) + tile_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + out_offs, total if OUT_FP32 else _to_bf16_rne(total), mask=out_mask)
                tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        else:
            tl.store(out_ptr + out_offs, acc if OUT_FP32 else _to_bf16_rne(acc), mask=out_mask)

    @triton.jit
    def _quant_linear_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        ws_ptr,
        count_ptr,
        M,
        N,
        n_groups,
        groups_per_split,
        n_splits,
        stride_xm,
        stride_wn,
        stride_sn,
        stride_om,
        IS_FP4: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        GROUPS_PER_ITER: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PTX_DECODE: tl.constexpr,
        OUT_FP32: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        m_ok = offs_m < M
        # K counted in groups of 32: offsets are then products (g * 32, g * 16 bytes), whose
        # alignment the compiler sees, so the weight loads vectorise (a `k // 2` would hide it)
        g_lo = pid_k * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, n_groups)

        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        gj = tl.arange(0, GROUPS_PER_ITER)
        x_rows = x_ptr + offs_m[None, None, :] * stride_xm  # [1, 1, BM]
        w_rows = w_ptr + offs_n[:, None, None] * stride_wn  # [BN, 1, 1]
        for g0 in range(g_lo, g_hi, GROUPS_PER_ITER):
            # one tile of GROUPS_PER_ITER groups of 32 K: [G, 32, BM] activations, [BN, G, 32]
            # weights; the last tile of a range may overrun it (masked: zero products)
            gi = g0 + gj
            g_ok = gi < g_hi
            x_mask = g_ok[:, None, None] & m_ok[None, None, :]
            w_mask = n_ok[:, None, None] & g_ok[None, :, None]
            s_mask = n_ok[:, None] & g_ok[None, :]
            if IS_FP4:
                # the activation split into even / odd K, matching the low / high nibbles
                j = tl.arange(0, 16)
                x_lo = x_rows + (gi * 32)[:, None, None] + (2 * j)[None, :, None]  # [G, 16, 1]
                x_even = tl.load(x_lo, mask=x_mask, other=0.0).to(tl.float32)
                x_odd = tl.load(x_lo + 1, mask=x_mask, other=0.0).to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))
                scale, inv_scale = _pow2_scale(amax)  # [G, BM]
                xq_even = tl.reshape(_fake_quant_groups(x_even, scale, inv_scale), (GROUPS_PER_ITER * 16, BLOCK_M))
                xq_odd = tl.reshape(_fake_quant_groups(x_odd, scale, inv_scale), (GROUPS_PER_ITER * 16, BLOCK_M))

                packed = tl.load(w_rows + (gi * 16)[None, :, None] + j[None, None, :], mask=w_mask, other=0)
                s_byte = _scale_bytes(s_ptr, offs_n, gi, stride_sn, s_mask, IS_FP4)
                w_lo, w_hi = _fp4_tile(packed, s_byte, PTX_DECODE, BLOCK_N, GROUPS_PER_ITER)
                acc += _dot(tl.reshape(w_lo, (BLOCK_N, GROUPS_PER_ITER * 16)), xq_even, DOT_FP32)
                acc += _dot(tl.reshape(w_hi, (BLOCK_N, GROUPS_PER_ITER * 16)), xq_odd, DOT_FP32)
            else:
                kk = tl.arange(0, 32)
                x_t = tl.load(x_rows + (gi * 32)[:, None, None] + kk[None, :, None], mask=x_mask, other=0.0)
                x_t = x_t.to(tl.float32)
                scale, inv_scale = _pow2_scale(tl.max(tl.abs(x_t), axis=1))  # [G, BM]
                xq = tl.reshape(_fake_quant_groups(x_t, scale, inv_scale), (GROUPS_PER_ITER * 32, BLOCK_M))

                w8 = tl.load(w_rows + (gi * 32)[None, :, None] + kk[None, None, :], mask=w_mask, other=0)
                s_byte = _scale_bytes(s_ptr, offs_n, gi, stride_sn, s_mask, IS_FP4)
                w = _fp8_tile(w8, s_byte, PTX_DECODE, BLOCK_N, GROUPS_PER_ITER)
                acc += _dot(tl.reshape(w, (BLOCK_N, GROUPS_PER_ITER * 32)), xq, DOT_FP32)

        _store_tile(acc, offs_n, offs_m, n_ok, m_ok, pid_m * tl.num_programs(0) + pid_n, pid_k, M, N, n_splits,
                    out_ptr, ws_ptr, count_ptr, stride_om, SPLIT, OUT_FP32)

    @triton.jit
    def _quant_gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        ws_ptr,
        count_ptr,
        M,
        N,
        n_groups,
        groups_per_split,
        n_splits,
        stride_xm,
        stride_wn,
        stride_sn,
        stride_om,
        IS_FP4: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUPS_PER_ITER: tl.constexpr,
        PTX_DECODE: tl.constexpr,
        OUT_FP32: tl.constexpr,
    ):
        # program (n_block, k_split, row): one activation row, no tensor cores. Each loop step
        # multiplies the dequantized weight tile [BLOCK_N, G, 32] (fp4: its even and odd halves,
        # [BLOCK_N, G, 16] each) by the row's fake-quantized
        # values elementwise (exact fp32 products) and adds them into a tile of fp32 sums of the
        # same shape; the tile is summed once, after the loop
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        row = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        g_lo = pid_k * groups_per_split
        g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
        gj = tl.arange(0, GROUPS_PER_ITER)
        x_row = x_ptr + row * stride_xm
        w_rows = w_ptr + offs_n[:, None, None] * stride_wn  # [BN, 1, 1]
        if IS_FP4:
            acc = tl.zeros([BLOCK_N, GROUPS_PER_ITER, 16], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, GROUPS_PER_ITER, 32], dtype=tl.float32)
        for g0 in range(g_lo, g_hi, GROUPS_PER_ITER):
            gi = g0 + gj
            g_ok = gi < g_hi
            w_mask = n_ok[:, None, None] & g_ok[None, :, None]
            s_mask = n_ok[:, None] & g_ok[None, :]
            if IS_FP4:
                j = tl.arange(0, 16)
                x_lo = x_row + (gi * 32)[:, None] + (2 * j)[None, :]  # [G, 16]
                x_even = tl.load(x_lo, mask=g_ok[:, None], other=0.0).to(tl.float32)
                x_odd = tl.load(x_lo + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))
                scale, inv_scale = _pow2_scale(amax)  # [G]
                xq_even = _fake_quant_scaled(x_even, scale[:, None], inv_scale[:, None]).to(tl.float32)
                xq_odd = _fake_quant_scaled(x_odd, scale[:, None], inv_scale[:, None]).to(tl.float32)
                packed = tl.load(w_rows + (gi * 16)[None, :, None] + j[None, None, :], mask=w_mask, other=0)
                s_byte = _scale_bytes(s_ptr, offs_n, gi, stride_sn, s_mask, IS_FP4)
                w_lo, w_hi = _fp4_tile(packed, s_byte, PTX_DECODE, BLOCK_N, GROUPS_PER_ITER)
                acc += w_lo.to(tl.float32) * xq_even[None, :, :]
                acc += w_hi.to(tl.float32) * xq_odd[None, :, :]
            else:
                kk = tl.arange(0, 32)
                x_t = tl.load(x_row + (gi * 32)[:, None] + kk[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
                scale, inv_scale = _pow2_scale(tl.max(tl.abs(x_t), axis=1))  # [G]
                xq = _fake_quant_scaled(x_t, scale[:, None], inv_scale[:, None]).to(tl.float32)
                w8 = tl.load(w_rows + (gi * 32)[None, :, None] + kk[None, None, :], mask=w_mask, other=0)
                s_byte = _scale_bytes(s_ptr, offs_n, gi, stride_sn, s_mask, IS_FP4)
                acc += _fp8_tile(w8, s_byte, PTX_DECODE, BLOCK_N, GROUPS_PER_ITER).to(tl.float32) * xq[None, :, :]
        total = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]  # [BN, 1]
        offs_m = row + tl.arange(0, 1)
        _store_tile(total, offs_n, offs_m, n_ok, offs_m < M, row * tl.num_programs(0) + pid_n, pid_k, M, N,
                    n_splits, out_ptr, ws_ptr, count_ptr, stride_om, SPLIT, OUT_FP32)


_TILE_COUNTERS: dict[tuple, torch.Tensor] = {}


def _tile_counters(device: torch.device) -> torch.Tensor:
    """The split-launch tile counters of `device`'s current stream: int32 ``[MAX_SPLIT_TILES]``,
    zero between launches (each launch's last program resets its tile's). Made by the stream's
    first split launch; inside a CUDA-graph capture that is a memset node of the graph, its memory
    the capture's (kept while these counters are), so every replay starts from zeros."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    key = (device.type, device.index, stream)
    counters = _TILE_COUNTERS.get(key)
    if counters is None:
        counters = _TILE_COUNTERS.setdefault(key, torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device))
    return counters


def _row_blocks(m: int, gemv: bool) -> int:
    # programs along the rows: one per row for the GEMV, one per 16 rows for the tile kernel
    return m if gemv else triton.cdiv(m, _BLOCK_M)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(
    m: int, n: int, k: int, weight_dtype: str, device: torch.device, **overrides
) -> QuantLinearConfig:
    """Launch parameters for ``[m, k] x [n, k]^T`` on `device`.

    The tile kernel: 128 output features per program and 4 groups of 32 K per loop step (unless
    `overrides` set them; they may set any field of :class:`QuantLinearConfig`); K is split only
    when the N x M blocks alone give fewer than four programs per SM, into as many ranges as reach
    that (each of at least 4 groups of 32). At M = 1 on 132 SMs, N blocks x K ranges:
    (32768, 1280) 256 x 3; (5120, 8192) 40 x 13. On an H200 (`benchmarks/quant_linear.py
    --sweep`, graph-replayed, weights from HBM) these were within about 5% of the fastest
    configuration of each decode shape.

    The CUDA-core GEMV (``gemv``; one row, fp4 weights or fp8 ones of at most
    :data:`GEMV_MAX_FP8_WEIGHT` elements): 16 features per program, 4 (fp8) or 8 (fp4) groups
    per loop step, K split for about eight programs per SM; the ranges launched (each a whole
    number of loop steps): fp8 (1280, 5120) 80 x 14, (512, 5120) 32 x 20, (2304, 5120) 144 x 8,
    (5120, 2304) 320 x 4; fp4 (2304, 5120) 144 x 7, (5120, 2304) 320 x 3.

    Raises:
        QuantLinearError: an unknown `weight_dtype`.
    """
    if weight_dtype not in _WEIGHT_FORMATS:
        raise QuantLinearError(f"weight_dtype must be one of {_WEIGHT_FORMATS}, got {weight_dtype!r}")
    gemv = overrides.get("gemv", m <= GEMV_MAX_ROWS and (weight_dtype == "fp4" or n * k <= GEMV_MAX_FP8_WEIGHT))
    fields = {**(_GEMV_DEFAULTS[weight_dtype] if gemv else {}), **overrides, "gemv": gemv}
    block_n = fields.get("block_n", QuantLinearConfig.block_n)
    sms = 1  # the interpreter: a couple of programs
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    tiles = triton.cdiv(n, block_n) * _row_blocks(m, gemv)
    target = (_GEMV_PROGRAMS_PER_SM if gemv else _PROGRAMS_PER_SM) * sms
    split = 1
    if tiles < target:
        split = max(1, min(triton.cdiv(target, tiles), (k // GROUP) // _MIN_GROUPS_PER_SPLIT))
    return QuantLinearConfig(**{"split_k": split, **fields})


def _check_args(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, weight_dtype: str) -> tuple[int, int]:
    """Validates the operands; returns (N, K)."""
    if weight_dtype not in _WEIGHT_FORMATS:
        raise QuantLinearError(f"weight_dtype must be one of {_WEIGHT_FORMATS}, got {weight_dtype!r}")
    if x.dtype != torch.bfloat16:
        raise QuantLinearError(f"the quantized linear takes bfloat16 activations, got {x.dtype}")
    if x.dim() == 0:
        raise QuantLinearError("the activation must have a feature dimension, got a 0-d tensor")
    if weight.dim() != 2:
        raise QuantLinearError(f"the weight must be 2-D, got shape {tuple(weight.shape)}")
    if weight_dtype == "fp8":
        if weight.dtype != torch.float8_e4m3fn:
            raise QuantLinearError(f"an fp8 weight must be float8_e4m3fn, got {weight.dtype}")
        n, k = weight.shape
        expected_scale = (triton.cdiv(n, GROUP), triton.cdiv(k, GROUP))
    else:
        if weight.dtype not in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8):
            raise QuantLinearError(
                f"an fp4 weight must be float4_e2m1fn_x2 (or an int8/uint8 view), got {weight.dtype}"
            )
        n, k = weight.size(0), 2 * weight.size(1)
        expected_scale = (n, k // GROUP)
    if k % GROUP or k == 0:
        raise QuantLinearError(f"in_features {k} is not a positive multiple of the group size {GROUP}")
    if x.size(-1) != k:
        raise QuantLinearError(
            f"the activation has {x.size(-1)} features, the {weight_dtype} weight {tuple(weight.shape)} takes {k}"
        )
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise QuantLinearError(f"the weight scale must be float8_e8m0fnu (or a uint8 view), got {scale.dtype}")
    if tuple(scale.shape) != expected_scale:
        raise QuantLinearError(
            f"the {weight_dtype} weight {tuple(weight.shape)} needs a scale of shape {expected_scale}, "
            f"got {tuple(scale.shape)}"
        )
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        # copying would move the whole weight on every call, which is what this kernel avoids
        raise QuantLinearError("the weight and its scale must be contiguous along their last dimension")
    if not (x.device == weight.device == scale.device):
        raise QuantLinearError(
            f"activation, weight and scale must be on one device, got {x.device}, {weight.device}, {scale.device}"
        )
    return n, k


def _check_config(config: QuantLinearConfig) -> None:
    bn = config.block_n
    if bn < 16 or bn & (bn - 1):
        raise QuantLinearError(f"block_n must be a power of two >= 16, got {bn}")
    for name in ("groups_per_iter", "split_k", "num_warps", "num_stages"):
        if getattr(config, name) < 1:
            raise QuantLinearError(f"{name} must be >= 1, got {getattr(config, name)}")


@on_input_device
def quantized_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    weight_dtype: str,
    config: QuantLinearConfig | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``fake_quant_fp8(x) @ dequantized(weight, scale)^T`` without materialising the weight.

    Mirrors the fast path of `DeepseekV41Linear.forward` (the reference's `inference/model.py:
    linear()` with fp8 activations); equal to it up to the order of the fp32 additions (see the
    module docstring). Written for decode (a few rows); correct for any number of rows.

    Args:
        x: bf16 ``[..., K]``, K a multiple of 32; copied only if its rows are not contiguous.
        weight: ``"fp8"``: float8_e4m3fn ``[N, K]``; ``"fp4"``: float4_e2m1fn_x2 (or int8 / uint8)
            ``[N, K/2]``, the even K element in the low nibble. Rows contiguous.
        scale: float8_e8m0fnu (or uint8) ``[ceil(N/32), ceil(K/32)]`` for fp8, ``[N, K/32]`` for fp4.
        weight_dtype: ``"fp8"`` or ``"fp4"``.
        config: launch parameters; ``None``: :func:`default_config`.
        out_dtype: ``torch.bfloat16`` (the linear's output, rounded once), or ``torch.float32``:
            the fp32 sums before that rounding (a row-parallel share, added to the other ranks'
            before the one rounding).

    Returns:
        ``[..., N]`` in `out_dtype`, a new tensor on the device of `x`.

    Raises:
        QuantLinearError: wrong dtypes or shapes, K not a multiple of 32, tensors on different
            devices or not contiguous along K, a bad config (a split launch over more than
            :data:`MAX_SPLIT_TILES` output tiles, ``gemv`` over more than 65535 rows), Triton missing, or CPU tensors outside Triton's
            interpreter (``TRITON_INTERPRET=1`` before this module is imported).
    """
    n, k = _check_args(x, weight, scale, weight_dtype)
    interpreted = _kernel_is_interpreted()
    problem = unrunnable(x.device, interpreted, "the quantized-linear kernel")
    if problem is not None:
        raise QuantLinearError(problem)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    m = x2d.size(0)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise QuantLinearError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    config = default_config(m, n, k, weight_dtype, x.device) if config is None else config
    _check_config(config)

    groups = k // GROUP
    # each split a whole number of loop steps: only the last one can overrun K (masked)
    step = config.groups_per_iter
    groups_per_split = triton.cdiv(triton.cdiv(groups, config.split_k), step) * step
    n_splits = triton.cdiv(groups, groups_per_split)
    if config.gemv and m > _MAX_GRID_ROWS:
        raise QuantLinearError(f"the one-row kernel (gemv) takes at most {_MAX_GRID_ROWS} rows, got {m}")
    grid = (triton.cdiv(n, config.block_n), n_splits, _row_blocks(m, config.gemv))
    split = n_splits > 1
    if split:
        if grid[0] * grid[2] > MAX_SPLIT_TILES:
            raise QuantLinearError(
                f"a split-K launch takes at most {MAX_SPLIT_TILES} output tiles, this one has {grid[0] * grid[2]} "
                f"({m} rows x {n} features at block_n={config.block_n}): use a wider block_n or split_k=1"
            )
        workspace = torch.empty(n_splits, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device)
    else:
        workspace = counters = out  # not read
    args = (x2d, weight.view(torch.uint8), scale.view(torch.uint8), out, workspace, counters, m, n, groups,
            groups_per_split, n_splits, x2d.stride(0), weight.stride(0), scale.stride(0), out.stride(0))
    flags = dict(
        IS_FP4=weight_dtype == "fp4",
        SPLIT=split,
        BLOCK_N=config.block_n,
        GROUPS_PER_ITER=config.groups_per_iter,
        PTX_DECODE=not interpreted,  # `dequant`'s inline-PTX decodes (the interpreter cannot run PTX)
        OUT_FP32=out_dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if config.gemv:
        _quant_gemv_kernel[grid](*args, **flags)
    else:
        _quant_linear_kernel[grid](*args, BLOCK_M=_BLOCK_M, DOT_FP32=interpreted, **flags)
    return out.view(*lead, n)


__all__ = [
    "ENV_BACKEND",
    "GEMV_MAX_FP8_WEIGHT",
    "GEMV_MAX_ROWS",
    "GROUP",
    "MAX_SPLIT_TILES",
    "QUANT_LINEAR_MAX_ROWS",
    "QuantLinearConfig",
    "QuantLinearError",
    "default_config",
    "quantized_linear_triton",
    "resolve_quant_linear_backend",
    "use_quant_linear_kernel",
]
