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

This file holds the layer itself; its parts live beside it: the per-forward state, the padding
rules and the window index lists in `attention_state_deepseek_v41_vl.py`, the compressors in
`compressor_deepseek_v41_vl.py`, the indexer in `indexer_deepseek_v41_vl.py`, and what persists
between forwards (window ring, partial groups, compressed rows, index keys) in
`cache_deepseek_v41_vl.py`.

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
online-softmax order of `kernel.sparse_attn`), so on CPU in exact numerics the outputs are
bitwise equal to the reference's.

Fast numerics keep every value's formula but bounds memory for long prefills: the query
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

from dataclasses import dataclass

import torch
from torch import nn

from ..triton_ops.sparse_attention import SPARSE_ATTN_BLOCK
from ..triton_ops.sparse_attention import sparse_attention as sparse_attention_op
from .attention_state_deepseek_v41_vl import (
    DeepseekV41AttentionState,
    chunk_window_idxs,
    decode_window_idxs,
    decode_window_idxs_at,
)
from .cache_deepseek_v41_vl import DeepseekV41AttentionCache
from .compressor_deepseek_v41_vl import compressor_for_layer
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from .indexer_deepseek_v41_vl import DeepseekV41Indexer
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm, needs_grad
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, plan_for
from .quantization_deepseek_v41_vl import DeepseekV41Linear, fake_quant_fp4, fake_quant_fp8
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, apply_rotary

# Compressed KV: fp4 in groups of 16 with e4m3 scales.
COMPRESSED_KV_FP4 = (16, "e4m3")


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


class DeepseekV41Attention(nn.Module):
    """One layer's attention: low-rank q, sliding-window KV, and (compress ratio > 0) compressed KV
    chosen by an indexer, all through one sparse attention with a per-head sink.

    Submodules and parameters carry the checkpoint names: `wq_a`, `q_norm`, `wq_b`, `wkv`,
    `kv_norm`, `wo_a`, `wo_b`, `attn_sink`, and where the layer has them `compressor.{wkv,wgate,norm}`
    and `indexer.{wq_b,weights_proj,wk,k_norm}`.

    Args:
        config: `DeepseekV41TextConfig` (roles from `kv_source_layer_ids`, `index_source_layer_ids`,
            `candidate_source_layer_id`, `compress_ratios`; the storage of the quantizable
            projections (wq_a, wq_b, wkv, wo_b, indexer.wq_b) from `config.weight_dtype`).
        layer_id: index in the backbone.
        numerics: the model's :class:`DeepseekV41Numerics` plan (default: `config.numerics` with
            the backends of the environment).

    Mirrors `inference/model.py: Attention`.
    """

    def __init__(self, config, layer_id: int, numerics: DeepseekV41Numerics | str | None = None):
        super().__init__()
        weight_dtype = config.weight_dtype
        numerics = plan_for(config, numerics)
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
        self.compressor = compressor_for_layer(config, layer_id, numerics) if self.is_kv_source else None
        self.indexer = (
            DeepseekV41Indexer(config, layer_id, weight_dtype, numerics) if self.is_index_source else None
        )
        self.rotary = DeepseekV41RotaryEmbedding.for_layer(config, layer_id)

    # -- window KV ----------------------------------------------------------------------------
    def window_kv_rows(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """This forward's window KV rows: ``wkv`` -> ``kv_norm`` -> RoPE -> fp8 fake-quant, bf16
        ``[B, S, head_dim]``."""
        kv = apply_rotary(self.kv_norm(self.wkv(x)), freqs)
        return fake_quant_fp8(kv, backend=self.numerics.backend("fake_quant", kv.device))

    def _compressed_row(self, latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """A compressed-KV row of pre-RoPE latents: RoPE at `freqs`, then fp4 fake-quant."""
        rows = apply_rotary(latent, freqs)
        return fake_quant_fp4(rows, *COMPRESSED_KV_FP4, backend=self.numerics.backend("fake_quant", rows.device))

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
            layer_cache.window_kv = layer_cache.buffer("window_kv", (bsz, win, self.head_dim), kv)
        else:
            window_kv = torch.cat([layer_cache.window_kv, kv], dim=1)  # a copy: the ring can be updated
        keep = min(seqlen, win)
        slots = torch.arange(start_pos + seqlen - keep, start_pos + seqlen, device=x.device) % win
        layer_cache.window_kv[:, slots] = kv[:, seqlen - keep :]
        span = state.window_span(seqlen) if self.numerics.exact else None
        return window_kv, chunk_window_idxs(win, bsz, seqlen, start_pos, state.pad_offsets, x.device, span)

    # -- compressed KV ------------------------------------------------------------------------
    def _compressed_kv(self, x, qr, freqs, state: DeepseekV41AttentionState, offset: int, pre: DecodeProjections | None = None):
        bsz, seqlen, _ = x.shape
        start_pos, ratio = state.start_pos, self.ratio
        compress_len = state.max_real_end(seqlen) // ratio
        latents = latent_freqs = None
        have_latent_rows = pre is not None and pre.latent_kv is not None  # ratio 1: made by decode_project
        if self.is_kv_source:
            step = {}
            if pre is not None:
                step["latent"] = pre.latent
                if self.compressor.parks:
                    step["kv_score"] = (pre.compressor_kv, pre.compressor_score)
            latents = self.compressor(x, start_pos, state.cache.layer(self.layer_id), state.pad_offsets, **step)
            if latents is not None:
                if not have_latent_rows:
                    latent_freqs = self.rotary(latents.groups * ratio)  # each latent at its group's first token
                # index keys come from the latent before RoPE
                if self.indexer is not None and self.indexer.owns_k and compress_len > 0:
                    self.indexer.publish_keys(latents, latent_freqs, state, None if pre is None else pre.latent_k)

        if self.is_index_source:
            if compress_len == 0:
                # nothing to rank yet; exact numerics keep the width one prefill would have
                width = min(self.indexer.index_topk, max(state.rank_ends(seqlen)) // ratio) if self.numerics.exact else 0
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
                latent = self._compressed_row(latents.values, latent_freqs)
            layer_cache = state.cache.layer(self.layer_id)
            layer_cache.compressed_kv = latents.store(
                layer_cache.compressed_kv, latent, fresh=start_pos == 0, role=layer_cache.role("compressed_kv")
            )
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
        chunk = self.numerics.query_chunk(bsz * self.n_heads * self.head_dim, x.device) or seqlen
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
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        return apply_rotary(q, freqs, inplace=not needs_grad(q))

    def _sparse(self, q: torch.Tensor, kv: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
        # exact numerics: the torch fallback, in the reference's op sequence and shapes (chunk None)
        backend = self.numerics.backend("sparse_attention", q.device)
        chunk = self.numerics.query_chunk(q.size(0) * SPARSE_ATTN_BLOCK * (self.head_dim + self.n_heads), q.device)
        return sparse_attention_op(q, kv, idxs, self.attn_sink, self.softmax_scale, backend=backend, query_chunk=chunk)

    def sparse_attention_graph_safe(self, device: torch.device) -> bool:
        """Whether this layer's sparse attention on `device` can be captured in a CUDA graph: the
        Triton kernel can; the torch fallback checks its indices on the host."""
        return self.numerics.backend("sparse_attention", device) == "triton"

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, the grouped ``wo_a`` (bf16 einsum) and ``wo_b``: o bf16 ``[B, n, H, D]`` ->
        bf16 ``[B, n, dim]``."""
        bsz, n_rows = o.shape[:2]
        o = apply_rotary(o, freqs, inverse=True, inplace=not needs_grad(o))
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
        compressor = self.compressor
        if compressor is None or not compressor.parks or state.pad_offsets is not None:
            return ()
        if not compressor.emits_latent(state.start_pos):
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
        if self.numerics.exact or state.pad_offsets is not None or state.record_index_scores:
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
            writes = self.compressor.emits_latent(state.start_pos)
            if own.compressed_kv is None or own.compressed_kv.length != visible - writes:
                return None
            if owns_k and (own.index_k is None or own.index_k.length != own.compressed_kv.length):
                return None
            if self.compressor.parks:
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
            latent = self.compressor.park_step(own, pos, pre.compressor_kv, pre.compressor_score, plan.writes, x.dtype)
            if latent is not None:  # a pooling compressor's group ends here
                group_freqs = self.rotary(pos + 1 - self.ratio)  # the group's first position
                latent_kv = self._compressed_row(latent, group_freqs)
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

    def decode_project(self, x: torch.Tensor, freqs: torch.Tensor, *group_inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's projections, which depend on nothing that grows: x bf16 ``[B, 1, dim]`` ->
        ``(qr [B, 1, q_lora], kv_row [B, 1, head_dim], q [B, 1, H, head_dim], *extras)`` where
        `extras` is :class:`DecodeProjections` as a flat tuple (indexer queries, compressor
        projections, and the latent the step completes with its compressed-KV row and index key:
        for ratio 1 at the token's own RoPE position; for ratio > 1 when `group_inputs`, from
        :meth:`decode_group_inputs`, give the parked slots and the group's table)."""
        qr = self.q_norm(self.wq_a(x))
        pre = DecodeProjections()
        if self.indexer is not None:
            pre.index_q, pre.index_weights = self.indexer.queries(x, qr, freqs)
        if self.compressor is not None:
            pre.compressor_kv, pre.compressor_score, pre.latent, latent_freqs = self.compressor.decode_project(
                x, freqs, *group_inputs
            )
            if pre.latent is not None:
                pre.latent_kv = self._compressed_row(pre.latent, latent_freqs)
                if self.indexer is not None and self.indexer.owns_k:
                    pre.latent_k = self.indexer.index_keys_of(pre.latent, latent_freqs)
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
    "COMPRESSED_KV_FP4",
    "DecodePlan",
    "DecodeProjections",
    "DeepseekV41Attention",
    "decode_rows",
]
