"""The mHC split + Sinkhorn of DeepSeek-V4.1 in one Triton launch.

Mirrors the kernel `hc_split_sinkhorn` (`inference/kernel_cpu.py`; the torch fallback is
`modeling/hyper_connection_deepseek_v41_vl.py: hc_split_sinkhorn`, REFERENCE.md section 4). Eager
torch spends about 90 small ops on it (20 Sinkhorn rounds of two sums and two divides), twice per
decoder layer: at decode, one token row, that is all launch overhead. Here each program takes a
block of rows and runs the whole sequence on registers.

Per row, with ``hc`` copies and ``m`` the ``(2 + hc) * hc`` mixes (all fp32)::

    pre  = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])
    c    = (m[2hc:] * scale[2] + base[2hc:]) as [hc, hc]
    c    = exp(c - rowmax(c)); c = c / rowsum(c) + eps; c = c / (colsum(c) + eps)
    repeat iters - 1 times: c = c / (rowsum(c) + eps); c = c / (colsum(c) + eps)

The kernel keeps that order op for op: products and sums rounded apart (no FMA contraction),
IEEE divisions (``div_rn``; Triton's plain ``/`` is approximate on the GPU), sigmoid written as
``1 / (1 + exp(-x))`` as torch computes it, and every row and column sum taken left to right over
the copies, the order torch's CPU reduction uses for these short rows. What can still differ is
``exp``: the GPU's (or, in the interpreter, numpy's) against torch's, about one ulp per entry.
All quantities are positive, so no cancellation amplifies that; through the 20 rounds the outputs
stay within a few ulps (relative) of the torch fallback.

The launch needs no host synchronisation (no value is read back), so it can be captured in a CUDA
graph once the kernel has been compiled (a warm-up call before capture).

Backend choice: :func:`resolve_backend` (``DEEPSEEK_V41_HC_SINKHORN_BACKEND``, else Triton on CUDA).
The dispatch between this kernel and the torch fallback lives in the hyper-connection module; on
the CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``). The kernel is
decorated lazily, per interpreter mode, so that variable may be set after `triton` was imported;
so are its helpers, each mode in its own copy of this module's namespace, where a kernel finds the
helpers of its mode.

The kernel's body is the helper `_split_sinkhorn`, shared with `_hc_mixes_sinkhorn_kernel`: the
second launch of `hc_mix.hc_mixes_sinkhorn_triton`, which finishes the projection of one token row
(the helper `_mixes_finish`, also the body of `hc_mix`'s finish kernel), stores it and runs the
split + Sinkhorn on it: one launch for what was two, the same operations in the same order.
"""

from __future__ import annotations

import types

import torch

try:  # Triton is optional: CPU-only installs use the torch fallback
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import on_input_device, triton_available, triton_interpret_mode
from .kernel_backend import resolve_backend as _resolve_backend

ENV_BACKEND = "DEEPSEEK_V41_HC_SINKHORN_BACKEND"
# copies per token the kernel accepts: its [rows, hc, hc] tile lives in registers
MAX_HC_MULT = 16
# fp32 elements of one program's comb tile; 64 rows at hc = 4
_TILE_ELEMENTS = 1024


class HcSinkhornError(ValueError):
    """Bad arguments to :func:`hc_split_sinkhorn_triton`: shapes, dtypes, devices, hc, iters, backend."""


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The concrete backend (``"triton"`` or ``"torch"``) for tensors on `device`; ``None`` or
    ``"auto"`` consult ``DEEPSEEK_V41_HC_SINKHORN_BACKEND`` first (see `kernel_backend.resolve_backend`).

    Raises:
        HcSinkhornError: an unknown backend name (argument or environment variable).
    """
    return _resolve_backend(backend, device, env_var=ENV_BACKEND, error=HcSinkhornError, what="mHC Sinkhorn")


if triton is not None:
    # The kernels and their helpers are plain functions here, decorated lazily (`_jit`).

    def _mixes_finish(dot_ptr, sq_ptr, row, T, K, NM, eps, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr):
        # The projection of one token row from the split partials: the splits added in order, then
        # scaled by rsqrt(mean(v^2) + eps). fp32 [BLOCK_M], 0 past NM.
        outs = tl.arange(0, BLOCK_M)
        out_ok = outs < NM
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        sq = tl.zeros((1,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(dot_ptr + (s * T + row) * NM + outs, mask=out_ok, other=0.0)
            sq += tl.load(sq_ptr + s * T + row + tl.arange(0, 1))
        scale = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sq, K * 1.0) + eps))  # rsqrt(mean + eps), IEEE-rounded
        return acc * scale

    def _split_sinkhorn(
        mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rows,
        n_rows, stride_row, iters, eps,
        HC: tl.constexpr, BLOCK_HC: tl.constexpr,
    ):
        # The split + Sinkhorn of the rows `rows` (int64 [BLOCK_R]) of the mixes; pre/post as
        # [BLOCK_R, BLOCK_HC], comb as [BLOCK_R, i, j].
        row_ok = rows < n_rows
        k = tl.arange(0, BLOCK_HC)
        k_ok = k < HC
        row_ptr = mixes_ptr + rows * stride_row
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)

        vec_mask = row_ok[:, None] & k_ok[None, :]
        vec_out = rows[:, None] * HC + k[None, :]
        x = tl.load(row_ptr[:, None] + k[None, :], mask=vec_mask, other=0.0)
        x = x * s_pre + tl.load(base_ptr + k, mask=k_ok, other=0.0)[None, :]
        pre = tl.div_rn(1.0, 1.0 + tl.exp(-x)) + eps
        tl.store(pre_ptr + vec_out, pre, mask=vec_mask)
        x = tl.load(row_ptr[:, None] + HC + k[None, :], mask=vec_mask, other=0.0)
        x = x * s_post + tl.load(base_ptr + HC + k, mask=k_ok, other=0.0)[None, :]
        post = 2.0 * tl.div_rn(1.0, 1.0 + tl.exp(-x))
        tl.store(post_ptr + vec_out, post, mask=vec_mask)

        i = k[None, :, None]
        j = k[None, None, :]
        cell_ok = (i < HC) & (j < HC)
        cell = 2 * HC + i * HC + j
        tile_mask = row_ok[:, None, None] & cell_ok
        c = tl.load(row_ptr[:, None, None] + cell, mask=tile_mask, other=0.0)
        c = c * s_comb + tl.load(base_ptr + cell, mask=cell_ok, other=0.0)
        # padding cells: -inf so exp gives 0; padding rows (i >= HC) get a finite max of 0
        c = tl.where(cell_ok, c, float("-inf"))
        row_max = tl.where(i < HC, tl.max(c, axis=2, keep_dims=True), 0.0)
        c = tl.exp(c - row_max)
        # Sums run left to right over the copies, as torch's: pick copy t exactly (one value plus
        # zeros) and accumulate; tl.sum alone would add pairwise.
        row_sum = tl.sum(tl.where(j == 0, c, 0.0), axis=2, keep_dims=True)
        for t in tl.static_range(1, HC):
            row_sum = row_sum + tl.sum(tl.where(j == t, c, 0.0), axis=2, keep_dims=True)
        row_sum = tl.where(i < HC, row_sum, 1.0)  # padding rows: 0 / 1, not 0 / 0
        c = tl.where(cell_ok, tl.div_rn(c, row_sum) + eps, 0.0)
        # round 0's row pass is the softmax above; from round 1 on the row pass divides by sum + eps
        for it in range(iters):
            if it > 0:
                row_sum = tl.sum(tl.where(j == 0, c, 0.0), axis=2, keep_dims=True)
                for t in tl.static_range(1, HC):
                    row_sum = row_sum + tl.sum(tl.where(j == t, c, 0.0), axis=2, keep_dims=True)
                c = tl.div_rn(c, row_sum + eps)
            col_sum = tl.sum(tl.where(i == 0, c, 0.0), axis=1, keep_dims=True)
            for t in tl.static_range(1, HC):
                col_sum = col_sum + tl.sum(tl.where(i == t, c, 0.0), axis=1, keep_dims=True)
            c = tl.div_rn(c, col_sum + eps)
        tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + i * HC + j, c, mask=tile_mask)

    def _hc_sinkhorn_kernel(
        mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
        n_rows, stride_row, iters, eps,
        HC: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        # One program = BLOCK_R rows.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        _split_sinkhorn(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rows,
                        n_rows, stride_row, iters, eps, HC=HC, BLOCK_HC=BLOCK_HC)

    def _hc_mixes_sinkhorn_kernel(
        dot_ptr, sq_ptr, mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
        T, K, NM, norm_eps, iters, eps,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, HC: tl.constexpr, BLOCK_HC: tl.constexpr,
    ):
        # One program = one token row: finish its projection into the mixes row (global memory,
        # written and read back by this program only), then split + Sinkhorn it.
        row = tl.program_id(0).to(tl.int64)
        outs = tl.arange(0, BLOCK_M)
        m = _mixes_finish(dot_ptr, sq_ptr, row, T, K, NM, norm_eps, SPLIT=SPLIT, BLOCK_M=BLOCK_M)
        tl.store(mixes_ptr + row * NM + outs, m, mask=outs < NM)
        tl.debug_barrier()  # the row's stores visible to all of the program's threads
        rows = row + tl.arange(0, 1)
        _split_sinkhorn(mixes_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, rows,
                        T, NM, iters, eps, HC=HC, BLOCK_HC=BLOCK_HC)


# Decorated lazily, per interpreter mode (see the module docstring): each mode gets its own copy
# of the module's namespace in which the kernels and helpers above are that mode's JIT objects,
# so a kernel calls helpers of its own mode.
_JIT_NAMES = ("_mixes_finish", "_split_sinkhorn", "_hc_sinkhorn_kernel", "_hc_mixes_sinkhorn_kernel")
_SCOPES: dict[bool, dict] = {}


def _jit(name: str):
    interpret = triton_interpret_mode()
    scope = _SCOPES.get(interpret)
    if scope is None:
        scope = dict(globals())
        for fn_name in _JIT_NAMES:
            raw = globals()[fn_name]
            fn = types.FunctionType(raw.__code__, scope, fn_name, raw.__defaults__, raw.__closure__)
            # the annotations mark the tl.constexpr parameters (FunctionType does not copy them)
            fn.__annotations__ = dict(raw.__annotations__)
            fn.__kwdefaults__, fn.__qualname__, fn.__module__ = raw.__kwdefaults__, raw.__qualname__, raw.__module__
            scope[fn_name] = triton.jit(fn)
        _SCOPES[interpret] = scope
    return scope[name]


def _kernel():
    return _jit("_hc_sinkhorn_kernel")


def _check_params(
    scale: torch.Tensor, base: torch.Tensor, hc_mult: int, iters: int, mixes: torch.Tensor | None = None
) -> None:
    # the Sinkhorn's arguments, and its input `mixes` where given
    if isinstance(hc_mult, bool) or not isinstance(hc_mult, int) or not 1 <= hc_mult <= MAX_HC_MULT:
        raise HcSinkhornError(f"hc_mult must be an int in [1, {MAX_HC_MULT}], got {hc_mult!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise HcSinkhornError(f"sinkhorn_iters must be an int >= 1, got {iters!r}")
    width = (2 + hc_mult) * hc_mult
    if mixes is not None and (mixes.dim() < 1 or mixes.size(-1) != width):
        raise HcSinkhornError(
            f"mixes must be [..., (2 + hc) * hc = {width}] for hc_mult={hc_mult}, got {tuple(mixes.shape)}"
        )
    if tuple(scale.shape) != (3,):
        raise HcSinkhornError(f"scale must be [3], got {tuple(scale.shape)}")
    if tuple(base.shape) != (width,):
        raise HcSinkhornError(f"base must be [{width}] for hc_mult={hc_mult}, got {tuple(base.shape)}")
    for name, t in (("mixes", mixes), ("scale", scale), ("base", base)):
        if t is not None and t.dtype != torch.float32:
            raise HcSinkhornError(f"{name} must be float32, got {t.dtype}")


def _check(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int, iters: int) -> None:
    _check_params(scale, base, hc_mult, iters, mixes)
    if not (mixes.device == scale.device == base.device):
        raise HcSinkhornError(
            f"mixes, scale and base must be on one device, got {mixes.device}, {scale.device}, {base.device}"
        )


def _check_runnable(device: torch.device) -> None:
    if not triton_available():
        raise HcSinkhornError("the mHC Sinkhorn Triton kernel needs the triton package, which is not installed")
    if device.type != "cuda" and not triton_interpret_mode():
        raise HcSinkhornError(
            f"the mHC Sinkhorn Triton kernel needs CUDA tensors (got {device.type}) or TRITON_INTERPRET=1"
        )


@on_input_device
def hc_split_sinkhorn_triton(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the mixes into (pre, post, comb), comb made doubly stochastic by Sinkhorn; one launch.

    Mirrors the kernel `hc_split_sinkhorn` (`inference/kernel_cpu.py`) and follows the torch
    fallback `hc_split_sinkhorn` op for op (see the module docstring for what may differ: ``exp``).

    Args:
        mixes: fp32 ``[..., (2 + hc) * hc]`` (``[R, 24]`` at hc = 4), any leading shape; the last
            dimension may be strided only if it is contiguous (else it is copied).
        scale: fp32 ``[3]``, the scales of pre, post and comb.
        base: fp32 ``[(2 + hc) * hc]``, added after scaling.
        hc_mult: copies ``hc``, 1 to :data:`MAX_HC_MULT`.
        iters: Sinkhorn rounds (``hc_sinkhorn_iters``), >= 1; the first is softmax + column pass.
        eps: ``hc_eps``, added to ``pre``, after the softmax and to every Sinkhorn denominator.

    Returns:
        pre ``[..., hc]``, post ``[..., hc]``, comb ``[..., hc, hc]``, fp32, contiguous, on the
        device of `mixes`. ``comb[..., i, j]`` weighs source copy ``i`` into output copy ``j``.

    Raises:
        HcSinkhornError: wrong shapes or dtypes, tensors on different devices, ``hc_mult`` or
            ``iters`` out of range, Triton missing, or CPU tensors outside ``TRITON_INTERPRET=1``.
    """
    _check(mixes, scale, base, hc_mult, iters)
    _check_runnable(mixes.device)
    lead = mixes.shape[:-1]
    flat = mixes.reshape(-1, mixes.size(-1))
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n_rows = flat.size(0)
    pre = torch.empty(*lead, hc_mult, dtype=torch.float32, device=mixes.device)
    post = torch.empty(*lead, hc_mult, dtype=torch.float32, device=mixes.device)
    comb = torch.empty(*lead, hc_mult, hc_mult, dtype=torch.float32, device=mixes.device)
    if n_rows == 0:
        return pre, post, comb
    block_hc = triton.next_power_of_2(hc_mult)
    # decode (one row) gets a one-row program on one warp; prefill 64 rows (hc 4) on 4 warps
    block_r = max(1, min(triton.next_power_of_2(n_rows), _TILE_ELEMENTS // (block_hc * block_hc)))
    tile = block_r * block_hc * block_hc
    _kernel()[(triton.cdiv(n_rows, block_r),)](
        flat, scale.contiguous(), base.contiguous(), pre, post, comb,
        n_rows, flat.stride(0), iters, float(eps),
        HC=hc_mult, BLOCK_HC=block_hc, BLOCK_R=block_r,
        num_warps=max(1, min(4, tile // 256)),
        enable_fp_fusion=False,  # m * scale + base rounded twice, as the eager ops round it
    )
    return pre, post, comb


def _finish_split_sinkhorn(
    dots: torch.Tensor,
    sq: torch.Tensor,
    width: int,
    norm_eps: float,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    iters: int,
    eps: float,
    lead: tuple[int, ...],
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The second launch of `hc_mix.hc_mixes_sinkhorn_triton`: the partials of its first launch
    # (dots fp32 [split, T, (2 + hc) * hc], sq fp32 [split, T], T >= 1) finished as
    # `hc_mix._hc_mixes_finish_kernel` does, then split + Sinkhorn as `_hc_sinkhorn_kernel` does.
    # The arguments are checked by the caller (`_check_params`, `_check_runnable`).
    split, tokens, n_mix = dots.shape
    device = dots.device
    mixes = torch.empty(tokens, n_mix, dtype=torch.float32, device=device)
    pre = torch.empty(*lead, hc_mult, dtype=torch.float32, device=device)
    post = torch.empty(*lead, hc_mult, dtype=torch.float32, device=device)
    comb = torch.empty(*lead, hc_mult, hc_mult, dtype=torch.float32, device=device)
    _jit("_hc_mixes_sinkhorn_kernel")[(tokens,)](
        dots, sq, mixes, scale.contiguous(), base.contiguous(), pre, post, comb,
        tokens, width, n_mix, float(norm_eps), iters, float(eps),
        SPLIT=split, BLOCK_M=block_m, HC=hc_mult,
        BLOCK_HC=triton.next_power_of_2(hc_mult),
        num_warps=1,  # what each of the two kernels runs one row with
        enable_fp_fusion=False,  # as `_hc_sinkhorn_kernel` (the finish has no product to contract)
    )
    return pre, post, comb


__all__ = ["ENV_BACKEND", "MAX_HC_MULT", "HcSinkhornError", "hc_split_sinkhorn_triton", "resolve_backend"]
