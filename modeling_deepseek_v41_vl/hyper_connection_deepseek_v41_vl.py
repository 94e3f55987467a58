"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4.1.

Mirrors `inference/model.py: Block.hc_mixes / hc_pre / hc_post` and the kernel
`hc_split_sinkhorn` (`kernel_cpu.py`), see `shared/docs/REFERENCE.md` section 4.

The learned parameters (`hc_attn_fn`, `hc_attn_base`, `hc_attn_scale` and the `hc_ffn_*` trio) are
stored directly on the decoder block in the checkpoint (`layers.{i}.hc_attn_fn`), so
:class:`DeepseekV41HyperConnection` holds none: the block owns them and passes them in. This keeps
`load_state_dict(strict=True)` a plain load of the checkpoint names.

Numerics: exact (the default) runs the split + Sinkhorn as the torch ops below, bit-identical to
the reference on CPU. Fast runs it as one Triton launch (`triton_ops/hc_sinkhorn.py`) where the
backend resolves to Triton (CUDA tensors, or ``DEEPSEEK_V41_HC_SINKHORN_BACKEND=triton``): the
same op order, within a few fp32 ulps (only ``exp`` differs), instead of ~90 small launches.
Likewise the projection of :meth:`mixes` (two launches, for decode-sized calls; with the Triton
Sinkhorn as well, its second launch also runs the split + Sinkhorn, the same ops bit for bit), the collapse
and the expand (`pre`, `post`, one launch each) of bf16 streams in fast numerics (`triton_ops/hc_mix.py`, the plan's
``hc_mix`` backend) unless autograd records them: the same products, summed in another order at
most. Where the collapse's and its norm's kernels would both run, :meth:`pre_norm` runs them as
one launch, and :meth:`post_mixes`, run in line, the expand and the next mixes' projection as two
launches instead of three (`triton_ops/hc_fused.py`): bit for bit the separate kernels. Beside a
decode step's FFN (`aside`), the expand runs alone and all of the projection aside.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from ..triton_ops.hc_fused import hc_post_mixes_triton, hc_pre_rms_norm_triton
from ..triton_ops.hc_mix import MAX_HC_MULT as HC_MIX_MAX_HC_MULT
from ..triton_ops.hc_mix import MIXES_MAX_ROWS as HC_MIXES_MAX_ROWS
from ..triton_ops.hc_mix import hc_mixes_sinkhorn_triton, hc_mixes_triton, hc_post_triton, hc_pre_triton
from ..triton_ops.hc_sinkhorn import hc_split_sinkhorn_triton
from .cuda_graphs_deepseek_v41_vl import in_line
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm, needs_grad
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, as_numerics

# None: not configured, which computes like "exact"


class DeepseekV41HyperConnectionError(ValueError):
    """An mHC input has the wrong shape or dtype."""


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the raw mixes into (pre, post, comb), comb made doubly stochastic by Sinkhorn.

    Mirrors the kernel `hc_split_sinkhorn` (`kernel_cpu.py`), with the same fp32 operations in the
    same order, so the result is bit-identical on CPU.

    Args:
        mixes: fp32 `[..., (2 + hc) * hc]`, the normalized projection of `hc_mixes`.
        scale: fp32 `[3]`, one scale each for pre, post and comb.
        base: fp32 `[(2 + hc) * hc]`, added after scaling.
        hc_mult: number of residual copies `hc`.
        sinkhorn_iters: total normalization rounds (the first column pass included).
        eps: `hc_eps`, added to `pre` and to every Sinkhorn denominator.

    Returns:
        pre `[..., hc]`, post `[..., hc]`, comb `[..., hc, hc]` (all fp32). `comb[..., i, j]` weighs
        source copy `i` into output copy `j`.
    """
    hc = hc_mult
    m = mixes.float()
    scale = scale.float()
    base = base.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    # softmax over j written out as exp(c - rowmax) / rowsum: the kernel's op order, not F.softmax's
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class DeepseekV41HyperConnection(nn.Module):
    r"""The mHC arithmetic around one sublayer (attention or MoE) of a DeepSeek-V4.1 block.

    The residual stream is carried as `hc_mult` copies `[B, S, N, D]`. Around each sublayer:

    ::

                                      N residual copies x  [B, S, N, D]
                                                │
                      ┌─────────────────────────┼──────────────────────────────┐
                      │                         │                              │
             ┌────────────────┐       ┌──────────────────────┐                 │
             │ COLLAPSE       │       │ FLATTEN fp32 [B,S,ND] │                 │
             │ (pre_mix_in,   │       │ PROJECT by fn         │                 │
             │  from the      │       │ x rsqrt(mean(x²)+eps) │                 │
             │  PREVIOUS      │       │ SPLIT + SINKHORN      │                 │
             │  sublayer)     │       └──────────────────────┘                 │
             └────────────────┘          │        │        │                   │
                      │               pre_out   post     comb                  │
               [B, S, D] bf16        [B,S,N]  [B,S,N]  [B,S,N,N]               │
                      │               │          │        │                    │
             ┌────────────────┐       │          │   ┌───────────────────────────┐
             │ norm + ATTN    │       │          │   │ MIX: Σ_i comb[i][j]·x[i]  │
             │ or norm + MoE  │       │          │   └───────────────────────────┘
             └────────────────┘       │          │                │
                      │ f [B, S, D]   │          │                │
                      └──────────┬────┼──────────┘                │
                          ┌────────────────────┐                  │
                          │ EXPAND: post[j]·f  │──────(ADD)───────┘
                          └────────────────────┘
                                      │                 pre_out is handed to the NEXT
                                      ▼                 sublayer's COLLAPSE (one-sublayer lag)
                            N output copies [B, S, N, D] (fp32 sum, cast to bf16)

    The one-sublayer lag (`Block.forward`): attention collapses with the previous block's FFN
    `pre` (a one-hot `[1, 0, 0, 0]` for block 0), the FFN collapses with this block's attention
    `pre` (computed from the block input before attention), and the final collapse before `norm`
    uses the last FFN `pre`.

    Holds no parameters: `fn` `[(2+N)*N, N*D]`, `base` `[(2+N)*N]` and `scale` `[3]` (all fp32)
    live on the block under their checkpoint names and are passed to :meth:`mixes`.

    Args:
        hc_mult (`int`): number of copies `N`.
        sinkhorn_iters (`int`): `hc_sinkhorn_iters`.
        hc_eps (`float`): `hc_eps` (Sinkhorn and `pre`).
        norm_eps (`float`): `rms_norm_eps`, inside the rsqrt of :meth:`mixes`.
        numerics: the model's plan (or a mode name): in fast numerics :meth:`mixes` runs the
            Sinkhorn as one Triton kernel where the plan's ``hc_sinkhorn`` backend is Triton, and
            the projection (decode-sized calls), :meth:`pre` and :meth:`post` take the kernels of
            `triton_ops/hc_mix.py` where its ``hc_mix`` backend is; exact numerics keep the torch
            ops.
    """

    def __init__(
        self, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float, numerics: DeepseekV41Numerics | str = "exact"
    ):
        super().__init__()
        self.hc_mult = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.numerics = as_numerics(numerics)

    def _check_stream(self, x: torch.Tensor, name: str) -> None:
        if x.dim() != 4 or x.size(2) != self.hc_mult:
            raise DeepseekV41HyperConnectionError(
                f"{name} must be [batch, seq, hc_mult={self.hc_mult}, hidden], got {tuple(x.shape)}"
            )

    def mixes(
        self, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre, post, comb) from the stream. Mirrors `Block.hc_mixes`.

        Args:
            x: `[B, S, N, D]` (bf16) residual copies.
            fn: fp32 `[(2+N)*N, N*D]`; scale: fp32 `[3]`; base: fp32 `[(2+N)*N]`.

        Returns:
            pre `[B, S, N]`, post `[B, S, N]`, comb `[B, S, N, N]`, fp32.

        Raises:
            DeepseekV41HyperConnectionError: `x` is not `[B, S, N, D]` or `fn` does not match it.
            HcSinkhornError, HcMixError: (fast numerics) ``triton`` forced where the kernels
                cannot run.
        """
        self._check_stream(x, "x")
        self._check_fn(fn, x, "x")
        if self._mixes_kernel_applies(x, fn):
            if self.numerics.backend("hc_sinkhorn", x.device) == "triton":
                # both kernels: the projection's finish and the Sinkhorn share one launch
                return hc_mixes_sinkhorn_triton(
                    x, fn, self.norm_eps, scale, base, self.sinkhorn_iters, self.hc_eps
                )
            m = hc_mixes_triton(x, fn, self.norm_eps)
        else:
            flat = x.flatten(2).float()
            # one RMS statistic over all N*D values of a token, applied after the projection, no weight
            rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
            m = F.linear(flat, fn) * rsqrt
        if self.numerics.backend("hc_sinkhorn", m.device) == "triton":
            return hc_split_sinkhorn_triton(m, scale, base, self.hc_mult, self.sinkhorn_iters, self.hc_eps)
        return hc_split_sinkhorn(m, scale, base, self.hc_mult, self.sinkhorn_iters, self.hc_eps)

    def pre(self, x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
        """Collapse: y = Σ_i mix[i]·x[i] in fp32, cast to `x.dtype`. Mirrors `Block.hc_pre`.

        Args:
            x: `[B, S, N, D]`; mix: fp32 `[B, S, N]`.

        Returns:
            `[B, S, D]` in `x.dtype`.

        Raises:
            DeepseekV41HyperConnectionError: `x` is not `[B, S, N, D]`.
            HcMixError: (fast numerics) ``triton`` forced where the kernel cannot run, or
                inputs that do not fit it.
        """
        self._check_stream(x, "x")
        if self._fused((x,), (mix,)):
            return hc_pre_triton(x, mix)
        return torch.sum(mix.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)

    def pre_norm(self, x: torch.Tensor, mix: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """``norm(self.pre(x, mix))``: the collapse and the sublayer's norm (`Block.hc_pre`, then
        `attn_norm` / `ffn_norm`).

        Where both would take their Triton kernels (the collapse's conditions of :meth:`pre`,
        `DeepseekV41RMSNorm.takes_kernel`, and no hooks on the norm), one launch
        (`hc_fused.hc_pre_rms_norm_triton`), bit for bit the two; otherwise the two calls.

        Args:
            x: `[B, S, N, D]`; mix: fp32 `[B, S, N]`; norm: the sublayer's norm module.

        Returns:
            `[B, S, D]` in `x.dtype`, as `norm` returns it.

        Raises:
            DeepseekV41HyperConnectionError: `x` is not `[B, S, N, D]`.
            HcMixError, RMSNormKernelError: (fast numerics) ``triton`` forced where the kernels
                cannot run, or inputs that do not fit them.
        """
        self._check_stream(x, "x")
        if self._fused((x,), (mix,)) and _norm_kernel_applies(norm, x):
            return hc_pre_rms_norm_triton(x, mix, norm.weight, norm.eps)
        return norm(self.pre(x, mix))

    def post_mixes(
        self,
        f: torch.Tensor,
        residual: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        aside: Callable = in_line,
    ) -> tuple[torch.Tensor, object]:
        """``x1 = self.post(f, residual, post, comb)`` and ``self.mixes(x1, fn, scale, base)``:
        the expand and the projection of the next sublayer's mixes from its output.

        Run in line, where both take their kernels (:meth:`post`'s and :meth:`mixes`'
        conditions), the expand and the projection's first launch are one
        (`hc_fused.hc_post_mixes_triton`), bit for bit the separate kernels; otherwise, and
        always with another `aside`, the two calls: then all of the projection runs aside and
        only the expand (which the FFN reads) stays on the caller's stream.

        Args:
            f, residual, post, comb: as :meth:`post`. fn, scale, base: as :meth:`mixes`.
            aside: ``aside(fn, *args) -> handle``, how the mixes after ``x1`` are run: by default
                in line; the decode step's `DeepseekV41DecodeStep.aside` runs them beside the
                FFN, which does not read them.

        Returns:
            ``(x1, handle)``: :meth:`post`'s output, and a handle whose ``join()`` gives
            :meth:`mixes`' of it, ``(pre, post, comb)``.

        Raises:
            DeepseekV41HyperConnectionError: `residual` is not `[B, S, N, D]`, or `fn` does not
                match it.
            HcMixError, HcSinkhornError: (fast numerics) ``triton`` forced where the kernels
                cannot run, or inputs that do not fit them.
        """
        self._check_stream(residual, "residual")
        self._check_fn(fn, residual, "residual")
        if aside is in_line and self._fused((residual, f), (post, comb)) and self._mixes_kernel_applies(residual, fn):
            if self.numerics.backend("hc_sinkhorn", residual.device) == "triton":
                sinkhorn = (scale, base, self.sinkhorn_iters, self.hc_eps)
                return hc_post_mixes_triton(f, residual, post, comb, fn, self.norm_eps, sinkhorn, aside=in_line)
            x1, m = hc_post_mixes_triton(f, residual, post, comb, fn, self.norm_eps)
            return x1, in_line(hc_split_sinkhorn, m, scale, base, self.hc_mult, self.sinkhorn_iters, self.hc_eps)
        # beside the FFN, the projection's first launch (~10 us at one row on an H100) leaves the
        # step's critical path: the FFN waits for the expand alone
        x1 = self.post(f, residual, post, comb)
        return x1, aside(self.mixes, x1, fn, scale, base)

    def _check_fn(self, fn: torch.Tensor, x: torch.Tensor, name: str) -> None:
        if fn.shape != ((2 + self.hc_mult) * self.hc_mult, self.hc_mult * x.size(-1)):
            raise DeepseekV41HyperConnectionError(
                f"fn has shape {tuple(fn.shape)}, incompatible with {name} {tuple(x.shape)}"
            )

    def _mixes_kernel_applies(self, x: torch.Tensor, fn: torch.Tensor) -> bool:
        # the projection's kernels for the stream `x` (checked, with `fn`): decode-sized calls
        # (past MIXES_MAX_ROWS rows cuBLAS's GEMM is faster) under `_fused`'s conditions;
        # :meth:`mixes` and :meth:`post_mixes` ask it
        return x.size(0) * x.size(1) <= HC_MIXES_MAX_ROWS and self._fused((x,), (fn,))

    def _fused(self, streams: tuple[torch.Tensor, ...], mixes: tuple[torch.Tensor, ...]) -> bool:
        # the `hc_mix` kernels (projection, collapse, expand): fast numerics with the Triton
        # backend, bf16 streams, fp32 mixes, and no autograd (the kernels have no backward)
        return (
            all(t.dtype == torch.bfloat16 for t in streams)
            and all(t.dtype == torch.float32 for t in mixes)
            and self.hc_mult <= HC_MIX_MAX_HC_MULT
            and not needs_grad(*streams, *mixes)
            and self.numerics.backend("hc_mix", streams[0].device) == "triton"
        )

    def post(self, f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Expand and mix: out[j] = post[j]·f + Σ_i comb[i][j]·residual[i]. Mirrors `Block.hc_post`.

        The reference's fp32 product ``[B, S, N, N, D]`` takes 5 GiB at 16K tokens of width 5120;
        long inputs are therefore computed in slices of positions, each with the reference's
        ops (the same values: every output element depends on its own position only).

        Args:
            f: sublayer output `[B, S, D]`; residual: `[B, S, N, D]`; post: fp32 `[B, S, N]`;
                comb: fp32 `[B, S, N, N]` (first index = source copy).

        Returns:
            `[B, S, N, D]` in `f.dtype` (computed in fp32).

        Raises:
            DeepseekV41HyperConnectionError: `residual` is not `[B, S, N, D]`.
            HcMixError: (fast numerics) ``triton`` forced where the kernel cannot run, or
                inputs that do not fit it.
        """
        self._check_stream(residual, "residual")
        if self._fused((residual, f), (post, comb)):
            return hc_post_triton(f, residual, post, comb)
        batch, seq, n, dim = residual.shape
        step = max(1, POST_SLICE_BYTES // max(1, batch * n * n * dim * 4))
        if seq <= step:
            return _post(f, residual, post, comb)
        out = torch.empty(residual.shape, dtype=f.dtype, device=residual.device)
        for start in range(0, seq, step):
            rows = slice(start, start + step)
            out[:, rows] = _post(f[:, rows], residual[:, rows], post[:, rows], comb[:, rows])
        return out

    def extra_repr(self) -> str:
        return (
            f"hc_mult={self.hc_mult}, sinkhorn_iters={self.sinkhorn_iters}, hc_eps={self.hc_eps}, "
            f"numerics={self.numerics.mode}"
        )


# bound on the fp32 product ``[B, rows, N, N, D]`` of one slice of `post`
POST_SLICE_BYTES = 256 << 20


def _post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    mixed = torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
    return (post.unsqueeze(-1) * f.unsqueeze(-2) + mixed).type_as(f)


def _norm_kernel_applies(norm: nn.Module, x: torch.Tensor) -> bool:
    # whether `norm` would run its Triton kernel on the collapse of the bf16 stream `x` (no grad:
    # `_fused`), with nothing watching its call: a plain DeepseekV41RMSNorm, no hooks. The
    # collapse has the stream's dtype, width and device, and autograd records it only if `x` or
    # its mix needs grad, so the norm's own predicate asked of `x` answers for it.
    return (
        type(norm) is DeepseekV41RMSNorm
        and not (norm._forward_hooks or norm._forward_pre_hooks or _global_forward_hooks or _global_forward_pre_hooks)
        and norm.takes_kernel(x)
    )


def identity_pre_mix(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The one-hot `[1, 0, ..., 0]` fp32 mix that collapses block 0's input. Mirrors
    `make_identity_pre_mix`. `x` is `[B, S, ...]`; returns fp32 `[B, S, hc_mult]`."""
    mix = x.new_zeros(x.size(0), x.size(1), hc_mult, dtype=torch.float32)
    mix[:, :, 0] = 1.0
    return mix


__all__ = ["DeepseekV41HyperConnection", "DeepseekV41HyperConnectionError", "hc_split_sinkhorn", "identity_pre_mix"]
