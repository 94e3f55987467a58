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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.sparse_attention import SPARSE_ATTN_BLOCK
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
    promoted to fp32 for the product, so holding it in fp32 gives identical results.
    """

    def __init__(self, dim: int, eps: float = 1e-20):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


# --------------------------------------------------------------------------- caches and state


class _RowBuffer:
    """Rows ``[B, n, D]`` appended along dim 1, stored with doubling capacity."""

    def __init__(self, rows: torch.Tensor):
        self._data = rows.contiguous()
        self.length = rows.size(1)

    def write(self, start: int, rows: torch.Tensor) -> None:
        if start != self.length:
            raise DeepseekV41AttentionError(f"cache rows must be appended in order: row {start} after {self.length}")
        end = start + rows.size(1)
        if end > self._data.size(1):
            grown = self._data.new_zeros(self._data.size(0), max(end, 2 * self._data.size(1)), self._data.size(2))
            grown[:, : self.length] = self._data[:, : self.length]
            self._data = grown
        self._data[:, start:end] = rows
        self.length = end

    def rows(self, n: int) -> torch.Tensor:
        if n > self.length:
            raise DeepseekV41AttentionError(f"asked for {n} cached rows, only {self.length} exist")
        return self._data[:, :n]


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
    """

    def __init__(self):
        self.layers: dict[int, DeepseekV41LayerAttentionCache] = {}
        self.seen_tokens = 0  # kept up to date by the owning transformers cache
        self.index_k_publisher: int | None = None

    def layer(self, layer_id: int) -> DeepseekV41LayerAttentionCache:
        return self.layers.setdefault(layer_id, DeepseekV41LayerAttentionCache())


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
    """

    start_pos: int = 0
    cache: DeepseekV41AttentionCache = field(default_factory=DeepseekV41AttentionCache)
    topk_idxs: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    record_index_scores: bool = False
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_blocks: torch.Tensor | None = None  # last: keeps the older fields' positions


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


def _latent_positions(start_pos: int, seqlen: int, ratio: int, device) -> torch.Tensor:
    """Positions of the latents a forward emits: each latent takes its group's first token."""
    if start_pos == 0:
        return torch.arange(0, seqlen - seqlen % ratio, ratio, device=device)
    return torch.arange(start_pos + 1 - ratio, start_pos + 2 - ratio, device=device)  # made on device: no copy


class DeepseekV41Compressor(nn.Module):
    """Pools `ratio` consecutive tokens into one KV latent (returned before RoPE).

    - ratio 1: latent = norm(wkv(x)), wkv bf16; no gate, no pooling.
    - ratio > 1: x in fp32, kv = wkv(x), score = wgate(x) (fp32 weights), per-channel softmax of the
      score over the group's tokens, latent = sum(kv * softmax), cast to bf16, then norm. Groups are
      aligned to absolute positions (r*j .. r*j + r-1); a trailing partial group is parked in the
      cache and completed by decode steps. ``numerics="fast"`` projects and pools the prefill in
      chunks of whole groups (the fp32 copy of x is the largest intermediate); the values are the
      same.

    Mirrors `inference/model.py: Compressor`.
    """

    def __init__(self, config, layer_id: int, numerics: str):
        super().__init__()
        self.ratio = config.compress_ratios[layer_id]
        self.numerics = numerics
        head_dim = config.head_dim
        self.norm = DeepseekV41RMSNorm(head_dim, config.rms_norm_eps)
        if self.ratio == 1:
            self.wkv = DeepseekV41Linear(config.hidden_size, head_dim, "bf16", numerics)
        else:
            self.wkv = DeepseekV41Linear(config.hidden_size, head_dim, "fp32", numerics)
            self.wgate = DeepseekV41Linear(config.hidden_size, head_dim, "fp32", numerics)

    def forward(self, x: torch.Tensor, start_pos: int, cache: DeepseekV41LayerAttentionCache) -> torch.Tensor | None:
        """x bf16 ``[B, S, dim]`` -> bf16 latents ``[B, n, head_dim]`` or None (no group completed).

        Raises:
            DeepseekV41AttentionError: a decode step (start_pos > 0) before any prefill.
        """
        ratio, dtype = self.ratio, x.dtype
        if ratio == 1:
            return self.norm(self.wkv(x))
        if start_pos == 0:
            pooled = self._prefill(x, cache)
            return None if pooled is None else self.norm(pooled.to(dtype))
        if cache.compressor_kv is None:
            raise DeepseekV41AttentionError("decode step before any prefill: the compressor has no state")
        x = x.float()
        slot = start_pos % ratio
        cache.compressor_kv[:, slot] = self.wkv(x).squeeze(1)
        cache.compressor_score[:, slot] = self.wgate(x).squeeze(1)
        if (start_pos + 1) % ratio:
            return None
        pooled = (cache.compressor_kv * cache.compressor_score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(dtype))

    def _prefill(self, x: torch.Tensor, cache: DeepseekV41LayerAttentionCache) -> torch.Tensor | None:
        """Pooled fp32 groups ``[B, S // ratio, D]`` of a prefill (None if S < ratio); parks the tail."""
        ratio = self.ratio
        bsz, seqlen, dim = x.shape
        head_dim = self.wkv.out_features
        cache.compressor_kv = x.new_zeros(bsz, ratio, head_dim, dtype=torch.float32)
        cache.compressor_score = x.new_full((bsz, ratio, head_dim), -torch.inf, dtype=torch.float32)
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
            self.k_norm = DeepseekV41RMSNorm(self.head_dim, config.rms_norm_eps)

    def publish_keys(
        self, latent: torch.Tensor, latent_freqs: torch.Tensor, start_pos: int, state: DeepseekV41AttentionState
    ) -> None:
        """Turn this forward's pre-RoPE latents ``[B, n, D]`` into index keys and publish them."""
        k = apply_rotary(self.k_norm(self.wk(latent)), latent_freqs)
        k = fake_quant_fp4(k, *INDEXER_FP4)
        layer_cache = state.cache.layer(self.layer_id)
        if start_pos == 0:
            layer_cache.index_k = _RowBuffer(k)
        else:
            layer_cache.index_k.write(start_pos // self.ratio, k)
        state.cache.index_k_publisher = self.layer_id

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        freqs: torch.Tensor,
        state: DeepseekV41AttentionState,
        offset: int,
    ) -> torch.Tensor:
        """x ``[B, S, dim]`` (attn_norm output), qr ``[B, S, q_lora]``, freqs the queries' rotation
        -> int32 ``[B, S, min(index_topk, end//ratio)]`` indices into the concatenated KV.

        Raises:
            DeepseekV41AttentionError: no index keys published yet, or a candidate user running
                before the candidate source.
        """
        bsz, seqlen, _ = x.shape
        end_pos = state.start_pos + seqlen
        publisher = state.cache.index_k_publisher
        if publisher is None:
            raise DeepseekV41AttentionError(f"layer {self.layer_id}: no index keys were published before its indexer")
        index_k = state.cache.layer(publisher).index_k.rows(end_pos // self.ratio)
        chunk = _query_chunk(self.numerics, bsz * self.n_heads * index_k.size(1), x.device) or seqlen
        idxs, scores_kept, candidates = [], [], []
        for row0 in range(0, seqlen, chunk):
            rows = slice(row0, min(row0 + chunk, seqlen))
            q = self.wq_b(qr[:, rows]).unflatten(-1, (self.n_heads, self.head_dim))
            q = fake_quant_fp4(apply_rotary(q, freqs[rows]), *INDEXER_FP4)
            weights = self.weights_proj(x[:, rows]) * self.weights_scale
            chunk_idxs, chunk_scores, chunk_candidates = self._select(q, weights, index_k, state, rows, offset)
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

    def _candidate_mask(self, state: DeepseekV41AttentionState, rows: slice, width: int) -> torch.Tensor:
        """The candidate source's kept positions for the queries `rows`, bool ``[B, rows, width]``."""
        if state.candidates is not None:
            return state.candidates[:, rows, :width]
        if state.candidate_blocks is not None:
            return candidate_mask_from_blocks(state.candidate_blocks[:, rows], width, self.candidate_block_size)
        raise DeepseekV41AttentionError(f"layer {self.layer_id} uses candidates but none were published")

    def _select(self, q, weights, index_k, state: DeepseekV41AttentionState, rows: slice, offset: int):
        """Scores, masks and top-k for the queries `rows` of this forward (all of them in exact mode).

        Returns (int32 indices ``[B, rows, k]``, bf16 masked scores ``[B, rows, T]`` (only when
        recorded, else None), this chunk's candidates: exact mode a bool mask ``[B, rows, T]``, fast
        mode block ids ``[B, rows, kb]``; None unless this layer is the candidate source).
        """
        start_pos, ratio = state.start_pos, self.ratio
        n_keys = index_k.size(1)
        k = min(self.index_topk, n_keys)
        if start_pos == 0 and self.numerics != "exact":
            # positions past the chunk's last visible one are -inf for every query of the chunk:
            # leave them out (exact mode keeps the reference's full-width shapes)
            n_keys = min(n_keys, rows.stop // ratio)
        bsz, n_rows = q.size(0), q.size(1)

        if start_pos == 0:
            # query t sees compressed position j once its group is complete: j < (t + 1) // ratio
            compress_lens = (torch.arange(rows.start + 1, rows.stop + 1, device=q.device) // ratio).unsqueeze(-1)
        else:
            compress_lens = (start_pos + 1) // ratio  # one decode query
        if n_keys == 0:  # no query of this chunk sees any compressed position yet
            scores = q.new_empty(bsz, n_rows, 0)
        else:
            scores = torch.einsum("bshd,btd->bsht", q, index_k[:, :n_keys])
            scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)
            if start_pos == 0:
                scores.masked_fill_(torch.arange(n_keys, device=q.device) >= compress_lens, -torch.inf)

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
            scores = scores.masked_fill(~self._candidate_mask(state, rows, n_keys), -torch.inf)

        picked = scores.topk(min(k, n_keys), dim=-1, sorted=False).indices.sort(dim=-1).values
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
        self.q_norm = DeepseekV41RMSNorm(config.q_lora_rank, eps)
        self.wq_b = DeepseekV41Linear(config.q_lora_rank, self.n_heads * self.head_dim, weight_dtype, numerics)
        self.wkv = DeepseekV41Linear(config.hidden_size, self.head_dim, weight_dtype, numerics)
        self.kv_norm = DeepseekV41RMSNorm(self.head_dim, eps)
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
    def _window_kv(self, x, freqs, state: DeepseekV41AttentionState):
        bsz, seqlen, _ = x.shape
        start_pos, win = state.start_pos, self.window
        kv = fake_quant_fp8(apply_rotary(self.kv_norm(self.wkv(x)), freqs))
        layer_cache = state.cache.layer(self.layer_id)
        if start_pos == 0:
            ring = kv.new_zeros(bsz, win, self.head_dim)
            keep = min(seqlen, win)
            slots = torch.arange(seqlen - keep, seqlen, device=x.device) % win
            ring[:, slots] = kv[:, seqlen - keep :]
            layer_cache.window_kv = ring
            window_kv = kv
        else:
            if layer_cache.window_kv is None:
                raise DeepseekV41AttentionError("decode step before any prefill: the window cache is empty")
            layer_cache.window_kv[:, start_pos % win] = kv.squeeze(1)
            window_kv = layer_cache.window_kv
        return window_kv, window_topk_idxs(win, bsz, seqlen, start_pos, x.device)

    # -- compressed KV ------------------------------------------------------------------------
    def _compressed_kv(self, x, qr, freqs, state: DeepseekV41AttentionState, offset: int):
        bsz, seqlen, _ = x.shape
        start_pos, ratio = state.start_pos, self.ratio
        compress_len = (start_pos + seqlen) // ratio
        latent = None
        latent_freqs = None
        if self.is_kv_source:
            latent = self.compressor(x, start_pos, state.cache.layer(self.layer_id))
            if latent is not None:
                latent_freqs = self.rotary(_latent_positions(start_pos, seqlen, ratio, x.device))
                # index keys come from the latent before RoPE
                if self.indexer is not None and self.indexer.owns_k and compress_len > 0:
                    self.indexer.publish_keys(latent, latent_freqs, start_pos, state)

        if self.is_index_source:
            if compress_len == 0:
                idxs = torch.empty(bsz, seqlen, 0, dtype=torch.int32, device=x.device)
            else:
                idxs = self.indexer(x, qr, freqs, state, offset)
            state.topk_idxs[self.layer_id] = idxs
        else:
            if self.index_source not in state.topk_idxs:
                raise DeepseekV41AttentionError(
                    f"layer {self.layer_id} needs the top-k indices of layer {self.index_source}, which has not run"
                )
            idxs = state.topk_idxs[self.index_source]

        if latent is not None:
            latent = fake_quant_fp4(apply_rotary(latent, latent_freqs), *COMPRESSED_KV_FP4)
            layer_cache = state.cache.layer(self.layer_id)
            if start_pos == 0:
                layer_cache.compressed_kv = _RowBuffer(latent)
            else:
                layer_cache.compressed_kv.write(start_pos // ratio, latent)
        source = state.cache.layer(self.kv_source).compressed_kv
        if source is None:
            if compress_len:
                raise DeepseekV41AttentionError(
                    f"layer {self.layer_id} needs the compressed KV of layer {self.kv_source}, which has none"
                )
            return x.new_zeros(bsz, 0, self.head_dim), idxs
        return source.rows(compress_len), idxs

    def forward(self, hidden_states: torch.Tensor, state: DeepseekV41AttentionState) -> torch.Tensor:
        """hidden_states: bf16 ``[B, S, dim]`` (the attn_norm output) -> bf16 ``[B, S, dim]``.

        `state.start_pos` = 0 is a prefill of S tokens; otherwise S must be 1 (a decode step after
        a prefill through the same `state.cache`).

        Raises:
            DeepseekV41AttentionError: S > 1 after position 0, decode without a prefill, or a layer
                run before the layers it reads from.
        """
        bsz, seqlen, _ = hidden_states.shape
        start_pos = state.start_pos
        if start_pos > 0 and seqlen != 1:
            raise DeepseekV41AttentionError(
                f"only a prefill at position 0 or one-token decode steps are supported, got {seqlen} tokens at {start_pos}"
            )
        x = hidden_states
        freqs = self.rotary(torch.arange(start_pos, start_pos + seqlen, device=x.device))
        qr = self.q_norm(self.wq_a(x))

        kv, idxs = self._window_kv(x, freqs, state)
        if self.ratio:
            compressed, compressed_idxs = self._compressed_kv(x, qr, freqs, state, kv.size(1))
            kv = torch.cat([kv, compressed], dim=1)
            idxs = torch.cat([idxs, compressed_idxs], dim=-1)

        # fast: the query path in chunks, so q and o ([B, S, H, D] each) exist one chunk at a time
        chunk = _query_chunk(self.numerics, bsz * self.n_heads * self.head_dim, x.device) or seqlen
        outs = [
            self._attend(qr[:, r : r + chunk], freqs[r : r + chunk], kv, idxs[:, r : r + chunk])
            for r in range(0, seqlen, chunk)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _attend(self, qr: torch.Tensor, freqs: torch.Tensor, kv: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
        """Queries of some rows through attention and the output projection.

        qr ``[B, n, q_lora]``, freqs their rotation, kv ``[B, N, D]``, idxs int32 ``[B, n, K]``
        -> bf16 ``[B, n, dim]``.
        """
        bsz, n_rows, _ = qr.shape
        q = apply_rotary(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), freqs)
        if self.numerics == "exact":
            backend, chunk = "torch", None  # the reference's op sequence and shapes
        else:
            backend = self.attention_backend or "auto"
            chunk = _query_chunk(self.numerics, bsz * SPARSE_ATTN_BLOCK * (self.head_dim + self.n_heads), q.device)
        o = sparse_attention_op(q, kv, idxs, self.attn_sink, self.softmax_scale, backend=backend, query_chunk=chunk)
        o = apply_rotary(o, freqs, inverse=True)
        # heads g*H/G .. (g+1)*H/G-1 form group g; each group has its own o_lora_rank slice of wo_a
        o = o.view(bsz, n_rows, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))


__all__ = [
    "DeepseekV41Attention",
    "DeepseekV41AttentionCache",
    "DeepseekV41AttentionError",
    "DeepseekV41AttentionState",
    "DeepseekV41Compressor",
    "DeepseekV41Indexer",
    "DeepseekV41LayerAttentionCache",
    "DeepseekV41RMSNorm",
    "candidate_block_ids",
    "candidate_mask_from_blocks",
    "select_candidate_blocks",
    "sparse_attention",
    "window_topk_idxs",
]
