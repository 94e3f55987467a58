"""Compressed sparse attention of DeepSeek-V4.1 (REFERENCE.md section 6).

Dataflow of one layer (x = attn_norm output, bf16 ``[B, S, dim]``)::

    x ──wq_a──q_norm──► qr ──wq_b──► q [B,S,H,D] ──RoPE(last rd)──┐
    x ──wkv──kv_norm──RoPE──fp8 fake-quant──► window KV [B,S,D] ───┤ (+ ring buffer for decode)
    x ──compressor (kv sources only)──► latent (pre-RoPE) ──┐      │
        indexer (index sources): wq_b(qr), weights_proj(x), │      │
        index keys from the latent ─► top-k compressed idxs │      │
        latent ──RoPE @ group-first pos──fp4 fake-quant──► compressed KV
                                                            ▼      ▼
               sparse_attention(q, [window KV ; compressed KV], sink, [window idx ; idx + offset])
                                 ──inverse RoPE──grouped wo_a (bf16 einsum)──wo_b──► [B,S,dim]

Layers hand things down the stack within one forward: kv sources publish compressed KV and index
keys, index sources publish top-k indices, the candidate source publishes its candidate blocks.
Here that is explicit: the caller creates one :class:`DeepseekV41AttentionState` per forward (around
a :class:`DeepseekV41AttentionCache` that persists across forwards for decoding) and passes it to
every layer in order. Nothing is kept in module globals.

Forwards the reference supports: a prefill at position 0, then one-token decode steps. Two more
are supported here (the reference cannot do either):

- **Chunked prefill**: a chunk of S > 1 tokens after position 0 continues the sequence as if it had
  been part of one prefill. Its queries see the window KV of the last `window` positions (the ring
  of earlier chunks, then this chunk's rows), the ratio-2 compressor completes the partial group
  parked by the previous chunk, a compressed position becomes visible once its group is complete
  (j < (t + 1) // ratio), and the indexer ranks every compressed position so far. The index lists
  keep the one-shot layout (window columns first, ascending, -1 padded; then the top-k columns).
- **Left padding**: `DeepseekV41AttentionState.pad_offsets` (``[B]`` pad tokens before each row's
  first real token, see :func:`left_padding_offsets`) makes every row behave as if it started at
  its first real token: RoPE positions, the window's lower bound, the compressor's groups (pairs
  of absolute positions counted from the row's first token), visibility, the compressed rows
  (stored per row at their own group index) and the reference's "last publisher" of index keys
  are all per row. Pad positions' outputs are don't-care; nothing real ever reads them. In exact
  numerics the indexer then ranks each row over exactly its own compressed positions, as the row
  alone would (`torch.topk` breaks ties depending on the row's width).

Numerics follow the reference op for op (fp32 RMSNorm/RoPE/pooling, bf16 index scores, the
online-softmax order of `kernel.sparse_attn`), so on CPU with ``numerics="exact"`` the outputs are
bitwise equal to the reference's.

``numerics="fast"`` keeps every value's formula but bounds memory for long prefills: the query
path (wq_b, attention, wo_a/wo_b), the indexer (queries, scores, both top-k levels) and the ratio-2
compressor run over query chunks, each indexer chunk scores only the compressed positions visible
to it, and the candidate source hands down kept block ids ``[B, S, <= candidate_topk_blocks]``
instead of a ``[B, S, T]`` mask. What stays per forward is O(S x (window + index_topk)) indices
plus one chunk's intermediates. The attention itself runs through
`triton_ops/sparse_attention.py` (the Triton kernel on CUDA, its torch fallback elsewhere; exact
numerics always take the fallback with the reference's op shapes).

One-token decode steps in fast numerics without padding have a second, graph-safe form
(:meth:`DeepseekV41Attention.decode_plan` / :meth:`~DeepseekV41Attention.decode_static` /
:meth:`~DeepseekV41Attention.decode_commit`): the host plans the step (which buffers, how wide),
and the step itself has no shape or branch that depends on the sequence length: caches are written
in place with ``index_copy_`` at the device position, the compressed rows and index keys are read
in a power-of-two width with the rows past the ones in use masked, and the top-k keeps the same
set as :meth:`forward` (listed in another order), so a CUDA graph of it stays valid from step to
step (see `cuda_graphs_deepseek_v41_vl.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.sparse_attention import SPARSE_ATTN_BLOCK
from ..triton_ops.rms_norm import MAX_COLS as RMS_NORM_MAX_COLS
from ..triton_ops.rms_norm import resolve_rms_norm_backend, rms_norm_triton
from ..triton_ops.sparse_attention import resolve_backend as resolve_sparse_backend
from ..triton_ops.sparse_attention import sparse_attention as sparse_attention_op
from .quantization_deepseek_v41_vl import DeepseekV41Linear, fake_quant_fp4, fake_quant_fp8
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, apply_rotary

# Compressed KV: fp4 in groups of 16 with e4m3 scales; indexer q/k: groups of 32 with e8m0 scales.
COMPRESSED_KV_FP4 = (16, "e4m3")
INDEXER_FP4 = (32, "ue8m0")


# "fast" numerics bound the largest intermediates by splitting the queries into chunks; "exact"
# keeps the reference's single-call shapes (CPU GEMM rounding may depend on them).
FAST_MAX_ELEMENTS = 1 << 26
# On a GPU a larger budget (0.5 GiB of bf16 per intermediate) keeps each chunk's kernels long
# enough that launch overhead stays small against their run time.
FAST_MAX_ELEMENTS_CUDA = 1 << 28


def _query_chunk(numerics: str, per_query_elements: int, device: torch.device | None = None) -> int | None:
    """Queries per chunk so that a chunk's largest intermediate stays within the budget; None = all
    at once (exact numerics)."""
    if numerics == "exact":
        return None
    budget = FAST_MAX_ELEMENTS_CUDA if device is not None and device.type == "cuda" else FAST_MAX_ELEMENTS
    return max(1, budget // max(per_query_elements, 1))


class DeepseekV41AttentionError(ValueError):
    """Unsupported call pattern (e.g. a multi-token chunk after position 0) or inconsistent state."""


class DeepseekV41RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in fp32, cast back to x's dtype.

    Mirrors `inference/model.py: RMSNorm`. The weight holds bf16 values (the checkpoint's); it is
    promoted to fp32 for the product, so holding it in fp32 gives identical results. With
    ``numerics="fast"`` (attribute `fused`), bf16 rows on CUDA go through one Triton kernel
    (`triton_ops/rms_norm.py`; the same formula, the mean summed in another order;
    ``DEEPSEEK_V41_RMSNORM_BACKEND`` overrides the choice).
    """

    def __init__(self, dim: int, eps: float = 1e-20, numerics: str = "exact"):
        super().__init__()
        self.eps = eps
        self.fused = numerics == "fast"
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.fused
            and x.dtype == torch.bfloat16
            and self.weight.dtype == torch.bfloat16
            and x.size(-1) <= RMS_NORM_MAX_COLS
            and resolve_rms_norm_backend(None, x.device) == "triton"
        ):
            return rms_norm_triton(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


# --------------------------------------------------------------------------- caches and state


class _RowBuffer:
    """Rows ``[B, n, D]`` appended along dim 1, stored with doubling capacity.

    `length` is the number of rows of the longest batch row; with left padding a shorter batch row
    holds zeros past its own end (nothing reads them: they are never visible to its queries).
    """

    def __init__(self, rows: torch.Tensor):
        # a copy, never a view: the rows may be a CUDA graph's output, rewritten by its next replay
        self._data = rows.clone(memory_format=torch.contiguous_format)
        self.length = rows.size(1)

    @classmethod
    def empty(cls, like: torch.Tensor) -> "_RowBuffer":
        """A buffer with no rows, for `like`'s batch, width, dtype and device."""
        return cls(like.new_zeros(like.size(0), 0, like.size(-1)))

    def _grow(self, end: int) -> None:
        if end > self._data.size(1):
            grown = self._data.new_zeros(self._data.size(0), max(end, 2 * self._data.size(1)), self._data.size(2))
            grown[:, : self.length] = self._data[:, : self.length]
            self._data = grown

    def write(self, start: int, rows: torch.Tensor) -> None:
        if start != self.length:
            raise DeepseekV41AttentionError(f"cache rows must be appended in order: row {start} after {self.length}")
        end = start + rows.size(1)
        self._grow(end)
        self._data[:, start:end] = rows
        self.length = end

    def scatter(self, index: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Per batch row writes: ``data[b, index[b, i]] = rows[b, i]`` where ``valid[b, i]``.

        index: int64 ``[B, n]`` (each batch row's own group indices), rows ``[B, n, D]``, valid bool
        ``[B, n]``.
        """
        if not bool(valid.any()):
            return
        end = int(index[valid].max()) + 1
        self._grow(end)
        batch = torch.arange(index.size(0), device=index.device).unsqueeze(1).expand_as(index)
        self._data[batch[valid], index[valid]] = rows[valid].to(self._data.dtype)
        self.length = max(self.length, end)

    def rows(self, n: int) -> torch.Tensor:
        if n > self.length:
            raise DeepseekV41AttentionError(f"asked for {n} cached rows, only {self.length} exist")
        return self._data[:, :n]

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` rows (the storage moves only when it grows)."""
        self._grow(capacity)

    def storage(self, n: int) -> torch.Tensor:
        """The first `n` rows of the storage, written or not (``n <= capacity``; a decode step
        captured in a CUDA graph reads a fixed width and masks the rows past `length`)."""
        if n > self._data.size(1):
            raise DeepseekV41AttentionError(f"asked for {n} storage rows, the capacity is {self._data.size(1)}")
        return self._data[:, :n]

    def write_at(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` ``[B, n, D]`` at the storage rows `index` (int64 ``[n]``, on the device):
        no host synchronisation, so a CUDA graph may capture it. `length` is left to the caller,
        who knows the step's position on the host."""
        self._data.index_copy_(1, index, rows.to(self._data.dtype))

    @property
    def address(self) -> int:
        return self._data.data_ptr()

    @property
    def device(self) -> torch.device:
        return self._data.device


@dataclass
class DeepseekV41LayerAttentionCache:
    """What one attention layer keeps between forwards (decode).

    Attributes:
        window_kv: bf16 ``[B, W, D]`` ring buffer, position p in slot p % W (fp8-fake-quantized KV).
        compressed_kv: kv sources: RoPE'd, fp4-fake-quantized latents ``[B, T, D]``.
        index_k: kv sources: index keys ``[B, T, index_head_dim]``.
        compressor_kv / compressor_score: ratio>1 kv sources: fp32 ``[B, ratio, D]`` partial group
            (score initialised to -inf), slot = position % ratio.
    """

    window_kv: torch.Tensor | None = None
    compressed_kv: _RowBuffer | None = None
    index_k: _RowBuffer | None = None
    compressor_kv: torch.Tensor | None = None
    compressor_score: torch.Tensor | None = None


class DeepseekV41AttentionCache:
    """Per-sequence-batch attention cache: one :class:`DeepseekV41LayerAttentionCache` per layer.

    `index_k_publisher` reproduces a reference detail: index keys are read from the kv source that
    most recently *published* keys (`shared_attn.index_k`), and a ratio-2 source publishes only when
    its group completes. On a decode step that completes no group, a ratio-2 indexer therefore reads
    the keys of the last publisher of the previous forward (the ratio-1 source). Kept so decode
    matches the reference tensor for tensor.

    With left padding the batch rows reach their group boundaries at different steps, so the
    publisher is per batch row: `index_k_publisher_rows` (int64 ``[B]``, -1 = none yet) when the
    rows differ, None when they agree (then `index_k_publisher` is every row's).

    Attributes:
        layers: layer id -> :class:`DeepseekV41LayerAttentionCache`.
        index_k_publisher: the layer whose index keys were published last (None before any).
        index_k_publisher_rows: per batch row publisher when the rows differ, else None.
        pad_offsets: int64 ``[B]`` left-padding of the batch rows as last given by the caller
            (:func:`left_padding_offsets`), reused by forwards that pass none; None = no padding.
        prefill_length: optional, set by a caller that prefills a prompt of this many (padded)
            columns in several chunks. Exact numerics then give each chunk's index lists the
            widths one prefill of the whole prompt has (window columns, top-k columns) and rank
            the indexer scores over the same width, padding with -inf: `torch.topk` breaks exact
            ties depending on the width it ranks, so this makes chunks pick what one prefill
            picks. Without it a chunk ranks the positions that exist so far (the same selection
            up to tie choices).
    """

    def __init__(self):
        self.layers: dict[int, DeepseekV41LayerAttentionCache] = {}
        self.seen_tokens = 0  # kept up to date by the owning transformers cache
        self.index_k_publisher: int | None = None
        self.index_k_publisher_rows: torch.Tensor | None = None
        self.pad_offsets: torch.Tensor | None = None
        self.prefill_length: int | None = None

    def layer(self, layer_id: int) -> DeepseekV41LayerAttentionCache:
        return self.layers.setdefault(layer_id, DeepseekV41LayerAttentionCache())

    def publish_index_keys(self, layer_id: int, rows: torch.Tensor | None = None) -> None:
        """Record that `layer_id` published index keys, for all batch rows or those where `rows`
        (bool ``[B]``) is True."""
        if rows is None or bool(rows.all()):
            self.index_k_publisher, self.index_k_publisher_rows = layer_id, None
            return
        if not bool(rows.any()):
            return
        current = self.index_k_publisher_rows
        if current is None:
            current = torch.full(rows.shape, -1 if self.index_k_publisher is None else self.index_k_publisher,
                                 dtype=torch.int64, device=rows.device)
        self.index_k_publisher_rows = torch.where(rows, layer_id, current)
        self.index_k_publisher = layer_id

    def index_keys(self, n: int, reader: int, device: torch.device | None = None) -> torch.Tensor:
        """The first `n` published index keys ``[B, n, index_head_dim]``, each batch row's from its
        own last publisher (rows without one get zeros; they see no compressed position), on
        `device` when given (the publisher may sit on another GPU).

        Raises:
            DeepseekV41AttentionError: nothing published yet (`reader` names the asking layer).
        """
        if self.index_k_publisher is None:
            raise DeepseekV41AttentionError(f"layer {reader}: no index keys were published before its indexer")
        if self.index_k_publisher_rows is None:
            rows = self.layer(self.index_k_publisher).index_k.rows(n)
            return rows if device is None else rows.to(device)
        publishers = self.index_k_publisher_rows
        keys = None
        for layer_id in sorted(set(publishers.tolist()) - {-1}):
            rows = self.layer(layer_id).index_k.rows(n)
            rows = rows.to(publishers.device if device is None else device)
            publishers = publishers.to(rows.device)
            if keys is None:
                keys = torch.where((publishers == layer_id).view(-1, 1, 1), rows, torch.zeros_like(rows))
            else:
                keys = torch.where((publishers == layer_id).view(-1, 1, 1), rows, keys)
        return keys


@dataclass
class DeepseekV41AttentionState:
    """Hand-down slots of one forward pass, created by the caller and passed to every layer in order.

    Mirrors `inference/model.py: SharedAttentionRuntime` (`shared_attn`), without the module global.

    Attributes:
        start_pos: absolute position of the first token of this forward (0 = prefill).
        cache: persistent per-layer caches (a fresh one when not given).
        topk_idxs: index source layer -> its top-k compressed indices ``[B, S, k]`` (int32, already
            offset into the concatenated KV, -1 = none).
        candidates: ``numerics="exact"``: the candidate source's bool mask ``[B, S, T]``, as the
            reference keeps it (None until it ran).
        candidate_blocks: ``numerics="fast"``: the candidate source's kept block ids
            ``[B, S, min(candidate_topk_blocks, ceil(T / candidate_block_size))]``, -1 = none,
            int16 (int32 past 32767 blocks) (None until it ran). The same set as `candidates`, in
            O(S x candidate_topk_blocks) memory instead of O(S x T).
        record_index_scores: keep each indexer's masked scores in `index_scores` (tests, analysis).
        pad_offsets: int64 ``[B]`` pad tokens before each row's first real token (left padding;
            positions are then counted per row from its first real token), or None. `start_pos`
            stays the padded column index of the first token of this forward.
    """

    start_pos: int = 0
    cache: DeepseekV41AttentionCache = field(default_factory=DeepseekV41AttentionCache)
    topk_idxs: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    record_index_scores: bool = False
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_blocks: torch.Tensor | None = None  # last: keeps the older fields' positions
    pad_offsets: torch.Tensor | None = None
    _pads: list[int] | None = field(default=None, init=False, repr=False)  # pad_offsets on the host
    # tables every layer of a one-token step would build alike (RoPE rows, window index lists),
    # built by the first layer that asks: each saves a few kernel launches per layer and step
    _step_tables: dict = field(default_factory=dict, init=False, repr=False)

    def step_table(self, key: tuple, build):
        """`build()` once per forward for `key`; later calls return the same (read-only) tensor."""
        if key not in self._step_tables:
            self._step_tables[key] = build()
        return self._step_tables[key]

    def positions(self, seqlen: int, device=None) -> torch.Tensor:
        """Positions of this forward's tokens: int64 ``[S]`` (start_pos .. start_pos + S - 1), or
        with `pad_offsets` ``[B, S]`` counted from each row's first real token (pads negative)."""
        pos = torch.arange(self.start_pos, self.start_pos + seqlen, device=device)
        if self.pad_offsets is None:
            return pos
        return pos - self.pad_offsets.to(device=pos.device, dtype=torch.int64).unsqueeze(1)

    def _host_pads(self) -> list[int]:
        if self.pad_offsets is None:
            return [0]
        if self._pads is None:
            self._pads = self.pad_offsets.tolist()  # one device sync per forward
        return self._pads

    def real_ends(self, seqlen: int) -> list[int]:
        """Per batch row: real tokens up to the end of this forward of `seqlen` tokens (the row's
        sequence length so far). Without padding a single entry, ``start_pos + S``."""
        end = self.start_pos + seqlen
        return [max(0, end - pad) for pad in self._host_pads()]

    def min_pad(self) -> int:
        """The fewest pad tokens of any batch row (0 without padding)."""
        return min(self._host_pads())

    def rank_ends(self, seqlen: int) -> list[int]:
        """Per batch row: the sequence length whose widths this forward's index lists take (see
        `DeepseekV41AttentionCache.prefill_length`): the real length so far, or for a chunk of a
        prompt of known length the row's length at the end of the prompt."""
        ends = self.real_ends(seqlen)
        total = self.cache.prefill_length
        if total is None or seqlen == 1 or self.start_pos + seqlen > total:
            return ends
        return [max(end, total - pad) for end, pad in zip(ends, self._host_pads())]

    def window_span(self, seqlen: int) -> int:
        """Padded columns whose window layout this multi-token forward takes (one prefill's)."""
        total = self.cache.prefill_length
        end = self.start_pos + seqlen
        return max(end, total) if total is not None and end <= total else end

    def max_real_end(self, seqlen: int) -> int:
        """The longest row's sequence length after this forward (``start_pos + S`` unpadded)."""
        return max(self.real_ends(seqlen))


# --------------------------------------------------------------------------- index helpers


def window_topk_idxs(window: int, batch: int, seqlen: int, start_pos: int, device=None) -> torch.Tensor:
    """Window KV rows each query attends to, int32 ``[B, S, min(S, W)]`` (prefill) or ``[B, 1, W]``.

    Prefill: query t sees rows max(0, t-W+1) .. t of the chunk (-1 pads t < W-1). Decode: the ring
    slots oldest to newest, -1 for slots not yet written. Mirrors `model.py: get_window_topk_idxs`.
    """
    if start_pos == 0:
        last = torch.arange(seqlen, device=device).unsqueeze(1)
        idxs = (last - window + 1).clamp(0) + torch.arange(min(seqlen, window), device=device)
        idxs = torch.where(idxs > last, -1, idxs)
    else:
        oldest = start_pos % window + 1
        idxs = torch.cat([torch.arange(oldest, window, device=device), torch.arange(oldest, device=device)])
        idxs = torch.where(idxs > start_pos, -1, idxs).unsqueeze(0)
    return idxs.int().unsqueeze(0).expand(batch, -1, -1).contiguous()


def chunk_window_idxs(
    window: int,
    batch: int,
    seqlen: int,
    start_pos: int,
    pad_offsets: torch.Tensor | None = None,
    device=None,
    span: int | None = None,
) -> torch.Tensor:
    """Window rows of a multi-token forward (a prefill, or a prefill chunk after position 0).

    The KV rows are this forward's S rows, preceded (start_pos > 0) by the `window` ring slots of
    the earlier positions (slot = position % window). Query t (padded column start_pos + i) sees
    the positions max(t - window + 1, first real position of its row) .. t, ascending in columns
    0, 1, ..., then -1: the layout of a one-shot prefill, so a chunk's rows match it.

    Returns:
        int32 ``[B, S, min(window, span)]`` (`span` defaults to start_pos + S: the layout of a
        prefill ending here); at start_pos 0 without padding exactly :func:`window_topk_idxs`.
    """
    pos = torch.arange(start_pos, start_pos + seqlen, device=device)
    width = min(window, max(start_pos + seqlen, span or 0))
    low = (pos - window + 1).clamp_min(0).unsqueeze(0)  # [1, S]
    if pad_offsets is not None:
        low = torch.maximum(low, pad_offsets.to(device=pos.device, dtype=torch.int64).unsqueeze(1))  # [B, S]
    seen = low.unsqueeze(-1) + torch.arange(width, device=pos.device)  # positions, [.., S, width]
    if start_pos > 0:
        rows = torch.where(seen < start_pos, seen % window, window + seen - start_pos)
    else:
        rows = seen
    idxs = torch.where(seen > pos.unsqueeze(-1), -1, rows).int()
    return idxs.expand(batch, -1, -1).contiguous()


def decode_window_idxs(window: int, batch: int, start_pos: int, pad_offsets: torch.Tensor | None = None, device=None):
    """Ring slots of a one-token step, oldest to newest (:func:`window_topk_idxs`), with the slots
    of a left-padded row's pad positions set to -1. int32 ``[B, 1, window]``."""
    idxs = window_topk_idxs(window, batch, 1, start_pos, device)
    if pad_offsets is None:
        return idxs
    # column c holds position start_pos - window + 1 + c
    held = torch.arange(start_pos - window + 1, start_pos + 1, device=idxs.device)
    pads = pad_offsets.to(device=idxs.device, dtype=torch.int64).view(-1, 1, 1)
    return torch.where(held < pads, -1, idxs).int()


def decode_window_idxs_at(window: int, batch: int, pos: torch.Tensor) -> torch.Tensor:
    """:func:`decode_window_idxs` without padding, from the step's position as a device tensor
    (int64 ``[1]``): the same int32 ``[B, 1, window]``, built without the host (graph-safe)."""
    slots = (pos % window + 1 + torch.arange(window, device=pos.device)) % window  # oldest first
    slots = torch.where(slots > pos, -1, slots).int()
    return slots.view(1, 1, window).expand(batch, 1, window).contiguous()


def left_padding_offsets(attention_mask: torch.Tensor | None, past_length: int, seqlen: int) -> torch.Tensor | None:
    """Pad tokens before each row's first real token, from a transformers attention mask.

    Args:
        attention_mask: ``[B, past_length + S]`` (1 = token, 0 = padding) covering every position
            so far, as `generate` passes it; None = no padding.
        past_length: positions processed before this forward.
        seqlen: S, the tokens of this forward.

    Returns:
        int64 ``[B]`` (the leading zeros of each row; a row padded throughout gets the mask width),
        or None when no row has padding.

    Raises:
        DeepseekV41AttentionError: a mask of another width, values other than 0/1, or padding that
            is not on the left (a 0 after a 1).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.size(1) != past_length + seqlen:
        raise DeepseekV41AttentionError(
            f"attention_mask must be [batch, past + seq] = [B, {past_length + seqlen}], got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(torch.int64)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise DeepseekV41AttentionError("attention_mask must hold only 0 (padding) and 1 (token)")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise DeepseekV41AttentionError(
            "only left padding is supported: attention_mask has a 0 after a 1 (pad the batch on the left)"
        )
    pads = (mask == 0).sum(dim=1)
    return pads if bool(pads.any()) else None


def candidate_block_ids(
    scores: torch.Tensor, compress_lens: torch.Tensor | int, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Level one of the two-level top-k, as block ids: the `topk_blocks` best blocks of `block_size`.

    Args:
        scores: ``[..., T]`` index scores with unreachable positions at -inf.
        compress_lens: visible compressed count per query (broadcasts against the leading dims), or
            an int during decode.
    Returns:
        int64 ``[..., min(topk_blocks, ceil(T / block_size))]``: kept block ids in `topk` order, -1
        for picks that came back -inf (dropped). A block's score is its max; the block holding the
        query's newest visible position is always kept.

    Mirrors `inference/model.py: select_candidate_blocks` up to the expansion to positions.
    """
    width = scores.size(-1)
    blocks = F.pad(scores, (0, -width % block_size), value=-torch.inf).unflatten(-1, (-1, block_size)).amax(dim=-1)
    n_blocks = blocks.size(-1)
    newest = (compress_lens - 1) // block_size
    blocks = blocks.masked_fill(torch.arange(n_blocks, device=scores.device) == newest, torch.inf)
    top = blocks.topk(min(topk_blocks, n_blocks), dim=-1)
    return torch.where(top.values > -torch.inf, top.indices, -1)


def candidate_mask_from_blocks(block_ids: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """Expand kept block ids ``[..., kb]`` (-1 = none) to a bool mask ``[..., width]`` over positions.

    Ids at or beyond ``ceil(width / block_size)`` select nothing inside `width`.
    """
    n_blocks = -(-width // block_size)
    dump = torch.where((block_ids < 0) | (block_ids >= n_blocks), n_blocks, block_ids).long()
    keep = torch.zeros(*block_ids.shape[:-1], n_blocks + 1, dtype=torch.bool, device=block_ids.device)
    keep.scatter_(-1, dump, True)
    return keep[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :width]


def select_candidate_blocks(
    scores: torch.Tensor, compress_lens: torch.Tensor | int, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Level one of the two-level top-k as a position mask (the reference's form).

    Args:
        scores: ``[..., T]`` index scores with unreachable positions at -inf.
        compress_lens: visible compressed count per query (broadcasts against the leading dims), or
            an int during decode.
    Returns:
        bool ``[..., T]``: True inside a kept block (see :func:`candidate_block_ids`).

    Mirrors `inference/model.py: select_candidate_blocks`.
    """
    ids = candidate_block_ids(scores, compress_lens, topk_blocks, block_size)
    return candidate_mask_from_blocks(ids, scores.size(-1), block_size)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    softmax_scale: float,
    query_chunk: int | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Single-latent-head attention over gathered rows with an attention sink, in the reference's
    argument order (`kernel.sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale)`).

    Args:
        q: bf16 ``[B, M, H, D]``; kv: bf16 ``[B, N, D]`` (K = V); attn_sink: fp32 ``[H]`` (a logit in
            the denominator only, unscaled); topk_idxs: int32 ``[B, M, K]`` rows of kv, -1 = none.
        softmax_scale: multiplies q.k.
        query_chunk: torch backend: this many queries at a time (None = all at once, the
            reference's exact op shapes).
        backend: ``"torch"`` (default: the reference's op sequence), ``"triton"`` or ``"auto"``.

    Returns:
        bf16 ``[B, M, H, D]``; a row without any valid index gives 0.

    Raises:
        SparseAttentionError: see `triton_ops/sparse_attention.py: sparse_attention`, which this
            calls (the one implementation of the semantics: online softmax over blocks of 64
            indices, bf16 probabilities before PV, sink in the denominator).
    """
    return sparse_attention_op(q, kv, topk_idxs, attn_sink, softmax_scale, backend=backend, query_chunk=query_chunk)


# --------------------------------------------------------------------------- submodules


@dataclass
class _Latents:
    """Latents one forward's compressor emits (pre-RoPE, bf16 ``[B, n, D]``).

    groups: int64 group index j of each latent (its RoPE position is j * ratio): ``[n]`` when all
    batch rows emit the same groups (then `first` is groups[0] as an int and `valid` None), else
    ``[B, n]`` with `valid` bool ``[B, n]`` marking the latents that exist (left padding).
    """

    values: torch.Tensor
    groups: torch.Tensor
    valid: torch.Tensor | None = None
    first: int | None = None

    def store(self, buffer: _RowBuffer | None, rows: torch.Tensor, fresh: bool) -> _RowBuffer:
        """Write `rows` (``[B, n, .]``, one per latent) into `buffer` (a new one when `fresh`)."""
        if self.valid is None:
            if fresh or buffer is None:
                if self.first == 0:
                    return _RowBuffer(rows)
                buffer = _RowBuffer.empty(rows)
            buffer.write(self.first, rows)
            return buffer
        if fresh or buffer is None:
            buffer = _RowBuffer.empty(rows)
        buffer.scatter(self.groups, rows, self.valid)
        return buffer


@dataclass
class DecodeProjections:
    """What a one-token step computes from the token alone (fixed shapes, CUDA-graph safe), handed
    to the cache-dependent middle (:meth:`DeepseekV41Attention.decode_attend`). Fields a layer
    does not have are None.

    Attributes:
        index_q, index_weights: the indexer's fp4 query ``[B, 1, IH, Id]`` and head weights
            ``[B, 1, IH]`` (index sources).
        compressor_kv, compressor_score: fp32 ``[B, 1, D]`` projections of the ratio-2 compressor.
        latent: the latent this step completes, normalized ``[B, 1, D]`` (pre-RoPE): every step of
            a ratio-1 compressor; for ratio > 1 the steps that end a group (pooled with the parked
            slots, which the caller passes in);
        latent_kv: its RoPE'd fp4 compressed-KV row; latent_k: its fp4 index key (owners of keys).
    """

    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None
    compressor_kv: torch.Tensor | None = None
    compressor_score: torch.Tensor | None = None
    latent: torch.Tensor | None = None
    latent_kv: torch.Tensor | None = None
    latent_k: torch.Tensor | None = None

    def as_tuple(self) -> tuple:
        return (self.index_q, self.index_weights, self.compressor_kv, self.compressor_score,
                self.latent, self.latent_kv, self.latent_k)


# A graph-captured decode step reads the compressed rows and index keys in widths of powers of two
# (at least this many rows): a new graph only when the sequence crosses one.
DECODE_MIN_ROWS = 256


def decode_rows(visible: int) -> int:
    """Rows of a compressed buffer a graph-safe decode step reads when `visible` are in use."""
    return max(DECODE_MIN_ROWS, 1 << max(visible - 1, 0).bit_length())


@dataclass(frozen=True)
class DecodePlan:
    """Host-side layout of one layer's graph-safe decode step (:meth:`DeepseekV41Attention.decode_plan`).

    Attributes:
        visible: compressed positions the step's query sees, ``(start_pos + 1) // ratio`` (0 for a
            window-only layer).
        width: rows of the compressed KV and index keys the step reads (:func:`decode_rows`; the
            rows from `visible` on are masked).
        writes: the step appends a compressed row (and an index key, for key owners) at row
            ``visible - 1``.
        publisher: the layer whose index keys the indexer reads (index sources), else None.
        key: what a CUDA graph of the step depends on besides its tensor arguments: the above and
            the address and shape of every cache buffer it reads or writes in place.
    """

    visible: int
    width: int
    writes: bool
    publisher: int | None
    key: tuple


class DeepseekV41Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one KV latent (returned before RoPE).

    - ratio 1: latent = norm(wkv(x)), wkv bf16; no gate, no pooling.
    - ratio > 1: x in fp32, kv = wkv(x), score = wgate(x) (fp32 weights), per-channel softmax of the
      score over the group's tokens, latent = sum(kv * softmax), cast to bf16, then norm. Groups are
      aligned to absolute positions (r*j .. r*j + r-1); a trailing partial group is parked in the
      cache and completed by later forwards (decode steps or prefill chunks). With left padding the
      positions are each row's own (counted from its first real token). ``numerics="fast"``
      projects the rows in chunks (the fp32 copy of x is the largest intermediate); the values
      are the same.

    Mirrors `inference/model.py: Compressor`.
    """

    def __init__(self, config, layer_id: int, numerics: str):
        super().__init__()
        self.ratio = config.compress_ratios[layer_id]
        self.numerics = numerics
        head_dim = config.head_dim
        self.norm = DeepseekV41RMSNorm(head_dim, config.rms_norm_eps, numerics)
        if self.ratio == 1:
            self.wkv = DeepseekV41Linear(config.hidden_size, head_dim, "bf16", numerics)
        else:
            self.wkv = DeepseekV41Linear(config.hidden_size, head_dim, "fp32", numerics)
            self.wgate = DeepseekV41Linear(config.hidden_size, head_dim, "fp32", numerics)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        cache: DeepseekV41LayerAttentionCache,
        pad_offsets: torch.Tensor | None = None,
        projected: DecodeProjections | None = None,
    ) -> _Latents | None:
        """x bf16 ``[B, S, dim]`` at padded columns start_pos.. -> the latents it completes, or None.
        `projected`: a one-token step's :meth:`decode_project` output (same values, computed earlier).

        Raises:
            DeepseekV41AttentionError: a forward after position 0 before any prefill.
        """
        ratio, dtype = self.ratio, x.dtype
        bsz, seqlen, _ = x.shape
        if ratio == 1:
            latent = projected.latent if projected is not None else self.norm(self.wkv(x))
            pos = torch.arange(start_pos, start_pos + seqlen, device=x.device)
            if pad_offsets is None:
                return _Latents(latent, pos, first=start_pos)
            pos = pos - pad_offsets.to(device=x.device, dtype=torch.int64).unsqueeze(1)
            return _Latents(latent, pos.clamp_min(0), valid=pos >= 0)
        if start_pos == 0 and pad_offsets is None:
            pooled = self._prefill(x, cache)
            if pooled is None:
                return None
            groups = torch.arange(pooled.size(1), device=x.device)
            return _Latents(self.norm(pooled.to(dtype)), groups, first=0)
        if start_pos > 0 and cache.compressor_kv is None:
            raise DeepseekV41AttentionError("a forward after position 0 before any prefill: the compressor has no state")
        if start_pos == 0:
            self._new_state(x, cache)  # a new sequence (left-padded prefill)
        kv_score = None if projected is None else (projected.compressor_kv, projected.compressor_score)
        if seqlen == 1 and pad_offsets is None:
            return self._step(x, start_pos, cache, kv_score, None if projected is None else projected.latent)
        return self._continue(x, start_pos, cache, pad_offsets, kv_score)

    def decode_project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A one-token step's projections of `x` ``[B, 1, dim]``: ratio 1 ``(latent,)`` (normalized,
        pre-RoPE), ratio 2 ``(kv, score)`` fp32."""
        if self.ratio == 1:
            return (self.norm(self.wkv(x)),)
        xf = x.float()
        return self.wkv(xf), self.wgate(xf)

    def pool_last(self, parked_kv: torch.Tensor, parked_score: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, dtype):
        """The latent of a group ended by a step's `kv`/`score` ``[B, 1, D]`` after the parked slots
        ``[B, ratio, D]`` (the last one is the step's own and ignored): normalized ``[B, 1, D]``,
        the same operations as :meth:`_step`."""
        group_kv = torch.cat([parked_kv[:, : self.ratio - 1], kv], dim=1)
        group_score = torch.cat([parked_score[:, : self.ratio - 1], score], dim=1)
        pooled = (group_kv * group_score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(dtype))

    def pool_parked(self, cache: DeepseekV41LayerAttentionCache, dtype) -> torch.Tensor:
        """The latent of the group held in the parked slots (all `ratio` written): normalized
        ``[B, 1, D]`` in `dtype`, the reference's `Compressor` decode pooling."""
        pooled = (cache.compressor_kv * cache.compressor_score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(dtype))

    def ends_group(self, start_pos: int) -> bool:
        """Whether a one-token step at `start_pos` (no padding) completes a group."""
        return self.ratio > 1 and (start_pos + 1) % self.ratio == 0

    def _new_state(self, x: torch.Tensor, cache: DeepseekV41LayerAttentionCache) -> None:
        head_dim = self.wkv.out_features
        cache.compressor_kv = x.new_zeros(x.size(0), self.ratio, head_dim, dtype=torch.float32)
        cache.compressor_score = x.new_full((x.size(0), self.ratio, head_dim), -torch.inf, dtype=torch.float32)

    def _step(
        self, x: torch.Tensor, start_pos: int, cache: DeepseekV41LayerAttentionCache, kv_score=None, latent=None
    ) -> _Latents | None:
        """One decode token (no padding): the reference's slot update, a latent when the group ends
        (`latent`: that latent, already pooled by :meth:`pool_last`)."""
        ratio = self.ratio
        kv, score = kv_score if kv_score is not None else self.decode_project(x)
        slot = start_pos % ratio
        cache.compressor_kv[:, slot] = kv.squeeze(1)
        cache.compressor_score[:, slot] = score.squeeze(1)
        if (start_pos + 1) % ratio:
            return None
        if latent is None:
            latent = self.pool_parked(cache, x.dtype)
        group = start_pos // ratio
        return _Latents(latent, torch.arange(group, group + 1, device=x.device), first=group)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 kv and score ``[B, S, D]`` of every row (fast numerics: in row chunks)."""
        bsz, seqlen, dim = x.shape
        chunk = _query_chunk(self.numerics, bsz * (dim + 2 * self.wkv.out_features), x.device) or seqlen
        kvs, scores = [], []
        for r in range(0, seqlen, chunk):
            xf = x[:, r : r + chunk].float()
            kvs.append(self.wkv(xf))
            scores.append(self.wgate(xf))
        if len(kvs) == 1:
            return kvs[0], scores[0]
        return torch.cat(kvs, dim=1), torch.cat(scores, dim=1)

    def _continue(
        self,
        x: torch.Tensor,
        start_pos: int,
        cache: DeepseekV41LayerAttentionCache,
        pad_offsets: torch.Tensor | None,
        kv_score: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> _Latents | None:
        """Any forward but a plain prefill or decode step: a prefill chunk after position 0, or a
        left-padded batch (prefill or step).

        Per batch row, the real positions of this forward are [first, end). Groups
        first // ratio .. end // ratio - 1 complete here; the positions of a group before `first`
        come from the parked partial group (slot = position % ratio), the others from this
        forward's rows. Positions from (end // ratio) * ratio on are parked for the next forward.
        """
        ratio, dtype = self.ratio, x.dtype
        bsz, seqlen, _ = x.shape
        device = x.device
        kv, score = kv_score if kv_score is not None else self._project(x)
        pads = (
            torch.zeros(bsz, dtype=torch.int64, device=device)
            if pad_offsets is None
            else pad_offsets.to(device=device, dtype=torch.int64)
        )
        offset = start_pos - pads  # real position of this forward's row 0, per batch row
        first = offset.clamp_min(0)
        end = (offset + seqlen).clamp_min(0)
        g_first, g_end = first // ratio, end // ratio
        n_groups = g_end - g_first
        n_max = int(n_groups.max())
        latents = None
        if n_max > 0:
            steps = torch.arange(n_max, device=device)
            groups = g_first.unsqueeze(1) + steps  # [B, n]
            valid = steps < n_groups.unsqueeze(1)
            pos = groups.unsqueeze(-1) * ratio + torch.arange(ratio, device=device)  # [B, n, ratio]
            from_rows = ratio + pos - offset.view(-1, 1, 1)  # index into [parked slots ; rows]
            source = torch.where(pos < first.view(-1, 1, 1), pos % ratio, from_rows)
            source = torch.where(valid.unsqueeze(-1), source, ratio)  # absent latents read row 0
            source = source.flatten(1).unsqueeze(-1).expand(-1, -1, kv.size(-1))
            all_kv = torch.cat([cache.compressor_kv, kv], dim=1).gather(1, source).unflatten(1, (n_max, ratio))
            all_score = torch.cat([cache.compressor_score, score], dim=1).gather(1, source).unflatten(1, (n_max, ratio))
            pooled = (all_kv * all_score.softmax(dim=2)).sum(dim=2)
            values = self.norm(pooled.to(dtype))
            if pad_offsets is None:
                group0 = start_pos // ratio  # every row alike
                latents = _Latents(values, groups[0], first=group0)
            else:
                latents = _Latents(values, groups, valid=valid)
        # park the new partial group (after reading the old one above)
        for r in range(ratio):
            t = g_end * ratio + r
            write = ((t >= first) & (t < end)).view(-1, 1)
            row = (t - offset).clamp(0, seqlen - 1).view(-1, 1, 1).expand(-1, 1, kv.size(-1))
            cache.compressor_kv[:, r] = torch.where(write, kv.gather(1, row).squeeze(1), cache.compressor_kv[:, r])
            cache.compressor_score[:, r] = torch.where(write, score.gather(1, row).squeeze(1), cache.compressor_score[:, r])
        return latents

    def _prefill(self, x: torch.Tensor, cache: DeepseekV41LayerAttentionCache) -> torch.Tensor | None:
        """Pooled fp32 groups ``[B, S // ratio, D]`` of a prefill (None if S < ratio); parks the tail."""
        ratio = self.ratio
        bsz, seqlen, dim = x.shape
        head_dim = self.wkv.out_features
        self._new_state(x, cache)
        full = seqlen - seqlen % ratio
        chunk = _query_chunk(self.numerics, bsz * (dim + 2 * head_dim), x.device)
        if chunk is None:
            spans = [(0, seqlen)]  # exact: one projection of every row, the reference's GEMM shapes
        else:
            step = max(ratio, chunk - chunk % ratio)
            spans = [(r, min(r + step, full)) for r in range(0, full, step)]
            if full < seqlen:
                spans.append((full, seqlen))
        pooled = []
        for r0, r1 in spans:
            xf = x[:, r0:r1].float()
            kv, score = self.wkv(xf), self.wgate(xf)
            if r1 > full:  # this span ends with the partial group: park it for decode
                cache.compressor_kv[:, : seqlen - full] = kv[:, full - r0 :]
                cache.compressor_score[:, : seqlen - full] = score[:, full - r0 :]
            n_rows = min(r1, full) - r0
            if n_rows > 0:
                kv, score = kv[:, :n_rows].unflatten(1, (-1, ratio)), score[:, :n_rows].unflatten(1, (-1, ratio))
                pooled.append((kv * score.softmax(dim=2)).sum(dim=2))
        if not pooled:
            return None
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)


class DeepseekV41Indexer(nn.Module):
    """Scores compressed positions per query and keeps the `index_topk` best ones.

    Index keys (owners = kv sources only): k = fp4(RoPE(k_norm(wk(latent)))) at the group-first
    positions, published for later layers. Queries: q = fp4(RoPE(wq_b(qr))) [B, S, IH, Id].
    score[t, j] = sum_h relu(q[t,h] . k[j]) * weights_proj(x)[t,h] * Id^-0.5 * IH^-0.5, in bf16;
    invisible positions (j >= (t+1)//ratio) are -inf; the candidate source publishes its kept blocks
    and candidate users mask their scores with them; top-k (unsorted) then sorted, invisible -> -1,
    the rest + offset.

    Queries are processed in chunks (``numerics="fast"``; exact mode takes all at once): each chunk
    computes its own index queries and weights, scores only the positions visible to its last query
    (a prefill chunk ending at row r sees ``r // ratio`` positions), and runs both top-k levels, so
    one chunk's ``[B, chunk, index_n_heads, T]`` product is the largest intermediate.

    Mirrors `inference/model.py: Indexer` and `select_candidate_blocks`.
    """

    def __init__(self, config, layer_id: int, weight_dtype: str, numerics: str):
        super().__init__()
        self.layer_id = layer_id
        self.numerics = numerics
        self.ratio = config.compress_ratios[layer_id]
        self.owns_k = layer_id in config.kv_source_layer_ids
        self.is_candidate_source = layer_id == config.candidate_source_layer_id
        self.uses_candidates = config.uses_candidates(layer_id)
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.index_topk = config.index_topk
        self.candidate_topk_blocks = config.candidate_topk_blocks
        self.candidate_block_size = config.candidate_block_size
        self.weights_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.wq_b = DeepseekV41Linear(config.q_lora_rank, self.n_heads * self.head_dim, weight_dtype, numerics)
        self.weights_proj = DeepseekV41Linear(config.hidden_size, self.n_heads, "bf16", numerics)
        if self.owns_k:
            self.wk = DeepseekV41Linear(config.head_dim, self.head_dim, "bf16", numerics)
            self.k_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps, numerics)

    def index_keys_of(self, latent: torch.Tensor, latent_freqs: torch.Tensor) -> torch.Tensor:
        """Index keys of pre-RoPE latents ``[B, n, D]``: fp4(RoPE(k_norm(wk(latent)))) ``[B, n, Id]``."""
        return fake_quant_fp4(apply_rotary(self.k_norm(self.wk(latent)), latent_freqs), *INDEXER_FP4)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries fp4(RoPE(wq_b(qr))) ``[B, n, IH, Id]`` and head weights ``[B, n, IH]``."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = fake_quant_fp4(apply_rotary(q, freqs), *INDEXER_FP4)
        return q, self.weights_proj(x) * self.weights_scale

    def publish_keys(
        self, latents: _Latents, latent_freqs: torch.Tensor | None, state: DeepseekV41AttentionState, k: torch.Tensor | None = None
    ) -> None:
        """Turn this forward's pre-RoPE latents into index keys (or take `k`, already computed),
        store and publish them."""
        if k is None:
            k = self.index_keys_of(latents.values, latent_freqs)
        layer_cache = state.cache.layer(self.layer_id)
        layer_cache.index_k = latents.store(layer_cache.index_k, k, fresh=state.start_pos == 0)
        state.cache.publish_index_keys(self.layer_id, None if latents.valid is None else latents.valid.any(dim=1))

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        freqs: torch.Tensor,
        state: DeepseekV41AttentionState,
        offset: int,
        positions: torch.Tensor | None = None,
        queries: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x ``[B, S, dim]`` (attn_norm output), qr ``[B, S, q_lora]``, freqs the queries' rotation
        (``[S, rd/2]`` or per row ``[B, S, rd/2]``), positions the queries' positions (``[S]`` or
        ``[B, S]``, default from `state`) -> int32 ``[B, S, min(index_topk, T)]`` indices into the
        concatenated KV, T = the compressed positions of the longest row so far. `queries`: the
        one-token step's :meth:`queries` output, computed earlier.

        Raises:
            DeepseekV41AttentionError: no index keys published yet, or a candidate user running
                before the candidate source.
        """
        bsz, seqlen, _ = x.shape
        if positions is None:
            positions = state.positions(seqlen, x.device)
        index_k = state.cache.index_keys(state.max_real_end(seqlen) // self.ratio, self.layer_id, x.device)
        chunk = _query_chunk(self.numerics, bsz * self.n_heads * index_k.size(1), x.device) or seqlen
        if queries is not None and seqlen != 1:
            raise DeepseekV41AttentionError("precomputed index queries are for a one-token step")
        idxs, scores_kept, candidates = [], [], []
        for row0 in range(0, seqlen, chunk):
            rows = slice(row0, min(row0 + chunk, seqlen))
            if queries is not None:
                q, weights = queries
            else:
                q, weights = self.queries(x[:, rows], qr[:, rows], freqs[..., rows, :])
            if self.numerics != "exact":
                found = self._select(q, weights, index_k, state, rows, offset, positions[..., rows])
            elif state.pad_offsets is not None:
                found = self._select_per_row(
                    q, weights, index_k, state, rows, offset, positions[..., rows],
                    state.real_ends(seqlen), state.rank_ends(seqlen),
                )
            else:
                rank_width = max(state.rank_ends(seqlen)) // self.ratio
                found = self._select(q, weights, index_k, state, rows, offset, positions[..., rows], rank_width=rank_width)
            chunk_idxs, chunk_scores, chunk_candidates = found
            idxs.append(chunk_idxs)
            if state.record_index_scores:
                scores_kept.append(chunk_scores)
            candidates.append(chunk_candidates)
        if self.is_candidate_source:
            merged = candidates[0] if len(candidates) == 1 else torch.cat(candidates, dim=1)
            if self.numerics == "exact":
                state.candidates = merged
            else:
                state.candidate_blocks = merged
        if state.record_index_scores:
            state.index_scores[self.layer_id] = scores_kept[0] if len(scores_kept) == 1 else torch.cat(scores_kept, dim=1)
        return idxs[0] if len(idxs) == 1 else torch.cat(idxs, dim=1)

    def decode_select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
        offset: int,
        candidate_blocks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A one-token step's top-k over a fixed width of keys (graph-safe: no shape or branch
        depends on the sequence length, which arrives as the device tensor `visible`).

        Args:
            q, weights: :meth:`queries` of the step, ``[B, 1, IH, Id]`` and ``[B, 1, IH]``.
            keys: ``[B, W, Id]`` index keys; rows from `visible` on are masked (-inf).
            visible: int64 ``[1]``, the compressed positions the query sees.
            offset: added to the kept positions (the window rows before the compressed KV).
            candidate_blocks: candidate users: the candidate source's kept block ids ``[B, 1, kb]``.

        Returns:
            int32 ``[B, 1, min(index_topk, W)]`` indices (-1 = none), unsorted (as the fast
            one-token path of :meth:`_select`), and for the candidate source its kept block ids
            ``[B, 1, min(candidate_topk_blocks, ceil(W / block))]`` (-1 = none), else None.
        """
        width = keys.size(1)
        scores = torch.einsum("bshd,btd->bsht", q, keys)
        scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)
        scores = scores.masked_fill(torch.arange(width, device=q.device) >= visible, -torch.inf)
        blocks = None
        if self.is_candidate_source:
            blocks = candidate_block_ids(scores, visible, self.candidate_topk_blocks, self.candidate_block_size)
            n_blocks = -(-width // self.candidate_block_size)
            blocks = blocks.to(torch.int16 if n_blocks <= torch.iinfo(torch.int16).max else torch.int32)
        elif self.uses_candidates:
            if candidate_blocks is None:
                raise DeepseekV41AttentionError(f"layer {self.layer_id} uses candidates but none were published")
            keep = candidate_mask_from_blocks(candidate_blocks, width, self.candidate_block_size)
            scores = scores.masked_fill(~keep, -torch.inf)
        picked = scores.topk(min(self.index_topk, width), dim=-1, sorted=False).indices
        return torch.where(picked < visible, picked + offset, -1).int(), blocks

    def _candidate_mask(self, state: DeepseekV41AttentionState, rows: slice, width: int, batch: slice) -> torch.Tensor:
        """The candidate source's kept positions for the queries `rows`, bool ``[B, rows, width]``."""
        if state.candidates is not None:
            return state.candidates[batch, rows, :width].to(self.wq_b.weight.device)
        if state.candidate_blocks is not None:
            blocks = state.candidate_blocks[batch, rows].to(self.wq_b.weight.device)
            return candidate_mask_from_blocks(blocks, width, self.candidate_block_size)
        raise DeepseekV41AttentionError(f"layer {self.layer_id} uses candidates but none were published")

    def _select_per_row(
        self,
        q,
        weights,
        index_k,
        state: DeepseekV41AttentionState,
        rows: slice,
        offset: int,
        positions,
        ends: list[int],
        rank_ends: list[int],
    ):
        """:meth:`_select` one batch row at a time over exactly that row's compressed positions (exact
        numerics with left padding): `torch.topk`'s choice among tied scores depends on the width
        it ranks, so a row ranks what it would rank alone. `ends` are the rows' real lengths so far,
        `rank_ends` the lengths whose widths they rank (:meth:`DeepseekV41AttentionState.rank_ends`).
        Outputs padded to the batch's widths."""
        n_keys = max(index_k.size(1), max(rank_ends) // self.ratio)
        k = min(self.index_topk, n_keys)
        idxs, scores, candidates = [], [], []
        for b in range(q.size(0)):
            width = ends[b] // self.ratio
            row = slice(b, b + 1)
            got_idxs, got_scores, got_cand = self._select(
                q[row], weights[row], index_k[row, :width], state, rows, offset,
                positions[row] if positions.dim() == 2 else positions, batch=row,
                rank_width=rank_ends[b] // self.ratio,
            )
            idxs.append(F.pad(got_idxs, (0, k - got_idxs.size(-1)), value=-1))
            if got_scores is not None:
                scores.append(F.pad(got_scores, (0, n_keys - got_scores.size(-1)), value=-torch.inf))
            if got_cand is not None:
                candidates.append(F.pad(got_cand, (0, n_keys - got_cand.size(-1)), value=False))
        return (
            torch.cat(idxs),
            torch.cat(scores) if scores else None,
            torch.cat(candidates) if candidates else None,
        )

    def _select(
        self,
        q,
        weights,
        index_k,
        state: DeepseekV41AttentionState,
        rows: slice,
        offset: int,
        positions: torch.Tensor,
        batch: slice = slice(None),
        rank_width: int = 0,
    ):
        """Scores, masks and top-k for the queries `rows` of this forward (all of them in exact mode).

        positions: the queries' positions ``[n]`` or ``[B, n]``; `batch` selects the batch rows of
        the forward's candidates that q holds; `rank_width` (exact numerics): rank at least this
        many positions, the ones past the keys at -inf (the width one prefill would rank).

        Returns (int32 indices ``[B, rows, k]``, bf16 masked scores ``[B, rows, T]`` (only when
        recorded, else None), this chunk's candidates: exact mode a bool mask ``[B, rows, T]``, fast
        mode block ids ``[B, rows, kb]``; None unless this layer is the candidate source).
        """
        start_pos, ratio = state.start_pos, self.ratio
        n_keys = index_k.size(1)
        k = min(self.index_topk, n_keys)
        if self.numerics != "exact":
            # positions past the chunk's last visible one are -inf for every query of the chunk:
            # leave them out (exact mode keeps the reference's full-width shapes)
            n_keys = min(n_keys, max(0, start_pos + rows.stop - state.min_pad()) // ratio)
        bsz, n_rows = q.size(0), q.size(1)

        # query t sees compressed position j once its group is complete: j < (t + 1) // ratio
        one_step = start_pos > 0 and n_rows == 1 and state.pad_offsets is None
        if one_step:
            compress_lens = (start_pos + 1) // ratio  # one decode query: every stored position
        else:
            compress_lens = ((positions + 1).clamp_min(0) // ratio).unsqueeze(-1)
        if n_keys == 0:  # no query of this chunk sees any compressed position yet
            scores = q.new_empty(bsz, n_rows, 0)
        else:
            scores = torch.einsum("bshd,btd->bsht", q, index_k[:, :n_keys])
            scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)
            if not one_step:
                scores.masked_fill_(torch.arange(n_keys, device=q.device) >= compress_lens, -torch.inf)
        if rank_width > n_keys and self.numerics == "exact":
            scores = F.pad(scores, (0, rank_width - n_keys), value=-torch.inf)
            n_keys = rank_width
            k = min(self.index_topk, n_keys)

        candidates = None
        if self.is_candidate_source:
            if self.numerics == "exact":
                candidates = select_candidate_blocks(scores, compress_lens, self.candidate_topk_blocks, self.candidate_block_size)
            else:
                # every chunk's ids padded to the width a full-width selection would have
                n_blocks = -(-index_k.size(1) // self.candidate_block_size)
                n_kept = min(self.candidate_topk_blocks, n_blocks)
                if n_keys:
                    candidates = candidate_block_ids(scores, compress_lens, self.candidate_topk_blocks, self.candidate_block_size)
                else:
                    candidates = torch.empty(bsz, n_rows, 0, dtype=torch.long, device=q.device)
                id_dtype = torch.int16 if n_blocks <= torch.iinfo(torch.int16).max else torch.int32
                candidates = F.pad(candidates, (0, n_kept - candidates.size(-1)), value=-1).to(id_dtype)
        elif self.uses_candidates:
            scores = scores.masked_fill(~self._candidate_mask(state, rows, n_keys, batch), -torch.inf)

        picked = scores.topk(min(k, n_keys), dim=-1, sorted=False).indices
        if not (one_step and self.numerics == "fast"):
            # ascending positions: the reference's order, in which the attention adds them up; a fast
            # decode step skips the sort (a radix sort of the k ids is the step's costliest kernel
            # after the GEMMs) and adds the same terms in another order
            picked = picked.sort(dim=-1).values
        idxs = torch.where(picked < compress_lens, picked + offset, -1).int()
        if idxs.size(-1) < k:  # fast mode, a chunk seeing fewer than k positions: pad with "none"
            idxs = F.pad(idxs, (0, k - idxs.size(-1)), value=-1)
        if state.record_index_scores and n_keys < index_k.size(1):
            scores = F.pad(scores, (0, index_k.size(1) - n_keys), value=-torch.inf)
        return idxs, (scores if state.record_index_scores else None), candidates


class DeepseekV41Attention(nn.Module):
    """One layer's attention: low-rank q, sliding-window KV, and (compress ratio > 0) compressed KV
    chosen by an indexer, all through one sparse attention with a per-head sink.

    Submodules and parameters carry the checkpoint names: `wq_a`, `q_norm`, `wq_b`, `wkv`,
    `kv_norm`, `wo_a`, `wo_b`, `attn_sink`, and where the layer has them `compressor.{wkv,wgate,norm}`
    and `indexer.{wq_b,weights_proj,wk,k_norm}`.

    Args:
        config: `DeepseekV41TextConfig` (roles from `kv_source_layer_ids`, `index_source_layer_ids`,
            `candidate_source_layer_id`, `compress_ratios`; numerics from `config.numerics`; the
            optional attribute `attention_backend` (``"auto"``, ``"triton"``, ``"torch"``) sets
            :attr:`attention_backend`).
        layer_id: index in the backbone.
        weight_dtype: storage of the quantizable projections (wq_a, wq_b, wkv, wo_b, indexer.wq_b):
            ``"fp8"`` for the released checkpoint, ``"bf16"`` for a bf16 one; default
            `config.weight_dtype`.

    Mirrors `inference/model.py: Attention`.
    """

    def __init__(self, config, layer_id: int, weight_dtype: str | None = None):
        super().__init__()
        weight_dtype = weight_dtype or getattr(config, "weight_dtype", "bf16")
        numerics = getattr(config, "numerics", "fast")
        self.numerics = numerics
        self.layer_id = layer_id
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.n_groups = config.o_groups
        self.o_lora_rank = config.o_lora_rank
        self.window = config.sliding_window
        self.ratio = config.compress_ratios[layer_id]
        self.softmax_scale = self.head_dim**-0.5
        eps = config.rms_norm_eps
        is_backbone = layer_id < config.num_hidden_layers
        self.is_kv_source = is_backbone and layer_id in config.kv_source_layer_ids
        self.is_index_source = is_backbone and layer_id in config.index_source_layer_ids
        self.kv_source = config.kv_source_of(layer_id) if is_backbone else None
        self.index_source = config.index_source_of(layer_id) if is_backbone else None

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = DeepseekV41Linear(config.hidden_size, config.q_lora_rank, weight_dtype, numerics)
        self.q_norm = DeepseekV41RMSNorm(config.q_lora_rank, eps, numerics)
        self.wq_b = DeepseekV41Linear(config.q_lora_rank, self.n_heads * self.head_dim, weight_dtype, numerics)
        self.wkv = DeepseekV41Linear(config.hidden_size, self.head_dim, weight_dtype, numerics)
        self.kv_norm = DeepseekV41RMSNorm(self.head_dim, eps, numerics)
        # wo_a is block-diagonal over groups and computed as a bf16 einsum (the converter
        # dequantizes the checkpoint's fp8 wo_a to bf16).
        self.wo_a = DeepseekV41Linear(
            self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, "bf16", numerics
        )
        self.wo_b = DeepseekV41Linear(self.n_groups * self.o_lora_rank, config.hidden_size, weight_dtype, numerics)
        self.compressor = DeepseekV41Compressor(config, layer_id, numerics) if self.is_kv_source else None
        self.indexer = (
            DeepseekV41Indexer(config, layer_id, weight_dtype, numerics) if self.is_index_source else None
        )
        self.rotary = DeepseekV41RotaryEmbedding.for_layer(config, layer_id)
        # sparse attention implementation in fast numerics: None = $DEEPSEEK_V41_SPARSE_ATTN_BACKEND,
        # else auto (the Triton kernel on CUDA, the torch fallback elsewhere); exact numerics
        # always take the fallback. A plain attribute: callers (benchmarks, tests) may set it.
        self.attention_backend: str | None = getattr(config, "attention_backend", None)

    # -- window KV ----------------------------------------------------------------------------
    def window_kv_rows(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """This forward's window KV rows: ``wkv`` -> ``kv_norm`` -> RoPE -> fp8 fake-quant, bf16
        ``[B, S, head_dim]``."""
        return fake_quant_fp8(apply_rotary(self.kv_norm(self.wkv(x)), freqs))

    def _window_kv(self, x, freqs, state: DeepseekV41AttentionState, kv: torch.Tensor | None = None):
        """This forward's window KV rows and each query's rows in them.

        Prefill: the chunk's rows. A prefill chunk after position 0: the ring (the last `window`
        positions before it) followed by the chunk's rows. Decode: the ring, after writing the
        step's row into it. The ring always ends up holding the last `window` positions.
        `kv`: the rows of :meth:`window_kv_rows` when the caller already has them.
        """
        bsz, seqlen, _ = x.shape
        start_pos, win = state.start_pos, self.window
        if kv is None:
            kv = self.window_kv_rows(x, freqs)
        layer_cache = state.cache.layer(self.layer_id)
        if start_pos > 0 and layer_cache.window_kv is None:
            raise DeepseekV41AttentionError("a forward after position 0 before any prefill: the window cache is empty")
        if start_pos > 0 and seqlen == 1:
            layer_cache.window_kv[:, start_pos % win] = kv.squeeze(1)
            return layer_cache.window_kv, self.decode_window_idxs(state, bsz, x.device)
        if start_pos == 0:
            window_kv = kv
            layer_cache.window_kv = kv.new_zeros(bsz, win, self.head_dim)
        else:
            window_kv = torch.cat([layer_cache.window_kv, kv], dim=1)  # a copy: the ring can be updated
        keep = min(seqlen, win)
        slots = torch.arange(start_pos + seqlen - keep, start_pos + seqlen, device=x.device) % win
        layer_cache.window_kv[:, slots] = kv[:, seqlen - keep :]
        span = state.window_span(seqlen) if self.numerics == "exact" else None
        return window_kv, chunk_window_idxs(win, bsz, seqlen, start_pos, state.pad_offsets, x.device, span)

    # -- compressed KV ------------------------------------------------------------------------
    def _compressed_kv(self, x, qr, freqs, state: DeepseekV41AttentionState, offset: int, pre: DecodeProjections | None = None):
        bsz, seqlen, _ = x.shape
        start_pos, ratio = state.start_pos, self.ratio
        compress_len = state.max_real_end(seqlen) // ratio
        latents = latent_freqs = None
        have_latent_rows = pre is not None and pre.latent_kv is not None  # ratio 1: made by decode_project
        if self.is_kv_source:
            latents = self.compressor(x, start_pos, state.cache.layer(self.layer_id), state.pad_offsets, pre)
            if latents is not None:
                if not have_latent_rows:
                    latent_freqs = self.rotary(latents.groups * ratio)  # each latent at its group's first token
                # index keys come from the latent before RoPE
                if self.indexer is not None and self.indexer.owns_k and compress_len > 0:
                    self.indexer.publish_keys(latents, latent_freqs, state, None if pre is None else pre.latent_k)

        if self.is_index_source:
            if compress_len == 0:
                # nothing to rank yet; exact numerics keep the width one prefill would have
                width = min(self.indexer.index_topk, max(state.rank_ends(seqlen)) // ratio) if self.numerics == "exact" else 0
                idxs = torch.full((bsz, seqlen, width), -1, dtype=torch.int32, device=x.device)
            else:
                queries = None if pre is None or pre.index_q is None else (pre.index_q, pre.index_weights)
                idxs = self.indexer(x, qr, freqs, state, offset, queries=queries)
            state.topk_idxs[self.layer_id] = idxs
        else:
            if self.index_source not in state.topk_idxs:
                raise DeepseekV41AttentionError(
                    f"layer {self.layer_id} needs the top-k indices of layer {self.index_source}, which has not run"
                )
            idxs = state.topk_idxs[self.index_source].to(x.device)  # (the source may sit on another GPU)

        if latents is not None:
            if have_latent_rows:
                latent = pre.latent_kv
            else:
                latent = fake_quant_fp4(apply_rotary(latents.values, latent_freqs), *COMPRESSED_KV_FP4)
            layer_cache = state.cache.layer(self.layer_id)
            layer_cache.compressed_kv = latents.store(layer_cache.compressed_kv, latent, fresh=start_pos == 0)
        source = state.cache.layer(self.kv_source).compressed_kv
        if source is None:
            if compress_len:
                raise DeepseekV41AttentionError(
                    f"layer {self.layer_id} needs the compressed KV of layer {self.kv_source}, which has none"
                )
            return x.new_zeros(bsz, 0, self.head_dim), idxs
        return source.rows(compress_len).to(x.device), idxs

    def forward(self, hidden_states: torch.Tensor, state: DeepseekV41AttentionState) -> torch.Tensor:
        """hidden_states: bf16 ``[B, S, dim]`` (the attn_norm output) -> bf16 ``[B, S, dim]``.

        `state.start_pos` = 0 starts a sequence (a prefill of S tokens); after it, a forward of
        S = 1 token is a decode step and of S > 1 tokens a prefill chunk, both through the same
        `state.cache`. With `state.pad_offsets` the rows are left-padded (see the module doc).

        Raises:
            DeepseekV41AttentionError: a forward after position 0 without a prefill, or a layer run
                before the layers it reads from.
        """
        bsz, seqlen, _ = hidden_states.shape
        x = hidden_states
        positions = state.positions(seqlen, x.device)
        freqs = self.rotary(positions.clamp_min(0))  # [S, rd/2], or per row [B, S, rd/2]
        qr = self.q_norm(self.wq_a(x))

        kv, idxs = self._window_kv(x, freqs, state)
        if self.ratio:
            compressed, compressed_idxs = self._compressed_kv(x, qr, freqs, state, kv.size(1))
            kv = torch.cat([kv, compressed], dim=1)
            idxs = torch.cat([idxs, compressed_idxs], dim=-1)

        # fast: the query path in chunks, so q and o ([B, S, H, D] each) exist one chunk at a time
        chunk = _query_chunk(self.numerics, bsz * self.n_heads * self.head_dim, x.device) or seqlen
        outs = [
            self._attend(qr[:, r : r + chunk], freqs[..., r : r + chunk, :], kv, idxs[:, r : r + chunk])
            for r in range(0, seqlen, chunk)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend(self, qr: torch.Tensor, freqs: torch.Tensor, kv: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
        """Queries of some rows through attention and the output projection.

        qr ``[B, n, q_lora]``, freqs their rotation, kv ``[B, N, D]``, idxs int32 ``[B, n, K]``
        -> bf16 ``[B, n, dim]``.
        """
        return self.output(self._sparse(self.queries(qr, freqs), kv, idxs), freqs)

    def queries(self, qr: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """``wq_b`` and RoPE of the last `rope_dim` dims: qr ``[B, n, q_lora]`` -> bf16 ``[B, n, H, D]``."""
        return apply_rotary(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), freqs)

    def _sparse(self, q: torch.Tensor, kv: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
        if self.numerics == "exact":
            backend, chunk = "torch", None  # the reference's op sequence and shapes
        else:
            backend = self.attention_backend or "auto"
            chunk = _query_chunk(self.numerics, q.size(0) * SPARSE_ATTN_BLOCK * (self.head_dim + self.n_heads), q.device)
        return sparse_attention_op(q, kv, idxs, self.attn_sink, self.softmax_scale, backend=backend, query_chunk=chunk)

    def sparse_attention_graph_safe(self, device: torch.device) -> bool:
        """Whether this layer's sparse attention on `device` can be captured in a CUDA graph: the
        Triton kernel can; the torch fallback checks its indices on the host."""
        return resolve_sparse_backend(self.attention_backend or "auto", device) == "triton"

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, the grouped ``wo_a`` (bf16 einsum) and ``wo_b``: o bf16 ``[B, n, H, D]`` ->
        bf16 ``[B, n, dim]``."""
        bsz, n_rows = o.shape[:2]
        o = apply_rotary(o, freqs, inverse=True)
        # heads g*H/G .. (g+1)*H/G-1 form group g; each group has its own o_lora_rank slice of wo_a
        o = o.view(bsz, n_rows, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))

    # -- one-token decode in three parts (the outer two have fixed shapes: CUDA-graph safe) ----
    def decode_freqs(self, state: DeepseekV41AttentionState, device: torch.device) -> torch.Tensor:
        """The RoPE table of a one-token step at `state.start_pos`: complex64 ``[1, rd/2]`` or
        ``[B, 1, rd/2]`` with left padding."""
        return state.step_table(
            ("decode_freqs", self.rotary.table_key, state.start_pos, device),
            lambda: self.rotary(state.positions(1, device).clamp_min(0)),
        )

    def decode_group_inputs(self, state: DeepseekV41AttentionState, device: torch.device) -> tuple:
        """For :meth:`decode_project` on a step that ends a ratio > 1 compressor group (no left
        padding): ``(parked_kv, parked_score, group_freqs)`` (the parked slots and the RoPE table of
        the group's first position), else ``()``."""
        if self.compressor is None or state.pad_offsets is not None or not self.compressor.ends_group(state.start_pos):
            return ()
        cache = state.cache.layer(self.layer_id)
        if cache.compressor_kv is None:
            return ()
        return cache.compressor_kv, cache.compressor_score, self._group_freqs(state, device)

    def _group_freqs(self, state: DeepseekV41AttentionState, device: torch.device) -> torch.Tensor:
        """RoPE table ``[1, rd/2]`` of the first position of the group a step at `start_pos` ends."""
        first = state.start_pos + 1 - self.ratio
        return state.step_table(
            ("group_freqs", self.rotary.table_key, first, device),
            lambda: self.rotary(torch.arange(first, first + 1, device=device)),
        )

    # -- one-token decode as one graph-safe function (fast numerics, no left padding) ------------
    def decode_plan(self, state: DeepseekV41AttentionState, batch: int) -> DecodePlan | None:
        """The host-side layout of this layer's step in :meth:`decode_static`, or None when the
        step must take :meth:`decode_attend` (exact numerics, left padding, recorded index scores,
        a cache that does not hold what the step reads yet: the first steps after a prompt
        shorter than a compressor group, or compressed rows / index keys on another GPU). Makes
        room in the buffers the step writes or reads (a buffer that grows moves: its address is
        part of the plan's key).
        """
        if self.numerics != "fast" or state.pad_offsets is not None or state.record_index_scores:
            return None
        cache = state.cache
        own = cache.layer(self.layer_id)
        if own.window_kv is None or own.window_kv.size(0) != batch:
            return None
        key = [batch, own.window_kv.data_ptr()]
        if not self.ratio:
            return DecodePlan(0, 0, False, None, tuple(key))
        visible = (state.start_pos + 1) // self.ratio
        if visible == 0:
            return None
        writes = False
        owns_k = self.indexer is not None and self.indexer.owns_k
        grown = []  # buffers the step writes or reads, with the rows they hold after its writes
        if self.is_kv_source:
            writes = self.ratio == 1 or self.compressor.ends_group(state.start_pos)
            if own.compressed_kv is None or own.compressed_kv.length != visible - writes:
                return None
            if owns_k and (own.index_k is None or own.index_k.length != own.compressed_kv.length):
                return None
            if self.ratio > 1:
                if own.compressor_kv is None:
                    return None
                key += [own.compressor_kv.data_ptr(), own.compressor_score.data_ptr()]
            if owns_k:
                grown.append((own.index_k, visible))
        source = cache.layer(self.kv_source).compressed_kv
        if source is None:
            return None
        grown.append((source, source.length + (writes and self.kv_source == self.layer_id)))
        publisher = None
        if self.is_index_source:
            publisher = self.layer_id if owns_k and writes else cache.index_k_publisher
            if publisher is None or cache.index_k_publisher_rows is not None:
                return None
            keys = cache.layer(publisher).index_k
            if keys is None:
                return None
            grown.append((keys, keys.length + (publisher == self.layer_id and writes)))
            if self.indexer.uses_candidates and state.candidate_blocks is None:
                return None
        elif self.index_source not in state.topk_idxs:
            return None
        device = own.window_kv.device
        if any(rows < visible or buffer.device != device for buffer, rows in grown):
            return None  # too few rows yet, or a source on another GPU (a device_map split)
        width = decode_rows(visible)
        for buffer, _ in grown:
            buffer.reserve(width)
        key += [buffer.address for buffer, _ in grown]
        return DecodePlan(visible, width, writes, publisher, (*key, publisher, width, writes))

    def decode_window_idxs(self, state: DeepseekV41AttentionState, batch: int, device: torch.device) -> torch.Tensor:
        """Ring slots a one-token step at `state.start_pos` attends to, int32 ``[B, 1, window]``
        (built once per step for all layers)."""
        win, start_pos = self.window, state.start_pos
        return state.step_table(
            ("decode_window_idxs", win, batch, start_pos, device),
            lambda: decode_window_idxs(win, batch, start_pos, state.pad_offsets, device),
        )

    def decode_static(
        self,
        plan: DecodePlan,
        cache: DeepseekV41AttentionCache,
        x: torch.Tensor,
        freqs: torch.Tensor,
        pos: torch.Tensor,
        topk_idxs: torch.Tensor | None = None,
        candidate_blocks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The attention of a one-token step with every shape fixed by `plan` and the position
        given on the device, so that a CUDA graph can capture it whole: projections, the ring
        write, the compressor (slot write, pooling on a step that ends a group, the compressed
        row and index key written in place), the indexer over `plan.width` keys, the sparse
        attention over ``[ring ; plan.width compressed rows]``. Equals :meth:`forward` up to the
        order in which tied or equal top-k picks are listed (the kept set is the same).

        Args:
            plan: from :meth:`decode_plan` for this step (its host bookkeeping is
                :meth:`decode_commit`, after this).
            cache: the attention cache the plan was made on.
            x: bf16 ``[B, 1, dim]`` (attn_norm output); freqs: the step's RoPE table
                (``self.rotary(pos)``).
            pos: int64 ``[1]``, the step's position (the window's index list and a group's RoPE
                table are built from it on the device).
            topk_idxs: layers that are not index sources: the index source's indices this step.
            candidate_blocks: candidate users: the candidate source's kept blocks this step.

        Returns:
            ``(o, topk_idxs, candidate_blocks)``: o bf16 ``[B, 1, H, head_dim]`` (before
            :meth:`output`); this layer's top-k indices (index sources) and kept blocks (the
            candidate source), else None.
        """
        qr, kv_row, q, *extras = self.decode_project(x, freqs)
        pre = DecodeProjections(*extras)
        own = cache.layer(self.layer_id)
        own.window_kv.index_copy_(1, pos % self.window, kv_row)
        window_idxs = decode_window_idxs_at(self.window, x.size(0), pos)
        if not self.ratio:
            return self._sparse(q, own.window_kv, window_idxs), None, None
        if self.is_kv_source:
            latent_kv, latent_k = pre.latent_kv, pre.latent_k
            if self.ratio > 1:
                slot = pos % self.ratio
                own.compressor_kv.index_copy_(1, slot, pre.compressor_kv)
                own.compressor_score.index_copy_(1, slot, pre.compressor_score)
                if plan.writes:
                    group_freqs = self.rotary(pos + 1 - self.ratio)  # the group's first position
                    latent = self.compressor.pool_parked(own, x.dtype)
                    latent_kv = fake_quant_fp4(apply_rotary(latent, group_freqs), *COMPRESSED_KV_FP4)
                    if self.indexer is not None and self.indexer.owns_k:
                        latent_k = self.indexer.index_keys_of(latent, group_freqs)
            if plan.writes:
                row = pos // self.ratio
                own.compressed_kv.write_at(row, latent_kv)
                if latent_k is not None:
                    own.index_k.write_at(row, latent_k)
        blocks = None
        if self.is_index_source:
            keys = cache.layer(plan.publisher).index_k.storage(plan.width)
            visible = (pos + 1) // self.ratio
            topk_idxs, blocks = self.indexer.decode_select(
                pre.index_q, pre.index_weights, keys, visible, self.window, candidate_blocks
            )
        compressed = cache.layer(self.kv_source).compressed_kv.storage(plan.width)
        kv = torch.cat([own.window_kv, compressed], dim=1)
        o = self._sparse(q, kv, torch.cat([window_idxs, topk_idxs], dim=-1))
        return o, (topk_idxs if self.is_index_source else None), blocks

    def decode_commit(
        self,
        plan: DecodePlan,
        state: DeepseekV41AttentionState,
        topk_idxs: torch.Tensor | None,
        candidate_blocks: torch.Tensor | None,
    ) -> None:
        """The host-side bookkeeping of a :meth:`decode_static` step: row counts of the written
        buffers, the index-key publisher, and what the step hands down to later layers (under a
        CUDA graph these are buffers the graph writes, outside its memory pool: valid through the
        step, rewritten by the graph's next replay)."""
        if plan.writes:
            own = state.cache.layer(self.layer_id)
            own.compressed_kv.length = plan.visible
            if self.indexer is not None and self.indexer.owns_k:
                own.index_k.length = plan.visible
                state.cache.publish_index_keys(self.layer_id)
        if topk_idxs is not None:
            state.topk_idxs[self.layer_id] = topk_idxs
        if candidate_blocks is not None:
            state.candidate_blocks = candidate_blocks

    def decode_project(
        self,
        x: torch.Tensor,
        freqs: torch.Tensor,
        parked_kv: torch.Tensor | None = None,
        parked_score: torch.Tensor | None = None,
        group_freqs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The step's projections, which depend on nothing that grows: x bf16 ``[B, 1, dim]`` ->
        ``(qr [B, 1, q_lora], kv_row [B, 1, head_dim], q [B, 1, H, head_dim], *extras)`` where
        `extras` is :class:`DecodeProjections` as a flat tuple (indexer queries, compressor
        projections, and the latent the step completes with its compressed-KV row and index key:
        for ratio 1 at the token's own RoPE position; for ratio > 1 when
        :meth:`decode_group_inputs` gave the parked slots and the group's table)."""
        qr = self.q_norm(self.wq_a(x))
        pre = DecodeProjections()
        if self.indexer is not None:
            pre.index_q, pre.index_weights = self.indexer.queries(x, qr, freqs)
        if self.compressor is not None:
            if self.ratio == 1:
                (pre.latent,) = self.compressor.decode_project(x)
                pre.latent_kv = fake_quant_fp4(apply_rotary(pre.latent, freqs), *COMPRESSED_KV_FP4)
                if self.indexer is not None and self.indexer.owns_k:
                    pre.latent_k = self.indexer.index_keys_of(pre.latent, freqs)
            else:
                pre.compressor_kv, pre.compressor_score = self.compressor.decode_project(x)
                if parked_kv is not None:
                    pre.latent = self.compressor.pool_last(parked_kv, parked_score, pre.compressor_kv, pre.compressor_score, x.dtype)
                    pre.latent_kv = fake_quant_fp4(apply_rotary(pre.latent, group_freqs), *COMPRESSED_KV_FP4)
                    if self.indexer is not None and self.indexer.owns_k:
                        pre.latent_k = self.indexer.index_keys_of(pre.latent, group_freqs)
        return (qr, self.window_kv_rows(x, freqs), self.queries(qr, freqs), *pre.as_tuple())

    def decode_attend(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        kv_row: torch.Tensor,
        q: torch.Tensor,
        freqs: torch.Tensor,
        state: DeepseekV41AttentionState,
        *extras: torch.Tensor | None,
    ) -> torch.Tensor:
        """The cache-dependent middle of a one-token step (its shapes grow with the sequence):
        ring write, compressor, indexer, index lists, sparse attention; `extras` are the tail of
        :meth:`decode_project`'s output. Returns o bf16
        ``[B, 1, H, head_dim]`` (before :meth:`output`). The three parts together equal
        :meth:`forward` on a one-token step.

        Raises:
            DeepseekV41AttentionError: not a one-token step after a prefill.
        """
        if x.size(1) != 1 or state.start_pos == 0:
            raise DeepseekV41AttentionError(f"decode_attend takes one token after a prefill, got {x.size(1)} at {state.start_pos}")
        kv, idxs = self._window_kv(x, freqs, state, kv=kv_row)
        if self.ratio:
            pre = DecodeProjections(*extras) if extras else None
            compressed, compressed_idxs = self._compressed_kv(x, qr, freqs, state, kv.size(1), pre)
            kv = torch.cat([kv, compressed], dim=1)
            idxs = torch.cat([idxs, compressed_idxs], dim=-1)
        return self._sparse(q, kv, idxs)

__all__ = [
    "DeepseekV41Attention",
    "DeepseekV41AttentionCache",
    "DeepseekV41AttentionError",
    "DeepseekV41AttentionState",
    "DeepseekV41Compressor",
    "DeepseekV41Indexer",
    "DeepseekV41LayerAttentionCache",
    "DecodePlan",
    "DeepseekV41RMSNorm",
    "candidate_block_ids",
    "candidate_mask_from_blocks",
    "chunk_window_idxs",
    "decode_window_idxs",
    "left_padding_offsets",
    "select_candidate_blocks",
    "sparse_attention",
    "window_topk_idxs",
]
