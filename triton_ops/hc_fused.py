"""The mHC collapse and expand fused with the launch that reads their output (fast numerics).

Two pairs of launches of a decoder layer (`modeling/decoder_layer_deepseek_v41_vl.py`,
REFERENCE.md section 4) read back a row the launch before them has just written:

- the collapse and its norm, ``norm(hc_pre(x, mix))`` before the attention and before the FFN
  (`Block.hc_pre`, then `RMSNorm`): :func:`hc_pre_rms_norm_triton` runs both in one launch;
- the expand after the attention and the projection of the FFN's mixes, ``x1 = hc_post(...)``
  then ``hc_mixes(x1, ...)`` (`Block.hc_post`, then `Block.hc_mixes`): :func:`hc_post_mixes_triton`
  writes ``x1`` and the projection's partial sums in one launch, which leaves the projection's
  second launch (`hc_mix._finish`: finish + split + Sinkhorn, or the finish alone).

Each is bit for bit the launches it replaces, by construction:

- the same tiles: the collapse + norm takes a whole row per program with the norm kernel's block
  and warps (`rms_norm._launch_shape`), so the mean's sum is taken in the norm kernel's order; the
  expand + projection takes the projection's tiles (`hc_mix._mixes_grid`: ``BLOCK_T`` rows, the
  K axis of ``hc * D`` columns split as for the projection) and computes the expand for the
  columns of each K step before that step;
- the same code for the second op: the norm is the norm kernel's body (`rms_norm._rms_norm_row`),
  the projection step the projection kernel's (`hc_mix._mixes_partial_step`), which reads back the
  ``x1`` tile this program has just stored (a barrier in between), so it runs on the same loads,
  in the same register layout, as in the projection's own kernel;
- the same code for the first op: the collapse and the expand are the jit helpers of their own
  kernels (`hc_mix._collapse`, `hc_mix._expand`), whose products are ``mul.rn.f32``
  (`hc_mix._mul_rn`), which no compiler pass contracts into an FMA, so the kernels are compiled as
  the norm and projection kernels are (FP fusion at Triton's default), which is what their sums of
  squares were compiled with. The bf16 rounding of the collapse / expand is kept before the
  second op.

No launch synchronises with the host; each allocates only its outputs: CUDA-graph capturable once
compiled.
"""

from __future__ import annotations

from typing import Callable

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .hc_mix import MIXES_MAX_ROWS, HcMixError, _check_runnable, _check_sinkhorn, _empty_mixes, _finish
from .hc_mix import _MIXES_BLOCK_K, _MIXES_BLOCK_T, _MIXES_NUM_WARPS, _mixes_block_m, _mixes_fn, _mixes_grid
from .hc_mix import _fp32, _post_args, _stream
from .kernel_backend import kernel_interpreted, on_input_device
from .rms_norm import _check_weight as _check_norm_weight
from .rms_norm import _launch_shape as _rms_norm_launch_shape

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .hc_mix import _collapse, _expand, _mixes_partial_step
    from .quant_linear import _to_bf16_rne
    from .rms_norm import _rms_norm_row


if triton is not None:

    @triton.jit
    def _hc_pre_rms_norm_kernel(x_ptr, mix_ptr, w_ptr, out_ptr, D, eps, HC: tl.constexpr, W_FP32: tl.constexpr,
                                INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        acc = _collapse(x_ptr, mix_ptr, t, cols, ok, D, HC, INTERPRET)
        y = tl.where(ok, _bf16_to_fp32(_to_bf16_rne(acc)), 0.0)  # the collapse's bf16 row, 0 past D
        tl.store(out_ptr + t * D + cols, _rms_norm_row(y, w_ptr, cols, ok, D, eps, W_FP32), mask=ok)

    @triton.jit
    def _hc_post_mixes_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, x1_ptr, fn_ptr, dot_ptr, sq_ptr,
                              T, D, K, NM, K_PER_SPLIT, HC: tl.constexpr, STEP_IN_COPY: tl.constexpr,
                              INTERPRET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        # the tiles of `hc_mix._hc_mixes_partial_kernel`; before each K step, the expand
        # (`hc_mix._hc_post_kernel`) of the step's columns k = j * D + d of x1 [T, K]
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(1)
        row_ok = rows < T
        r64 = rows.to(tl.int64)
        outs = tl.arange(0, BLOCK_M)
        out_ok = outs < NM
        acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        k_lo = split * K_PER_SPLIT
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = row_ok[:, None] & (cols < K)[None, :]
            if STEP_IN_COPY:  # D a multiple of BLOCK_K: the step lies in one copy j
                k00 = k0 + tl.zeros((1, 1), dtype=tl.int32)
                j = k00 // D
                d = (k00 - j * D) + tl.arange(0, BLOCK_K)[None, :]
                j_ok = row_ok[:, None] & (k00 < K)
            else:
                j = (cols // D)[None, :]
                d = cols[None, :] - j * D
                j_ok = ok
            out = _expand(f_ptr, res_ptr, post_ptr, comb_ptr, r64[:, None], j, j_ok, d, ok, D, HC, INTERPRET,
                          ROWS=BLOCK_T, COLS=BLOCK_K)
            tl.store(x1_ptr + r64[:, None] * K + cols[None, :], _to_bf16_rne(out), mask=ok)
            tl.debug_barrier()  # the tile's stores visible to all of the program's threads
            acc, sq = _mixes_partial_step(x1_ptr, fn_ptr, rows, row_ok, k0, K, NM, acc, sq,
                                          BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
        base = (split * T + rows).to(tl.int64)
        tl.store(dot_ptr + base[:, None] * NM + outs[None, :], acc, mask=row_ok[:, None] & out_ok[None, :])
        tl.store(sq_ptr + base, sq, mask=row_ok)


@on_input_device
def hc_pre_rms_norm_triton(x: torch.Tensor, mix: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Collapse, then RMSNorm, in one launch: bit for bit
    ``rms_norm_triton(hc_pre_triton(x, mix), weight, eps)`` (`Block.hc_pre`, then `RMSNorm`).

    Args:
        x: bf16 ``[B, S, hc, D]``, hc 1 to :data:`hc_mix.MAX_HC_MULT`, D up to
            :data:`rms_norm.MAX_COLS`. mix: fp32 ``[B, S, hc]``.
        weight: bf16 or fp32 ``[D]``, the norm's weight. eps: added to the mean of squares.

    Returns:
        bf16 ``[B, S, D]``, contiguous, on the device of `x`.

    Raises:
        HcMixError: other shapes or dtypes, D past the norm kernel's limit, tensors on two devices,
            Triton missing, or CPU tensors outside Triton's interpreter.
    """
    tokens, hc, dim = _stream(x, "x")
    mix = _fp32(mix, tuple(x.shape[:3]), "mix")
    _check_norm_weight(weight, dim, HcMixError)
    _check_runnable(x, mix, weight)
    x = x.contiguous()
    out = torch.empty(*x.shape[:2], dim, dtype=torch.bfloat16, device=x.device)
    if tokens and dim:
        block, num_warps = _rms_norm_launch_shape(dim)
        _hc_pre_rms_norm_kernel[(tokens,)](
            x, mix, weight.contiguous(), out, dim, float(eps), HC=hc, W_FP32=weight.dtype == torch.float32,
            INTERPRET=kernel_interpreted(_hc_pre_rms_norm_kernel), BLOCK=block, num_warps=num_warps,
        )
    return out


@on_input_device
def hc_post_mixes_triton(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    norm_eps: float,
    sinkhorn: tuple[torch.Tensor, torch.Tensor, int, float] | None = None,
    aside: Callable | None = None,
) -> tuple[torch.Tensor, object]:
    """Expand, then the projection of the next mixes from its output, in two launches instead of
    three (`Block.hc_post`, then `Block.hc_mixes`).

    The first launch writes ``x1`` and the projection's partial sums; the second finishes the
    projection and, given `sinkhorn`, runs the split + Sinkhorn on it. Bit for bit
    ``x1 = hc_post_triton(f, residual, post, comb)`` and then
    ``hc_mixes_sinkhorn_triton(x1, fn, norm_eps, scale, base, iters, hc_eps)`` (with `sinkhorn`)
    or ``hc_mixes_triton(x1, fn, norm_eps)`` (without). Meant for decode steps, as the
    projection's kernels: up to :data:`hc_mix.MIXES_MAX_ROWS` token rows.

    Args:
        f: bf16 ``[B, S, D]`` (the sublayer's output). residual: bf16 ``[B, S, hc, D]``, hc 1 to
            :data:`hc_mix.MAX_HC_MULT`. post: fp32 ``[B, S, hc]``. comb: fp32 ``[B, S, hc, hc]``
            (first index = source copy).
        fn: fp32 ``[(2 + hc) * hc, hc * D]``. norm_eps: the eps inside the projection's rsqrt.
        sinkhorn: ``(scale, base, iters, hc_eps)`` as :func:`hc_mix.hc_mixes_sinkhorn_triton`
            takes them, or None for the projection alone.
        aside: ``aside(fn, *args)``, how the second launch is run (by default called in line):
            one that runs it on a second stream and returns a handle
            (`modeling/cuda_graphs_deepseek_v41_vl.py: SideStream`) overlaps it with the
            sublayer the caller runs next. (The decode step's graph runs all of the projection
            aside instead, `DeepseekV41HyperConnection.post_mixes`: then this launch is not used.)

    Returns:
        ``(x1, mixes)``: x1 bf16 ``[B, S, hc, D]``; mixes the fp32 tuple (pre ``[B, S, hc]``,
        post ``[B, S, hc]``, comb ``[B, S, hc, hc]``) with `sinkhorn`, else the fp32 projection
        ``[B, S, (2 + hc) * hc]``; with `aside`, what it returned for that launch.

    Raises:
        HcMixError: other shapes or dtypes, no columns (D = 0), more than
            :data:`hc_mix.MIXES_MAX_ROWS` rows, tensors on two devices, Triton missing, or CPU
            tensors outside Triton's interpreter.
        HcSinkhornError: `sinkhorn`'s tensors of other shapes or dtypes or not on the device of
            `residual`, or ``iters`` out of range.
    """
    tokens, hc, dim, post, comb = _post_args(f, residual, post, comb)
    n_mix, width, fn = _mixes_fn(residual, fn, "residual")
    if tokens > MIXES_MAX_ROWS:
        raise HcMixError(f"{tokens} token rows are past the projection kernels' {MIXES_MAX_ROWS}")
    _check_runnable(residual, f, post, comb, fn)
    if sinkhorn is not None:
        _check_sinkhorn(residual, "residual", sinkhorn)
    residual, f = residual.contiguous(), f.contiguous()
    x1 = torch.empty(residual.shape, dtype=torch.bfloat16, device=residual.device)
    lead = tuple(residual.shape[:2])
    run = _call if aside is None else aside
    if tokens == 0:
        return x1, run(_empty_mixes, lead, hc, x1.device, sinkhorn)
    row_blocks, split, cols_per_split = _mixes_grid(tokens, width)
    dots = torch.empty(split, tokens, n_mix, dtype=torch.float32, device=x1.device)
    sq = torch.empty(split, tokens, dtype=torch.float32, device=x1.device)
    _hc_post_mixes_kernel[(row_blocks, split)](
        f, residual, post, comb, x1, fn, dots, sq, tokens, dim, width, n_mix, cols_per_split,
        HC=hc, STEP_IN_COPY=dim % _MIXES_BLOCK_K == 0, INTERPRET=kernel_interpreted(_hc_post_mixes_kernel),
        BLOCK_T=_MIXES_BLOCK_T, BLOCK_M=_mixes_block_m(n_mix), BLOCK_K=_MIXES_BLOCK_K, num_warps=_MIXES_NUM_WARPS,
        num_stages=1,  # no load of a later K step issued before that step's x1 tile is stored
    )
    return x1, run(_finish, dots, sq, width, norm_eps, lead, hc, sinkhorn)


def _call(fn: Callable, *args):
    return fn(*args)


__all__ = ["hc_post_mixes_triton", "hc_pre_rms_norm_triton"]
