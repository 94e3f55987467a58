"""DeepSeek-V4.1-Flash language backbone with image rows (REFERENCE.md sections 3, 4 and 9).

Mirrors `inference/model.py: Transformer.forward`, `Block` and `merge_image_embeddings`::

    input_ids [B, S] ──engram_hash (+ carried history)──► hash ids [B, S, n_engram_layers, cols]
    input_ids ──embed──► [B, S, D] ──image merge──► START/NEWLINE/END vectors, aligner rows on IMAGE
              ──repeat to hc copies──► x [B, S, hc, D],  pre_mix = one-hot [1, 0, .., 0]
    for each layer i:
        (layer in engram_layer_ids)  x = engram(x, hash ids, ~image_mask)   on all copies
        x, pre_mix = block_i(x, pre_mix)          (the one-sublayer mHC lag, see the HC module)
    hc collapse with the last FFN pre ──norm──► head (fp32) ──► logits

Module and parameter names equal the checkpoint names with no prefix inside
:class:`DeepseekV41Transformer` (`embed.weight`, `layers.{i}.hc_attn_fn`, `layers.{i}.attn.wq_a.weight`,
`layers.{i}.engram.*`, `vision.*`, `aligner.*`, `image_start`, `norm.weight`, `head.weight`), so
the converted checkpoint is a plain ``load_state_dict(strict=True)``. The one key the checkpoint
lacks is `engram_hash.token_map` (raw id -> compressed Engram id), which the converter builds from
the tokenizer (`build_compressed_token_map`).

Image spans (REFERENCE.md section 15): `mm_token_type_ids` is 1 on every span position; the roles
inside each span follow from `image_grid_thw`: ``[START] ([IMAGE] * n_llm_w [NEWLINE]) * n_llm_h
[END]`` with ``n_llm = ceil(n_vit / downsample_ratio)``. The whole span (START/NEWLINE/END
included) is the "image rows" mask: it selects the MoE `bias_vl` and shuts the Engram gate.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.generation.logits_process import SuppressTokensLogitsProcessor
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import ModelOutput

from ..conversion.load_time import convert_state_dict

from .attention_deepseek_v41_vl import (
    DeepseekV41Attention,
    DeepseekV41AttentionCache,
    DeepseekV41AttentionError,
    DeepseekV41AttentionState,
    DeepseekV41RMSNorm,
    DecodePlan,
    left_padding_offsets,
)
from .cache_deepseek_v41_vl import DeepseekV41Cache
from .configuration_deepseek_v41_vl import DeepseekV41Config, DeepseekV41TextConfig
from .cuda_graphs_deepseek_v41_vl import GraphedSegment
from .engram_deepseek_v41_vl import DeepseekV41Engram, DeepseekV41EngramHash
from .engram_placement_deepseek_v41_vl import (
    check_engram_placement,
    device_map_with_engram_tables,
    empty_model,
    keep_engram_tables_resident,
    wrapped_dispatch_model,
)
from ..processing.image_spans_deepseek_v41_vl import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, image_span_length
from ..processing.image_spans_deepseek_v41_vl import image_token_roles as _image_token_roles
from .hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection, identity_pre_mix
from .moe_deepseek_v41_vl import DeepseekV41Gate, DeepseekV41MoE
from .quantization_deepseek_v41_vl import DeepseekV41Linear
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, rope_inv_frequencies
from .vision_deepseek_v41_vl import (
    DeepseekV41VisionAligner,
    DeepseekV41VisionRMSNorm,
    DeepseekV41VisionTransformer,
    llm_grid,
    on_device,
    parse_image_grid,
)



class DeepseekV41ModelError(ValueError):
    """Inputs the model cannot run: image spans that do not match the images, images after
    position 0, a missing Engram history, ..."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    # The reference builds its modules under `torch.set_default_dtype(bf16)`; modules that take their
    # dtype from the default (the vision tower's nn.Linear) are built the same way here.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _moe_quantization(text_config: DeepseekV41TextConfig) -> dict | None:
    # The MoE module reads a quantization dict; the storage itself lives in the text config.
    if text_config.weight_dtype != "fp8":
        return None
    expert = text_config.expert_weight_dtype
    return {"quant_method": "fp8", "expert_dtype": expert if expert in ("fp4", "fp8") else None}


# --------------------------------------------------------------------------------------------
# Image span roles
# --------------------------------------------------------------------------------------------


def image_token_roles(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    downsample_ratio: int,
) -> torch.Tensor:
    """Role of every position (TEXT -1, IMAGE_START 0, IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3):
    `image_spans_deepseek_v41_vl.image_token_roles`, the one implementation the processor shares.

    Raises:
        DeepseekV41ModelError: values other than 0/1, more or fewer spans than images, or a span
            whose length is not the one its image's grid implies.
    """
    return _image_token_roles(mm_token_type_ids, image_grid_thw, downsample_ratio, error=DeepseekV41ModelError)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class DeepseekV41Head(nn.Module):
    """Output projection, held and computed in fp32 (the checkpoint stores bf16). Untied.

    Mirrors `inference/model.py: ParallelHead` (one shard). Parameter: ``weight`` fp32 ``[V, D]``.
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` (bf16) -> fp32 logits ``[..., V]``."""
        return F.linear(hidden_states.float(), self.weight)


def _holds_inference_tensors(cache: DeepseekV41Cache) -> bool:
    """Whether the attention state of `cache` was made under `torch.inference_mode()` (its first
    layer's window ring tells: every layer's state is made in the same forward)."""
    for layer in cache.attention.layers.values():
        if layer.window_kv is not None:
            return layer.window_kv.is_inference()
    return False


def _check_same_padding(recorded: torch.Tensor | None, pads: torch.Tensor | None, start_pos: int, batch: int) -> None:
    """A forward after position 0: its attention mask must pad the cached positions as the cache
    records (left padding per row; a row still padded throughout may stay so).

    Raises:
        DeepseekV41AttentionError: a row whose padding differs.
    """
    if recorded is None and pads is None:
        return
    device = (pads if pads is not None else recorded).device
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    old = zeros if recorded is None else recorded.to(device=device, dtype=torch.int64)
    new = zeros if pads is None else pads.to(torch.int64)
    if old.shape != new.shape:
        raise DeepseekV41AttentionError(f"attention_mask has {new.numel()} rows, the cache {old.numel()}")
    started = old < start_pos  # rows with a real token in the cache
    bad = torch.where(started, new != old, new < start_pos)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise DeepseekV41AttentionError(
            f"attention_mask row {row} pads {int(new[row])} leading positions; the cache holds that row with "
            f"{int(old[row])} (padding is fixed at the prefill: pass the mask of every position so far)"
        )


_GRAPH_POOLS: dict = {}
_DECODE_POSITIONS: dict = {}


def _decode_position(device: torch.device, start_pos: int) -> torch.Tensor:
    """The position of a one-token step as int64 ``[1]`` on `device`, in one tensor per device
    rewritten in place at each step: the decode graphs read it where it is (no copy per layer).
    Like the shared graph pool, this assumes one decoding stream per device."""
    device = torch.device(device)
    pos = _DECODE_POSITIONS.get(device)
    if pos is None:
        # a normal tensor even when first asked for under torch.inference_mode(): an inference
        # tensor could not be rewritten by later steps outside it
        with torch.inference_mode(False):
            pos = _DECODE_POSITIONS[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return pos.fill_(start_pos)


def _graph_pool(device: torch.device):
    """One CUDA-graph memory pool per device, shared by the decode graphs of every layer (they
    replay one after another on one stream, so their intermediates may share memory)."""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    if key not in _GRAPH_POOLS:
        handle = torch.cuda.graph_pool_handle()
        # a pool lives while a graph uses it: once the last one is freed (graphs dropped after
        # `.to()`, or collected when a capture starts), capturing into its handle again fails
        # inside torch. A one-kernel graph kept here keeps the pool alive (so memory the decode
        # graphs held stays reserved in it for the process's life, `empty_cache()` included).
        with torch.cuda.device(key):
            stream = torch.cuda.Stream()
            keeper, scratch = torch.cuda.CUDAGraph(), torch.zeros(1, device=torch.device("cuda", key))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(keeper, pool=handle, stream=stream):
                scratch.add_(1)
            torch.cuda.current_stream().wait_stream(stream)
        _GRAPH_POOLS[key] = (handle, keeper, scratch)
    return _GRAPH_POOLS[key][0]


class DeepseekV41DecoderLayer(nn.Module):
    """One backbone block: Engram (where configured), then attention and MoE between mHC mixes.

    Mirrors `inference/model.py: Block` (and the Engram call `Transformer.forward` makes before
    the block). Checkpoint names: `attn_norm`, `attn`, `ffn_norm`, `ffn`, `engram` (Engram layers
    only), and the mHC parameters `hc_attn_fn` / `hc_ffn_fn` fp32 ``[(2+hc)*hc, hc*D]``,
    `hc_attn_base` / `hc_ffn_base` fp32 ``[(2+hc)*hc]``, `hc_attn_scale` / `hc_ffn_scale` fp32 ``[3]``.

    Args:
        config: the text config (`numerics`, `weight_dtype`, ... are read at construction).
        layer_idx: position in the backbone.
    """

    def __init__(self, config: DeepseekV41TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        hc, dim = config.hc_mult, config.hidden_size
        self.attn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps, config.numerics)
        self.attn = DeepseekV41Attention(config, layer_idx, config.weight_dtype)
        self.ffn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps, config.numerics)
        self.ffn = DeepseekV41MoE(config, layer_idx, _moe_quantization(config))
        self.engram = (
            DeepseekV41Engram(config, layer_idx, config.weight_dtype) if layer_idx in config.engram_layer_ids else None
        )
        self.hc = DeepseekV41HyperConnection(
            hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps, numerics=config.numerics
        )
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, hc * dim, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        # One-token decode steps on CUDA (numerics "fast") are replayed from CUDA graphs (see
        # `decode_step`): the whole step, or (piecewise) its fixed-shape head and tail
        self._decode_segments: dict[str, GraphedSegment] | None = None
        self.decode_cuda_graphs = getattr(config, "decode_cuda_graphs", True)
        # fast numerics without padding: the step as one graph-safe function (False: the
        # piecewise split everywhere, which `forward` equals bit for bit; tests compare the two)
        self._whole_decode_step = True

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
        with on_device(hidden_states.device):
            return self._forward(hidden_states, pre_mix_in, attention_state, image_mask, engram_hash_ids, engram_mask)

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
        one_step = x.size(1) == 1 and attention_state.start_pos > 0 and self.attn.numerics == "fast"
        if one_step and not self._submodules_hooked():
            if self._decode_graphs_apply(x.size(0), x.device, attention_state):
                return self.decode_step(x, pre_mix_in, attention_state, image_mask, graphs=True)
            if self._whole_decode_step:
                # the same computation a graph replays (graphs off, or on the CPU)
                return self.decode_step(x, pre_mix_in, attention_state, image_mask)
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

    # -- one-token decode: fixed-shape head and tail around the cache-dependent attention middle
    def _decode_head(self, x, pre_mix_in, freqs, *group_inputs):
        attn_pre, attn_post, attn_comb = self.hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        xa = self.attn_norm(self.hc.pre(x, pre_mix_in))
        # x and freqs are handed on to the tail: under graphs, the head's own copies of them
        return (x, freqs, attn_pre, attn_post, attn_comb, xa, *self.attn.decode_project(xa, freqs, *group_inputs))

    def _decode_tail(self, o, freqs, x, attn_pre, attn_post, attn_comb, image_mask):
        return self._ffn_half(self.attn.output(o, freqs), x, attn_pre, attn_post, attn_comb, image_mask)

    def _decode_whole(self, context, x, pre_mix_in, pos, image_mask, topk_idxs, blocks):
        plan, cache = context
        freqs = self.attn.rotary(pos)  # in the graph: the host hands over the position only
        attn_pre, attn_post, attn_comb = self.hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        xa = self.attn_norm(self.hc.pre(x, pre_mix_in))
        o, topk_idxs, blocks = self.attn.decode_static(plan, cache, xa, freqs, pos, topk_idxs, blocks)
        x2, f_pre = self._ffn_half(self.attn.output(o, freqs), x, attn_pre, attn_post, attn_comb, image_mask)
        return x2, f_pre, topk_idxs, blocks

    def _segment(self, name, device: torch.device, run: list | None = None) -> GraphedSegment:
        if self._decode_segments is None:
            self._decode_segments = {}
        if name not in self._decode_segments and run is not None:
            # a run of layers starting here (`decode_layers`): any layer's weights moving drops it
            self._decode_segments[name] = GraphedSegment(
                _run_step,
                _graph_pool(device),
                lambda: tuple(layer._graph_owner_key() for layer in run),
                clone_first=2,
                borrowed=(2,),
            )
        if name not in self._decode_segments:
            pool = _graph_pool(device)
            self._decode_segments[name] = {
                # the step's output rows go to the caller; the hand-downs are read within the step
                # the position tensor is the same storage at every step (`_decode_position`)
                "whole": lambda: GraphedSegment(
                    self._decode_whole, pool, self._graph_owner_key, clone_first=2, borrowed=(2,)
                ),
                # the head's outputs are consumed within the step; the tail's go to the caller
                "head": lambda: GraphedSegment(self._decode_head, pool, self._graph_owner_key, clone_outputs=False),
                # the tail reads the head's x, freqs and mixes in place (no copies)
                "tail": lambda: GraphedSegment(
                    self._decode_tail, pool, self._graph_owner_key, clone_outputs=True, borrowed=(1, 2, 3, 4, 5)
                ),
            }[name]()
        return self._decode_segments[name]

    def _submodules_hooked(self) -> bool:
        """Whether forward hooks watch a submodule (`capture_intermediates`, a user's hook). Then
        decode steps take the plain forward, which calls every submodule as a module: a graph
        replay, or the step's own function, would skip them."""
        modules = self.__dict__.get("_hook_watch")
        if modules is None:
            # not the routed experts (~1500 modules at release width, too many to scan at every
            # step): the steps that skip module calls run them in the expert kernels, as the
            # plain forward does then, so hooks on them fire in neither; an eager step calls
            # them as modules, as the plain forward does
            experts = {id(m) for m in self.ffn.experts.modules()}
            modules = self.__dict__["_hook_watch"] = [m for m in self.modules() if id(m) not in experts][1:]
        if _global_forward_hooks or _global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in modules)

    def _call_wrapped(self) -> bool:
        """Whether calling this layer does more than its forward: its own hooks, `compile()`, a
        replaced `forward`, or accelerate weights swapped in around each call. A run of layers
        (`decode_layers`) does not call the layer, so such a layer steps alone. accelerate's hook
        that only moves the inputs to the layer's GPU is no obstacle: a run moves them."""
        if self._forward_hooks or self._forward_pre_hooks or getattr(self, "_compiled_call_impl", None) is not None:
            return True
        if getattr(self, "_hf_hook", None) is None:
            return "forward" in self.__dict__
        return self._offloaded()

    def _offloaded(self) -> bool:
        """Whether accelerate swaps this layer's weights in and out around each call (offload)."""
        hook = getattr(self, "_hf_hook", None)
        hooks = getattr(hook, "hooks", [hook]) if hook is not None else []
        return any(getattr(h, "offload", False) for h in hooks)

    def _decode_graphs_apply(self, batch: int, device: torch.device, state: DeepseekV41AttentionState) -> bool:
        if not (self.decode_cuda_graphs and device.type == "cuda" and state.start_pos > 0):
            return False
        if self.attn.numerics != "fast" or torch.is_grad_enabled():
            return False
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        if not self.ffn.runs_without_host_sync(batch, device):
            return False  # e.g. a batch past the expert kernels' size: the MoE reads counts on the host
        # accelerate's offloading hooks swap the weights in and out around each forward: a graph
        # would keep reading the addresses of the first load
        return not self._offloaded()

    def run_plan(self, batch: int, state: DeepseekV41AttentionState, graphs: bool) -> DecodePlan | None:
        """This layer's plan (:meth:`DeepseekV41Attention.decode_plan`) when its one-token step can
        join a run of layers replayed as one (:func:`decode_layers`), else None: Engram layers,
        hooked submodules, exact numerics, left padding, a cache not ready for the fixed-shape step,
        and with `graphs` whatever keeps :meth:`block` from replaying its step on CUDA."""
        if self.engram is not None or not self._whole_decode_step or self.attn.numerics != "fast":
            return None
        if state.start_pos == 0 or torch.is_grad_enabled() or self._submodules_hooked() or self._call_wrapped():
            return None
        device = self.weight_device
        if graphs and not (
            self._decode_graphs_apply(batch, device, state) and self.attn.sparse_attention_graph_safe(device)
        ):
            return None
        return self.attn.decode_plan(state, batch)

    @property
    def weight_device(self) -> torch.device:
        """The device of the layer's weights (where its step runs)."""
        return self.attn.wq_a.weight.device

    def _graph_owner_key(self) -> tuple:
        return (self.attn.numerics, self.attn.wq_a.weight.data_ptr(), self.ffn.shared_experts.w2.weight.data_ptr())

    def decode_step(
        self,
        x: torch.Tensor,
        pre_mix_in: torch.Tensor,
        attention_state: DeepseekV41AttentionState,
        image_mask: torch.Tensor | None = None,
        graphs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`block` for a one-token step after a prefill, in three parts: the head (mHC mixes
        and collapse, `attn_norm`, the attention's projections), the attention's cache-dependent
        middle (:meth:`DeepseekV41Attention.decode_attend`), the tail (`wo_a`/`wo_b`, mHC,
        `ffn_norm`, MoE, mHC). The head and tail have the same shapes at every step; with `graphs`
        (CUDA only) they are captured once per batch size in CUDA graphs and replayed.

        In fast numerics without left padding the step instead runs as one function whose shapes
        are fixed by :meth:`DeepseekV41Attention.decode_plan` (the middle is
        :meth:`DeepseekV41Attention.decode_static`: caches written in place, the compressed rows
        read in a bucketed width), and with `graphs` the whole step is one CUDA graph, captured
        per cache layout. :meth:`block` takes the same route for such steps, so graphs on and off
        compute the same values; against the piecewise split it differs only in the order of the
        top-k picks (the same set), hence in the sparse attention's fp32 summation order.

        Args:
            x: bf16 ``[B, 1, hc, D]``; pre_mix_in: fp32 ``[B, 1, hc]``.
            attention_state: the step's state (``start_pos > 0``).
            image_mask: bool ``[B, 1]`` or None, as :meth:`block` (a graph input: None and a
                tensor are captured separately).
            graphs: replay the head and tail from CUDA graphs.

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
        plan = self.attn.decode_plan(attention_state, x.size(0)) if self._whole_decode_step else None
        if plan is not None and (not graphs or self.attn.sparse_attention_graph_safe(x.device)):
            return self._decode_step_whole(plan, x, pre_mix_in, attention_state, image_mask, graphs)
        freqs = self.attn.decode_freqs(attention_state, x.device)
        head, tail = self._decode_head, self._decode_tail
        if graphs:
            head, tail = self._segment("head", x.device), self._segment("tail", x.device)
        # a step that ends a compressor group also pools it in the head (from the parked slots)
        group_inputs = self.attn.decode_group_inputs(attention_state, x.device)
        x, head_freqs, attn_pre, attn_post, attn_comb, xa, *projections = head(x, pre_mix_in, freqs, *group_inputs)
        o = self.attn.decode_attend(xa, *projections[:3], freqs, attention_state, *projections[3:])
        return tail(o, head_freqs, x, attn_pre, attn_post, attn_comb, image_mask)

    def _decode_step_whole(self, plan, x, pre_mix_in, state: DeepseekV41AttentionState, image_mask, graphs: bool):
        attn, device = self.attn, x.device
        pos = state.step_table(("decode_pos", device), lambda: _decode_position(device, state.start_pos))
        topk_idxs = blocks = None
        if attn.ratio and not attn.is_index_source:
            topk_idxs = state.topk_idxs[attn.index_source].to(device)  # (the source may sit on another GPU)
        if attn.indexer is not None and attn.indexer.uses_candidates:
            blocks = state.candidate_blocks.to(device)
        args = (x, pre_mix_in, pos, image_mask, topk_idxs, blocks)
        context = (plan, state.cache)
        if graphs:
            out = self._segment("whole", device)(*args, key=plan.key, context=context)
        else:
            out = self._decode_whole(context, *args)
        x2, f_pre, topk_idxs, blocks = out
        attn.decode_commit(plan, state, topk_idxs, blocks)
        return x2, f_pre


class _PendingHandDown:
    """Stands in the attention state for a hand-down (top-k indices, candidate blocks) of a layer
    planned into a run that has not been replayed yet: later layers' plans only ask whether it
    exists; the run's replay puts the tensor there."""

    def __repr__(self) -> str:
        return "<hand-down of a pending run>"


_PENDING = _PendingHandDown()


def _run_step(context, x, pre_mix_in, pos, image_mask, *outside):
    """The one-token steps of a run of layers, one after another (the function a run's graph
    captures). `context` = ``(entries, cache, outside_keys)``: ``(layer, plan)`` pairs, the
    attention cache, and what each of `outside` is (an index source's layer id, or "blocks" for
    the candidate blocks) for hand-downs made before the run. Returns ``(x, f_pre, *topk of the
    run's index sources in order, candidate blocks made in the run or None)``."""
    entries, cache, outside_keys = context
    handed = dict(zip(outside_keys, outside))
    made, blocks_made = [], None
    for layer, plan in entries:
        attn = layer.attn
        topk = handed[attn.index_source] if attn.ratio and not attn.is_index_source else None
        blocks = handed["blocks"] if attn.indexer is not None and attn.indexer.uses_candidates else None
        x, pre_mix_in, topk, blocks = layer._decode_whole((plan, cache), x, pre_mix_in, pos, image_mask, topk, blocks)
        if topk is not None:
            handed[layer.layer_idx] = topk
            made.append(topk)
        if blocks is not None:
            handed["blocks"] = blocks_made = blocks
    return (x, pre_mix_in, *made, blocks_made)


def _replay_run(entries, x, pre_mix_in, state: DeepseekV41AttentionState, image_mask, graphs: bool):
    """Run the planned `entries` (their plans already committed on the host) as one step: on one
    CUDA graph with `graphs`, else eagerly. Puts the run's hand-downs in `state`."""
    device = entries[0][0].weight_device
    x, pre_mix_in = x.to(device), pre_mix_in.to(device)
    image_mask = image_mask.to(device) if image_mask is not None else None
    pos = state.step_table(("decode_pos", device), lambda: _decode_position(device, state.start_pos))
    inside, outside_keys = set(), []  # hand-downs made in the run so far; those it reads from before it
    for layer, _ in entries:
        attn, indexer = layer.attn, layer.attn.indexer
        wants = []
        if attn.ratio and not attn.is_index_source:
            wants.append(attn.index_source)
        if indexer is not None and indexer.uses_candidates:
            wants.append("blocks")
        outside_keys += [k for k in wants if k not in inside and k not in outside_keys]
        if attn.ratio and attn.is_index_source:
            inside.add(layer.layer_idx)
        if indexer is not None and indexer.is_candidate_source:
            inside.add("blocks")
    outside = [(state.candidate_blocks if k == "blocks" else state.topk_idxs[k]).to(device) for k in outside_keys]
    context = (entries, state.cache, tuple(outside_keys))
    args = (x, pre_mix_in, pos, image_mask, *outside)
    if graphs:
        ids = tuple(layer.layer_idx for layer, _ in entries)
        run = [layer for layer, _ in entries]
        segment = entries[0][0]._segment(("run", ids), device, run)
        key = (tuple(outside_keys), *(plan.key for _, plan in entries))
        out = segment(*args, key=key, context=context)
    else:
        out = _run_step(context, *args)
    x, pre_mix_in, *made, blocks = out
    sources = [layer.layer_idx for layer, _ in entries if layer.attn.ratio and layer.attn.is_index_source]
    for layer_id, topk in zip(sources, made, strict=True):
        state.topk_idxs[layer_id] = topk
    if blocks is not None:
        state.candidate_blocks = blocks
    return x, pre_mix_in


def decode_layers(
    layers: Sequence[DeepseekV41DecoderLayer],
    x: torch.Tensor,
    pre_mix_in: torch.Tensor,
    state: DeepseekV41AttentionState,
    image_mask: torch.Tensor | None = None,
    engram_hash_ids: torch.Tensor | None = None,
    engram_mask: torch.Tensor | None = None,
    graphs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token decode step through consecutive decoder `layers`, with each run of layers that
    share a device replayed from one CUDA graph: one launch for the run instead of one per layer,
    so the host's work per layer is only its plan (:meth:`DeepseekV41DecoderLayer.run_plan`).

    A layer that cannot join a run (an Engram layer, hooks on it or its submodules, a cache not
    ready for the fixed-shape step, graphs off for it: see `run_plan`) ends the run before it and
    takes its own call (``layer(...)``, which may still replay its own graphs). The values are
    those of calling the layers one by one, bit for bit: a run executes each layer's
    :meth:`_decode_whole` in order, handing top-k indices and candidate blocks from layer to layer
    inside the graph. A run that fails (an out-of-memory error at its capture, say) puts back the
    host bookkeeping of its layers before the error propagates: the cache is left as layer-by-layer
    steps failing at that layer would leave it.

    Args:
        layers: consecutive decoder layers (a model's `layers`, or a slice of them).
        x: bf16 ``[B, 1, hc, D]``; pre_mix_in: fp32 ``[B, 1, hc]``.
        state: the step's attention state (``start_pos > 0``).
        image_mask, engram_hash_ids, engram_mask: as :meth:`DeepseekV41DecoderLayer.forward`.
        graphs: replay runs from CUDA graphs (False: run them eagerly, the same computation;
            tests compare the two on the CPU).

    Returns:
        ``(x, f_pre)`` of the last layer, on its device.

    Raises:
        DeepseekV41ModelError: not one token per row, or position 0.
    """
    if x.dim() != 4 or x.size(1) != 1:
        raise DeepseekV41ModelError(f"decode_layers takes one token per row, x [B, 1, hc, D]; got {tuple(x.shape)}")
    if state.start_pos == 0:
        raise DeepseekV41ModelError("decode_layers follows a prefill: state.start_pos is 0")
    batch, pending, undo = x.size(0), [], []
    try:
        for layer in layers:
            plan = layer.run_plan(batch, state, graphs)
            if pending and (plan is None or layer.weight_device != pending[0][0].weight_device):
                x, pre_mix_in = _replay_run(pending, x, pre_mix_in, state, image_mask, graphs)
                pending, undo = [], []
            if plan is None:
                x, pre_mix_in = layer(x, pre_mix_in, state, image_mask, engram_hash_ids, engram_mask)
                continue
            # the host bookkeeping now: the next layers' plans read it (row counts, the publisher)
            undo.append(_commit_undo(layer, state))
            layer.attn.decode_commit(plan, state, None, None)
            if layer.attn.ratio and layer.attn.is_index_source:
                state.topk_idxs[layer.layer_idx] = _PENDING
            if layer.attn.indexer is not None and layer.attn.indexer.is_candidate_source:
                state.candidate_blocks = _PENDING
            pending.append((layer, plan))
        if pending:
            x, pre_mix_in = _replay_run(pending, x, pre_mix_in, state, image_mask, graphs)
    except BaseException:
        # a run that did not complete (out of memory at its capture, say): its layers' bookkeeping
        # is put back, so the cache holds what the layers before it wrote, as layer-by-layer steps
        # would leave it
        for restore in reversed(undo):
            restore()
        raise
    return x, pre_mix_in


_MISSING = object()


def _commit_undo(layer: DeepseekV41DecoderLayer, state: DeepseekV41AttentionState):
    """A function that puts back what this layer's `decode_commit` and pending hand-downs change
    on the host: its buffers' row counts, the index-key publisher, the state's hand-downs."""
    cache = state.cache
    own = cache.layer(layer.layer_idx)
    lengths = [(buffer, buffer.length) for buffer in (own.compressed_kv, own.index_k) if buffer is not None]
    publisher = (cache.index_k_publisher, cache.index_k_publisher_rows)
    topk, blocks = state.topk_idxs.get(layer.layer_idx, _MISSING), state.candidate_blocks

    def restore() -> None:
        for buffer, length in lengths:
            buffer.length = length
        cache.index_k_publisher, cache.index_k_publisher_rows = publisher
        if topk is _MISSING:
            state.topk_idxs.pop(layer.layer_idx, None)
        else:
            state.topk_idxs[layer.layer_idx] = topk
        state.candidate_blocks = blocks

    return restore


@dataclass
class DeepseekV41TransformerOutput(ModelOutput):
    """Output of :class:`DeepseekV41Transformer`.

    Attributes:
        logits: fp32 ``[B, K, V]``, the last K positions (``logits_to_keep``; all when 0).
        cache: the :class:`DeepseekV41Cache` holding the decode state (None without one).
        last_hidden_state: bf16 ``[B, S, D]``, the `norm` output (the head input).
    """

    logits: torch.Tensor | None = None
    cache: DeepseekV41Cache | None = None
    last_hidden_state: torch.Tensor | None = None


class DeepseekV41Transformer(nn.Module):
    """The complete V4.1 VL network with the checkpoint's module names and no prefix.

    Mirrors `inference/model.py: Transformer` (DSpark/MTP excluded: generation never calls it).

    Submodules / parameters: `embed` (bf16 ``[V, D]``), `layers`, `norm`, `head` (fp32),
    `image_start` / `image_end` / `image_newline` (bf16 ``[D]``), `vision`, `aligner` (when the
    vision tower has layers), `engram_hash` (buffer `token_map`, when Engram layers exist).

    Args:
        config: the composite :class:`DeepseekV41Config`; `text_config.numerics` picks
            ``"exact"`` (bitwise the reference on CPU) or ``"fast"``.
    """

    def __init__(self, config: DeepseekV41Config):
        super().__init__()
        self.config = config
        text = config.text_config
        self.text_config = text
        dim = text.hidden_size
        self.hc_mult = text.hc_mult
        self.embed = nn.Embedding(text.vocab_size, dim, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(DeepseekV41DecoderLayer(text, i) for i in range(text.num_hidden_layers))
        self.norm = DeepseekV41RMSNorm(dim, text.rms_norm_eps, text.numerics)
        self.head = DeepseekV41Head(text.vocab_size, dim)
        self.hc = DeepseekV41HyperConnection(
            text.hc_mult, text.hc_sinkhorn_iters, text.hc_eps, text.rms_norm_eps, numerics=text.numerics
        )
        self.engram_hash = DeepseekV41EngramHash(text) if text.engram_layer_ids else None
        self.decode_layer_runs = False
        self.vision_enabled = config.vision_config.num_hidden_layers > 0
        if self.vision_enabled:
            with _default_dtype(torch.bfloat16):
                self.vision = DeepseekV41VisionTransformer(config.vision_config)
                self.aligner = DeepseekV41VisionAligner(config.vision_config)
            for name in ("image_start", "image_end", "image_newline"):
                self.register_parameter(name, nn.Parameter(torch.empty(dim, dtype=torch.bfloat16)))

    @property
    def decode_layer_runs(self) -> bool:
        """Whether one-token decode steps replay each run of layers on a GPU as one CUDA graph
        (:func:`decode_layers`) instead of one graph per layer. Default False: a run's layers are
        all planned on the host before its graph starts, while per-layer graphs let the host plan
        a layer while the GPU runs the one before; on an H200 the per-layer graphs were faster
        (host work ~0.1-0.2 ms per layer against ~0.6 ms of GPU time: BENCHMARKS.md). Runs pay
        where the host is the slower side. Both give the same values, bit for bit.

        Raises (on assignment):
            DeepseekV41ModelError: a value that is not a bool.
        """
        return self._decode_layer_runs

    @decode_layer_runs.setter
    def decode_layer_runs(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise DeepseekV41ModelError(f"decode_layer_runs must be True or False, got {value!r}")
        self._decode_layer_runs = value

    # -- images ---------------------------------------------------------------------------
    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Aligner rows of all images, ``[sum n_llm_h * n_llm_w, D]`` bf16, images in order and
        each row-major. Mirrors `Transformer.encode_image`.

        Raises:
            DeepseekV41ModelError: the model has no vision tower.
        """
        if not self.vision_enabled:
            raise DeepseekV41ModelError("this model has no vision tower (vision_config.num_hidden_layers == 0)")
        return self.aligner(self.vision(pixel_values, image_grid_thw), image_grid_thw)

    def merge_image_embeddings(
        self, inputs_embeds: torch.Tensor, roles: torch.Tensor, image_features: torch.Tensor
    ) -> torch.Tensor:
        """Write the span vectors into the token embeddings. Mirrors `merge_image_embeddings`.

        START / NEWLINE / END positions take `image_start` / `image_newline` / `image_end`; the
        IMAGE positions take the aligner rows in reading order (batch row, then position).

        Raises:
            DeepseekV41ModelError: the number of IMAGE positions differs from the aligner rows.
        """
        image_positions = roles == IMAGE
        n_slots, n_rows = int(image_positions.sum()), image_features.size(0)
        if n_slots != n_rows:
            raise DeepseekV41ModelError(
                f"the image spans hold {n_slots} IMAGE positions but the images give {n_rows} rows"
            )
        dtype = inputs_embeds.dtype
        h = inputs_embeds
        delimiters = ((IMAGE_START, self.image_start), (IMAGE_END, self.image_end), (IMAGE_NEW_LINE, self.image_newline))
        for role, vector in delimiters:
            h = torch.where((roles == role).unsqueeze(-1), vector.to(dtype), h)
        return h.masked_scatter(image_positions.unsqueeze(-1), image_features.to(h.device, dtype))

    def get_image_span_embeddings(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """The embedding of every position of every image span, bf16 ``[sum span lengths, D]``.

        Per image ``[image_start, (aligner row) * n_llm_w + image_newline for each of n_llm_h grid
        rows, image_end]``, images in order: one row per span position (all carry
        `image_token_id`), in the (batch row, position) order of the spans. This is what a chunked
        prefill passes, sliced per chunk, as `image_span_embeds`; the images are encoded once.

        Raises:
            DeepseekV41ModelError: the model has no vision tower.
        """
        features = self.get_image_features(pixel_values, image_grid_thw)
        dtype = self.embed.weight.dtype
        spans, row = [], 0
        for n_vit_h, n_vit_w in parse_image_grid(image_grid_thw):
            n_h, n_w = llm_grid(n_vit_h, n_vit_w, self.config.vision_config.downsample_ratio)
            grid = features[row : row + n_h * n_w].to(dtype).view(n_h, n_w, -1)
            row += n_h * n_w
            newline = self.image_newline.to(dtype).expand(n_h, 1, -1)
            body = torch.cat([grid, newline], dim=1).flatten(0, 1)
            spans += [self.image_start.to(dtype)[None], body, self.image_end.to(dtype)[None]]
        return torch.cat(spans)

    # -- forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        cache: DeepseekV41Cache | None = None,
        logits_to_keep: int = 1,
        attention_mask: torch.Tensor | None = None,
        image_span_embeds: torch.Tensor | None = None,
    ) -> DeepseekV41TransformerOutput:
        """Prefill (cache empty), prefill chunk or one-token decode step. Mirrors `Transformer.forward`.

        A forward of S > 1 tokens on a non-empty cache is a prefill chunk: it continues the
        sequence exactly like one prefill would (see `attention_deepseek_v41_vl.py`). Images in a
        chunked prefill: compute :meth:`get_image_span_embeddings` once and pass each chunk the
        rows of the span positions it holds as `image_span_embeds` (with `mm_token_type_ids` of
        the chunk), so a span may be split between chunks; `pixel_values` only prefill at 0.
        Setting ``cache.attention.prefill_length`` to the prompt length before the first chunk
        makes exact numerics rank the indexer like one prefill (bitwise the same logits; see
        `DeepseekV41AttentionCache`).

        Args:
            input_ids: int64 ``[B, S]``; image-span positions carry `image_token_id`.
            mm_token_type_ids: int ``[B, S]``, 1 on every image-span position; None for text.
            pixel_values: ``[total_patches, 588]`` (or ``[total_patches, 3, 14, 14]``), the images
                of all spans in order; only at position 0.
            image_grid_thw: int ``[n_images, 3]``, rows ``(1, n_vit_h, n_vit_w)``.
            cache: a :class:`DeepseekV41Cache` to continue (decode) or fill (prefill);
                None runs a standalone prefill.
            logits_to_keep: logits of the last K positions; 0 keeps all. The default 1 is what
                the reference returns (its GEMM over ``[B, D]``, bitwise the same).
            attention_mask: ``[B, past + S]``, 0 on left padding (every position so far, as
                `generate` passes it). Each row then runs as if it started at its first real token
                (positions, window, compressor groups, Engram look-back); None: the padding the
                cache recorded, or none.
            image_span_embeds: ``[n, D]`` rows for the n image-span positions of this forward
                (``mm_token_type_ids == 1``, in (batch row, position) order), a slice of
                :meth:`get_image_span_embeddings`; instead of `pixel_values`, at any position.

        Returns:
            :class:`DeepseekV41TransformerOutput`.

        Raises:
            DeepseekV41ModelError: `input_ids` that are not integer ids in ``[0, vocab_size)`` or
                hold no token; a step outside `torch.inference_mode()` on a cache filled inside
                it; images after position 0 or without span marks, spans that do not fit the
                images or hold other ids than `image_token_id`, `image_span_embeds` rows that do
                not match the marked positions.
            DeepseekV41AttentionError: a forward after position 0 on a cache without a prefill,
                an attention mask that is not a left padding of every position so far, or one
                whose padding of the positions already cached differs from the cache's.
        """
        if input_ids.dim() != 2:
            raise DeepseekV41ModelError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise DeepseekV41ModelError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise DeepseekV41ModelError(f"input_ids holds no token: shape {tuple(input_ids.shape)}")
        vocab = self.text_config.vocab_size
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise DeepseekV41ModelError(
                f"input_ids must lie in [0, {vocab}) (vocab_size); got values from {int(input_ids.min())} to {int(input_ids.max())}"
            )
        start_pos = cache.get_seq_length() if cache is not None else 0
        if start_pos > 0 and not torch.is_inference_mode_enabled() and _holds_inference_tensors(cache):
            raise DeepseekV41ModelError(
                "the cache was filled under torch.inference_mode(), whose tensors cannot be updated "
                "outside it: continue this sequence under torch.inference_mode() too (or fill it "
                "under torch.no_grad())"
            )

        if pixel_values is not None and start_pos != 0:
            raise DeepseekV41ModelError("pixel_values prefill at position 0 only; pass later chunks image_span_embeds")
        if pixel_values is not None and image_span_embeds is not None:
            raise DeepseekV41ModelError("pass pixel_values or image_span_embeds, not both")
        image_mask = engram_mask = roles = None
        if mm_token_type_ids is not None:
            if mm_token_type_ids.shape != input_ids.shape:
                raise DeepseekV41ModelError(
                    f"mm_token_type_ids {tuple(mm_token_type_ids.shape)} must match input_ids {tuple(input_ids.shape)}"
                )
            if pixel_values is None and image_span_embeds is None and bool((mm_token_type_ids != 0).any()):
                raise DeepseekV41ModelError("mm_token_type_ids marks image spans but no pixel_values were given")
            if image_span_embeds is not None:
                # rows already hold each span position's vector; a chunk may hold part of a span
                if bool(((mm_token_type_ids != 0) & (mm_token_type_ids != 1)).any()):
                    raise DeepseekV41ModelError("mm_token_type_ids must hold only 0 (text) and 1 (image span)")
                image_mask = mm_token_type_ids.bool()
                n_slots = int(image_mask.sum())
                if image_span_embeds.dim() != 2 or image_span_embeds.size(0) != n_slots:
                    raise DeepseekV41ModelError(
                        f"image_span_embeds must be [{n_slots}, D] (one row per marked span position of this "
                        f"forward), got {tuple(image_span_embeds.shape)}"
                    )
            else:
                roles = image_token_roles(
                    mm_token_type_ids, image_grid_thw, self.config.vision_config.downsample_ratio
                )
                image_mask = roles >= 0
            engram_mask = ~image_mask
            if bool((input_ids[image_mask] != self.config.image_token_id).any()):
                raise DeepseekV41ModelError(
                    f"every image-span position must carry image_token_id {self.config.image_token_id}"
                )
        if pixel_values is not None:
            if roles is None:
                raise DeepseekV41ModelError("pixel_values were given without mm_token_type_ids marking the image spans")
        if image_span_embeds is not None and image_mask is None:
            raise DeepseekV41ModelError("image_span_embeds were given without mm_token_type_ids marking their positions")
        if cache is not None and (attention_mask is not None or start_pos == 0):
            pads = left_padding_offsets(attention_mask, start_pos, input_ids.size(1))
            if start_pos > 0:
                _check_same_padding(cache.attention.pad_offsets, pads, start_pos, input_ids.size(0))
            cache.attention.pad_offsets = pads
        pad_offsets = (
            cache.attention.pad_offsets
            if cache is not None
            else left_padding_offsets(attention_mask, start_pos, input_ids.size(1))
        )

        hash_ids = None
        if self.engram_hash is not None:
            history = cache.engram_history if cache is not None else None
            if start_pos > 0 and history is None:
                raise DeepseekV41ModelError("decode step with a cache that holds no Engram history")
            hash_ids, history = self.engram_hash(
                input_ids, token_mask=engram_mask, history=history, attention_mask=attention_mask
            )
            if cache is not None:
                cache.engram_history = history

        h = self.embed(input_ids)
        if pixel_values is not None:
            h = self.merge_image_embeddings(h, roles, self.get_image_features(pixel_values, image_grid_thw))
        elif image_span_embeds is not None:
            h = h.masked_scatter(image_mask.unsqueeze(-1), image_span_embeds.to(h.dtype))

        x = h.unsqueeze(2).repeat(1, 1, self.hc_mult, 1)
        pre_mix = identity_pre_mix(x, self.hc_mult)
        attention_cache = cache.attention if cache is not None else DeepseekV41AttentionCache()
        state = DeepseekV41AttentionState(start_pos=start_pos, cache=attention_cache, pad_offsets=pad_offsets)
        if input_ids.size(1) == 1 and start_pos > 0 and self.decode_layer_runs:
            x, pre_mix = decode_layers(self.layers, x, pre_mix, state, image_mask, hash_ids, engram_mask)
        else:
            for layer in self.layers:
                x, pre_mix = layer(x, pre_mix, state, image_mask, hash_ids, engram_mask)
        hidden = self.norm(self.hc.pre(x, pre_mix))
        if cache is not None:
            cache.record_tokens(input_ids.size(1))

        if logits_to_keep == 1:
            # the reference's default: the GEMM over [B, D] (bitwise what it returns)
            logits = self.head(hidden[:, -1]).unsqueeze(1)
        elif logits_to_keep == 0:
            logits = self.head(hidden)
        else:
            logits = self.head(hidden[:, -logits_to_keep:])
        return DeepseekV41TransformerOutput(logits=logits, cache=cache, last_hidden_state=hidden)


# --------------------------------------------------------------------------------------------
# Intermediate capture (golden comparisons, debugging)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def capture_intermediates(model: DeepseekV41Transformer) -> Iterator[dict[str, torch.Tensor | list[torch.Tensor]]]:
    """Record the reference's boundaries of every forward run inside the ``with`` block.

    Keys are the golden names without the ``prefill.`` / ``decode.`` prefix (a later forward
    overwrites an earlier one's entries): ``embed.lookup``, ``embed.merged`` (copy 0 entering
    layer 0), ``image{k}.aligner_out``, ``engram_hash_ids``, ``block_in.{i}`` (after Engram),
    ``pre_mix_in.{i}``, ``attn_out.{i}``, ``block_out.{i}``, ``gate.{i}.weights`` / ``.indices`` /
    ``.biased_scores``, ``indexer.{i}.topk_idxs``, ``final_hc_collapsed``, ``head_in``.

    Forward hooks are removed on exit, so the model pays nothing outside the block.
    """
    records: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    handles = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        records[name] = tensor.detach()

    handles.append(model.embed.register_forward_hook(lambda m, a, out: keep("embed.lookup", out)))
    handles.append(model.norm.register_forward_hook(lambda m, a, out: keep("final_hc_collapsed", a[0])))
    handles.append(model.head.register_forward_hook(lambda m, a, out: keep("head_in", a[0])))
    if model.engram_hash is not None:
        handles.append(model.engram_hash.register_forward_hook(lambda m, a, out: keep("engram_hash_ids", out[0])))
    if model.vision_enabled:
        # reset per forward, then one entry per image in call order
        handles.append(model.aligner.register_forward_pre_hook(lambda m, a: records.pop("_aligner_rows", None)))

        def aligner_row(m, a, out):
            rows = records.setdefault("_aligner_rows", [])
            records[f"image{len(rows)}.aligner_out"] = out.detach()
            rows.append(out.detach())

        handles.append(model.aligner.w2.register_forward_hook(aligner_row))

    for i, layer in enumerate(model.layers):

        def layer_in(m, args, i=i):
            x, pre_mix = args[0], args[1]
            if i == 0:
                keep("embed.merged", x[:, :, 0])
            if m.engram is None:
                keep(f"block_in.{i}", x)
            keep(f"pre_mix_in.{i}", pre_mix)

        handles.append(layer.register_forward_pre_hook(layer_in))
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: keep(f"block_out.{i}", out[0])))
        if layer.engram is not None:
            handles.append(layer.engram.register_forward_hook(lambda m, a, out, i=i: keep(f"block_in.{i}", out)))
        handles.append(layer.attn.register_forward_hook(lambda m, a, out, i=i: keep(f"attn_out.{i}", out)))
        if layer.attn.indexer is not None:
            handles.append(
                layer.attn.indexer.register_forward_hook(lambda m, a, out, i=i: keep(f"indexer.{i}.topk_idxs", out))
            )

        def gate_out(gate, args, out, i=i):
            x = args[0]
            image_rows = args[1] if len(args) > 1 else None
            bias = gate.bias if image_rows is None else torch.where(image_rows.unsqueeze(-1), gate.bias_vl, gate.bias)
            keep(f"gate.{i}.weights", out[0])
            keep(f"gate.{i}.indices", out[1])
            keep(f"gate.{i}.biased_scores", gate.scores(x) + bias)

        handles.append(layer.ffn.gate.register_forward_hook(gate_out))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()
        records.pop("_aligner_rows", None)



# --------------------------------------------------------------------------------------------
# transformers classes: PreTrainedModel, AutoModel, AutoModelForImageTextToText, AutoModelForCausalLM
# --------------------------------------------------------------------------------------------

# Routed experts stored as packed fp4: I8 ``[out, in/2]`` on disk, float4_e2m1fn_x2 in the module.
_FP4_EXPERT_WEIGHT = r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$"


def _fp32_parameter_names(module: nn.Module) -> list[str]:
    return [name for name, param in module.named_parameters() if param.dtype == torch.float32]


@contextlib.contextmanager
def _checkpoint_tensor_views(model: nn.Module) -> Iterator[None]:
    """While transformers' loader sets parameters on `model`: an I8 tensor arriving for a packed-fp4
    weight is re-VIEWED as float4_e2m1fn_x2 (the bytes are the packed E2M1 pairs; a value cast is
    wrong and not even implemented), and every parameter keeps the `requires_grad` of the module's
    own (quantized storage is not trainable; the loader would mark every float tensor trainable)."""
    fp4_modules = {id(m) for m in model.modules() if isinstance(m, DeepseekV41Linear) and m.weight_dtype == "fp4"}
    ours = {id(m) for m in model.modules()}

    def hook(module, name, param):
        if id(module) not in ours or param is None:
            return None
        if id(module) in fp4_modules and name == "weight" and param.dtype in (torch.int8, torch.uint8):
            return nn.Parameter(param.detach().view(torch.float4_e2m1fn_x2), requires_grad=False)
        previous = module._parameters.get(name)
        if previous is not None and previous.requires_grad != param.requires_grad:
            param.requires_grad_(previous.requires_grad and param.is_floating_point())
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _resave_offloaded_fp4(offload_index: dict, offload_folder: str | None) -> None:
    """Disk-offloaded packed-fp4 weights: transformers' offload index points at the I8 tensor of the
    checkpoint with the parameter's dtype (float4_e2m1fn_x2), and accelerate would value-cast it on
    every load. Each one is re-saved once as F4 in the offload folder (the same bytes) and its
    index entry repointed (updated in place: the index is handed to the dispatch afterwards).

    Raises:
        DeepseekV41ModelError: fp4 weights offloaded to disk without an `offload_folder`.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    fp4 = str(torch.float4_e2m1fn_x2).removeprefix("torch.")
    for name, info in offload_index.items():
        if info.get("dtype") != fp4 or info.get("safetensors_file") is None:
            continue
        with safe_open(info["safetensors_file"], framework="pt") as f:
            tensor = f.get_tensor(info.get("weight_name", name))
        if tensor.dtype == torch.float4_e2m1fn_x2:
            continue
        if offload_folder is None:
            raise DeepseekV41ModelError(
                f"{name} (packed fp4) is offloaded to disk: pass offload_folder to from_pretrained"
            )
        path = os.path.join(offload_folder, f"{name}.safetensors")
        save_file({name: tensor.view(torch.float4_e2m1fn_x2)}, path)
        info.update(safetensors_file=path, weight_name=name)


def _restore_host_tensors(model: nn.Module) -> None:
    """Rebuild the plain tensor attributes that were created on the meta device (transformers builds
    the model under ``torch.device("meta")``): the RoPE frequencies, which are attributes, not
    buffers, so that a dtype cast of the model cannot round them."""
    for module in model.modules():
        if isinstance(module, DeepseekV41RotaryEmbedding) and module.inv_freq.is_meta:
            with torch.device("cpu"):
                module.inv_freq = rope_inv_frequencies(module.rope_dim, module.base, **module.yarn)


def _offloaded_layers_load_whole(module_classes: list[str]):
    """While `from_pretrained` dispatches a `device_map` with offloaded ("cpu"/"disk") entries: the
    offloaded decoder layers and ViT blocks bring ALL their weights to the execution device when
    they start (accelerate's `preload_module_classes`). Without it accelerate loads each submodule's
    weights only when that submodule is called, and a layer that reads a child's weight directly
    (the attention's grouped `wo_a` einsum) would see a meta tensor. transformers does not pass the
    option itself, so its `dispatch_model` is wrapped for the duration of the call. A context
    manager."""

    def wrap(original):
        @functools.wraps(original)
        def dispatch_model(*args, **kwargs):
            kwargs.setdefault("preload_module_classes", module_classes)
            return original(*args, **kwargs)

        return dispatch_model

    return wrapped_dispatch_model(wrap)


def _official_layout_index(path) -> dict[str, str] | None:
    """The weight map of a local ``convert --link`` folder (its index ``metadata.layout`` is
    ``"official"``), else None (a converted folder, a single file, a Hub id)."""
    if path is None or not os.path.isdir(str(path)):
        return None
    index = os.path.join(str(path), "model.safetensors.index.json")
    if not os.path.isfile(index):
        return None
    with open(index, encoding="utf-8") as f:
        data = json.load(f)
    if (data.get("metadata") or {}).get("layout") != "official":
        return None
    return data["weight_map"]


class DeepseekV41PreTrainedModel(PreTrainedModel):
    """Base class: config class, weight init, loading rules and device-map constraints.

    - `base_model_prefix` ``"model"`` holds the :class:`DeepseekV41Transformer`, whose parameter
      names are the official checkpoint names, so a converted folder (``model.`` + official name)
      loads without any renaming.
    - Module dtypes are fixed by the modules (fp8 linears with e8m0 scales, packed fp4 experts, fp32
      mHC / sink / head / gate biases / ratio-2 compressor / ViT norms, bf16 elsewhere) whatever the
      `dtype` passed to `from_pretrained`: the loader casts each stored tensor to the dtype of the
      parameter it fills, which for a converted folder is always its own dtype (no value change), and
      packed fp4 is viewed, never cast (:meth:`_get_dtype_plan`, :func:`_checkpoint_tensor_views`).
    - `_keep_in_fp32_modules` lists the exact fp32 parameters of the instance (a name pattern such
      as ``compressor.wkv`` would also catch the bf16 ratio-1 compressors).
    - `_no_split_modules`: a decoder layer (its mHC, attention, MoE and Engram) and a ViT block
      always sit on one device.
    """

    config_class = DeepseekV41Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = False
    _no_split_modules = ["DeepseekV41DecoderLayer", "DeepseekV41VisionBlock"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    # the decode state cannot be rolled back (assisted decoding is refused)
    _is_stateful = True

    def _build_transformer(self, config: DeepseekV41Config) -> None:
        self.model = DeepseekV41Transformer(config)
        self._keep_in_fp32_modules = [f"model.{name}" for name in _fp32_parameter_names(self.model)]

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`; ``dtype`` "auto" (the default) means bfloat16, the
        compute dtype. It never changes a stored tensor: every parameter keeps its module dtype.
        ``numerics="exact"`` sets `config.text_config.numerics` (bitwise the reference on CPU).
        A local ``convert --link`` folder (index ``metadata.layout == "official"``) is then filled
        through the load-time transform (:meth:`_load_official_layout`).

        Engram tables in host memory: a `device_map` entry ``model.layers.{i}.engram.embed: "cpu"``
        under a layer on a GPU keeps that table resident on the CPU (only hash ids and looked-up
        rows cross; `engram_placement_deepseek_v41_vl.py`). ``engram_device="cpu"`` adds those
        entries for every table to the `device_map` given: "auto" / "balanced" /
        "balanced_low_0" / "sequential" infer the rest over the GPUs without the tables
        (`engram_offload_device_map`), a dict gets the entries, one device takes all the rest.

        Raises:
            DeepseekV41ModelError: a ``--link`` folder with a `device_map` other than None / "cpu".
            DeepseekV41EngramPlacementError: `engram_device` other than "cpu" or without a `device_map`;
                a table mapped to "cpu" inside an offloaded ("disk", or "cpu" beside GPUs) layer.
        """
        if kwargs.get("dtype", kwargs.get("torch_dtype")) in (None, "auto"):
            kwargs.pop("torch_dtype", None)
            kwargs["dtype"] = torch.bfloat16
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        engram_device = kwargs.pop("engram_device", None)
        if engram_device is not None:
            kwargs["device_map"] = device_map_with_engram_tables(
                kwargs.get("device_map"), engram_device, cls._empty_for_device_map(path, kwargs), kwargs.get("max_memory")
            )
        check_engram_placement(kwargs.get("device_map"))  # before the weights load
        official = _official_layout_index(path)
        if official is not None and kwargs.get("device_map") not in (None, "cpu"):
            raise DeepseekV41ModelError(
                f"{path} is a --link folder (official tensor layout); it loads on CPU only, without a "
                f"device_map (got {kwargs['device_map']!r}): convert without --link to use a device_map"
            )
        with _offloaded_layers_load_whole(list(cls._no_split_modules)), keep_engram_tables_resident():
            model = super().from_pretrained(*args, **kwargs)
        # a folder without generation_config.json gets a fresh one from the config
        model_or_first = model[0] if isinstance(model, tuple) else model
        if official is not None:
            model_or_first._load_official_layout(path, official)
        model_or_first._suppress_image_token()
        return model

    @classmethod
    def _empty_for_device_map(cls, path, kwargs: dict) -> nn.Module:
        """This class on the meta device for the config `from_pretrained` will use (names and sizes
        for a device map; the config is read with the same hub arguments)."""
        from transformers import PretrainedConfig

        config = kwargs.get("config")
        if not isinstance(config, PretrainedConfig):
            hub = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
            config = cls.config_class.from_pretrained(
                config if config is not None else path, **{key: kwargs[key] for key in hub if key in kwargs}
            )
        return empty_model(config, cls)

    @torch.no_grad()
    def _load_official_layout(self, folder, weight_map: dict[str, str]) -> None:
        """Fill every tensor of a ``--link`` folder (official names in the linked source shards) with
        `conversion/load_time.convert_state_dict` under this model's config, then
        ``load_state_dict(strict=True)``. `PreTrainedModel.from_pretrained` cannot do it: it would
        value-cast the fp8 ``wo_a`` weights (dequantized with their scales by the converter) and
        leave their scales unexpected; everything it loaded is overwritten here.

        Raises:
            DeepseekV41ModelError: a missing or unexpected tensor after the transform.
        """
        from safetensors import safe_open

        handles = {}
        try:
            for file in sorted(set(weight_map.values())):
                handles[file] = safe_open(os.path.join(folder, file), framework="pt")

            def get_tensor(name: str) -> torch.Tensor:
                return handles[weight_map[name]].get_tensor(name)

            official = [name for name in weight_map if not name.startswith(f"{self.base_model_prefix}.")]
            state = dict(convert_state_dict(official, get_tensor, self.config))
            # the converter's own entries (the Engram token map) already carry the model name
            state.update({name: get_tensor(name) for name in weight_map if name not in official})
        finally:
            handles.clear()
        expected = self.state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise DeepseekV41ModelError(
                f"{folder}: the official-layout weights do not fit the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for name, tensor in state.items():
            target = expected[name]
            if target.dtype != tensor.dtype or target.shape != tensor.shape:
                raise DeepseekV41ModelError(
                    f"{folder}: {name} is {tensor.dtype} {tuple(tensor.shape)} after the transform, the model "
                    f"holds {target.dtype} {tuple(target.shape)}"
                )
            # byte copy: copy_ has no kernel for the 1-byte float formats (packed fp4, e8m0)
            if target.element_size() == 1:
                target.view(torch.uint8).copy_(tensor.view(torch.uint8))
            else:
                target.copy_(tensor)

    def _suppress_image_token(self) -> None:
        generation_config = getattr(self, "generation_config", None)
        if generation_config is None or not self.can_generate():
            return
        suppress = list(generation_config.suppress_tokens or [])
        if self.config.image_token_id not in suppress:
            generation_config.suppress_tokens = suppress + [self.config.image_token_id]

    def _get_dtype_plan(self, dtype: torch.dtype) -> dict:
        """Loader dtype rules: only packed fp4 needs one (None = take the stored I8 as is; the
        parameter hook views it). Every other tensor is cast to its parameter's own dtype."""
        if self.config.text_config.expert_weight_dtype == "fp4":
            return {_FP4_EXPERT_WEIGHT: None}
        return {}

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        with _checkpoint_tensor_views(model):
            result = PreTrainedModel._load_pretrained_model(
                model, state_dict, checkpoint_files, load_config, *args, **kwargs
            )
        _restore_host_tensors(model)
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            _resave_offloaded_fp4(result[1], getattr(load_config, "disk_offload_folder", None))
        return result

    def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
        """`PreTrainedModel.save_pretrained`, writing the converted-folder layout: packed fp4 as I8
        (safetensors' F4 entries cannot be read back in slices) and, for a model of the installed
        package, the remote-code files and `auto_map` (`conversion/bundle.py`), so the saved folder
        loads like a converted one, with or without the package."""
        if state_dict is None and not any(t.is_meta for t in self.state_dict().values()):
            state_dict = {
                name: tensor.view(torch.int8) if tensor.dtype == torch.float4_e2m1fn_x2 else tensor
                for name, tensor in self.state_dict().items()
            }
        result = super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        package = __package__ or ""
        if getattr(self, "_auto_class", None) is None and package.endswith(".modeling"):
            # looked up at run time: the bundled (flat) copy of this file has no conversion package,
            # and there transformers' own `custom_object_save` copies the files
            bundle = importlib.import_module(package.rsplit(".", 1)[0] + ".conversion.bundle")
            bundle.bundle_remote_code(save_directory)
        return result

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh values for parameters a checkpoint did not provide (and for `Model(config)`).

        Quantized storage (fp8 / fp4 weights, e8m0 scales, the fp8 Engram tables) is never touched:
        it only comes from a checkpoint. A missing Engram token map is set to -1, which the model
        refuses with a clear error instead of hashing with garbage.
        """
        std = self.config.text_config.initializer_range
        if isinstance(module, DeepseekV41Linear):
            if not module.is_quantized:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (nn.Embedding, DeepseekV41Head)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (DeepseekV41RMSNorm, DeepseekV41VisionRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, DeepseekV41Gate):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
            init.zeros_(module.bias_vl)
        elif isinstance(module, DeepseekV41Attention):
            init.zeros_(module.attn_sink)
        elif isinstance(module, DeepseekV41Engram):
            init.ones_(module.q_weight)
            init.ones_(module.k_weight)
        elif isinstance(module, DeepseekV41EngramHash):
            init.constant_(module.token_map, -1)
        elif isinstance(module, DeepseekV41DecoderLayer):
            for site in ("attn", "ffn"):
                init.normal_(getattr(module, f"hc_{site}_fn"), mean=0.0, std=std)
                init.zeros_(getattr(module, f"hc_{site}_base"))
                init.ones_(getattr(module, f"hc_{site}_scale"))
        elif isinstance(module, DeepseekV41Transformer) and module.vision_enabled:
            for name in ("image_start", "image_end", "image_newline"):
                init.normal_(getattr(module, name), mean=0.0, std=std)

    # -- embeddings -----------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Aligner rows of all images, bf16 ``[sum n_llm_h * n_llm_w, hidden_size]`` (images in
        order, each row-major). See :meth:`DeepseekV41Transformer.get_image_features`."""
        return self.model.get_image_features(pixel_values, image_grid_thw)

    # -- shared forward plumbing ----------------------------------------------------------
    def _run(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        mm_token_type_ids: torch.Tensor | None,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        cache: DeepseekV41Cache | None,
        use_cache: bool | None,
        inputs_embeds: torch.Tensor | None,
        logits_to_keep: int,
    ) -> DeepseekV41TransformerOutput:
        if inputs_embeds is not None:
            raise DeepseekV41ModelError(
                "inputs_embeds is not supported: the model needs input_ids (Engram hashes the token ids)"
            )
        if input_ids is None:
            raise DeepseekV41ModelError("input_ids is required")
        if cache is not None and not isinstance(cache, DeepseekV41Cache):
            raise DeepseekV41ModelError(
                f"the cache must be a DeepseekV41Cache, got {type(cache).__name__} (the model keeps a window ring, "
                "compressor state and Engram history that a key/value cache cannot hold)"
            )
        use_cache = self.config.text_config.use_cache if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = DeepseekV41Cache(self.config)
        if cache is not None and cache.get_seq_length() > 0:
            # decode: generate() keeps extending mm_token_type_ids with zeros; the new positions are text
            if mm_token_type_ids is not None and bool((mm_token_type_ids != 0).any()):
                raise DeepseekV41ModelError("image positions after the prefill: images must be prefilled at position 0")
            mm_token_type_ids = None
        return self.model(
            input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            cache=cache,
            logits_to_keep=logits_to_keep,
        )


class DeepseekV41Model(DeepseekV41PreTrainedModel):
    """The backbone for `AutoModel`: returns the final normed hidden states (the head input).

    Forward args as :meth:`DeepseekV41ForConditionalGeneration.forward`; returns
    `BaseModelOutputWithPast` (``last_hidden_state`` bf16 ``[B, S, D]``, ``cache``).
    """

    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        self._build_transformer(config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        cache: DeepseekV41Cache | None = None,
        past_key_values: DeepseekV41Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        out = self._run(
            input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw,
            cache if cache is not None else past_key_values, use_cache, inputs_embeds, 1,
        )
        return BaseModelOutputWithPast(last_hidden_state=out.last_hidden_state, cache=out.cache)


class DeepseekV41ForConditionalGeneration(DeepseekV41PreTrainedModel, GenerationMixin):
    """DeepSeek-V4.1-Flash with image input, for `generate`, `AutoModelForImageTextToText` and the
    ``image-text-to-text`` pipeline. Mirrors `inference/model.py: Transformer` + `generate.py`.

    Generation follows the reference: one prefill from position 0 (images are encoded there, once
    each), then one token per step through :class:`DeepseekV41Cache`; `mm_token_type_ids` is
    extended with zeros by `generate` and the new positions are text. The image token id is never
    generated (it is suppressed in logits processing).

    Padding: batches are left-padded by the processor and `attention_mask` reaches the backbone,
    where positions, the window, the compressors' groups and the Engram look-back count from each
    row's first real token, so a padded row computes what it computes alone.
    """

    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        self._build_transformer(config)
        self.post_init()
        self._suppress_image_token()

    def get_output_embeddings(self) -> DeepseekV41Head:
        return self.model.head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        cache: DeepseekV41Cache | None = None,
        past_key_values: DeepseekV41Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Prefill (empty or no cache) or a one-token decode step.

        Args:
            input_ids: int64 ``[B, S]``; every image-span position carries `image_token_id`.
            attention_mask: int ``[B, S]``; 0 marks padding (run as tokens, see the class doc).
            mm_token_type_ids: int ``[B, S]``, 1 on image-span positions (processor output).
            pixel_values: float ``[total_patches, 588]``; prefill only. image_grid_thw: int
                ``[n_images, 3]`` rows ``(1, n_vit_h, n_vit_w)``.
            cache / past_key_values: a :class:`DeepseekV41Cache`; a new one is made when
                `use_cache` (default `text_config.use_cache`) and none is given.
            labels: int64 ``[B, S]`` for the causal LM loss (-100 ignored); needs all logits.
            logits_to_keep: logits of the last K positions (0: all). `generate` passes 1, which
                computes the head exactly as the reference (a GEMM over ``[B, D]``).
            position_ids: ignored (positions follow the cache). inputs_embeds: refused.

        Returns:
            `CausalLMOutputWithPast`: ``logits`` fp32 ``[B, K, V]``, ``cache``, ``loss``.

        Raises:
            DeepseekV41ModelError: inputs_embeds, a cache of another type, image spans that do not
                fit the images, images after position 0.
            DeepseekV41AttentionError: more than one token per decode step.
        """
        if labels is not None:
            logits_to_keep = 0
        out = self._run(
            input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw,
            cache if cache is not None else past_key_values, use_cache, inputs_embeds, logits_to_keep,
        )
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=out.logits, labels=labels, vocab_size=self.config.text_config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, cache=out.cache)

    # -- generation -----------------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """A :class:`DeepseekV41Cache` for the batch (the model has no key/value cache to share)."""
        if model_kwargs.get("cache") is not None:
            model_kwargs["cache"]._is_user_defined = True
            return
        if model_kwargs.get("past_key_values") is not None:
            model_kwargs["cache"] = model_kwargs.pop("past_key_values")
            return
        if generation_config.use_cache is False:
            return
        model_kwargs["cache"] = DeepseekV41Cache(self.config)

    def _expand_inputs_for_generation(self, expand_size: int = 1, *args, **kwargs):
        # pixel_values / image_grid_thw are per image, not per batch row: a plain repeat would
        # pair rows with the wrong images
        if expand_size > 1 and kwargs.get("pixel_values") is not None:
            raise DeepseekV41ModelError(
                "num_beams > 1 or num_return_sequences > 1 with images is not supported; repeat the prompt in the batch"
            )
        return super()._expand_inputs_for_generation(expand_size, *args, **kwargs)

    def _get_logits_processor(self, generation_config, *args, **kwargs):
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        suppressed = generation_config.suppress_tokens or []
        if self.config.image_token_id not in suppressed:
            # also when a caller's generation config dropped it: the image id is never a valid output
            device = kwargs.get("device") or self.device
            processors.append(SuppressTokensLogitsProcessor([self.config.image_token_id], device=device))
        return processors


class DeepseekV41ForCausalLM(DeepseekV41ForConditionalGeneration):
    """Text-only DeepSeek-V4.1-Flash for `AutoModelForCausalLM`: the same backbone without the
    vision tower (a folder with vision weights loads; they are left unused)."""

    input_modalities = ("text",)
    # a VL folder loads: its vision weights are expected to be left unused
    _keys_to_ignore_on_load_unexpected = [r"^model\.(vision|aligner)\.", r"^model\.image_(start|end|newline)$"]

    def __init__(self, config: DeepseekV41Config):
        if config.vision_config.num_hidden_layers:
            config = copy.deepcopy(config)
            config.vision_config.num_hidden_layers = 0
            config.architectures = ["DeepseekV41ForCausalLM"]
        super().__init__(config)

    def forward(self, input_ids: torch.LongTensor | None = None, *args, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise DeepseekV41ModelError("DeepseekV41ForCausalLM is text-only; use DeepseekV41ForConditionalGeneration")
        return super().forward(input_ids, *args, **kwargs)


__all__ = [
    "DeepseekV41DecoderLayer",
    "DeepseekV41ForCausalLM",
    "DeepseekV41ForConditionalGeneration",
    "DeepseekV41Model",
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Head",
    "DeepseekV41ModelError",
    "DeepseekV41Transformer",
    "DeepseekV41TransformerOutput",
    "capture_intermediates",
    "image_span_length",
    "image_token_roles",
]
