"""MoE router top-k for DeepSeek-V4.1: sqrt-softplus scores, biased selection, unbiased weights.

One function, :func:`route_topk`, with two backends of the same semantics:

- ``"torch"``: the reference's own sequence of torch ops (mirrors `inference/model.py:
  Gate.forward` after the logits GEMM). On CPU it is bit-exact to the reference, ties included,
  because it *is* the same ``torch.topk`` call; this is what ``numerics="exact"`` uses.
- ``"triton"``: one kernel launch; each program loads a block of rows with all their experts,
  computes the scores, picks the top-k by repeated arg-max and writes normalised weights. It is
  the default on CUDA. Its scores agree with the torch backend to a few fp32 ulps (``exp``/``log``
  are the GPU's, not glibc's), so on inputs without near-ties it picks the same experts.

Semantics (per token row t, expert e; REFERENCE.md section 8 and 21.11):

1. ``s[t, e] = sqrt(softplus(logits[t, e] / gate_temp))`` in fp32. softplus is torch's (beta 1,
   threshold 20: identity above 20).
2. ``sel[t] = s[t] + (bias_vl if image_rows[t] else bias)``; the experts are the top-k of ``sel``.
   The bias only selects.
3. ``w = s[t, chosen]``; when ``norm_topk_prob`` and ``top_k > 1``: ``w = w / (sum(w) + 1e-20)``
   (a literal, not ``norm_eps``); then ``w = w * route_scale``.

Tie rule. Equal biased scores at the top-k boundary are implementation-defined in the reference
(``torch.topk`` on CPU). The torch backend keeps ``torch.topk``'s choice, which is what makes it
exact. The Triton kernel takes the *lowest expert index* among equal values, slot by slot, so its
slots come out in descending score order with ties broken towards low ids.

Non-finite logits (NaN) give unspecified experts; they are not checked here because a check costs
a device sync per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernel_backend import kernel_interpreted, on_input_device

try:  # triton is optional: CPU-only installs use the torch backend
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

__all__ = ["MoERoutingError", "route_topk", "router_scores", "ROUTING_BACKENDS"]

ROUTING_BACKENDS = ("auto", "triton", "torch")

# The reference normalises the chosen weights by (sum + 1e-20); the literal, not norm_eps.
_NORM_EPS = 1e-20
# torch's softplus (beta 1) returns its input unchanged above this threshold.
_SOFTPLUS_THRESHOLD = 20.0


class MoERoutingError(ValueError):
    """Bad arguments to the MoE router (shape, dtype, device, top_k or backend)."""


def router_scores(router_logits: torch.Tensor, gate_temp: float = 1.0) -> torch.Tensor:
    """Unbiased router scores ``sqrt(softplus(router_logits / gate_temp))``.

    Args:
        router_logits: fp32 ``[T, E]``, the gate GEMM output.
        gate_temp: temperature; the logits are divided by it (reference ``ModelArgs.gate_temp``).

    Returns:
        fp32 ``[T, E]``. Same torch ops, in the same order, as `inference/model.py: Gate.forward`
        for ``score_func="sqrtsoftplus"``, hence bit-exact on CPU.
    """
    return F.softplus(router_logits / gate_temp).sqrt()


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_route_topk_kernel)


def _check_inputs(router_logits, bias, bias_vl, image_rows, top_k) -> None:
    if router_logits.dim() != 2:
        raise MoERoutingError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    if router_logits.dtype != torch.float32:
        raise MoERoutingError(f"router_logits must be float32, got {router_logits.dtype}")
    n_tokens, n_experts = router_logits.shape
    for name, vec in (("bias", bias), ("bias_vl", bias_vl)):
        if vec is None:
            continue
        if vec.shape != (n_experts,) or vec.dtype != torch.float32:
            raise MoERoutingError(
                f"{name} must be float32 [{n_experts}], got {vec.dtype} {tuple(vec.shape)}"
            )
        if vec.device != router_logits.device:
            raise MoERoutingError(f"{name} is on {vec.device}, router_logits on {router_logits.device}")
    if image_rows is not None:
        if image_rows.shape != (n_tokens,) or image_rows.dtype != torch.bool:
            raise MoERoutingError(
                f"image_rows must be bool [{n_tokens}], got {image_rows.dtype} {tuple(image_rows.shape)}"
            )
        if image_rows.device != router_logits.device:
            raise MoERoutingError(f"image_rows is on {image_rows.device}, router_logits on {router_logits.device}")
        if bias_vl is None:
            raise MoERoutingError("image_rows given but bias_vl is None")
    if not 1 <= top_k <= n_experts:
        raise MoERoutingError(f"top_k must be in [1, {n_experts}], got {top_k}")


def _route_topk_torch(router_logits, bias, bias_vl, image_rows, top_k, route_scale, gate_temp, norm_topk_prob):
    scores = router_scores(router_logits, gate_temp)
    row_bias = bias
    if image_rows is not None:
        # per-row choice between the two bias vectors; values are copied, so sel is unchanged
        # bitwise from the reference's `torch.where(image_mask, bias_vl, bias)`
        row_bias = torch.where(image_rows.unsqueeze(-1), bias_vl, bias)
    expert_ids = (scores + row_bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob and top_k > 1:
        weights /= weights.sum(dim=-1, keepdim=True) + _NORM_EPS
    weights *= route_scale
    return weights, expert_ids


if triton is not None:

    @triton.jit
    def _route_topk_kernel(
        logits_ptr,
        bias_ptr,
        bias_vl_ptr,
        image_ptr,
        weights_ptr,
        ids_ptr,
        n_tokens,
        n_experts,
        stride_logits,
        gate_temp,
        route_scale,
        HAS_IMAGE: tl.constexpr,
        NORMALIZE: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < n_tokens
        col_ok = cols < n_experts
        tile_ok = row_ok[:, None] & col_ok[None, :]

        x = tl.load(logits_ptr + rows[:, None] * stride_logits + cols[None, :], mask=tile_ok, other=0.0)
        x = x / gate_temp
        # softplus = log1p(exp(x)); log1p through Goldberg's trick (log(1+u) * u / ((1+u) - 1)),
        # which keeps full relative accuracy for tiny u without a libdevice call
        u = tl.exp(tl.minimum(x, 20.0))
        one_plus_u = 1.0 + u
        exact_one = one_plus_u == 1.0
        ratio = u / tl.where(exact_one, 1.0, one_plus_u - 1.0)  # guarded: no 0/0 in dropped lanes
        log1p_u = tl.where(exact_one, u, tl.log(one_plus_u) * ratio)
        softplus = tl.where(x > 20.0, x, log1p_u)  # torch softplus threshold
        scores = tl.sqrt_rn(softplus)

        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
        if HAS_IMAGE:
            is_image = tl.load(image_ptr + rows, mask=row_ok, other=0) != 0
            bias_vl = tl.load(bias_vl_ptr + cols, mask=col_ok, other=0.0)
            row_bias = tl.where(is_image[:, None], bias_vl[None, :], bias[None, :])
        else:
            row_bias = bias[None, :]
        # padding columns can never win: real scores are finite and >= 0, the bias finite
        sel = tl.where(col_ok[None, :], scores + row_bias, float("-inf"))

        slots = tl.arange(0, BLOCK_K)
        out_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
        out_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for slot in tl.static_range(TOP_K):
            best_val = tl.max(sel, axis=1)
            # tie rule: lowest expert index among the maxima
            best = tl.min(tl.where(sel == best_val[:, None], cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == best[:, None]
            w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            total += w  # left-to-right over the slots
            out_w = tl.where(slots[None, :] == slot, w[:, None], out_w)
            out_ids = tl.where(slots[None, :] == slot, best[:, None].to(tl.int64), out_ids)
            sel = tl.where(hit, float("-inf"), sel)

        if NORMALIZE:
            out_w = tl.div_rn(out_w, (total + 1e-20)[:, None])
        out_w = out_w * route_scale

        out_ok = row_ok[:, None] & (slots[None, :] < TOP_K)
        out_offs = rows[:, None] * TOP_K + slots[None, :]
        tl.store(weights_ptr + out_offs, out_w, mask=out_ok)
        tl.store(ids_ptr + out_offs, out_ids, mask=out_ok)


@on_input_device
def _route_topk_triton(router_logits, bias, bias_vl, image_rows, top_k, route_scale, gate_temp, norm_topk_prob):
    if triton is None:
        raise MoERoutingError("backend='triton' needs the triton package, which is not installed")
    if not router_logits.is_cuda and not _kernel_is_interpreted():
        raise MoERoutingError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before this module is imported"
        )
    n_tokens, n_experts = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device)
    expert_ids = torch.empty(n_tokens, top_k, dtype=torch.int64, device=logits.device)
    if n_tokens == 0:
        return weights, expert_ids
    block_e = triton.next_power_of_2(n_experts)
    # small tiles (~1K fp32, whole expert rows) and 2 warps: measured on an H200 with E=384, k=6,
    # 2 rows x 2 warps ran 3x faster than 16 rows x 4 warps (200 us vs 690 us for 65536 tokens)
    block_t = max(1, min(128, 1024 // block_e, triton.next_power_of_2(n_tokens)))
    has_image = image_rows is not None
    grid = (triton.cdiv(n_tokens, block_t),)
    _route_topk_kernel[grid](
        logits,
        bias.contiguous(),
        (bias_vl if has_image else bias).contiguous(),
        image_rows.contiguous() if has_image else logits,  # dummy pointer, never read
        weights,
        expert_ids,
        n_tokens,
        n_experts,
        logits.stride(0),
        float(gate_temp),
        float(route_scale),
        HAS_IMAGE=has_image,
        NORMALIZE=bool(norm_topk_prob and top_k > 1),
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=2,
    )
    return weights, expert_ids


def route_topk(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    bias_vl: torch.Tensor | None,
    image_rows: torch.Tensor | None,
    top_k: int,
    route_scale: float,
    gate_temp: float = 1.0,
    backend: str = "auto",
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select ``top_k`` experts per token and their routing weights.

    Mirrors `inference/model.py: Gate.forward` from the logits on (``score_func="sqrtsoftplus"``).

    Args:
        router_logits: fp32 ``[T, E]``, ``x_fp32 @ W_gate_fp32.T`` before the temperature.
        bias: fp32 ``[E]``, the text selection bias (``Gate.bias``).
        bias_vl: fp32 ``[E]`` or None, the image-span selection bias (``Gate.bias_vl``).
        image_rows: bool ``[T]`` or None; True selects ``bias_vl`` for that row. None: text bias
            on every row.
        top_k: experts per token, ``1 <= top_k <= E``.
        route_scale: multiplies the (normalised) weights (``routed_scaling_factor``).
        gate_temp: logits are divided by it before softplus.
        backend: ``"auto"`` (Triton for CUDA tensors, torch otherwise), ``"triton"`` or ``"torch"``.
        norm_topk_prob: normalise the chosen weights to sum 1 (only when ``top_k > 1``).

    Returns:
        ``(weights, expert_ids)``: fp32 ``[T, top_k]`` and int64 ``[T, top_k]``. Slot order: the
        torch backend returns ``torch.topk``'s order (descending biased score); the Triton backend
        returns descending biased score with ties broken towards the lower expert id.

    Raises:
        MoERoutingError: wrong shapes, dtypes or devices, ``image_rows`` without ``bias_vl``,
            ``top_k`` outside ``[1, E]``, an unknown backend, or ``"triton"`` where it cannot run.
    """
    if backend not in ROUTING_BACKENDS:
        raise MoERoutingError(f"backend must be one of {ROUTING_BACKENDS}, got {backend!r}")
    _check_inputs(router_logits, bias, bias_vl, image_rows, top_k)
    if backend == "auto":
        backend = "triton" if (router_logits.is_cuda and triton is not None) else "torch"
    impl = _route_topk_triton if backend == "triton" else _route_topk_torch
    return impl(router_logits, bias, bias_vl, image_rows, top_k, route_scale, gate_temp, norm_topk_prob)
