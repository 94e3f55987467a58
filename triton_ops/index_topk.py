"""The indexer's top-k of a decode step in one Triton launch (fast numerics).

A one-token step of an index source ranks the compressed positions by their index score and keeps
the `k` best (`modeling/indexer_deepseek_v41_vl.py: DeepseekV41Indexer.decode_select`). In torch
that is about twenty small launches per layer: the mask of the positions the query does not see
yet, two `topk` calls and the glue that sends ties at the k-th score to the lower position
(:func:`topk_ties_by_position`), then the offset past the window rows. This kernel does all of it in
one program per batch row, the row held in registers:

1. every score past the row's `visible` positions reads as -inf (the padding of the block as
   below every score), and -0 as +0 (they compare equal);
2. the k-th largest score (with multiplicity) is found bit by bit, from the most significant, on
   an order-preserving 16-bit key of the bf16 score: 16 counts over the row;
3. every position above it is kept, then as many at it as fit, in ascending position (a running
   count of the ties); the kept positions are written in ascending order, each as
   ``position + offset`` where it is visible, else -1.

The kept set is exactly the torch ops' (the same rule, the same comparisons on the same bf16
values; scores hold no NaN, which neither ranks meaningfully); the order of the list is ascending position, where `topk`'s unsorted order is its own.
The attention then adds the same terms in another order, so the step's values are not bit for
bit the torch ops' (the reason the model runs it in fast numerics only).

Launch: grid ``(B,)``; no host synchronisation (`visible` is read on the device): CUDA-graph
capturable once compiled. Mirrors the top-k of `inference/model.py: Indexer.forward` at
``start_pos > 0``.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device, unrunnable

ENV_BACKEND = "DEEPSEEK_V41_INDEX_TOPK_BACKEND"
MAX_WIDTH = 16384  # positions ranked per row (in registers): a static cache's rows up to 16K per ratio
_INT32_MAX = torch.iinfo(torch.int32).max


class IndexTopkError(ValueError):
    """Bad arguments to :func:`index_topk_triton`: dtypes, shapes, devices, a width past the limit."""


if triton is not None:

    @triton.jit
    def _index_topk_kernel(s_ptr, vis_ptr, out_ptr, W, K, offset, stride_s, stride_v, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.arange(0, BLOCK)
        in_row = t < W
        visible = tl.load(vis_ptr + row * stride_v)
        bits = tl.load(s_ptr + row * stride_s + t, mask=in_row, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(t < visible, bits, 0xFF80)  # -inf where the query does not see the position
        bits = tl.where(bits == 0x8000, 0, bits)  # -0 ties with +0, as the comparisons of the values
        # order-preserving key of a bf16 value: negatives flipped, positives above them; -1 (below
        # every key) past the row
        key = tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)
        key = tl.where(in_row, key, -1)
        # the k-th largest key: the largest value v with at least K keys >= v, built from the top bit
        kth = tl.full([], 0, tl.int32)
        for b in tl.static_range(15, -1, -1):
            candidate = kth | (1 << b)
            kth = tl.where(tl.sum((key >= candidate).to(tl.int32), axis=0) >= K, candidate, kth)
        above = key > kth
        tied = key == kth
        room = K - tl.sum(above.to(tl.int32), axis=0)
        keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))
        slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        value = tl.where(t < visible, t + offset, -1)
        tl.store(out_ptr + row * K + slot, value.to(tl.int32), mask=keep)


def topk_ties_by_position(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest scores along the last dim, ties going to the lower position.

    `torch.topk` breaks ties (the relu makes many scores exactly 0) in an order that depends on
    the width it ranks, so a left-padded row ranked at a batch's width could pick other positions
    than alone. Ranking (score, -position) instead makes the choice the row's own: the positions
    past its visible ones are -inf and never outrank a visible one. int64 ``[..., k]``, in
    `topk`'s unsorted order.
    """
    if k == 0:
        return scores.new_empty(*scores.shape[:-1], 0, dtype=torch.long)
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    # every score above the k-th, then as many tied at the k-th as fit, in ascending position
    keep = above | (tied & (torch.cumsum(tied, dim=-1, dtype=torch.int32) <= k - above.sum(dim=-1, keepdim=True)))
    # exactly k kept per query: a second top-k over (kept, -position) returns them without a
    # host sync (no nonzero), so CUDA graphs can still capture the step
    width = scores.size(-1)
    key = keep.to(torch.int32) * width - torch.arange(width, device=scores.device, dtype=torch.int32)
    return key.topk(k, dim=-1, sorted=False).indices


def index_topk_torch(scores: torch.Tensor, visible: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    """The torch ops of :func:`index_topk_triton` (the same arguments): int32 ``[B, 1, k]``, the
    same positions in `topk`'s unsorted order."""
    visible = visible.reshape(-1, 1, 1)  # one count per row, or one for all
    scores = scores.masked_fill(torch.arange(scores.size(-1), device=scores.device) >= visible, -torch.inf)
    picked = topk_ties_by_position(scores, k)
    return torch.where(picked < visible, picked + offset, -1).int()


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_index_topk_kernel)


def _problem(scores, visible, k, offset) -> str | None:
    # what keeps `index_topk_triton` from taking these arguments (None: nothing)
    if not isinstance(scores, torch.Tensor) or not isinstance(visible, torch.Tensor):
        return "scores and visible must be tensors"
    if scores.dtype != torch.bfloat16 or scores.dim() != 3 or scores.size(1) != 1:
        return f"scores must be bf16 [B, 1, W], got {scores.dtype} {tuple(scores.shape)}"
    batch, width = scores.size(0), scores.size(2)
    if not 0 < width <= MAX_WIDTH:
        return f"a width of {width} positions is outside the kernel's 1 to {MAX_WIDTH}"
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= width:
        return f"k must be an int from 1 to the width {width}, got {k!r}"
    if visible.dtype != torch.int64 or visible.numel() not in (1, batch):
        return f"visible must hold one int64 count per row (or one for all), got {visible.dtype} {tuple(visible.shape)}"
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= _INT32_MAX - width:
        return f"offset must be an int from 0 to {_INT32_MAX} - W (int32 indices), got {offset!r}"
    if scores.device != visible.device:
        return f"scores are on {scores.device}, visible on {visible.device}"
    return unrunnable(scores.device, _kernel_is_interpreted(), "index_topk_triton")


def kernel_runs(scores, visible, k, offset) -> bool:
    """Whether :func:`index_topk_triton` takes these arguments (else it raises, naming why): the
    caller asks first and otherwise runs :func:`index_topk_torch`."""
    return _problem(scores, visible, k, offset) is None


@on_input_device
def index_topk_triton(scores: torch.Tensor, visible: torch.Tensor, k: int, offset: int) -> torch.Tensor:
    """The `k` best visible positions of each row, ties to the lower position, in one launch.

    Args:
        scores: bf16 ``[B, 1, W]`` index scores (any strides along B), W up to :data:`MAX_WIDTH`;
            no NaN.
        visible: int64, one per row (``[B, 1, 1]``, ``[B]``, any strides) or one for all: the
            positions each row's query sees; positions from it on score -inf (and are written as
            -1 if kept).
        k: positions kept per row, 1 to W.
        offset: int >= 0 added to each kept visible position (the window rows before the
            compressed KV), ``offset + W`` within int32.

    Returns:
        int32 ``[B, 1, k]``: the kept positions plus `offset` in ascending position, -1 for kept
        positions that are not visible (a row seeing fewer than `k`).

    Raises:
        IndexTopkError: other dtypes or shapes, W past the limit, k or offset out of range,
            tensors on two devices, Triton missing, or CPU tensors outside Triton's interpreter.
    """
    problem = _problem(scores, visible, k, offset)
    if problem is not None:
        raise IndexTopkError(problem)
    batch, width = scores.size(0), scores.size(2)
    src = scores if scores.stride(2) == 1 else scores.contiguous()
    counts = visible.reshape(-1)
    out = torch.empty(batch, 1, k, dtype=torch.int32, device=scores.device)
    _index_topk_kernel[(batch,)](
        src, counts, out, width, k, offset, src.stride(0), counts.stride(0) if counts.numel() > 1 else 0,
        BLOCK=max(16, triton.next_power_of_2(width)), num_warps=8 if width > 2048 else 4,
    )
    return out


__all__ = [
    "ENV_BACKEND",
    "MAX_WIDTH",
    "IndexTopkError",
    "index_topk_torch",
    "index_topk_triton",
    "kernel_runs",
    "topk_ties_by_position",
]
