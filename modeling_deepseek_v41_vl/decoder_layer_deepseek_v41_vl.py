"""One decoder layer of DeepSeek-V4.1: Engram (where configured), then attention and MoE between
mHC mixes (REFERENCE.md sections 4 and 9). Mirrors `inference/model.py: Block`.

Besides the plain forward, the decode engine's one-token step has its own function,
:meth:`DeepseekV41DecoderLayer.decode_step` (device tensors only; the model's step calls it for
every layer, see `decode_step_deepseek_v41_vl.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from .attention_deepseek_v41_vl import DeepseekV41Attention
from .attention_state_deepseek_v41_vl import DeepseekV41AttentionState, DeepseekV41DecodeStep
from .cuda_graphs_deepseek_v41_vl import in_line
from .configuration_deepseek_v41_vl import DeepseekV41TextConfig
from .engram_deepseek_v41_vl import DeepseekV41Engram
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection
from .layers_deepseek_v41_vl import DeepseekV41RMSNorm, on_device
from .moe_deepseek_v41_vl import DeepseekV41MoE
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, plan_for

logger = logging.get_logger(__name__)


@dataclass
class _ReplayPoint:
    """What a checkpointed layer read of the attention state (a
    :meth:`DeepseekV41AttentionState.shared_snapshot`), and whether its first pass has run."""

    snapshot: tuple
    ran: bool = False


class DeepseekV41DecoderLayer(GradientCheckpointingLayer):
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

    def __call__(
        self,
        hidden_states: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        *rest,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the module (hooks, then :meth:`forward`); under gradient checkpointing, first notes
        what the layer reads of the per-forward state, for the backward's replay.

        transformers' :class:`GradientCheckpointingLayer` checkpoints :meth:`forward`, so the
        replay starts inside it, after later layers advanced `attention_state` (the last
        index-key publisher, the candidate source's choice, the index sources' top-k) and after
        this layer filled its own cache entry. The snapshot is taken here, outside the
        checkpoint, and handed to :meth:`forward` as `replay_point`.

        A forward after position 0 (a continued cache) runs without checkpointing: its cache
        writes (the window ring, compressor groups, index keys) land in entries that already
        exist and cannot be put back, so a replay would read this forward's own rows.
        """
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return super().__call__(hidden_states, pre_mix_in, attention_state, *rest, **kwargs)
        if attention_state.start_pos != 0:
            self.gradient_checkpointing = False  # read by transformers' wrapper of `forward`
            try:
                return super().__call__(hidden_states, pre_mix_in, attention_state, *rest, **kwargs)
            finally:
                self.gradient_checkpointing = True
        kwargs["replay_point"] = _ReplayPoint(attention_state.shared_snapshot(self.layer_idx))
        return super().__call__(hidden_states, pre_mix_in, attention_state, *rest, **kwargs)

    @property
    def _gradient_checkpointing_func(self) -> Callable:
        """The checkpoint function `gradient_checkpointing_enable` / `activation_checkpointing_enable`
        (or `_set_gradient_checkpointing`) set, always with ``use_reentrant=False``.

        Layers hand tensors to later layers through the attention state (compressed KV, index
        keys, top-k), outside the checkpoint's inputs and outputs. A reentrant checkpoint runs
        the first pass without autograd, so the gradient that flows back through those tensors
        would be lost; the non-reentrant one records them, and its recompute is :meth:`forward`'s
        replay. Any function but a ``partial(..., use_reentrant=False)`` is therefore bound to
        ``use_reentrant=False``: a plain callable (`_set_gradient_checkpointing`'s default, the bare
        `torch.utils.checkpoint.checkpoint`, which runs reentrant when the argument is unset) or a
        partial without it silently, an explicit ``use_reentrant=True`` with a warning.
        """
        return self._checkpoint_func

    @_gradient_checkpointing_func.setter
    def _gradient_checkpointing_func(self, func: Callable) -> None:
        asked = func.keywords.get("use_reentrant") if isinstance(func, partial) else None
        if asked is not False and callable(func):  # (None, as a reset, stays None)
            if asked:
                logger.warning_once(
                    "DeepseekV41DecoderLayer: gradient checkpointing runs non-reentrant (use_reentrant=False); a "
                    "reentrant checkpoint would lose the gradients that reach a layer through the tensors later layers read"
                )
            func = partial(func, use_reentrant=False)
        self._checkpoint_func = func

    def forward(
        self,
        hidden_states: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        image_mask: torch.Tensor | None = None,
        engram_hash_ids: torch.Tensor | None = None,
        engram_mask: torch.Tensor | None = None,
        *,
        replay_point: _ReplayPoint | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Engram (if this is an Engram layer) on all copies, then :meth:`block`.

        The unit transformers' gradient checkpointing recomputes (`gradient_checkpointing_enable`
        or `activation_checkpointing_enable`). The recompute (the second run with the same
        `replay_point`) first puts back the state the first pass read, so it computes the same
        values, and afterwards the state as the whole forward left it (the layer's cache entry
        too: the recompute writes a throwaway one), so a cache filled by a checkpointed training
        forward continues as one filled without checkpointing.

        Args:
            hidden_states: bf16 ``[B, S, hc, D]``.
            pre_mix_in: fp32 ``[B, S, hc]``, the previous block's FFN `pre` (one-hot for layer 0).
            attention_state: the per-forward hand-down state shared by all layers.
            image_mask: bool ``[B, S]``, True on image-span rows (selects `bias_vl`); None: text.
            engram_hash_ids: int64 ``[B, S, n_engram_layers, cols]`` (all Engram layers).
            engram_mask: bool ``[B, S]``, False on image-span rows; None: all True.
            replay_point: set by :meth:`__call__` under gradient checkpointing.

        Returns:
            ``(x2, f_pre)``: bf16 ``[B, S, hc, D]`` and fp32 ``[B, S, hc]``.

        Raises:
            DeepseekV41ModelError: an Engram layer called without hash ids.
        """
        if replay_point is None or not replay_point.ran:
            if replay_point is not None:
                replay_point.ran = True
            return self._run(hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask)
        after = attention_state.shared_snapshot(self.layer_idx)
        attention_state.restore_shared(replay_point.snapshot, self.layer_idx)
        try:
            return self._run(hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask)
        finally:
            attention_state.restore_shared(after, self.layer_idx)

    def _run(self, hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask):
        with on_device(hidden_states.device):
            if self.engram is not None:
                if engram_hash_ids is None:
                    raise DeepseekV41ModelError(f"layer {self.layer_idx} runs Engram and needs engram_hash_ids")
                hidden_states = self.engram(hidden_states, engram_hash_ids[:, :, self.engram.hash_index], engram_mask)
            self._tap(attention_state.hidden_taps, hidden_states)
            return self.block(hidden_states, pre_mix_in, attention_state, image_mask)

    def _tap(self, taps: dict | None, x: torch.Tensor) -> None:
        # the draft head's part of `main_hidden`: the mean of the copies at this block's input,
        # after its Engram (`Transformer.forward` collects it for `dspark_target_layer_ids`)
        if taps is not None and self.layer_idx in taps:
            taps[self.layer_idx] = x.mean(dim=2)

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
        hc = self.hc
        attn_pre, attn_post, attn_comb = hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        f = self.attn(hc.pre_norm(x, pre_mix_in, self.attn_norm), attention_state)
        return self._ffn_half(f, x, attn_pre, attn_post, attn_comb, image_mask)

    def _ffn_half(self, f, x, attn_pre, attn_post, attn_comb, image_mask=None, aside=in_line):
        # the FFN reads the attention's mixes (the lag), not its own: with a decode step's graph
        # `aside`, those and the shared expert run beside the routed experts
        hc = self.hc
        x1, ffn_mixes = hc.post_mixes(
            f, x, attn_post, attn_comb, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, aside=aside
        )  # the mixes as a handle, joined after the FFN
        f = self.ffn(hc.pre_norm(x1, attn_pre, self.ffn_norm), image_mask, aside=aside)
        ffn_pre, ffn_post, ffn_comb = ffn_mixes.join()
        return hc.post(f, x1, ffn_post, ffn_comb), ffn_pre

    def decode_step(self, x: torch.Tensor, pre_mix_in: torch.Tensor, step: DeepseekV41DecodeStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode engine's one-token step of this block (Engram included): :meth:`forward`'s
        computation from device tensors only, the attention through
        :meth:`DeepseekV41Attention.decode_step`. Decode tokens are text (no `bias_vl` rows).

        Args:
            x: bf16 ``[B, 1, hc, D]``; pre_mix_in: fp32 ``[B, 1, hc]``.
            step: the model step's :class:`DeepseekV41DecodeStep`.

        Returns:
            ``(x2, f_pre)`` as :meth:`forward`.
        """
        if self.engram is not None:
            x = self.engram(x, step.engram_hash_ids[:, :, self.engram.hash_index])
        self._tap(step.hidden_taps, x)
        hc = self.hc
        # the attention reads the previous FFN's mixes (the lag), so this block's own mixes and
        # their Sinkhorn run beside it (`step.aside`), as do the FFN's beside the FFN
        attn_mixes = step.aside(hc.mixes, x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        o = self.attn.decode_step(hc.pre_norm(x, pre_mix_in, self.attn_norm), step)
        f = self.attn.output(o, step.freqs(self.attn.rotary))
        attn_pre, attn_post, attn_comb = attn_mixes.join()
        return self._ffn_half(f, x, attn_pre, attn_post, attn_comb, aside=step.aside)

    @property
    def weight_device(self) -> torch.device:
        """The device of the layer's weights (where its step runs)."""
        return self.attn.wq_a.weight.device


__all__ = ["DeepseekV41DecoderLayer"]
