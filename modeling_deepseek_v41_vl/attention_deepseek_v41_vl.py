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

A one-token step of the decode engine has its own function, :meth:`DeepseekV41Attention.decode_step`:
the same values from device tensors only (each row's position, the cache written in place, the
compressed rows read in a width fixed for the sequence), so that the whole model's step is
captured once and replayed (`decode_step_deepseek_v41_vl.py`). :meth:`forward` keeps one-token
steps too (exact numerics, hooks, autograd), in the reference's op order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..triton_ops.sparse_attention import SPARSE_ATTN_BLOCK
from ..triton_ops.sparse_attention import sparse_attention as sparse_attention_op
from ..triton_ops.window_kv import window_kv_row_if_runs
from .attention_state_deepseek_v41_vl import (
    DeepseekV41AttentionState,
    DeepseekV41DecodeStep,
    chunk_window_idxs,
    decode_window_idxs,
)
from .compressor_deepseek_v41_vl import compressor_for_layer
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from .indexer_deepseek_v41_vl import DeepseekV41Indexer
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm, needs_grad
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, plan_for
from .quantization_deepseek_v41_vl import DeepseekV41Linear, fake_quant_fp4, fake_quant_fp8
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, apply_rotary

# Compressed KV: fp4 in groups of 16 with e4m3 scales.
COMPRESSED_KV_FP4 = (16, "e4m3")


# A step on a growing cache reads the compressed rows and index keys in widths of powers of two
# (at least this many rows): a new capture only when the sequence crosses one.
DECODE_MIN_ROWS = 256


def decode_rows(visible: int) -> int:
    """Rows of a growing cache's compressed buffers a decode step reads when `visible` are in use."""
    return max(DECODE_MIN_ROWS, 1 << max(visible - 1, 0).bit_length())


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

    # tensor parallelism: the rank's `DeepseekV41Shard` once `parallel_deepseek_v41_vl.shard_model`
    # gave it a share of the heads (`n_heads` and `n_groups` are then this rank's)
    shard = None

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
        return self._finish_kv(self.wkv(x), freqs)

    def _finish_kv(self, kv: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        kv = self.kv_norm(kv)
        kv = apply_rotary(kv, freqs, backend=self.numerics.backend("rope", kv.device))
        return fake_quant_fp8(kv, backend=self.numerics.backend("fake_quant", kv.device))

    def _write_window_row(self, x: torch.Tensor, freqs: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor) -> None:
        """A one-token step's :meth:`window_kv_rows` written into `ring` at `slot`: where the plan
        runs the norm, RoPE and fake-quant kernels, one launch after ``wkv`` does all three and the
        write (`triton_ops/window_kv.py`, the same bits), else those ops and an index copy."""
        kv = self.wkv(x)
        plan = self.numerics
        fused = (
            self.kv_norm.takes_kernel(kv)
            and plan.backend("rope", kv.device) == plan.backend("fake_quant", kv.device) == "triton"
            and window_kv_row_if_runs(kv, self.kv_norm.weight, self.kv_norm.eps, freqs, ring, slot)
        )
        if not fused:
            ring.index_copy_(1, slot, self._finish_kv(kv, freqs))

    def _compressed_row(self, latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """A compressed-KV row of pre-RoPE latents: RoPE at `freqs`, then fp4 fake-quant."""
        rows = apply_rotary(latent, freqs, backend=self.numerics.backend("rope", latent.device))
        return fake_quant_fp4(rows, *COMPRESSED_KV_FP4, backend=self.numerics.backend("fake_quant", rows.device))

    def _window_kv(self, x, freqs, state: DeepseekV41AttentionState):
        """This forward's window KV rows and each query's rows in them.

        Prefill: the chunk's rows. A prefill chunk after position 0: the ring (the last `window`
        positions before it) followed by the chunk's rows. Decode: the ring, after writing the
        step's row into it. The ring always ends up holding the last `window` positions.
        """
        bsz, seqlen, _ = x.shape
        start_pos, win = state.start_pos, self.window
        kv = self.window_kv_rows(x, freqs)
        layer_cache = state.cache.layer(self.layer_id)
        if start_pos > 0 and layer_cache.window_kv is None:
            raise DeepseekV41AttentionError("a forward after position 0 before any prefill: the window cache is empty")
        if start_pos > 0 and seqlen == 1:
            layer_cache.window_kv[:, start_pos % win] = kv.squeeze(1)
            return layer_cache.window_kv, decode_window_idxs(win, bsz, start_pos, state.pad_offsets, x.device)
        if start_pos == 0:
            window_kv = kv
            layer_cache.start_window(kv, win)
        else:
            window_kv = torch.cat([layer_cache.window_kv, kv], dim=1)  # a copy: the ring can be updated
        keep = min(seqlen, win)
        slots = torch.arange(start_pos + seqlen - keep, start_pos + seqlen, device=x.device) % win
        layer_cache.window_kv[:, slots] = kv[:, seqlen - keep :]
        span = state.window_span(seqlen) if self.numerics.exact else None
        return window_kv, chunk_window_idxs(win, bsz, seqlen, start_pos, state.pad_offsets, x.device, span)

    # -- compressed KV ------------------------------------------------------------------------
    def _compressed_kv(self, x, qr, freqs, state: DeepseekV41AttentionState, offset: int):
        bsz, seqlen, _ = x.shape
        start_pos, ratio = state.start_pos, self.ratio
        compress_len = state.max_real_end(seqlen) // ratio
        latents = latent_freqs = None
        if self.is_kv_source:
            latents = self.compressor(x, start_pos, state.cache.layer(self.layer_id), state.pad_offsets)
            if latents is not None:
                latent_freqs = self.rotary(latents.groups * ratio)  # each latent at its group's first token
                # index keys come from the latent before RoPE
                if self.indexer is not None and self.indexer.owns_k and compress_len > 0:
                    self.indexer.publish_keys(latents, latent_freqs, state)

        if self.is_index_source:
            if compress_len == 0:
                # nothing to rank yet; exact numerics keep the width one prefill would have
                width = min(self.indexer.index_topk, max(state.rank_ends(seqlen)) // ratio) if self.numerics.exact else 0
                idxs = torch.full((bsz, seqlen, width), -1, dtype=torch.int32, device=x.device)
            else:
                idxs = self.indexer(x, qr, freqs, state, offset)
            state.topk_idxs[self.layer_id] = idxs
        else:
            if self.index_source not in state.topk_idxs:
                raise DeepseekV41AttentionError(
                    f"layer {self.layer_id} needs the top-k indices of layer {self.index_source}, which has not run"
                )
            idxs = state.topk_idxs[self.index_source].to(x.device)  # (the source may sit on another GPU)

        if latents is not None:
            latent = self._compressed_row(latents.values, latent_freqs)
            layer_cache = state.cache.layer(self.layer_id)
            make = lambda like: layer_cache.row_buffer("compressed_kv", like, ratio)  # noqa: E731
            layer_cache.compressed_kv = latents.store(layer_cache.compressed_kv, latent, fresh=start_pos == 0, make=make)
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
        return apply_rotary(q, freqs, inplace=not needs_grad(q), backend=self.numerics.backend("rope", q.device))

    def _sparse(self, q: torch.Tensor, kv: torch.Tensor, idxs: torch.Tensor, kv_tail: torch.Tensor | None = None) -> torch.Tensor:
        # exact numerics: the torch fallback, in the reference's op sequence and shapes (chunk None);
        # `kv_tail`: rows kv.size(1).. of the indexed kv, read in place by the kernel
        backend = self.numerics.backend("sparse_attention", q.device)
        chunk = self.numerics.query_chunk(q.size(0) * SPARSE_ATTN_BLOCK * (self.head_dim + self.n_heads), q.device)
        return sparse_attention_op(
            q, kv, idxs, self.attn_sink, self.softmax_scale, backend=backend, query_chunk=chunk, kv_tail=kv_tail
        )

    def sparse_attention_graph_safe(self, device: torch.device) -> bool:
        """Whether this layer's sparse attention on `device` can be captured in a CUDA graph: the
        Triton kernel can; the torch fallback checks its indices on the host."""
        return self.numerics.backend("sparse_attention", device) == "triton"

    def output(self, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, the grouped ``wo_a`` (bf16 einsum) and ``wo_b``: o bf16 ``[B, n, H, D]`` ->
        bf16 ``[B, n, dim]``."""
        bsz, n_rows = o.shape[:2]
        o = apply_rotary(o, freqs, inverse=True, inplace=not needs_grad(o), backend=self.numerics.backend("rope", o.device))
        # heads g*H/G .. (g+1)*H/G-1 form group g; each group has its own o_lora_rank slice of wo_a
        o = o.view(bsz, n_rows, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        if self.shard is not None:  # this rank's groups' fp32 share, summed over the ranks, rounded once
            return self.shard.all_reduce(self.wo_b.partial(o.flatten(2))).to(torch.bfloat16)
        return self.wo_b(o.flatten(2))

    # -- the one-token decode step (one function of device tensors, see `decode_step_deepseek_v41_vl.py`)
    def decode_step(self, x: torch.Tensor, step: DeepseekV41DecodeStep) -> torch.Tensor:
        """The attention of a one-token step after a prefill, with no shape, branch or host value
        that changes from step to step: the caches are written in place at each row's device
        position, the compressed rows and index keys are read in the step's fixed width
        (``step.width(ratio)``) with the rows past each row's visible ones masked. A CUDA graph
        of it stays valid for the whole sequence.

        Per batch row (its position ``step.positions[b]``, counted from its first real token):
        the window ring slot ``column % window``; a kv source parks its compressor projections,
        pools the group they are in and writes the latent at row ``position // ratio`` (a row no
        query sees until the group ends there: the step that ends it writes the final value); an
        owner of index keys writes its key there too and becomes the row's publisher when the
        group ends; an index source ranks the keys of each row's publisher.

        Against :meth:`forward` on a one-token step the values are the same except for the order
        of the top-k picks (fast numerics skip their sort; the attention then adds the same terms
        in another order) and ties of equal scores at the top-k boundary, ranked over a wider
        width.

        Args:
            x: bf16 ``[B, 1, dim]`` (the attn_norm output).
            step: the step's :class:`DeepseekV41DecodeStep` (tables, hand-downs, cache).

        Returns:
            o bf16 ``[B, 1, H, head_dim]`` (before :meth:`output`).

        Mirrors `inference/model.py: Attention.forward` with ``start_pos > 0``.
        """
        freqs = step.freqs(self.rotary)
        own = step.cache.layer(self.layer_id)
        window_idxs = step.window_idxs(self.window)
        # the keys (the ring's row; a kv source's compressed row and index key) beside the queries
        keys = step.aside(self._decode_keys, x, freqs, own, step.window_slot(self.window), step)
        qr = self.q_norm(self.wq_a(x))
        q = self.queries(qr, freqs)
        if self.is_index_source:
            index_q, index_weights = self.indexer.queries(x, qr, freqs)
        keys.join()
        if not self.ratio:
            return self._sparse(q, own.window_kv, window_idxs)
        width = step.width(self.ratio)
        if self.is_index_source:
            visible = ((step.positions + 1) // self.ratio).view(-1, 1, 1)
            topk_idxs, blocks = self.indexer.decode_select(
                index_q, index_weights, step.published_keys(width), visible, self.window, step.candidate_blocks
            )
            step.topk_idxs[self.layer_id] = topk_idxs
            if blocks is not None:
                step.candidate_blocks = blocks
        source = self.layer_id if self.is_index_source else self.index_source
        compressed = step.cache.layer(self.kv_source).compressed_kv.storage(width)
        # the window ring's rows, then the compressed ones, each read where it lies
        return self._sparse(q, own.window_kv, step.attended_idxs(self.window, source), kv_tail=compressed)

    def make_decode_rows(self, own) -> None:
        """Before a decode step: the row buffers this kv source writes (compressed KV, and index
        keys for an owner), empty when its prefill completed no group yet (a prompt shorter than
        the group). `own` is this layer's cache entry, filled by the prefill."""
        if not self.is_kv_source:
            return
        ring = own.window_kv
        if own.compressed_kv is None:
            own.compressed_kv = own.row_buffer("compressed_kv", ring[:, :0], self.ratio)
        if self.indexer is not None and self.indexer.owns_k and own.index_k is None:
            own.index_k = own.row_buffer("index_k", ring.new_empty(ring.size(0), 0, self.indexer.head_dim), 1)

    def _decode_keys(self, x: torch.Tensor, freqs: torch.Tensor, own, slot: torch.Tensor, step: DeepseekV41DecodeStep) -> None:
        """The keys a decode step writes (see :meth:`decode_step`): the window ring's row at `slot`,
        and a kv source's compressor state, compressed row and index key, and `step.publisher`
        (in place); nothing the queries read. Run by `step.aside` (in a decode step's graph, on a
        side stream) and joined before anything reads them."""
        self._write_window_row(x, freqs, own.window_kv, slot)
        if self.ratio and self.is_kv_source:
            self._decode_compress(x, freqs, own, step)

    def _decode_compress(self, x: torch.Tensor, freqs: torch.Tensor, own, step: DeepseekV41DecodeStep) -> None:
        """A kv source's part of a decode step: the latent of each row's current group (see
        :meth:`decode_step`), its compressed-KV row and index key written at row position // ratio,
        and the publisher of the rows whose group ends here."""
        positions = step.positions
        latent, group_freqs = self.compressor.decode_latent(x, freqs, own, positions, self.rotary)
        row = positions // self.ratio
        own.compressed_kv.write_rows_at(row, self._compressed_row(latent, group_freqs))
        if self.indexer is not None and self.indexer.owns_k:
            own.index_k.write_rows_at(row, self.indexer.index_keys_of(latent, group_freqs))
            if self.ratio == 1:
                step.publisher.fill_(self.layer_id)
            else:
                ends_group = (positions + 1) % self.ratio == 0
                step.publisher.copy_(torch.where(ends_group, self.layer_id, step.publisher))


__all__ = [
    "COMPRESSED_KV_FP4",
    "DECODE_MIN_ROWS",
    "DeepseekV41Attention",
    "decode_rows",
]
