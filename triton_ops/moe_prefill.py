"""Routed MoE experts of DeepSeek-V4.1 for many token rows (prefill): batched dequant + grouped GEMMs.

Mirrors `inference/model.py: Expert.forward` and the routed half of `MoE.forward` for
``numerics="fast"`` (REFERENCE.md sections 8 and 21.11), on token rows already sorted by expert (as
`DeepseekV41MoE._routed_grouped` sorts them). For expert ``e`` with rows ``x`` (bf16) and routing
weights ``w`` (fp32 ``[n, 1]``)::

    gu = fq(x) @ [W1_e; W3_e]^T  (bf16)        g, u = gu[:, :I].float(), gu[:, I:].float()
    if swiglu_limit > 0:  u = clamp(u, -limit, limit);  g = clamp(g, max=limit)
    h = (w * (silu(g) * u)).to(bf16)
    y = fq(h) @ W2_e^T  (bf16)

``fq`` is the per-32 e4m3 activation fake-quant (`quantization_deepseek_v41_vl.fake_quant_fp8`) for
fp4 / fp8 experts, the identity for bf16 experts. ``fq`` is row-local, so it runs once over all
sorted rows instead of once per expert; the SwiGLU epilogue is elementwise, so it runs once per
chunk of experts.

Why: the module path loops over the experts on the host, ~50 launches per expert (fake-quant,
dequant, GEMM, epilogue), ~20k launches per layer at 384 experts. Here, per chunk of ``G`` experts
with rows: one launch dequantizes the chunk's w1 | w3 into a reused bf16 buffer ``[G, 2I, D]``
(:func:`dequantize_experts`), one grouped GEMM (``torch._grouped_mm``, CUDA) gives g | u, a
handful of elementwise ops the epilogue, one launch dequantizes w2 into ``[G, D, I]`` and a second
grouped GEMM gives y. About a dozen launches per chunk.

Numerics: the dequantization is exact (bitwise equal to `dequantize_fp4_weight` /
`dequantize_fp8_weight`), the fake-quant kernel bitwise equal to `fake_quant_fp8`, the epilogue
the same torch ops as `DeepseekV41Expert.forward`; so the result equals the module path up to the
fp32 accumulation order inside the grouped GEMMs. Without ``torch._grouped_mm`` on the tensors'
device (the CPU tests) each expert of a chunk runs ``F.linear`` on its rows against views of the
dequantized buffers, the module path's exact GEMMs: bitwise equal there.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

try:  # triton is optional: CPU-only installs never reach the kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device
from .kernel_backend import resolve_backend as _resolve_backend
from .kernel_backend import triton_interpret_mode
from .moe_expert_table import _FORMATS, QUANT_GROUP, ExpertWeightTable

if triton is not None:
    from .dequant import _e4m3_scaled_f32, e8m0_to_fp32, fp4_tile_to_bf16
    from .formats import E8M0_BIAS_TL, bf16_rne
    from .moe_experts import _fake_quant_rows_kernel

__all__ = [
    "ENV_BACKEND",
    "MoEPrefillError",
    "dequantize_experts",
    "grouped_mm_available",
    "moe_routed_prefill",
    "use_moe_prefill",
]

ENV_BACKEND = "DEEPSEEK_V41_MOE_PREFILL_BACKEND"

# table columns (see `ExpertWeightTable.offsets`): weights w1, w3, w2, then scales s1, s3, s2
_W13, _W2 = 0, 2


class MoEPrefillError(ValueError):
    """Bad arguments to the MoE prefill path: shapes, dtypes, devices, counts or storage."""


if triton is not None:

    @triton.jit
    def _dequant_experts_kernel(
        ids_ptr,  # int32 [n] expert ids (the chunk's experts are ids[first : first + G])
        first,
        w_base,  # uint8 (fp4 / fp8) or bf16 weight base of the table
        s_base,  # uint8 scale base (unused for bf16)
        offs_ptr,  # int64 [E, 6] offsets from the bases
        out_ptr,  # bf16 [G, NSEL * N, K]
        N,
        K,
        COL0: tl.constexpr,  # first table column (0: w1 then w3; 2: w2)
        NSEL: tl.constexpr,  # weights per expert stacked along N (2: w1 | w3; 1: w2)
        FMT: tl.constexpr,  # 0 bf16, 1 fp4, 2 fp8
        ROWS: tl.constexpr,
        GROUPS: tl.constexpr,
    ):
        # one program: ROWS rows x GROUPS 32-column groups of one weight of one expert
        row0 = tl.program_id(0) * ROWS
        group0 = tl.program_id(1) * GROUPS
        slot = tl.program_id(2) // NSEL
        which = tl.program_id(2) % NSEL
        e = tl.load(ids_ptr + first + slot).to(tl.int64)
        w_off = tl.load(offs_ptr + e * 6 + COL0 + which)
        s_off = tl.load(offs_ptr + e * 6 + 3 + COL0 + which)
        out_base = out_ptr + (slot.to(tl.int64) * NSEL + which) * N * K

        n_groups = K // 32
        r2 = row0 + tl.arange(0, ROWS)[:, None]
        g2 = group0 + tl.arange(0, GROUPS)[None, :]
        ok2 = (r2 < N) & (g2 < n_groups)
        r = r2[:, :, None].to(tl.int64)
        g = g2[:, :, None]
        col = g * 32 + tl.arange(0, 32)[None, None, :]
        ok = ok2[:, :, None] & (col >= 0)
        if FMT == 0:
            out = tl.load(w_base + w_off + r * K + col, mask=ok, other=0.0)
        else:
            if FMT == 1:
                s_ptrs = s_base + s_off + r2.to(tl.int64) * n_groups + g2  # one scale per row and group
            else:
                s_ptrs = s_base + s_off + (r2 // 32).to(tl.int64) * n_groups + g2  # one per 32 x 32 tile
            # masked scales read as 127 (2^0): inside the common range, never stored
            sb = tl.load(s_ptrs, mask=ok2, other=E8M0_BIAS_TL).to(tl.int32)
            if FMT == 1:
                byte = tl.arange(0, 16)[None, None, :]
                u = tl.load(w_base + w_off + r * (K // 2) + g * 16 + byte, mask=ok2[:, :, None] & (byte < 16), other=0)
                out = fp4_tile_to_bf16(u.to(tl.int32), sb, ROWS, GROUPS)
            else:
                v = tl.load(w_base + w_off + r * K + col, mask=ok, other=0).to(tl.int32)
                x = _e4m3_scaled_f32(v)  # the value times 2^-8
                if (tl.min(tl.min(sb, axis=1), axis=0) >= 10) & (tl.max(tl.max(sb, axis=1), axis=0) <= 246):
                    factor = ((sb + 8) << 23).to(tl.float32, bitcast=True)[:, :, None]
                    out = (x * factor).to(tl.bfloat16)
                else:
                    out = bf16_rne((x * 256.0) * e8m0_to_fp32(sb)[:, :, None])
        tl.store(out_base + r * K + col, out, mask=ok)


def use_moe_prefill(x: torch.Tensor, weight_dtype: str, backend: str | None = "auto") -> bool:
    """True when the routed experts of bf16 rows `x` should run :func:`moe_routed_prefill`: the
    backend (``"triton"``, ``"torch"``, ``"auto"`` / None: ``DEEPSEEK_V41_MOE_PREFILL_BACKEND``,
    else Triton on CUDA) resolves to Triton and the storage is ``"fp4"``, ``"fp8"`` or ``"bf16"``.

    Raises:
        MoEPrefillError: an unknown backend name (argument or environment variable).
    """
    chosen = _resolve_backend(backend, x.device, env_var=ENV_BACKEND, error=MoEPrefillError, what="MoE prefill")
    return chosen == "triton" and weight_dtype in _FORMATS and x.dtype == torch.bfloat16


def _kernels_interpreted() -> bool:
    return triton is not None and kernel_interpreted(_dequant_experts_kernel)


def _check_runnable(device: torch.device) -> None:
    if triton is None:
        raise MoEPrefillError("the MoE prefill kernels need the triton package, which is not installed")
    if device.type != "cuda" and not (_kernels_interpreted() or triton_interpret_mode()):
        raise MoEPrefillError(
            f"the MoE prefill kernels on {device} tensors need CUDA or Triton's interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported)"
        )


# (ROWS, GROUPS, num_warps): fp8 programs must own 32 rows (one scale row); GPU tiles give 16-byte
# accesses as in `dequant.LAUNCH_CONFIG`; the interpreter runs whole small tiles
_DEQUANT_CONFIG = {"bf16": (32, 8, 8), "fp4": (32, 8, 8), "fp8": (32, 8, 8)}


@on_input_device
def dequantize_experts(
    table: ExpertWeightTable,
    which: str,
    expert_ids: torch.Tensor,
    first: int,
    count: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize `count` experts' gate-up (w1 | w3) or down (w2) weights to bf16, one launch.

    Bitwise equal, expert by expert, to `dequantize_fp4_weight` / `dequantize_fp8_weight` (NaN
    payloads aside) and a copy for bf16 storage.

    Args:
        table: the experts' :class:`ExpertWeightTable` (`moe_experts.build_expert_table`).
        which: ``"w13"`` (out ``[G, 2I, D]``: w1's rows then w3's) or ``"w2"`` (out ``[G, D, I]``).
        expert_ids: int32 ``[n]`` on the table's device; the experts dequantized are
            ``expert_ids[first : first + count]`` (for a contiguous range pass ``arange(E)``).
        first, count: where in `expert_ids` the chunk starts, and its size ``G``.
        out: optional contiguous bf16 buffer with at least ``G`` entries along dim 0 of the shape
            above; its first ``G`` entries are written and returned.

    Returns:
        bf16 ``[G, 2I, D]`` or ``[G, D, I]``.

    Raises:
        MoEPrefillError: unknown `which`, ids of a wrong dtype / device / length, a bad `out`, or
            no way to run Triton here. Ids outside ``[0, E)`` are not checked (a sync).
    """
    if which not in ("w13", "w2"):
        raise MoEPrefillError(f"which must be 'w13' or 'w2', got {which!r}")
    d, inter = table.hidden_size, table.intermediate_size
    shape = (count, 2 * inter, d) if which == "w13" else (count, d, inter)
    device = table.offsets.device
    if expert_ids.dtype != torch.int32 or expert_ids.dim() != 1 or expert_ids.device != device:
        raise MoEPrefillError(f"expert_ids must be int32 [n] on {device}, got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    if first < 0 or count < 0 or first + count > expert_ids.numel():
        raise MoEPrefillError(f"experts [{first}, {first + count}) outside expert_ids of length {expert_ids.numel()}")
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    else:
        if (
            out.dtype != torch.bfloat16 or out.dim() != 3 or tuple(out.shape[1:]) != shape[1:]
            or out.size(0) < count or not out.is_contiguous() or out.device != device
        ):
            raise MoEPrefillError(f"out must be contiguous bf16 [>={count}, {shape[1]}, {shape[2]}] on {device}, "
                                  f"got {out.dtype} {tuple(out.shape)} on {out.device}")
        out = out[:count]
    if count == 0:
        return out
    _check_runnable(device)
    n, k = shape[1] // (2 if which == "w13" else 1), shape[2]
    nsel = 2 if which == "w13" else 1
    rows, groups, warps = _DEQUANT_CONFIG[table.fmt]
    groups = min(groups, triton.next_power_of_2(k // QUANT_GROUP))
    scale_base = table.scale_base if table.scale_base is not None else table.offsets  # dummy, never read
    grid = (triton.cdiv(n, rows), triton.cdiv(k // QUANT_GROUP, groups), count * nsel)
    _dequant_experts_kernel[grid](
        expert_ids, first, table.weight_base, scale_base, table.offsets, out, n, k,
        COL0=_W13 if which == "w13" else _W2, NSEL=nsel, FMT=_FORMATS[table.fmt], ROWS=rows, GROUPS=groups,
        num_warps=warps,
    )
    return out


def grouped_mm_available(device: torch.device) -> bool:
    """True when ``torch._grouped_mm`` (bf16, 2-D x 3-D with ``offs``) is used on `device`: CUDA
    builds of torch that have it. Elsewhere :func:`moe_routed_prefill` loops ``F.linear``."""
    return device.type == "cuda" and hasattr(torch, "_grouped_mm")


@on_input_device
def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    # `fake_quant_fp8` of each row (row-local), one launch
    n, d = x.shape
    out = torch.empty_like(x)
    if n == 0:
        return out
    block_g = min(64, triton.next_power_of_2(d // QUANT_GROUP))
    _fake_quant_rows_kernel[(n, triton.cdiv(d // QUANT_GROUP, block_g))](x, out, d, x.stride(0), BLOCK_G=block_g, num_warps=4)
    return out


def _chunk_gemm(a, b, offs, offs_host, out_features):
    # a bf16 [M, K] rows of the chunk's experts; b bf16 [G, N, K]; offs int32 [G] row ends
    if offs is not None:
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    out = torch.empty(a.size(0), out_features, dtype=a.dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs_host):
        if end > start:
            if b.size(1) == out_features:
                out[start:end] = F.linear(a[start:end], b[g])
            else:  # gate-up: w1 and w3 as separate GEMMs, as the module path runs them
                half = b.size(1) // 2
                out[start:end, :half] = F.linear(a[start:end], b[g, :half])
                out[start:end, half:] = F.linear(a[start:end], b[g, half:])
        start = end
    return out


def moe_routed_prefill(
    x_sorted: torch.Tensor,
    w_sorted: torch.Tensor,
    counts: Sequence[int],
    table: ExpertWeightTable,
    experts_per_chunk: int = 16,
    fake_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """Every routed expert on its own rows of an expert-sorted token copy (module docstring).

    Mirrors the per-expert loop of `inference/model.py: MoE.forward` (``Expert.forward`` with the
    routing weight applied before w2), ``numerics="fast"``.

    Args:
        x_sorted: bf16 ``[R, D]`` rows sorted by expert id: expert e's rows are the
            ``counts[e]`` rows after those of experts ``< e``. Unit column stride.
        w_sorted: fp32 ``[R, 1]`` routing weight of each row.
        counts: ``E`` host ints, rows per expert, summing to ``R``.
        table: the experts' :class:`ExpertWeightTable`, on x's device.
        experts_per_chunk: ``G``, experts (with rows) dequantized together; the buffers hold
            ``G * 3 * I * D`` bf16 values.
        fake_quant: the activation fake-quant of quantized experts (bf16 ``[n, K]`` -> same);
            default the Triton kernel of `moe_experts` (bitwise equal to `fake_quant_fp8`).
        use_grouped_mm: force (True) or forbid (False) ``torch._grouped_mm``; default
            :func:`grouped_mm_available`.

    Returns:
        bf16 ``[R, D]``: row r is its expert's output for row r.

    Raises:
        MoEPrefillError: bad shapes / dtypes / devices, counts that do not fit, a table for another
            width or device, ``experts_per_chunk < 1``, or Triton not runnable here.
    """
    if x_sorted.dim() != 2 or x_sorted.dtype != torch.bfloat16:
        raise MoEPrefillError(f"x_sorted must be bf16 [R, D], got {x_sorted.dtype} {tuple(x_sorted.shape)}")
    n_rows, d = x_sorted.shape
    inter = table.intermediate_size
    if d != table.hidden_size:
        raise MoEPrefillError(f"x_sorted has {d} features, the experts take {table.hidden_size}")
    if tuple(w_sorted.shape) != (n_rows, 1) or w_sorted.dtype != torch.float32:
        raise MoEPrefillError(f"w_sorted must be fp32 [{n_rows}, 1], got {w_sorted.dtype} {tuple(w_sorted.shape)}")
    for name, t in (("w_sorted", w_sorted), ("the expert table", table.offsets)):
        if t.device != x_sorted.device:
            raise MoEPrefillError(f"{name} is on {t.device}, x_sorted on {x_sorted.device}")
    counts = [int(c) for c in counts]
    if len(counts) != table.n_experts or min(counts, default=0) < 0 or sum(counts) != n_rows:
        raise MoEPrefillError(
            f"counts must be {table.n_experts} non-negative ints summing to {n_rows}, got {len(counts)} summing to {sum(counts)}"
        )
    if experts_per_chunk < 1:
        raise MoEPrefillError(f"experts_per_chunk must be >= 1, got {experts_per_chunk}")
    device = x_sorted.device
    y_sorted = torch.empty_like(x_sorted)
    used = [e for e, c in enumerate(counts) if c]
    if not used:
        return y_sorted
    _check_runnable(device)
    grouped = grouped_mm_available(device) if use_grouped_mm is None else use_grouped_mm
    quantized = table.fmt != "bf16"
    if quantized:
        if x_sorted.stride(1) != 1:
            x_sorted = x_sorted.contiguous()
        fq = fake_quant if fake_quant is not None else _fake_quant_rows
        a = fq(x_sorted)
    else:
        fq = None
        a = x_sorted.contiguous()

    # host bookkeeping: chunks of G used experts, their row spans and cumulative row ends (int32),
    # all sent to the device in one copy
    g_max = min(experts_per_chunk, len(used))
    chunks, ends_all = [], []
    row = 0
    for c0 in range(0, len(used), g_max):
        ids = used[c0 : c0 + g_max]
        start, ends = row, []
        for e in ids:
            row += counts[e]
            ends.append(row - start)
        chunks.append((c0, len(ids), start, row, ends))
        ends_all.extend(ends)
    meta = torch.tensor(used + ends_all, dtype=torch.int32).to(device)
    ids_dev = meta[: len(used)]
    offs_dev = meta[len(used) :]

    buf13 = torch.empty(g_max, 2 * inter, d, dtype=torch.bfloat16, device=device)
    buf2 = torch.empty(g_max, d, inter, dtype=torch.bfloat16, device=device)
    limit = table.swiglu_limit
    for c0, g, start, stop, ends in chunks:
        offs = offs_dev[c0 : c0 + g] if grouped else None
        w13 = dequantize_experts(table, "w13", ids_dev, c0, g, out=buf13)
        gu = _chunk_gemm(a[start:stop], w13, offs, ends, 2 * inter)
        # `DeepseekV41Expert.forward`'s epilogue, the same torch ops
        gate = gu[:, :inter].float()
        up = gu[:, inter:].float()
        if limit > 0:
            up = up.clamp(min=-limit, max=limit)
            gate = gate.clamp(max=limit)
        h = (w_sorted[start:stop] * (F.silu(gate) * up)).to(torch.bfloat16)
        if quantized:
            h = fq(h)
        w2 = dequantize_experts(table, "w2", ids_dev, c0, g, out=buf2)
        y_sorted[start:stop] = _chunk_gemm(h, w2, offs, ends, d)
    return y_sorted
