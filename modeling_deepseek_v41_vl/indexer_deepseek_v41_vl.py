"""The indexer of DeepSeek-V4.1's compressed sparse attention (REFERENCE.md section 6.4).

It scores compressed positions per query and keeps the `index_topk` best ones:

- index keys (owners = kv sources only): k = fp4(RoPE(k_norm(wk(latent)))) at the group-first
  positions, published for later layers (the cache records the last publisher);
- queries: q = fp4(RoPE(wq_b(qr))) ``[B, S, IH, Id]``;
- score[t, j] = sum_h relu(q[t,h] . k[j]) * weights_proj(x)[t,h] * Id^-0.5 * IH^-0.5, in bf16;
  invisible positions (j >= (t+1)//ratio) are -inf;
- two-level top-k: the candidate source keeps the best blocks of `candidate_block_size`
  positions (:func:`candidate_block_ids`) and publishes them, candidate users mask their scores
  to those blocks; then top-k (unsorted) and sorted, invisible -> -1, the rest + the window offset.

Mirrors `inference/model.py: Indexer` and `select_candidate_blocks`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..triton_ops.index_topk import index_topk_torch, index_topk_triton, topk_ties_by_position
from ..triton_ops.index_topk import kernel_runs as index_topk_runs
from .attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from .compressor_deepseek_v41_vl import DeepseekV41Latents
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm
from .numerics_deepseek_v41_vl import DeepseekV41Numerics
from .quantization_deepseek_v41_vl import DeepseekV41Linear, fake_quant_fp4
from .rope_deepseek_v41_vl import apply_rotary

# indexer q/k: fp4 in groups of 32 with e8m0 scales
INDEXER_FP4 = (32, "ue8m0")


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


class DeepseekV41Indexer(nn.Module):
    """Scores compressed positions per query and keeps the `index_topk` best ones.

    Index keys (owners = kv sources only): k = fp4(RoPE(k_norm(wk(latent)))) at the group-first
    positions, published for later layers. Queries: q = fp4(RoPE(wq_b(qr))) [B, S, IH, Id].
    score[t, j] = sum_h relu(q[t,h] . k[j]) * weights_proj(x)[t,h] * Id^-0.5 * IH^-0.5, in bf16;
    invisible positions (j >= (t+1)//ratio) are -inf; the candidate source publishes its kept blocks
    and candidate users mask their scores with them; top-k (unsorted) then sorted, invisible -> -1,
    the rest + offset.

    Queries are processed in chunks (fast numerics; exact mode takes all at once): each chunk
    computes its own index queries and weights, scores only the positions visible to its last query
    (a prefill chunk ending at row r sees ``r // ratio`` positions), and runs both top-k levels, so
    one chunk's ``[B, chunk, index_n_heads, T]`` product is the largest intermediate.

    Mirrors `inference/model.py: Indexer` and `select_candidate_blocks`.
    """

    def __init__(self, config, layer_id: int, weight_dtype: str, numerics: DeepseekV41Numerics):
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
        k = self.k_norm(self.wk(latent))
        return self._fp4(apply_rotary(k, latent_freqs, backend=self.numerics.backend("rope", k.device)))

    def _fp4(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp4(x, *INDEXER_FP4, backend=self.numerics.backend("fake_quant", x.device))

    def queries(self, x: torch.Tensor, qr: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries fp4(RoPE(wq_b(qr))) ``[B, n, IH, Id]`` and head weights ``[B, n, IH]``."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = self._fp4(apply_rotary(q, freqs, backend=self.numerics.backend("rope", q.device)))
        return q, self.weights_proj(x) * self.weights_scale

    def publish_keys(
        self, latents: DeepseekV41Latents, latent_freqs: torch.Tensor | None, state: DeepseekV41AttentionState, k: torch.Tensor | None = None
    ) -> None:
        """Turn this forward's pre-RoPE latents into index keys (or take `k`, already computed),
        store and publish them."""
        if k is None:
            k = self.index_keys_of(latents.values, latent_freqs)
        layer_cache = state.cache.layer(self.layer_id)
        # index keys are kept at the width of a ratio-1 reader: any index source may read them
        make = lambda like: layer_cache.row_buffer("index_k", like, 1)  # noqa: E731
        layer_cache.index_k = latents.store(layer_cache.index_k, k, fresh=state.start_pos == 0, make=make)
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
        chunk = self.numerics.query_chunk(bsz * self.n_heads * index_k.size(1), x.device) or seqlen
        if queries is not None and seqlen != 1:
            raise DeepseekV41AttentionError("precomputed index queries are for a one-token step")
        idxs, scores_kept, candidates = [], [], []
        for row0 in range(0, seqlen, chunk):
            rows = slice(row0, min(row0 + chunk, seqlen))
            if queries is not None:
                q, weights = queries
            else:
                q, weights = self.queries(x[:, rows], qr[:, rows], freqs[..., rows, :])
            if not self.numerics.exact:
                found = self._select(q, weights, index_k, state, rows, offset, positions[..., rows])
            elif state.per_row():
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
            if self.numerics.exact:
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
            visible: int64 ``[B, 1, 1]`` (or ``[1]``), the compressed positions each row's query sees.
            offset: added to the kept positions (the window rows before the compressed KV).
            candidate_blocks: candidate users: the candidate source's kept block ids ``[B, 1, kb]``.

        Returns:
            int32 ``[B, 1, min(index_topk, W)]`` indices (-1 = none), ties to the lower position (as
            the fast one-token path of :meth:`_select`), in ascending position from the Triton
            kernel, else unsorted; and for the candidate source its kept block ids
            ``[B, 1, min(candidate_topk_blocks, ceil(W / block))]`` (-1 = none), else None.
        """
        width = keys.size(1)
        scores = torch.einsum("bshd,btd->bsht", q, keys)
        scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)
        blocks = None
        if self.is_candidate_source:
            # the block maxima need the visible mask now (the top-k below applies it again)
            scores = scores.masked_fill(torch.arange(width, device=q.device) >= visible, -torch.inf)
            blocks = candidate_block_ids(scores, visible, self.candidate_topk_blocks, self.candidate_block_size)
            n_blocks = -(-width // self.candidate_block_size)
            blocks = blocks.to(torch.int16 if n_blocks <= torch.iinfo(torch.int16).max else torch.int32)
        elif self.uses_candidates:
            if candidate_blocks is None:
                raise DeepseekV41AttentionError(f"layer {self.layer_id} uses candidates but none were published")
            keep = candidate_mask_from_blocks(candidate_blocks, width, self.candidate_block_size)
            scores = scores.masked_fill(~keep, -torch.inf)
        # ties go to the lower position: the picks do not depend on the width ranked (a static
        # cache's capacity, a growing cache's bucket) nor on the other rows of the batch; the
        # positions from `visible` on score -inf (`triton_ops/index_topk.py`: one launch on CUDA)
        k = min(self.index_topk, width)
        if self.numerics.backend("index_topk", q.device) == "triton" and index_topk_runs(scores, visible, k, offset):
            return index_topk_triton(scores, visible, k, offset), blocks
        return index_topk_torch(scores, visible, k, offset), blocks

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
        numerics with left or right padding): `torch.topk`'s choice among tied scores depends on the
        width it ranks, so a row ranks what it would rank alone. `ends` are the rows' real lengths so
        far, `rank_ends` the lengths whose widths they rank
        (:meth:`DeepseekV41AttentionState.rank_ends`). Outputs padded to the batch's widths."""
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
        if not self.numerics.exact:
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
        if rank_width > n_keys and self.numerics.exact:
            scores = F.pad(scores, (0, rank_width - n_keys), value=-torch.inf)
            n_keys = rank_width
            k = min(self.index_topk, n_keys)

        candidates = None
        if self.is_candidate_source:
            if self.numerics.exact:
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

        if self.numerics.exact or (state.pad_offsets is None and not one_step):
            # torch.topk's tie choice: the reference's (exact mode ranks each padded row alone)
            picked = scores.topk(min(k, n_keys), dim=-1, sorted=False).indices
        else:
            # fast numerics with left padding ranks the batch at once, and a one-token step ranks
            # as the decode engine does: ties by position, so the choice depends neither on the
            # width ranked nor on the other rows' lengths
            picked = topk_ties_by_position(scores, min(k, n_keys))
        if not one_step or self.numerics.exact:
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


__all__ = [
    "DeepseekV41Indexer",
    "INDEXER_FP4",
    "candidate_block_ids",
    "candidate_mask_from_blocks",
    "select_candidate_blocks",
]
