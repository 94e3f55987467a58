"""The mHC projection, collapse and expand of DeepSeek-V4.1 in Triton (fast numerics).

Mirrors `inference/model.py: Block.hc_mixes` (up to the split + Sinkhorn, which is
`hc_sinkhorn.py`), `Block.hc_pre` and `Block.hc_post` (the torch ops are
`modeling/hyper_connection_deepseek_v41_vl.py: DeepseekV41HyperConnection.mixes / pre / post`,
REFERENCE.md section 4). In torch each is a chain of broadcast products, a reduction over the
copies and casts, and `post` materialises an fp32 ``[T, hc, hc, D]`` product: at a 16K-token
prefill that is ~5 GiB written and read again per call, 80 calls a forward. Here a program takes
one token and a block of columns and keeps everything in registers::

    pre:   y[d]    = bf16( sum_i mix[i] * float(x[i, d]) )
    post:  out[j, d] = bf16( post[j] * float(f[d]) + sum_i comb[i, j] * float(res[i, d]) )

with torch's order: each product rounded to fp32 on its own (no FMA contraction: ``mul.rn.f32``,
`_mul_rn`, which no compiler pass contracts, whatever the kernel's FP fusion), the sum over the
copies taken from 0 in ascending i, the expand's product added last, one rounding to bf16. The
jit helpers `_collapse` and `_expand` are this arithmetic, also run by the fused kernels of
`hc_fused.py`.
Launch: grid ``(T, cdiv(D, BLOCK_D))`` for T tokens.

The projection (:func:`hc_mixes_triton`) is, per token row ``v = float(x.flatten())`` of
``hc * D`` values::

    m = (fn @ v) * rsqrt(mean(v^2) + eps)          fp32 [(2 + hc) * hc]

torch runs it as a widening copy, a square, a mean, an rsqrt, an fp32 GEMM and a product. Here a
first launch takes ``BLOCK_T`` rows and 1/SPLIT of the columns (SPLIT set by the width alone, so
that a row's sums do not depend on the rows beside it; one decode row would otherwise leave one
program reading 20480 columns alone) and stores fp32 partial dot products and
sums of squares; a second adds the splits in order and scales. The dot products are exact fp32
FMA sums (``input_precision="ieee"``, no TF32), in another order than cuBLAS's. It is meant for
decode steps (up to :data:`MIXES_MAX_ROWS` rows): for a prefill cuBLAS's GEMM is faster.
:func:`hc_mixes_sinkhorn_triton` runs the whole of `Block.hc_mixes` in two launches: the second
finishes each row as above and runs the split + Sinkhorn of `hc_sinkhorn.py` on it, with the same
jit helpers as the two kernels it replaces (bit for bit their results).

No launch synchronises with the host; each allocates only its output: CUDA-graph capturable
once compiled.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .hc_sinkhorn import HcSinkhornError, _check_params, _finish_split_sinkhorn
from .hc_sinkhorn import _check_runnable as _check_sinkhorn_runnable
from .kernel_backend import kernel_interpreted, on_input_device, triton_available, triton_interpret_mode

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .hc_sinkhorn import _mixes_finish as _mixes_finish_fn
    from .quant_linear import _to_bf16_rne

ENV_BACKEND = "DEEPSEEK_V41_HC_MIX_BACKEND"
MAX_HC_MULT = 16
# token rows up to which the projection runs here: past it cuBLAS's fp32 GEMM is faster (measured
# on an H200 at 16K rows: 5.9 ms a call here, about 1 ms for the torch ops)
MIXES_MAX_ROWS = 256
_BLOCK_D = 512


class HcMixError(ValueError):
    """Bad arguments to :func:`hc_pre_triton` / :func:`hc_post_triton`: shapes, dtypes, devices."""


if triton is not None:

    @triton.jit
    def _mul_rn(a, b, INTERPRET: tl.constexpr):
        # a * b (broadcast to one shape) rounded to fp32 on its own: ``mul.rn.f32``, which no
        # compiler pass contracts with a following add into an FMA, whatever the kernel's FP fusion
        a, b = tl.broadcast(a, b)
        if INTERPRET:
            out = a * b  # numpy's product: no FMA
        else:
            out = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                            is_pure=True, pack=1)
        return out

    @triton.jit
    def _collapse(x_ptr, mix_ptr, t, cols, ok, D, HC: tl.constexpr, INTERPRET: tl.constexpr):
        # The collapse of token t over the columns `cols` (0 where not ok), fp32:
        # sum_i mix[t, i] * float(x[t, i, cols]), from i = 0, each product rounded on its own.
        # Also the collapse of `hc_fused._hc_pre_rms_norm_kernel`.
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for i in tl.static_range(HC):
            m = tl.load(mix_ptr + t * HC + i)
            acc += _mul_rn(m, _bf16_to_fp32(tl.load(x_ptr + (t * HC + i) * D + cols, mask=ok, other=0.0)), INTERPRET)
        return acc

    @triton.jit
    def _expand(f_ptr, res_ptr, post_ptr, comb_ptr, t, j, j_ok, d, ok, D, HC: tl.constexpr, INTERPRET: tl.constexpr,
                ROWS: tl.constexpr, COLS: tl.constexpr):
        # The expand of the [ROWS, COLS] tile of elements (t, j, d) (token, output copy, column;
        # index tensors that broadcast to the tile, j in range where j_ok, d where ok), fp32:
        # post[t, j] * float(f[t, d]) + sum_i comb[t, i, j] * float(res[t, i, d]), the sum from
        # i = 0, each product rounded on its own, the expand's product added last. Also the
        # expand of `hc_fused._hc_post_mixes_kernel`.
        mixed = tl.zeros((ROWS, COLS), dtype=tl.float32)
        for i in tl.static_range(HC):
            c = tl.load(comb_ptr + (t * HC + i) * HC + j, mask=j_ok, other=0.0)
            r = _bf16_to_fp32(tl.load(res_ptr + (t * HC + i) * D + d, mask=ok, other=0.0))
            mixed += _mul_rn(c, r, INTERPRET)
        p = tl.load(post_ptr + t * HC + j, mask=j_ok, other=0.0)
        f = _bf16_to_fp32(tl.load(f_ptr + t * D + d, mask=ok, other=0.0))
        return _mul_rn(p, f, INTERPRET) + mixed

    @triton.jit
    def _hc_pre_kernel(x_ptr, mix_ptr, out_ptr, D, HC: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        acc = _collapse(x_ptr, mix_ptr, t, cols, ok, D, HC, INTERPRET)
        tl.store(out_ptr + t * D + cols, _to_bf16_rne(acc), mask=ok)

    @triton.jit
    def _hc_post_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, INTERPRET: tl.constexpr,
                        BLOCK_HC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        j = tl.arange(0, BLOCK_HC)
        j_ok = j < HC
        out = _expand(f_ptr, res_ptr, post_ptr, comb_ptr, t, j[:, None], j_ok[:, None], cols[None, :], ok[None, :], D,
                      HC, INTERPRET, ROWS=BLOCK_HC, COLS=BLOCK_D)
        tl.store(out_ptr + (t * HC + j[:, None]) * D + cols[None, :], _to_bf16_rne(out), mask=j_ok[:, None] & ok[None, :])

    @triton.jit
    def _mixes_partial_step(x_ptr, fn_ptr, rows, row_ok, k0, K, NM, acc, sq,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # One K step of the projection's first launch: columns k0 .. k0 + BLOCK_K of the rows
        # `rows` of x ([T, K] bf16) into the dot products acc [BLOCK_T, BLOCK_M] and the sums of
        # squares sq [BLOCK_T]. Also the step of `hc_fused._hc_post_mixes_kernel`.
        outs = tl.arange(0, BLOCK_M)
        out_ok = outs < NM
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        v = _bf16_to_fp32(tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                                  mask=row_ok[:, None] & col_ok[None, :], other=0.0))
        w = tl.load(fn_ptr + outs.to(tl.int64)[None, :] * K + cols[:, None],
                    mask=out_ok[None, :] & col_ok[:, None], other=0.0)  # fn^T tile [BLOCK_K, BLOCK_M]
        acc = tl.dot(v, w, acc, input_precision="ieee")
        sq += tl.sum(v * v, axis=1)
        return acc, sq

    @triton.jit
    def _hc_mixes_partial_kernel(x_ptr, fn_ptr, dot_ptr, sq_ptr, T, K, NM, K_PER_SPLIT,
                                 BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(1)
        row_ok = rows < T
        outs = tl.arange(0, BLOCK_M)
        out_ok = outs < NM
        acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        k_lo = split * K_PER_SPLIT
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            acc, sq = _mixes_partial_step(x_ptr, fn_ptr, rows, row_ok, k0, K, NM, acc, sq,
                                          BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
        base = (split * T + rows).to(tl.int64)
        tl.store(dot_ptr + base[:, None] * NM + outs[None, :], acc, mask=row_ok[:, None] & out_ok[None, :])
        tl.store(sq_ptr + base, sq, mask=row_ok)

    # the finish, shared with the finish + Sinkhorn kernel of `hc_sinkhorn.py` (decorated here in
    # this module's interpreter mode, as this module's kernels are)
    _mixes_finish = triton.jit(_mixes_finish_fn)

    @triton.jit
    def _hc_mixes_finish_kernel(dot_ptr, sq_ptr, out_ptr, T, K, NM, eps, SPLIT: tl.constexpr,
                                BLOCK_M: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        outs = tl.arange(0, BLOCK_M)
        m = _mixes_finish(dot_ptr, sq_ptr, row, T, K, NM, eps, SPLIT=SPLIT, BLOCK_M=BLOCK_M)
        tl.store(out_ptr + row * NM + outs, m, mask=outs < NM)


def _check_runnable(*tensors: torch.Tensor) -> None:
    if not triton_available():
        raise HcMixError("the mHC mix kernels need the triton package, which is not installed")
    device = tensors[0].device
    # the kernels were defined interpreted (TRITON_INTERPRET=1 at import) and still run so
    if device.type != "cuda" and not (kernel_interpreted(_hc_pre_kernel) and triton_interpret_mode()):
        raise HcMixError(
            f"the mHC mix kernels need CUDA tensors (got {device.type}) or Triton's interpreter "
            "(TRITON_INTERPRET=1 before this module is imported)"
        )
    for t in tensors[1:]:
        if t.device != device:
            raise HcMixError(f"all tensors must be on {device}, got one on {t.device}")


def _stream(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    if x.dim() != 4 or x.dtype != torch.bfloat16:
        raise HcMixError(f"{name} must be bf16 [B, S, hc, D], got {x.dtype} {tuple(x.shape)}")
    if not 1 <= x.size(2) <= MAX_HC_MULT:
        raise HcMixError(f"{name} has {x.size(2)} copies; the kernels take 1 to {MAX_HC_MULT}")
    return x.size(0) * x.size(1), x.size(2), x.size(3)


def _fp32(t: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise HcMixError(f"{name} must be fp32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t.contiguous()


# rows per program of the projection; columns per K step; programs a row's columns are split over
# (at most); warps per program
_MIXES_BLOCK_T = 16
_MIXES_BLOCK_K = 64
_MIXES_SPLIT_TARGET = 128
_MIXES_NUM_WARPS = 4


def _post_args(
    f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    # (tokens, hc, D, post, comb contiguous) of an expand of checked shapes and dtypes (the devices
    # are the caller's `_check_runnable`); also `hc_fused.hc_post_mixes_triton`'s
    tokens, hc, dim = _stream(residual, "residual")
    if f.dtype != torch.bfloat16 or tuple(f.shape) != (*residual.shape[:2], dim):
        raise HcMixError(f"f must be bf16 {[*residual.shape[:2], dim]}, got {f.dtype} {list(f.shape)}")
    post = _fp32(post, tuple(residual.shape[:3]), "post")
    comb = _fp32(comb, (*residual.shape[:3], hc), "comb")
    return tokens, hc, dim, post, comb


def _mixes_fn(x: torch.Tensor, fn: torch.Tensor, name: str) -> tuple[int, int, torch.Tensor]:
    # (n_mix, width, fn contiguous) of the projection of the stream `x` (checked by `_stream`);
    # also `hc_fused.hc_post_mixes_triton`'s
    hc, dim = x.size(2), x.size(3)
    n_mix, width = (2 + hc) * hc, hc * dim
    if width == 0:
        raise HcMixError(f"{name} {tuple(x.shape)} has no columns: the projection's norm would divide by 0")
    return n_mix, width, _fp32(fn, (n_mix, width), "fn")


def _mixes_args(x: torch.Tensor, fn: torch.Tensor) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    # (tokens, n_mix, width, x as [tokens, width], fn contiguous) of a checked projection
    tokens, _, _ = _stream(x, "x")
    n_mix, width, fn = _mixes_fn(x, fn, "x")
    _check_runnable(x, fn)
    return tokens, n_mix, width, x.contiguous().view(tokens, width), fn


# the split + Sinkhorn's arguments after the projection: (scale, base, iters, hc_eps), as
# :func:`hc_mixes_sinkhorn_triton` takes them
_SinkhornArgs = tuple[torch.Tensor, torch.Tensor, int, float]


def _check_sinkhorn(x: torch.Tensor, name: str, sinkhorn: _SinkhornArgs) -> None:
    # HcSinkhornError unless the split + Sinkhorn of the stream `x` (checked by `_stream`) can run
    # on `sinkhorn`; also `hc_fused.hc_post_mixes_triton`'s
    scale, base, iters, _ = sinkhorn
    _check_params(scale, base, x.size(2), iters)
    if not (scale.device == base.device == x.device):
        raise HcSinkhornError(
            f"{name}, scale and base must be on one device, got {x.device}, {scale.device}, {base.device}"
        )
    _check_sinkhorn_runnable(x.device)


def _empty_mixes(
    lead: tuple[int, ...], hc: int, device: torch.device, sinkhorn: _SinkhornArgs | None
) -> tuple[torch.Tensor, ...] | torch.Tensor:
    # the output of a projection of no rows ([*lead] with a 0): (pre, post, comb) given
    # `sinkhorn`, else the projection [*lead, (2 + hc) * hc]
    if sinkhorn is None:
        return torch.empty(*lead, (2 + hc) * hc, dtype=torch.float32, device=device)
    return tuple(torch.empty(*lead, *shape, dtype=torch.float32, device=device) for shape in ((hc,), (hc,), (hc, hc)))


def _finish(
    dots: torch.Tensor, sq: torch.Tensor, width: int, eps: float, lead: tuple[int, ...], hc: int,
    sinkhorn: _SinkhornArgs | None,
) -> tuple[torch.Tensor, ...] | torch.Tensor:
    # the projection's second launch, from the partials of its first (>= 1 rows): the finish +
    # split + Sinkhorn given `sinkhorn` (pre, post, comb), else the finish alone (fp32 [*lead, n_mix]);
    # also `hc_fused.hc_post_mixes_triton`'s
    split, tokens, n_mix = dots.shape
    block_m = _mixes_block_m(n_mix)
    if sinkhorn is not None:
        scale, base, iters, hc_eps = sinkhorn
        return _finish_split_sinkhorn(dots, sq, width, eps, scale, base, hc, iters, hc_eps, lead, block_m)
    out = torch.empty(*lead, n_mix, dtype=torch.float32, device=dots.device)
    _hc_mixes_finish_kernel[(tokens,)](
        dots, sq, out, tokens, width, n_mix, float(eps), SPLIT=split, BLOCK_M=block_m, num_warps=1,
    )
    return out


def _mixes_partials(rows: torch.Tensor, fn: torch.Tensor, n_mix: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the first launch of the projection: fp32 partial dot products [split, T, n_mix] and partial
    # sums of squares [split, T] of T >= 1 rows
    tokens, width = rows.shape
    row_blocks, split, cols_per_split = _mixes_grid(tokens, width)
    dots = torch.empty(split, tokens, n_mix, dtype=torch.float32, device=rows.device)
    sq = torch.empty(split, tokens, dtype=torch.float32, device=rows.device)
    _hc_mixes_partial_kernel[(row_blocks, split)](
        rows, fn, dots, sq, tokens, width, n_mix, cols_per_split,
        BLOCK_T=_MIXES_BLOCK_T, BLOCK_M=_mixes_block_m(n_mix), BLOCK_K=_MIXES_BLOCK_K, num_warps=_MIXES_NUM_WARPS,
    )
    return dots, sq


def _mixes_grid(tokens: int, width: int) -> tuple[int, int, int]:
    # (row blocks, splits, columns per split) of the projection's first launch: its tiles, and so
    # the order of its sums (also the tiles of `hc_fused.hc_post_mixes_triton`). The splits depend
    # on the width only, never on the rows: a row's mixes are the same bits in a call of any
    # number of rows (a conversation's next turn continues like one prefill of it, a forward of
    # k tokens like k one-token steps)
    row_blocks = triton.cdiv(tokens, _MIXES_BLOCK_T)
    k_steps = triton.cdiv(width, _MIXES_BLOCK_K)
    split = max(1, min(k_steps, _MIXES_SPLIT_TARGET))
    steps_per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps_per_split)  # no split left without columns
    return row_blocks, split, steps_per_split * _MIXES_BLOCK_K


def _mixes_block_m(n_mix: int) -> int:
    return max(16, triton.next_power_of_2(n_mix))


@on_input_device
def hc_mixes_triton(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """The mHC projection before the split + Sinkhorn: ``m = (fn @ v) * rsqrt(mean(v^2) + eps)``
    per token, ``v`` its ``hc * D`` values in fp32 (`Block.hc_mixes`), in two launches.

    Args:
        x: bf16 ``[B, S, hc, D]``. fn: fp32 ``[(2 + hc) * hc, hc * D]``. eps: the norm's eps.

    Returns:
        fp32 ``[B, S, (2 + hc) * hc]``.

    Raises:
        HcMixError: other shapes or dtypes, no columns (D = 0), tensors on two devices, Triton
            missing, or CPU tensors outside Triton's interpreter.
    """
    tokens, n_mix, width, rows, fn = _mixes_args(x, fn)
    lead, hc = tuple(x.shape[:2]), x.size(2)
    if tokens == 0:
        return _empty_mixes(lead, hc, x.device, None)
    dots, sq = _mixes_partials(rows, fn, n_mix)
    return _finish(dots, sq, width, eps, lead, hc, None)


@on_input_device
def hc_mixes_sinkhorn_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    norm_eps: float,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole of `inference/model.py: Block.hc_mixes` in two launches: the projection of
    :func:`hc_mixes_triton`, then the split + Sinkhorn (the kernel `hc_split_sinkhorn`,
    `inference/kernel_cpu.py`) of `hc_sinkhorn.hc_split_sinkhorn_triton`.

    Bit for bit ``hc_split_sinkhorn_triton(hc_mixes_triton(x, fn, norm_eps), scale, base, hc,
    iters, hc_eps)``: the first launch is the projection's partial products, the second finishes
    each row with the same helper as the projection's second launch and runs the same split +
    Sinkhorn helper as the Sinkhorn kernel, so every fp32 operation and its order are the same.
    One launch fewer than the two calls; meant for decode steps (up to :data:`MIXES_MAX_ROWS`
    rows), as :func:`hc_mixes_triton`.

    Args:
        x: bf16 ``[B, S, hc, D]``, hc 1 to :data:`MAX_HC_MULT`. fn: fp32 ``[(2 + hc) * hc, hc * D]``.
        norm_eps: the eps inside the projection's rsqrt (``rms_norm_eps``).
        scale: fp32 ``[3]``, the scales of pre, post and comb. base: fp32 ``[(2 + hc) * hc]``.
        iters: Sinkhorn rounds (``hc_sinkhorn_iters``), >= 1.
        hc_eps: ``hc_eps``, added to ``pre``, after the softmax and to every Sinkhorn denominator.

    Returns:
        pre ``[B, S, hc]``, post ``[B, S, hc]``, comb ``[B, S, hc, hc]``, fp32, contiguous, on the
        device of `x`. ``comb[..., i, j]`` weighs source copy ``i`` into output copy ``j``.

    Raises:
        HcMixError: `x` or `fn` of other shapes or dtypes, no columns (D = 0), `x` and `fn` on two
            devices, Triton missing, or CPU tensors outside Triton's interpreter.
        HcSinkhornError: `scale` or `base` of other shapes or dtypes or not on the device of `x`,
            or ``iters`` out of range.
    """
    tokens, n_mix, width, rows, fn = _mixes_args(x, fn)
    sinkhorn = (scale, base, iters, hc_eps)
    _check_sinkhorn(x, "x", sinkhorn)
    lead, hc = tuple(x.shape[:2]), x.size(2)
    if tokens == 0:
        return _empty_mixes(lead, hc, x.device, sinkhorn)
    dots, sq = _mixes_partials(rows, fn, n_mix)
    return _finish(dots, sq, width, norm_eps, lead, hc, sinkhorn)


@on_input_device
def hc_pre_triton(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Collapse the copies: ``y = sum_i mix[i] * x[i]`` in fp32, as bf16 (`Block.hc_pre`).

    Args:
        x: bf16 ``[B, S, hc, D]``. mix: fp32 ``[B, S, hc]``.

    Returns:
        bf16 ``[B, S, D]``.

    Raises:
        HcMixError: other shapes or dtypes, tensors on two devices, Triton missing, or CPU
            tensors outside Triton's interpreter.
    """
    tokens, hc, dim = _stream(x, "x")
    mix = _fp32(mix, tuple(x.shape[:3]), "mix")
    _check_runnable(x, mix)
    x = x.contiguous()
    out = torch.empty(*x.shape[:2], dim, dtype=torch.bfloat16, device=x.device)
    if tokens and dim:
        _hc_pre_kernel[(tokens, triton.cdiv(dim, _BLOCK_D))](
            x, mix, out, dim, HC=hc, INTERPRET=kernel_interpreted(_hc_pre_kernel), BLOCK_D=_BLOCK_D, num_warps=4,
        )
    return out


@on_input_device
def hc_post_triton(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand and mix: ``out[j] = post[j] * f + sum_i comb[i, j] * residual[i]`` in fp32, as bf16
    (`Block.hc_post`).

    Args:
        f: bf16 ``[B, S, D]`` (the sublayer's output). residual: bf16 ``[B, S, hc, D]``.
        post: fp32 ``[B, S, hc]``. comb: fp32 ``[B, S, hc, hc]`` (first index = source copy).

    Returns:
        bf16 ``[B, S, hc, D]``.

    Raises:
        HcMixError: other shapes or dtypes, tensors on two devices, Triton missing, or CPU
            tensors outside Triton's interpreter.
    """
    tokens, hc, dim, post, comb = _post_args(f, residual, post, comb)
    _check_runnable(residual, f, post, comb)
    residual, f = residual.contiguous(), f.contiguous()
    out = torch.empty(residual.shape, dtype=torch.bfloat16, device=residual.device)
    if tokens and dim:
        _hc_post_kernel[(tokens, triton.cdiv(dim, _BLOCK_D))](
            f, residual, post, comb, out, dim, HC=hc, INTERPRET=kernel_interpreted(_hc_post_kernel),
            BLOCK_HC=triton.next_power_of_2(hc), BLOCK_D=_BLOCK_D, num_warps=4,
        )
    return out


__all__ = [
    "ENV_BACKEND", "MAX_HC_MULT", "MIXES_MAX_ROWS", "HcMixError", "hc_mixes_sinkhorn_triton", "hc_mixes_triton",
    "hc_post_triton", "hc_pre_triton",
]
