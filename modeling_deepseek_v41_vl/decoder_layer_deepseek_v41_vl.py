"""One decoder layer of DeepSeek-V4.1: Engram (where configured), then attention and MoE between
mHC mixes (REFERENCE.md sections 4 and 9). Mirrors `inference/model.py: Block`.

Besides the plain forward, a one-token decode step has its own functions: the whole step with
fixed shapes (:meth:`DeepseekV41DecoderLayer.decode_whole`, what a CUDA graph captures) and a
piecewise split (:meth:`~DeepseekV41DecoderLayer.decode_step_piecewise`) for the steps the
fixed-shape form cannot take. When a step replays from graphs is decided in
`cuda_graphs_deepseek_v41_vl.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention_deepseek_v41_vl import DeepseekV41Attention
from .attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from .configuration_deepseek_v41_vl import DeepseekV41TextConfig
from .cuda_graphs_deepseek_v41_vl import GraphedSegment, decode_position, graphs_apply, layer_segment, submodules_hooked
from .engram_deepseek_v41_vl import DeepseekV41Engram
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm, on_device
from .moe_deepseek_v41_vl import DeepseekV41MoE
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, plan_for


class DeepseekV41DecoderLayer(nn.Module):
    """One backbone block: Engram (where configured), then attention and MoE between mHC mixes.

    Mirrors `inference/model.py: Block` (and the Engram call `Transformer.forward` makes before
    the block). Checkpoint names: `attn_norm`, `attn`, `ffn_norm`, `ffn`, `engram` (Engram layers
    only), and the mHC parameters `hc_attn_fn` / `hc_ffn_fn` fp32 ``[(2+hc)*hc, hc*D]``,
    `hc_attn_base` / `hc_ffn_base` fp32 ``[(2+hc)*hc]``, `hc_attn_scale` / `hc_ffn_scale` fp32 ``[3]``.

    Args:
        config: the text config (the storage, `weight_dtype` / `expert_weight_dtype`, is read at
            construction).
        layer_idx: position in the backbone.
        numerics: the model's :class:`DeepseekV41Numerics` plan, shared by every submodule
            (default: `config.numerics` with the environment's backends).
    """

    def __init__(self, config: DeepseekV41TextConfig, layer_idx: int, numerics: DeepseekV41Numerics | str | None = None):
        super().__init__()
        numerics = plan_for(config, numerics)
        self.layer_idx = layer_idx
        hc, dim = config.hc_mult, config.hidden_size
        self.attn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps, numerics)
        self.attn = DeepseekV41Attention(config, layer_idx, numerics)
        self.ffn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps, numerics)
        self.ffn = DeepseekV41MoE(config, layer_idx, numerics)
        self.engram = DeepseekV41Engram(config, layer_idx, numerics) if layer_idx in config.engram_layer_ids else None
        self.hc = DeepseekV41HyperConnection(hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps, numerics)
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, hc * dim, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        # One-token decode steps on CUDA (fast numerics) are replayed from CUDA graphs (see
        # `decode_step`): the whole step, or (piecewise) its fixed-shape head and tail
        self._decode_segments: dict[str, GraphedSegment] | None = None
        self.decode_cuda_graphs = True

    @property
    def decode_cuda_graphs(self) -> bool:
        """Whether one-token decode steps on CUDA (numerics "fast") replay the fixed-shape parts of
        the block from CUDA graphs (`decode_step`). Default True.

        Raises (on assignment):
            DeepseekV41ModelError: a value that is not a bool.
        """
        return self._decode_cuda_graphs

    @decode_cuda_graphs.setter
    def decode_cuda_graphs(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise DeepseekV41ModelError(f"decode_cuda_graphs must be True or False, got {value!r}")
        self._decode_cuda_graphs = value

    def _apply(self, fn, *args, **kwargs):
        # `.to()` / `.cuda()` / dtype casts move the weights: graphs captured before would read the
        # old addresses
        self._decode_segments = None
        return super()._apply(fn, *args, **kwargs)

    def forward(
        self,
        hidden_states: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        image_mask: torch.Tensor | None = None,
        engram_hash_ids: torch.Tensor | None = None,
        engram_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Engram (if this is an Engram layer) on all copies, then :meth:`block`.

        Args:
            hidden_states: bf16 ``[B, S, hc, D]``.
            pre_mix_in: fp32 ``[B, S, hc]``, the previous block's FFN `pre` (one-hot for layer 0).
            attention_state: the per-forward hand-down state shared by all layers.
            image_mask: bool ``[B, S]``, True on image-span rows (selects `bias_vl`); None: text.
            engram_hash_ids: int64 ``[B, S, n_engram_layers, cols]`` (all Engram layers).
            engram_mask: bool ``[B, S]``, False on image-span rows; None: all True.

        Returns:
            ``(x2, f_pre)``: bf16 ``[B, S, hc, D]`` and fp32 ``[B, S, hc]``.

        Raises:
            DeepseekV41ModelError: an Engram layer called without hash ids.
        """
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and attention_state.start_pos == 0:
            return self._checkpointed(hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask)
        with on_device(hidden_states.device):
            return self._forward(hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask)

    # set by `gradient_checkpointing_enable`, with `_gradient_checkpointing_func`
    gradient_checkpointing = False

    def _checkpointed(self, hidden_states, pre_mix_in, attention_state, *rest):
        # The backward replays this layer after later layers advanced the per-forward state it
        # read (the last index-key publisher, the candidate source's choice, the index sources'
        # top-k) and after its own cache entry was filled: the replay first puts back what the
        # layer saw, so it recomputes the same values.
        seen = attention_state.shared_snapshot(self.layer_idx)

        def replay(h, p):
            attention_state.restore_shared(seen, self.layer_idx)
            with on_device(h.device):
                return self._forward(h, p, attention_state, *rest)

        return self._gradient_checkpointing_func(replay, hidden_states, pre_mix_in)

    def _forward(self, hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask):
        if self.engram is not None:
            if engram_hash_ids is None:
                raise DeepseekV41ModelError(f"layer {self.layer_idx} runs Engram and needs engram_hash_ids")
            hidden_states = self.engram(hidden_states, engram_hash_ids[:, :, self.engram.hash_index], engram_mask)
        return self.block(hidden_states, pre_mix_in, attention_state, image_mask)

    def block(
        self,
        x: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        image_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block proper (after any Engram). Mirrors `Block.forward`.

        Attention collapses the copies with `pre_mix_in` (the lag), the FFN with this block's
        attention `pre`, computed from the block input before attention; the FFN's own `pre` is
        returned for the next block.
        """
        one_step = x.size(1) == 1 and attention_state.start_pos > 0 and not self.attn.numerics.exact
        if one_step and not submodules_hooked(self):
            # the computation a graph replays, replayed or run eagerly (graphs off, or the CPU)
            graphs = graphs_apply(self, x.size(0), x.device, attention_state)
            return self.decode_step(x, pre_mix_in, attention_state, image_mask, graphs=graphs)
        hc = self.hc
        attn_pre, attn_post, attn_comb = hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        f = self.attn(self.attn_norm(hc.pre(x, pre_mix_in)), attention_state)
        return self._ffn_half(f, x, attn_pre, attn_post, attn_comb, image_mask)

    def _ffn_half(self, f, x, attn_pre, attn_post, attn_comb, image_mask=None):
        hc = self.hc
        x1 = hc.post(f, x, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = hc.mixes(x1, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        f = self.ffn(self.ffn_norm(hc.pre(x1, attn_pre)), image_mask)
        return hc.post(f, x1, ffn_post, ffn_comb), ffn_pre

    # -- one-token decode: fixed-shape head and tail around the cache-dependent attention middle,
    #    or the whole step as one graph-safe function (the functions `cuda_graphs` captures)
    def decode_head(self, x, pre_mix_in, freqs, *group_inputs):
        """The fixed-shape head of a piecewise step: mHC mixes and collapse, `attn_norm`, the
        attention's projections."""
        attn_pre, attn_post, attn_comb = self.hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        xa = self.attn_norm(self.hc.pre(x, pre_mix_in))
        # x and freqs are handed on to the tail: under graphs, the head's own copies of them
        return (x, freqs, attn_pre, attn_post, attn_comb, xa, *self.attn.decode_project(xa, freqs, *group_inputs))

    def decode_tail(self, o, freqs, x, attn_pre, attn_post, attn_comb, image_mask):
        """The fixed-shape tail of a piecewise step: `wo_a`/`wo_b`, mHC, `ffn_norm`, MoE, mHC."""
        return self._ffn_half(self.attn.output(o, freqs), x, attn_pre, attn_post, attn_comb, image_mask)

    def decode_whole(self, context, x, pre_mix_in, pos, image_mask, topk_idxs, blocks):
        """The whole step with every shape fixed by the attention's plan (`context` = ``(plan,
        cache)``; the position `pos` an int64 ``[1]`` device tensor): ``(x2, f_pre, topk_idxs,
        blocks)``."""
        plan, cache = context
        freqs = self.attn.rotary(pos)  # in the graph: the host hands over the position only
        attn_pre, attn_post, attn_comb = self.hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        xa = self.attn_norm(self.hc.pre(x, pre_mix_in))
        o, topk_idxs, blocks = self.attn.decode_static(plan, cache, xa, freqs, pos, topk_idxs, blocks)
        x2, f_pre = self._ffn_half(self.attn.output(o, freqs), x, attn_pre, attn_post, attn_comb, image_mask)
        return x2, f_pre, topk_idxs, blocks

    @property
    def weight_device(self) -> torch.device:
        """The device of the layer's weights (where its step runs)."""
        return self.attn.wq_a.weight.device

    def graph_owner_key(self) -> tuple:
        """What the layer's graphs depend on besides their inputs: the plan and the weights'
        addresses (a change drops them)."""
        return (self.attn.numerics, self.attn.wq_a.weight.data_ptr(), self.ffn.shared_experts.w2.weight.data_ptr())

    def decode_step(
        self,
        x: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        image_mask: torch.Tensor | None = None,
        graphs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`block` for a one-token step after a prefill.

        In fast numerics without left padding the step runs as one function whose shapes are
        fixed by :meth:`DeepseekV41Attention.decode_plan` (the middle is
        :meth:`DeepseekV41Attention.decode_static`: caches written in place, the compressed rows
        read in a bucketed width), and with `graphs` the whole step is one CUDA graph, captured
        per cache layout. Otherwise (left padding, exact numerics, a cache not ready for the
        fixed-shape step) it takes :meth:`decode_step_piecewise`. :meth:`block` takes this route
        for one-token steps, so graphs on and off compute the same values; against the piecewise
        split the whole step differs only in the order of the top-k picks (the same set), hence
        in the sparse attention's fp32 summation order.

        Args:
            x: bf16 ``[B, 1, hc, D]``; pre_mix_in: fp32 ``[B, 1, hc]``.
            attention_state: the step's state (``start_pos > 0``).
            image_mask: bool ``[B, 1]`` or None, as :meth:`block` (a graph input: None and a
                tensor are captured separately).
            graphs: replay the step (or the piecewise head and tail) from CUDA graphs.

        Returns:
            ``(x2, f_pre)`` as :meth:`block`.

        Raises:
            DeepseekV41ModelError: not one token per row, position 0 (a prefill), or `graphs`
                with tensors that are not on a CUDA device.
        """
        if x.dim() != 4 or x.size(1) != 1:
            raise DeepseekV41ModelError(f"decode_step takes one token per row, x [B, 1, hc, D]; got {tuple(x.shape)}")
        if attention_state.start_pos == 0:
            raise DeepseekV41ModelError("decode_step follows a prefill: attention_state.start_pos is 0")
        if graphs and not x.is_cuda:
            raise DeepseekV41ModelError(f"decode_step(graphs=True) needs CUDA tensors, got {x.device}")
        plan = self.attn.decode_plan(attention_state, x.size(0))
        if plan is not None and (not graphs or self.attn.sparse_attention_graph_safe(x.device)):
            return self._decode_step_whole(plan, x, pre_mix_in, attention_state, image_mask, graphs)
        return self.decode_step_piecewise(x, pre_mix_in, attention_state, image_mask, graphs)

    def decode_step_piecewise(
        self,
        x: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        image_mask: torch.Tensor | None = None,
        graphs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-token step in three parts: :meth:`decode_head`, the attention's cache-dependent
        middle (:meth:`DeepseekV41Attention.decode_attend`), :meth:`decode_tail`. The head and tail
        have the same shapes at every step; with `graphs` (CUDA only) they are captured once per
        batch size in CUDA graphs and replayed. Equals the plain forward bit for bit. Arguments
        and returns as :meth:`decode_step`."""
        freqs = self.attn.decode_freqs(attention_state, x.device)
        head, tail = self.decode_head, self.decode_tail
        if graphs:
            head, tail = layer_segment(self, "head", x.device), layer_segment(self, "tail", x.device)
        # a step that ends a compressor group also pools it in the head (from the parked slots)
        group_inputs = self.attn.decode_group_inputs(attention_state, x.device)
        x, head_freqs, attn_pre, attn_post, attn_comb, xa, *projections = head(x, pre_mix_in, freqs, *group_inputs)
        o = self.attn.decode_attend(xa, *projections[:3], freqs, attention_state, *projections[3:])
        return tail(o, head_freqs, x, attn_pre, attn_post, attn_comb, image_mask)

    def _decode_step_whole(self, plan, x, pre_mix_in, state: DeepseekV41AttentionState, image_mask, graphs: bool):
        attn, device = self.attn, x.device
        pos = state.step_table(("decode_pos", device), lambda: decode_position(device, state.start_pos))
        topk_idxs = blocks = None
        if attn.ratio and not attn.is_index_source:
            topk_idxs = state.topk_idxs[attn.index_source].to(device)  # (the source may sit on another GPU)
        if attn.indexer is not None and attn.indexer.uses_candidates:
            blocks = state.candidate_blocks.to(device)
        args = (x, pre_mix_in, pos, image_mask, topk_idxs, blocks)
        context = (plan, state.cache)
        if graphs:
            out = layer_segment(self, "whole", device)(*args, key=plan.key, context=context)
        else:
            out = self.decode_whole(context, *args)
        x2, f_pre, topk_idxs, blocks = out
        attn.decode_commit(plan, state, topk_idxs, blocks)
        return x2, f_pre


__all__ = ["DeepseekV41DecoderLayer"]
