"""Routed MoE experts of DeepSeek-V4.1 for a few token rows (decode), in four to five launches, no host sync.

Mirrors `inference/model.py: Expert.forward` and the routed half of `MoE.forward` for
``numerics="fast"`` (REFERENCE.md sections 8 and 21.11). For each (token t, slot j) pair with expert
``e = indices[t, j]`` and routing weight ``w = weights[t, j]`` (fp32)::

    g = bf16(fq(x_t) @ W1_e^T).float()        u = bf16(fq(x_t) @ W3_e^T).float()
    if swiglu_limit > 0:  u = clamp(u, -limit, limit);  g = clamp(g, max=limit)
    h = bf16(w * (silu(g) * u))                            # fp32 products, one rounding
    y = bf16(fq(h) @ W2_e^T)
    out[t] = sum over the k slots, in ascending expert id, of y.float()   (fp32, from 0)

``fq`` is the per-32 e4m3 activation fake-quant with power-of-two scales
(`quantization_deepseek_v41_vl.fake_quant_fp8`) for fp4 / fp8 experts and the identity for bf16
experts. The GEMMs accumulate exact products (fake-quantized activation x dequantized weight, both
exact in bf16) in fp32, so the result equals the module math (`DeepseekV41Expert.forward` behind
`DeepseekV41MoE._routed_grouped`) up to the fp32 summation order; a bf16 rounding of g, u, h or y
can then differ by one ulp where the fp32 sums straddle a rounding boundary.

Expert storage (read in place: the 3 x E parameters are not copied or stacked):

- ``"fp4"`` (the release): weight float4_e2m1fn_x2 ``[N, K/2]``, even element in the low nibble;
  scale float8_e8m0fnu ``[N, K/32]``;
- ``"fp8"``: weight float8_e4m3fn ``[N, K]``; scale float8_e8m0fnu ``[ceil(N/32), ceil(K/32)]``;
- ``"bf16"``: weight bf16 ``[N, K]``, no activation quantization.

Design (:func:`moe_experts_triton`):

1. **Pointer table** (`moe_expert_table.py`). :func:`build_expert_table` records, once, the byte (bf16: element) offset of
   every expert's w1/w3/w2 weight and scale from one base tensor (expert 0's w1 weight / scale),
   in an int64 ``[E, 6]`` tensor on the device. A program adds its expert's offset to the base
   pointer; this keeps Triton's 16-byte alignment facts for the base (the offsets are checked to
   be multiples of 16 elements), which a raw int-to-pointer cast would lose (that cast works
   too, interpreter included, but gives byte-wise weight loads). :class:`ExpertTableCache`
   rebuilds the table when the device, storage or the first / last expert's addresses change.
2. **x fake-quant launch** (quantized experts only): ``fq(x)`` once per token row, bf16.
3. **Gate-up launch**, grid ``(P, cdiv(I, BLOCK_N))`` over the ``P = T*k`` pairs in token-major
   order: program (p, n) works for expert ``e = ids[p]`` only if p is that expert's first pair
   (else it has nothing to do); it then takes all pairs of e (``BLOCK_M`` at a time, in pair
   order): with up to ``BLOCK_M`` (16) pairs on an expert each weight tile is read once per call;
   more pairs re-read it once per further ``BLOCK_M`` (identical decode rows share experts). The
   tile product is "swap-AB": ``W[BLOCK_N, K] @ fq(x)^T[K, BLOCK_M]``, weight rows on the MMA's M
   side (tokens are few). The epilogue rounds g and u to bf16 (ties to even, by bits), clamps,
   applies silu and the routing weight, rounds h to bf16 and, for quantized experts, applies the
   down projection's input fake-quant right there (a 32-group of h lies inside the program's
   ``BLOCK_N`` columns): it stores ``fq(h)`` bf16 ``[P, I]``.
4. **Down launch**, grid ``(P, cdiv(D, BLOCK_N))``, the same grouping, stores ``y`` bf16 ``[P, D]``.
5. **Combine launch**, grid ``(T, cdiv(D, BLOCK_D))``: per token, the k slots are visited in
   ascending expert id (repeated minimum) and added in fp32: ``out`` fp32 ``[T, D]``. No atomics;
   every output element is written by one program, so results are run-to-run deterministic.

**Split-K** (`_default_splits`: calls with few pairs have too few programs to keep the GPU's
memory busy): the gate-up and down grids get a third axis over ``S`` shares of the K blocks, each
program storing fp32 partial sums ``[S, P, parts, N]``; a finishing launch adds the gate-up
partials in split order and runs the same epilogue (`_gate_up_epilogue`), and the combine launch
adds the down partials in split order and rounds each y to bf16 before the slot sum. Still
deterministic; the fp32 sums are taken in another order than without splits, and since the split
counts (and the launch kind, below) follow the number of pairs, a row decoded alone may round a
bf16 bit apart from the same row in a larger batch.

**One token row** (``fma``, the default up to :data:`FMA_MAX_TOKENS` rows): a 16-pair MMA tile
would be nearly all padding; the gate-up and down programs instead take their expert's pairs one
at a time and multiply the decoded weight tile by the pair's row elementwise on the CUDA cores
(the same exact fp32 products), into an fp32 tile summed over K after the loop. Same grids,
split-K and epilogues. Many pairs on one expert are the tl.dot launches' case: they read each
weight tile once for up to ``BLOCK_M`` of them, these once per pair.

Two ways to multiply by quantized weights (``mma``): ``"scaled"`` hands the packed fp4 / fp8 bytes
and e8m0 scales to ``tl.dot_scaled`` (Triton's own upcast to bf16, then a bf16 MMA); ``"manual"``
decodes the codes to bf16 and calls ``tl.dot`` (fp4 on the GPU: integer and bf16x2 instructions,
`dequant.fp4_pairs_to_bf16_ptx`; elsewhere integer / float ops). Both compute the same
exact products. Triton's CPU interpreter gets both wrong for bf16 operands (``tl.dot`` outright,
``tl.dot_scaled`` by rounding the bf16 operand through fp16), so there the kernels multiply fp32
operands (exact), the "scaled" weight tile being decoded by ``tl.dot_scaled`` against the identity.

Nothing here synchronizes with the host or has a data-dependent shape: the launches can be
captured in a CUDA graph (build the table, i.e. run once, before capturing). Expert ids are not
range-checked (a check would cost a sync); an id outside ``[0, E)`` is clamped into it for the
address, giving a wrong but memory-safe result.

Backends of :func:`moe_experts`: ``"triton"``; ``"torch"`` (:func:`moe_experts_torch`, the expert
modules themselves, looped on the host); ``"auto"`` reads ``DEEPSEEK_V41_MOE_EXPERTS_BACKEND``,
then picks Triton for CUDA tensors. On the CPU the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1`` before Triton is imported).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

try:  # triton is optional: CPU-only installs use the torch fallback
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device
from .kernel_backend import resolve_backend as _resolve_backend
from .moe_expert_table import (  # noqa: F401 - the table's names, re-exported
    _FORMATS,
    QUANT_GROUP,
    ExpertTableCache,
    ExpertWeightTable,
    MoEExpertsError,
    build_expert_table,
    expert_table_key,
)

__all__ = [
    "ENV_BACKEND",
    "DEFAULT_MMA",
    "ENV_MMA",
    "FMA_MAX_TOKENS",
    "MMA_CHOICES",
    "KERNEL_MAX_PAIRS",
    "MAX_PAIRS",
    "ExpertTableCache",
    "ExpertWeightTable",
    "MoEExpertsError",
    "build_expert_table",
    "combine_slots",
    "default_tiles",
    "expert_table_key",
    "moe_experts",
    "moe_experts_torch",
    "moe_experts_triton",
    "resolve_moe_experts_backend",
    "use_moe_experts_kernel",
]

ENV_BACKEND = "DEEPSEEK_V41_MOE_EXPERTS_BACKEND"
# "scaled" or "manual": how quantized weights are multiplied. The model reads it once, into its
# numerics plan (`numerics_deepseek_v41_vl.KERNEL_OPTION_ENV`), and passes the plan's choice as `mma`;
# a direct call with ``mma=None`` reads it at call time.
ENV_MMA = "DEEPSEEK_V41_MOE_EXPERTS_MMA"
MMA_CHOICES = ("scaled", "manual")
# measured on an H200 (triton 3.6, benchmarks/moe_experts.py, CUDA graphs, before split-K):
# the manual decode reads the experts at 890-1240 GB/s with the PTX fp4 decode (710-850 with
# the portable one), the dot_scaled upcast at 510-610
DEFAULT_MMA = "manual"
# The kernels target decode: the MoE sends calls with more (token, slot) pairs to its grouped path
# (which reads expert counts on the host, so a step taking it cannot be a CUDA graph). 384 = a
# decode step of 64 rows at the release's top-6: batches up to 64 decode on the graph-safe path.
MAX_PAIRS = 384
# Hard limit of one call: every program scans all pair ids ([BLOCK_M, P] compares per member chunk).
KERNEL_MAX_PAIRS = 1024

def resolve_moe_experts_backend(backend: str | None, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for tensors on `device`; ``None`` / ``"auto"`` read
    ``DEEPSEEK_V41_MOE_EXPERTS_BACKEND`` first, then pick Triton on CUDA (`kernel_backend`).

    Raises:
        MoEExpertsError: an unknown backend name (argument or environment variable).
    """
    return _resolve_backend(backend, device, env_var=ENV_BACKEND, error=MoEExpertsError, what="MoE experts")


def use_moe_experts_kernel(x: torch.Tensor, indices: torch.Tensor, weight_dtype: str, backend: str | None = "auto") -> bool:
    """True when the routed experts of `x` ``[T, D]`` with `indices` ``[T, k]`` should run
    :func:`moe_experts_triton`: the backend resolves to Triton, the storage is one the kernels read
    (``"fp4"``, ``"fp8"``, ``"bf16"``), x is bf16 and ``T*k <= MAX_PAIRS``. Reads only shapes,
    dtypes and the device (no synchronisation).

    Raises:
        MoEExpertsError: an unknown backend name.
    """
    chosen = resolve_moe_experts_backend(backend, x.device)
    return (
        chosen == "triton"
        and weight_dtype in _FORMATS
        and x.dtype == torch.bfloat16
        and indices.numel() <= MAX_PAIRS
    )


# ---------------------------------------------------------------------------------------------
# torch fallback
# ---------------------------------------------------------------------------------------------
def _check_inputs(x, weights, indices, hidden: int | None = None) -> None:
    if x.dim() != 2:
        raise MoEExpertsError(f"x must be [T, D], got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise MoEExpertsError(f"x must be bfloat16, got {x.dtype}")
    if hidden is not None and x.size(1) != hidden:
        raise MoEExpertsError(f"x has {x.size(1)} features, the experts take {hidden}")
    if indices.dim() != 2 or indices.size(0) != x.size(0) or indices.size(1) == 0:
        raise MoEExpertsError(f"indices must be [T={x.size(0)}, k>=1], got shape {tuple(indices.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise MoEExpertsError(f"indices must be int64 (or int32), got {indices.dtype}")
    if weights.shape != indices.shape or weights.dtype != torch.float32:
        raise MoEExpertsError(
            f"weights must be float32 {tuple(indices.shape)}, got {weights.dtype} {tuple(weights.shape)}"
        )
    for name, t in (("weights", weights), ("indices", indices)):
        if t.device != x.device:
            raise MoEExpertsError(f"{name} is on {t.device}, x on {x.device}")


def moe_experts_torch(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: Sequence) -> torch.Tensor:
    """The routed experts through the expert modules themselves (host loop; for the CPU).

    Each expert used runs once on its rows (in token order); per token the outputs are added in
    fp32, in ascending expert id, from zero. With ``numerics="fast"`` modules this is the math the
    kernels reproduce. Reads the expert ids on the host (a sync on CUDA).

    Args:
        x: bf16 ``[T, D]``. weights: fp32 ``[T, k]``. indices: int64 ``[T, k]`` in ``[0, E)``.
        experts: sequence of ``E`` modules called as ``expert(x_rows, weights_rows[:, None])``.

    Returns:
        fp32 ``[T, D]``.

    Raises:
        MoEExpertsError: bad shapes / dtypes / devices, or an expert id outside ``[0, E)``.
    """
    _check_inputs(x, weights, indices)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.size(0) == 0:
        return out
    ids = indices.long()
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= len(experts):
        raise MoEExpertsError(f"expert ids must be in [0, {len(experts)}), got [{lo}, {hi}]")
    for e in torch.unique(ids).tolist():  # ascending: each row's sum runs in ascending expert id
        rows, slots = torch.where(ids == e)
        out[rows] += experts[e](x[rows], weights[rows, slots, None]).float()
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------
if triton is not None:
    from .dequant import e8m0_to_bf16, e8m0_to_fp32, fp4_pairs_to_bf16_ptx
    from .formats import BLOCK_TL, E4M3_MAX_TL

    @triton.jit
    def _round_bf16(v):
        # fp32 -> the fp32 value of the nearest bf16, ties to even (the interpreter's bf16 cast
        # truncates; on the GPU this equals cvt.rn.bf16.f32); NaN stays NaN
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def _group_amax(v, ROWS: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
        # max |v| over groups of GROUP consecutive columns: [ROWS, COLS] -> [ROWS, COLS // GROUP]
        return tl.max(tl.reshape(tl.abs(v), (ROWS, COLS // GROUP, GROUP)), axis=2)

    @triton.jit
    def _fake_quant_e4m3(v, amax, ROWS: tl.constexpr, COLS: tl.constexpr, GROUP: tl.constexpr):
        # `fake_quant_fp8` of fp32 v [ROWS, COLS] (bf16 values) with the groups' amax [ROWS, COLS // GROUP]:
        # s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) by the exponent bits, q = e4m3(clamp(v/s)),
        # returns q*s (exact in bf16) as fp32
        prod = tl.maximum(amax, 1e-4) * (1.0 / E4M3_MAX_TL)
        bits = prod.to(tl.int32, bitcast=True)
        expo = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (expo << 23).to(tl.float32, bitcast=True)
        inv_scale = ((254 - expo) << 23).to(tl.float32, bitcast=True)  # 1/s, exact: s is a power of 2
        q = tl.reshape(v, (ROWS, COLS // GROUP, GROUP)) * inv_scale[:, :, None]
        q = tl.minimum(tl.maximum(q, -E4M3_MAX_TL), E4M3_MAX_TL)
        # e4m3 round-to-nearest-even: 3 mantissa bits for |q| >= 2^-6; below, the subnormal step
        # 2^-9 is reached by rounding |q| + 2^-6 (in [2^-6, 2^-5): step 2^-9) and subtracting 2^-6
        mag = tl.abs(q)
        sub = mag < 0.015625
        t = tl.where(sub, mag + 0.015625, mag)
        tb = t.to(tl.uint32, bitcast=True)
        tb = ((tb + 0x7FFFF + ((tb >> 20) & 1)) >> 20) << 20
        r = tb.to(tl.float32, bitcast=True)
        r = tl.where(sub, r - 0.015625, r)
        # the sign from v's bits, as the e4m3 cast keeps it (-0.0 for negatives that round to 0)
        sign = (tl.reshape(v, (ROWS, COLS // GROUP, GROUP)).to(tl.uint32, bitcast=True) >> 31) << 31
        r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return tl.reshape(r * scale[:, :, None], (ROWS, COLS))

    @triton.jit
    def _fp4_to_f32(code):
        # E2M1 code (int32, bit 3 = sign) -> value: the code's bits placed as an fp16 (exponent
        # field = E2M1 exponent, mantissa msb = E2M1 mantissa) is E2M1 * 2^-14, subnormals included
        half = ((code & 7) << 9) | ((code & 8) << 12)
        return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0

    @triton.jit
    def _load_weight_tile(w_row_ptrs, s_row_ptrs, k0, FMT: tl.constexpr, MANUAL: tl.constexpr, PTX: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One weight tile for the K step starting at k0.
        # FMT 0 (bf16): (w [BLOCK_N, BLOCK_K] bf16, same)
        # FMT 1 (fp4), scaled: (packed bytes [BLOCK_N, BLOCK_K/2], e8m0 scales [BLOCK_N, BLOCK_K/32])
        # FMT 1, manual: (even columns [BLOCK_N, BLOCK_K/2] bf16, odd columns [BLOCK_N, BLOCK_K/2] bf16)
        # FMT 2 (fp8), scaled: (e4m3 bytes [BLOCK_N, BLOCK_K], e8m0 scales [BLOCK_N, BLOCK_K/32])
        # FMT 2, manual: (w [BLOCK_N, BLOCK_K] bf16, same)
        # (single return: Triton wants one return type even across constexpr branches)
        NG: tl.constexpr = BLOCK_K // BLOCK_TL
        g = tl.arange(0, NG)
        if FMT == 0:
            wa = tl.load(w_row_ptrs + k0 + tl.arange(0, BLOCK_K)[None, :])
            wb = wa
        elif FMT == 1:
            packed = tl.load(w_row_ptrs + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :])
            sc = tl.load(s_row_ptrs + k0 // BLOCK_TL + g[None, :])
            if MANUAL and PTX:
                s = e8m0_to_bf16(sc.to(tl.int32))[:, :, None]
                lo, hi = fp4_pairs_to_bf16_ptx(tl.reshape(packed, (BLOCK_N, NG, 16)), s)
                wa = tl.reshape(lo, (BLOCK_N, BLOCK_K // 2))
                wb = tl.reshape(hi, (BLOCK_N, BLOCK_K // 2))
            elif MANUAL:
                b = packed.to(tl.int32)
                s = e8m0_to_fp32(sc)[:, :, None]
                lo = tl.reshape(tl.reshape(_fp4_to_f32(b & 15), (BLOCK_N, NG, 16)) * s, (BLOCK_N, BLOCK_K // 2))
                hi = tl.reshape(tl.reshape(_fp4_to_f32(b >> 4), (BLOCK_N, NG, 16)) * s, (BLOCK_N, BLOCK_K // 2))
                wa = lo.to(tl.bfloat16)
                wb = hi.to(tl.bfloat16)
            else:
                wa = packed
                wb = sc
        else:
            raw = tl.load(w_row_ptrs + k0 + tl.arange(0, BLOCK_K)[None, :])
            sc = tl.load(s_row_ptrs + k0 // BLOCK_TL + g[None, :])
            if MANUAL:
                v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                s = e8m0_to_fp32(sc)[:, :, None]
                wa = tl.reshape(tl.reshape(v, (BLOCK_N, NG, BLOCK_TL)) * s, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
                wb = wa
            else:
                wa = raw
                wb = sc
        return wa, wb

    @triton.jit
    def _weight_dot(acc, wa, wb, xa_t, xb_t, FMT: tl.constexpr, MANUAL: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        # acc [BLOCK_N, BLOCK_M] += W_tile @ x_tile^T with the pieces of `_load_weight_tile`; for
        # fp4-manual xa_t / xb_t are the even / odd K columns of x^T, otherwise xa_t is all of x^T.
        # UPCAST_DOT (the interpreter, whose bf16 tl.dot is wrong): fp32 operands, exact here.
        if FMT == 1 and MANUAL:
            if UPCAST_DOT:
                acc += tl.dot(wa.to(tl.float32), xa_t.to(tl.float32))
                acc += tl.dot(wb.to(tl.float32), xb_t.to(tl.float32))
            else:
                acc += tl.dot(wa, xa_t)
                acc += tl.dot(wb, xb_t)
        elif FMT == 0 or MANUAL:
            if UPCAST_DOT:
                acc += tl.dot(wa.to(tl.float32), xa_t.to(tl.float32))
            else:
                acc += tl.dot(wa, xa_t)
        else:
            if FMT == 1:
                fmt: tl.constexpr = "e2m1"
            else:
                fmt: tl.constexpr = "e4m3"
            if UPCAST_DOT:
                # the interpreter's dot_scaled passes a bf16 operand through fp16 (it loses tiny and
                # huge activations); decode the weight tile with dot_scaled against the identity
                # (one exact product per output) and multiply in fp32. On the GPU the bf16 operand
                # goes to the MMA unchanged (checked in the TTGIR: fp4_to_fp, scale, wgmma).
                eye = tl.where(tl.arange(0, BLOCK_K)[:, None] == tl.arange(0, BLOCK_K)[None, :], 1.0, 0.0)
                w_dec = tl.dot_scaled(wa, wb, fmt, eye.to(tl.bfloat16), None, "bf16")
                acc += tl.dot(w_dec, xa_t.to(tl.float32))
            else:
                acc = tl.dot_scaled(wa, wb, fmt, xa_t, None, "bf16", acc)
        return acc

    @triton.jit
    def _load_act_t(a_ptr, row_off, valid, k0, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # The (already fake-quantized) bf16 activation tile of the K step at k0, transposed for the
        # swap-AB product: [BLOCK_K, BLOCK_M] twice, or with SPLIT (fp4-manual) its even and odd
        # K columns, [BLOCK_K/2, BLOCK_M] each. Rows that are not valid read 0.
        if SPLIT:
            ptrs = a_ptr + row_off[:, None] + k0 + 2 * tl.arange(0, BLOCK_K // 2)[None, :]
            xa_t = tl.trans(tl.load(ptrs, mask=valid[:, None], other=0.0))
            xb_t = tl.trans(tl.load(ptrs + 1, mask=valid[:, None], other=0.0))
        else:
            ptrs = a_ptr + row_off[:, None] + k0 + tl.arange(0, BLOCK_K)[None, :]
            xa_t = tl.trans(tl.load(ptrs, mask=valid[:, None], other=0.0))
            xb_t = xa_t
        return xa_t, xb_t

    @triton.jit
    def _load_act_row(a_ptr, row_off, valid, k0, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
        # The CUDA-core variant's activation: one pair's row (row_off, valid: [1]) of the K step at
        # k0 as fp32 [1, BLOCK_K] twice, or with SPLIT (fp4) its even and odd K columns
        # [1, BLOCK_K/2]
        if SPLIT:
            ptrs = a_ptr + row_off[:, None] + k0 + 2 * tl.arange(0, BLOCK_K // 2)[None, :]
            xa = tl.load(ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
            xb = tl.load(ptrs + 1, mask=valid[:, None], other=0.0).to(tl.float32)
        else:
            ptrs = a_ptr + row_off[:, None] + k0 + tl.arange(0, BLOCK_K)[None, :]
            xa = tl.load(ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
            xb = xa
        return xa, xb

    @triton.jit
    def _weight_fma(acc, wa, wb, xa, xb, FMT: tl.constexpr):
        # acc [BLOCK_N, ACC_K] += the decoded tile (`_load_weight_tile`, manual) times one row,
        # elementwise: exact fp32 products, summed over K after the loop
        acc += wa.to(tl.float32) * xa
        if FMT == 1:
            acc += wb.to(tl.float32) * xb
        return acc

    @triton.jit
    def _fake_quant_rows_kernel(x_ptr, out_ptr, D, stride_x, BLOCK_G: tl.constexpr):
        # out[t] = fake_quant_fp8(x[t]) for one token row and BLOCK_G groups of 32 columns
        t = tl.program_id(0).to(tl.int64)
        groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        cols = groups[:, None] * BLOCK_TL + tl.arange(0, BLOCK_TL)[None, :]
        ok = cols < D
        v = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        q = _fake_quant_e4m3(v, _group_amax(v, BLOCK_G, BLOCK_TL, BLOCK_TL), BLOCK_G, BLOCK_TL, BLOCK_TL)
        tl.store(out_ptr + t * D + cols, q.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _moe_expert_gemm_kernel(
        a_ptr,  # bf16 activations: gate-up x [T, K]; down h [P, K]
        ids_ptr,  # int64 / int32 [P] expert of each (token, slot) pair, token-major
        rw_ptr,  # fp32 [P] routing weights (gate-up only)
        w_base,  # weight base: uint8 (fp4 / fp8) or bf16
        s_base,  # uint8 scale base (unused for bf16)
        offs_ptr,  # int64 [E, 6] offsets from the bases
        out_ptr,  # bf16 [P, N]; with SPLITS > 1 fp32 partial sums [SPLITS, P, 2 (gate-up) or 1, N]
        n_pairs,
        n_experts,
        N,
        K,
        stride_a,
        w_row_stride,  # elements of w_base per weight row
        s_row_stride,  # bytes per scale row
        limit,
        GATE_UP: tl.constexpr,
        TOP_K: tl.constexpr,
        FMT: tl.constexpr,
        MANUAL: tl.constexpr,
        HAS_LIMIT: tl.constexpr,
        ALIGNED: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        PTX_DECODE: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr,
        FMA: tl.constexpr,
        ACC_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_blk = tl.program_id(1)
        split = tl.program_id(2)
        # this program's expert and all pairs routed to it; only the expert's first pair's
        # programs work, the others leave (n_members = 0)
        pairs = tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + pairs, mask=pairs < n_pairs, other=-1).to(tl.int32)
        expert = tl.load(ids_ptr + pid).to(tl.int32)
        same = (ids == expert).to(tl.int32)
        n_before = tl.sum(tl.where(pairs < pid, same, 0))
        n_members = tl.where(n_before == 0, tl.sum(same), 0)
        rank = tl.cumsum(same, axis=0) - same  # position of each pair among the expert's pairs
        e = tl.minimum(tl.maximum(expert, 0), n_experts - 1).to(tl.int64)  # memory safety only

        rows_n = n_blk * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_ld = tl.minimum(rows_n, N - 1).to(tl.int64)  # unmasked loads; the store is masked
        if GATE_UP:
            wa_off = tl.load(offs_ptr + e * 6 + 0)
            wb_off = tl.load(offs_ptr + e * 6 + 1)
            sa_off = tl.load(offs_ptr + e * 6 + 3)
            sb_off = tl.load(offs_ptr + e * 6 + 4)
        else:
            wa_off = tl.load(offs_ptr + e * 6 + 2)
            wb_off = wa_off
            sa_off = tl.load(offs_ptr + e * 6 + 5)
            sb_off = sa_off
        if ALIGNED:
            wa_off = tl.multiple_of(wa_off, 16)
            wb_off = tl.multiple_of(wb_off, 16)
        if FMT == 2:
            s_rows = (rows_ld // BLOCK_TL) * s_row_stride  # one fp8 scale per 32 x 32 block
        else:
            s_rows = rows_ld * s_row_stride
        wa_rows = w_base + wa_off + rows_ld[:, None] * w_row_stride
        wb_rows = w_base + wb_off + rows_ld[:, None] * w_row_stride
        sa_rows = s_base + sa_off + s_rows[:, None]
        sb_rows = s_base + sb_off + s_rows[:, None]

        slots = tl.arange(0, BLOCK_M)
        for m0 in range(0, n_members, BLOCK_M):
            pick = (same[None, :] != 0) & (rank[None, :] == (m0 + slots)[:, None])  # [BLOCK_M, BLOCK_P]
            valid = tl.sum(pick.to(tl.int32), axis=1) > 0
            pair = tl.sum(tl.where(pick, pairs[None, :], 0), axis=1)
            if GATE_UP:
                row_off = (pair // TOP_K).to(tl.int64) * stride_a
            else:
                row_off = pair.to(tl.int64) * stride_a
            # split-K: this program's share of the K blocks (all of them without splits)
            k_blocks = K // BLOCK_K
            k_lo = (split * k_blocks // SPLITS) * BLOCK_K
            k_hi = ((split + 1) * k_blocks // SPLITS) * BLOCK_K
            if FMA:
                # one pair at a time (BLOCK_M == 1), no tensor cores: the decoded weight tile times
                # the row, elementwise, into [BLOCK_N, ACC_K] fp32 sums, summed over K at the end
                sum_a = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
                sum_b = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    xa, xb = _load_act_row(a_ptr, row_off, valid, k0, FMT == 1, BLOCK_K)
                    w0, w1 = _load_weight_tile(wa_rows, sa_rows, k0, FMT, True, PTX_DECODE, BLOCK_N, BLOCK_K)
                    sum_a = _weight_fma(sum_a, w0, w1, xa, xb, FMT)
                    if GATE_UP:
                        w0, w1 = _load_weight_tile(wb_rows, sb_rows, k0, FMT, True, PTX_DECODE, BLOCK_N, BLOCK_K)
                        sum_b = _weight_fma(sum_b, w0, w1, xa, xb, FMT)
                acc_a = tl.sum(sum_a, axis=1)[:, None]
                acc_b = tl.sum(sum_b, axis=1)[:, None]
            else:
                acc_a = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc_b = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    xa_t, xb_t = _load_act_t(a_ptr, row_off, valid, k0, FMT == 1 and MANUAL, BLOCK_M, BLOCK_K)
                    w0, w1 = _load_weight_tile(wa_rows, sa_rows, k0, FMT, MANUAL, PTX_DECODE, BLOCK_N, BLOCK_K)
                    acc_a = _weight_dot(acc_a, w0, w1, xa_t, xb_t, FMT, MANUAL, UPCAST_DOT, BLOCK_K)
                    if GATE_UP:
                        w0, w1 = _load_weight_tile(wb_rows, sb_rows, k0, FMT, MANUAL, PTX_DECODE, BLOCK_N, BLOCK_K)
                        acc_b = _weight_dot(acc_b, w0, w1, xa_t, xb_t, FMT, MANUAL, UPCAST_DOT, BLOCK_K)
            store_ok = valid[:, None] & (rows_n < N)[None, :]
            if SPLITS > 1:
                # fp32 partial sums; the finishing launch adds the splits in order
                parts: tl.constexpr = 2 if GATE_UP else 1
                part_ptrs = out_ptr + ((split * n_pairs + pair.to(tl.int64)) * parts)[:, None] * N + rows_n[None, :]
                tl.store(part_ptrs, tl.trans(acc_a), mask=store_ok)
                if GATE_UP:
                    tl.store(part_ptrs + N, tl.trans(acc_b), mask=store_ok)
            else:
                if GATE_UP:
                    rw = tl.load(rw_ptr + pair, mask=valid, other=0.0)
                    res = _gate_up_epilogue(tl.trans(acc_a), tl.trans(acc_b), rw[:, None], limit, FMT, HAS_LIMIT,
                                            BLOCK_M, BLOCK_N)
                else:
                    res = tl.trans(_round_bf16(acc_a))
                out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * N + rows_n[None, :]
                tl.store(out_ptrs, res.to(tl.bfloat16), mask=store_ok)

    @triton.jit
    def _gate_up_epilogue(acc_g, acc_u, rw, limit, FMT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                          ROWS: tl.constexpr, COLS: tl.constexpr):
        # fp32 sums g, u [ROWS pairs, COLS] and routing weights rw [ROWS, 1] -> h (fp32 holding bf16
        # values), fake-quantized for quantized experts: a 32-group of h lies inside the COLS
        # columns (a multiple of 32), so the down projection's input quantization is done here
        gate = _round_bf16(acc_g)  # the linears' bf16 outputs, then .float()
        up = _round_bf16(acc_u)
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up  # silu(g) * u, as torch
        res = _round_bf16(rw * act)
        if FMT != 0:
            res = _fake_quant_e4m3(res, _group_amax(res, ROWS, COLS, BLOCK_TL), ROWS, COLS, BLOCK_TL)
        return res

    @triton.jit
    def _gate_up_finish_kernel(part_ptr, rw_ptr, out_ptr, n_pairs, N, limit, FMT: tl.constexpr,
                               HAS_LIMIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        # split-K gate-up: h[p, cols] from the partial sums of g and u, splits added in order
        p = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = cols < N
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            row = part_ptr + ((sp * n_pairs + p) * 2) * N + cols
            acc_g += tl.load(row, mask=ok, other=0.0)
            acc_u += tl.load(row + N, mask=ok, other=0.0)
        rw = tl.load(rw_ptr + p)
        res = _gate_up_epilogue(acc_g[None, :], acc_u[None, :], rw, limit, FMT, HAS_LIMIT, 1, BLOCK_N)
        tl.store(out_ptr + p * N + cols[None, :], res.to(tl.bfloat16), mask=ok[None, :])

    @triton.jit
    def _moe_combine_kernel(y_ptr, ids_ptr, shared_ptr, out_ptr, D, n_pairs, TOP_K: tl.constexpr, BLOCK_S: tl.constexpr,
                            BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, HAS_SHARED: tl.constexpr):
        # out[t] = sum of y[t*k + slot] over the slots in ascending expert id, fp32, from 0; with
        # SPLITS > 1 y_ptr holds the down launch's fp32 partials [SPLITS, P, D] and each y is their
        # sum (splits in order) rounded to bf16, as the unsplit launch stores it. HAS_SHARED: then
        # + shared[t] (bf16, widened) and the bf16 rounding, stored as bf16
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        slots = tl.arange(0, BLOCK_S)
        ids = tl.load(ids_ptr + t * TOP_K + slots, mask=slots < TOP_K, other=2147483647).to(tl.int32)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for _ in tl.static_range(TOP_K):
            lowest = tl.min(ids, axis=0)
            slot = tl.min(tl.where(ids == lowest, slots, BLOCK_S), axis=0)
            if SPLITS > 1:
                y = tl.zeros((BLOCK_D,), dtype=tl.float32)
                for sp in tl.static_range(SPLITS):
                    y += tl.load(y_ptr + (sp * n_pairs + t * TOP_K + slot) * D + cols, mask=col_ok, other=0.0)
                acc += _round_bf16(y)
            else:
                acc += tl.load(y_ptr + (t * TOP_K + slot) * D + cols, mask=col_ok, other=0.0).to(tl.float32)
            ids = tl.where(slots == slot, 2147483647, ids)
        if HAS_SHARED:
            acc += tl.load(shared_ptr + t * D + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * D + cols, _round_bf16(acc).to(tl.bfloat16), mask=col_ok)
        else:
            tl.store(out_ptr + t * D + cols, acc, mask=col_ok)


def _kernels_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_moe_expert_gemm_kernel)


def _default_mma() -> str:
    choice = (os.environ.get(ENV_MMA) or "").lower()
    if choice in MMA_CHOICES:
        return choice
    if choice:
        raise MoEExpertsError(f"{ENV_MMA} must be 'scaled' or 'manual', got {choice!r}")
    return DEFAULT_MMA


# (BLOCK_N, BLOCK_K, num_warps, num_stages) per launch; the interpreter uses small tiles (speed)
_GPU_CONFIG = {"gate_up": (64, 128, 4, 3), "down": (64, 128, 4, 3)}
# Token rows up to which the launches multiply on the CUDA cores, one pair at a time (``fma``),
# and their tiles on the GPU. Measured on an H100 (`benchmarks/moe_experts.py`-style graph replay
# over disjoint expert sets, release width, fp4, top-6): one row 105.7 us with the tl.dot launches,
# 86.9 us with these tiles; 64 rows 5.71 ms with tl.dot, 7.14 ms on the CUDA cores
FMA_MAX_TOKENS = 1
_GPU_FMA_CONFIG = {"gate_up": (32, 256, 4, 1), "down": (16, 256, 2, 1)}
_INTERPRET_CONFIG = {"gate_up": (32, 32, 1, 1), "down": (16, 32, 1, 1)}


def default_tiles(fma: bool, interpret: bool = False) -> dict:
    """The launches' default ``{"gate_up": (BLOCK_N, BLOCK_K, num_warps, num_stages), "down": ...}``:
    the CUDA-core ones (`fma`) or the tl.dot ones on the GPU, small tiles in the interpreter."""
    return _INTERPRET_CONFIG if interpret else _GPU_FMA_CONFIG if fma else _GPU_CONFIG


def _block_k(k: int, want: int) -> int:
    block = want
    while k % block:
        block //= 2
    return block


@on_input_device
def moe_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    table: ExpertWeightTable,
    mma: str | None = None,
    config: dict | None = None,
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts in four Triton launches (three for bf16 experts; one more when the
    gate-up launch is split: module docstring), no host sync.

    Args:
        x: bf16 ``[T, D]`` token rows (any row stride, unit column stride).
        weights: fp32 ``[T, k]`` routing weights. indices: int64 ``[T, k]`` expert ids in
            ``[0, E)`` (not checked: see the module docstring). An id may repeat within a row: each
            slot is its own pair (tensor parallelism gives the other ranks' slots weight 0 on expert 0).
        table: from :func:`build_expert_table` / :class:`ExpertTableCache`, on x's device.
        mma: ``"scaled"`` (``tl.dot_scaled``), ``"manual"``, or None: ``DEEPSEEK_V41_MOE_EXPERTS_MMA``,
            else ``"manual"`` (the faster on an H200: `_default_mma`). Ignored for bf16 experts.
        config: per launch ``{"gate_up": (BLOCK_N, BLOCK_K, num_warps, num_stages), "down": (...),
            "block_m": 16}`` overrides (benchmarks sweep these); BLOCK_K is halved until it divides K.
            ``fma`` (a bool; default: at most :data:`FMA_MAX_TOKENS` token rows and no
            ``block_m`` above 1 given) multiplies on the
            CUDA cores, one pair at a time (``block_m`` 1), the weight tiles decoded as for
            ``"manual"`` whatever `mma` says; without it the tiles go to ``tl.dot``.
            ``block_m`` (pairs of one expert per MMA, a power of 2) must be >= 16 on the GPU;
            ``ptx_decode`` (a bool; default: on the GPU) picks the inline-PTX fp4 decode for
            ``"manual"`` and ``fma``; ``splits`` (``{"gate_up": S, "down": S}``, ints >= 1, capped at the
            launch's K blocks; default `_default_splits`) splits each launch along K.
        shared: bf16 ``[T, D]`` or None: the shared expert's output, added by the combine launch
            (`MoE.forward`'s ``y += shared; y.to(bf16)`` in the same fp32 add and one rounding).
            Or a handle whose ``join()`` gives it, joined right before the combine launch (the
            decode step's CUDA graph computes the shared expert on a second stream, beside these
            launches).

    Returns:
        fp32 ``[T, D]``: the sum over each row's k experts, in ascending expert id; with `shared`,
        bf16 ``[T, D]``: that sum plus ``shared``, rounded.

    Raises:
        MoEExpertsError: Triton missing, CPU tensors without the interpreter, bad shapes / dtypes /
            devices, ``T*k`` above ``KERNEL_MAX_PAIRS`` (1024), a bad `config`, or an unknown `mma`.
    """
    if triton is None:
        raise MoEExpertsError("backend 'triton' needs the triton package, which is not installed")
    interpret = _kernels_interpreted()
    if not x.is_cuda and not interpret:
        raise MoEExpertsError(
            "backend 'triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported"
        )
    _check_inputs(x, weights, indices, table.hidden_size)
    if table.offsets.device != x.device:
        raise MoEExpertsError(f"the expert table is on {table.offsets.device}, x on {x.device}")
    mma = _default_mma() if mma is None else mma
    if mma not in MMA_CHOICES:
        raise MoEExpertsError(f"mma must be 'scaled' or 'manual', got {mma!r}")
    n_tokens, top_k = indices.shape
    n_pairs = n_tokens * top_k
    if n_pairs > KERNEL_MAX_PAIRS:
        raise MoEExpertsError(
            f"{n_pairs} (token, slot) pairs: the kernels are for decode-sized calls (<= {KERNEL_MAX_PAIRS})"
        )
    d, inter = table.hidden_size, table.intermediate_size
    if shared is not None and not hasattr(shared, "join"):  # a tensor: checked before any launch
        shared = _checked_shared(shared, n_tokens, d, x.device)

    def shared_now():  # the shared output, a handle joined right before the combine launch
        if hasattr(shared, "join"):
            return _checked_shared(shared.join(), n_tokens, d, x.device)
        return shared

    out = torch.empty(n_tokens, d, dtype=torch.float32 if shared is None else torch.bfloat16, device=x.device)
    if n_pairs == 0:
        return out if shared is None else out.copy_(shared_now())
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = indices.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    rw = weights.reshape(-1).contiguous()
    fmt = _FORMATS[table.fmt]
    given = config or {}
    fma = given.get("fma", n_tokens <= FMA_MAX_TOKENS and given.get("block_m", 1) == 1)
    if not isinstance(fma, bool):
        raise MoEExpertsError(f"fma must be a bool, got {fma!r}")
    config = {**default_tiles(fma, interpret), "splits": _default_splits(n_pairs, interpret),
              "block_m": 1 if fma else 16, **given}
    splits = config["splits"]
    if (
        not isinstance(splits, Mapping)
        or set(splits) != {"gate_up", "down"}
        or any(type(v) is not int or v < 1 for v in splits.values())  # bools are ints to isinstance
    ):
        raise MoEExpertsError(f"splits must map 'gate_up' and 'down' to ints >= 1, got {splits!r}")
    block_m = config["block_m"]
    if fma and block_m != 1:
        raise MoEExpertsError(f"the CUDA-core launches (fma) take one pair at a time: block_m must be 1, got {block_m!r}")
    if type(block_m) is not int or block_m < 1 or block_m & (block_m - 1) or (block_m < 16 and not (interpret or fma)):
        raise MoEExpertsError(f"block_m must be a power of 2 (>= 16 on the GPU), got {block_m!r}")
    block_p = max(16, triton.next_power_of_2(n_pairs))
    # fp4-manual on the GPU: the inline-PTX decode (`dequant.fp4_pairs_to_bf16_ptx`); False keeps
    # the portable integer / float decode the interpreter runs (benchmarks compare the two)
    ptx_decode = config.get("ptx_decode", not interpret)
    if not isinstance(ptx_decode, bool):
        raise MoEExpertsError(f"ptx_decode must be a bool, got {ptx_decode!r}")
    if ptx_decode and interpret:
        raise MoEExpertsError("ptx_decode needs the GPU: the Triton interpreter cannot run inline PTX")
    scale_base = table.scale_base if table.scale_base is not None else table.offsets  # dummy, never read
    common = dict(
        TOP_K=top_k,
        FMT=fmt,
        MANUAL=mma == "manual",
        HAS_LIMIT=table.swiglu_limit > 0,
        ALIGNED=table.aligned,
        UPCAST_DOT=interpret,
        PTX_DECODE=ptx_decode,
        BLOCK_P=block_p,
        BLOCK_M=block_m,
    )

    def launch(gate_up: bool, a, n, k):
        # -> (bf16 [P, n] output, 1), or for a split down launch (its fp32 partials, splits)
        block_n, block_k, warps, stages = config["gate_up" if gate_up else "down"]
        block_k = _block_k(k, block_k)
        if block_k < QUANT_GROUP:
            raise MoEExpertsError(f"K={k} has no block size >= {QUANT_GROUP} dividing it")
        if gate_up and block_n % QUANT_GROUP:
            raise MoEExpertsError(f"gate_up BLOCK_N={block_n} must be a multiple of {QUANT_GROUP} (h is quantized per 32)")
        if table.fmt == "fp4":
            w_row, s_row = k // 2, k // QUANT_GROUP
        elif table.fmt == "fp8":
            w_row, s_row = k, -(-k // QUANT_GROUP)
        else:
            w_row, s_row = k, 0
        n_split = min(splits["gate_up" if gate_up else "down"], k // block_k)
        out_t = torch.empty(n_pairs, n, dtype=torch.bfloat16, device=x.device) if gate_up or n_split == 1 else None
        if n_split > 1:  # fp32 partials, added up by the finishing launch (gate-up) or the combine
            parts = torch.empty(n_split, n_pairs, 2 if gate_up else 1, n, dtype=torch.float32, device=x.device)
        grid = (n_pairs, triton.cdiv(n, block_n), n_split)
        _moe_expert_gemm_kernel[grid](
            a, ids, rw, table.weight_base, scale_base, table.offsets, out_t if n_split == 1 else parts,
            n_pairs, table.n_experts, n, k, a.stride(0), w_row, s_row, float(table.swiglu_limit),
            GATE_UP=gate_up, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=n_split, num_warps=warps,
            num_stages=stages, FMA=fma, ACC_K=block_k // 2 if table.fmt == "fp4" else block_k, **common,
        )
        if n_split == 1:
            return out_t, 1
        if not gate_up:
            return parts, n_split  # the combine launch adds the splits
        _gate_up_finish_kernel[(n_pairs, triton.cdiv(n, block_n))](
            parts, rw, out_t, n_pairs, n, float(table.swiglu_limit), FMT=fmt, HAS_LIMIT=table.swiglu_limit > 0,
            SPLITS=n_split, BLOCK_N=block_n, num_warps=4,
        )
        return out_t, 1

    if fmt != 0:  # the gate-up input quantization, once per token row
        xq = torch.empty(n_tokens, d, dtype=torch.bfloat16, device=x.device)
        block_g = min(64, triton.next_power_of_2(d // QUANT_GROUP))
        _fake_quant_rows_kernel[(n_tokens, triton.cdiv(d // QUANT_GROUP, block_g))](
            x, xq, d, x.stride(0), BLOCK_G=block_g, num_warps=4
        )
        x = xq
    h, _ = launch(True, x, inter, d)
    y, y_splits = launch(False, h, d, inter)
    return _combine(y, ids, n_tokens, top_k, out, y_splits, shared_now())


def _checked_shared(shared: torch.Tensor, n_tokens: int, d: int, device: torch.device) -> torch.Tensor:
    if shared.dtype != torch.bfloat16 or shared.shape != (n_tokens, d) or shared.device != device:
        raise MoEExpertsError(
            f"shared must be bf16 [{n_tokens}, {d}] on {device}, got {shared.dtype} {tuple(shared.shape)} on {shared.device}"
        )
    return shared.contiguous()


def _default_splits(n_pairs: int, interpret: bool) -> dict:
    # split-K of each launch (the K blocks shared out among more programs). Measured on an H200
    # (benchmarks/moe_experts.py --split-sweep, CUDA graphs, release width, fp4, the tl.dot
    # launches): 6 pairs 0.124 -> 0.101 ms at (4, 2); 48 pairs 0.892 -> 0.880 at (2, 1); 384 pairs
    # 6.67 -> 5.68 at (2, 1). The one-row CUDA-core launches on an H100 (before their gate-up
    # tile's tuning): 96.7 us at (4, 2), 93.6 at the best of (2..8, 1..4), (8, 1)
    if interpret:
        return {"gate_up": 1, "down": 1}
    if n_pairs <= 16:
        return {"gate_up": 4, "down": 2}
    return {"gate_up": 2, "down": 1}


@on_input_device
def _combine(y, ids, n_tokens, top_k, out, splits: int = 1, shared=None):
    # y: bf16 [P, D], or with splits the down launch's fp32 partials [splits, P, 1, D]; out fp32,
    # or bf16 with `shared` (bf16 [T, D], contiguous) added before the rounding
    d = y.size(-1)
    block_d = min(1024, triton.next_power_of_2(d))
    _moe_combine_kernel[(n_tokens, triton.cdiv(d, block_d))](
        y, ids, out if shared is None else shared, out, d, n_tokens * top_k, TOP_K=top_k,
        BLOCK_S=max(2, triton.next_power_of_2(top_k)), BLOCK_D=block_d, SPLITS=splits,
        HAS_SHARED=shared is not None, num_warps=4,
    )
    return out


def combine_slots(y: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The last launch of :func:`moe_experts_triton` on its own: ``out[t] = sum over slots j, in
    ascending ``indices[t, j]``, of y[t*k + j].float()`` (fp32, from 0).

    Args:
        y: bf16 ``[T*k, D]``, one row per (token, slot) pair, token-major, contiguous.
        indices: int64 / int32 ``[T, k]`` expert ids (a repeated id: its slots in slot order).

    Returns:
        fp32 ``[T, D]``.

    Raises:
        MoEExpertsError: Triton unusable here, or shapes / dtypes that do not fit.
    """
    if triton is None or (not y.is_cuda and not _kernels_interpreted()):
        raise MoEExpertsError("combine_slots needs Triton on CUDA, or its interpreter (TRITON_INTERPRET=1)")
    if indices.dim() != 2 or indices.dtype not in (torch.int64, torch.int32) or indices.device != y.device:
        raise MoEExpertsError(f"indices must be int64 [T, k] on {y.device}, got {indices.dtype} {tuple(indices.shape)}")
    n_tokens, top_k = indices.shape
    if y.dim() != 2 or y.size(0) != n_tokens * top_k or y.dtype != torch.bfloat16 or not y.is_contiguous():
        raise MoEExpertsError(f"y must be contiguous bf16 [{n_tokens * top_k}, D], got {y.dtype} {tuple(y.shape)}")
    out = torch.empty(n_tokens, y.size(1), dtype=torch.float32, device=y.device)
    if n_tokens == 0 or top_k == 0:
        return out.zero_()
    return _combine(y, indices.reshape(-1).contiguous(), n_tokens, top_k, out)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: Sequence,
    cache: ExpertTableCache | None = None,
    backend: str | None = "auto",
) -> torch.Tensor:
    """Routed experts of a MoE for few rows: ``sum_j expert_{indices[t,j]}(x_t, weights[t,j])``.

    Mirrors the routed half of `inference/model.py: MoE.forward` (``numerics="fast"``).

    Args:
        x: bf16 ``[T, D]``. weights: fp32 ``[T, k]``. indices: int64 ``[T, k]``.
        experts: the ``E`` expert modules (`DeepseekV41Expert`).
        cache: where the Triton backend keeps its :class:`ExpertWeightTable` (a fresh one, built
            now, when None).
        backend: ``"triton"``, ``"torch"`` (:func:`moe_experts_torch`), ``"auto"`` / None
            (``DEEPSEEK_V41_MOE_EXPERTS_BACKEND``, else Triton on CUDA).

    Returns:
        fp32 ``[T, D]``.

    Raises:
        MoEExpertsError: as :func:`moe_experts_triton` / :func:`moe_experts_torch`, or an unknown
            backend.
    """
    if resolve_moe_experts_backend(backend, x.device) == "torch":
        return moe_experts_torch(x, weights, indices, experts)
    table = (cache or ExpertTableCache()).get(experts)
    return moe_experts_triton(x, weights, indices, table)
