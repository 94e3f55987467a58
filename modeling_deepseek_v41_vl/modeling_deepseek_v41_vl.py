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
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.generation.logits_process import SuppressTokensLogitsProcessor
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import ModelOutput

from .attention_deepseek_v41_vl import (
    DeepseekV41Attention,
    DeepseekV41AttentionCache,
    DeepseekV41AttentionState,
    DeepseekV41RMSNorm,
)
from .cache_deepseek_v41_vl import DeepseekV41Cache
from .configuration_deepseek_v41_vl import DeepseekV41Config, DeepseekV41TextConfig
from .engram_deepseek_v41_vl import DeepseekV41Engram, DeepseekV41EngramHash
from .hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection, identity_pre_mix
from .moe_deepseek_v41_vl import DeepseekV41Gate, DeepseekV41MoE
from .quantization_deepseek_v41_vl import DeepseekV41Linear
from .rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, rope_inv_frequencies
from .vision_deepseek_v41_vl import (
    DeepseekV41VisionAligner,
    DeepseekV41VisionRMSNorm,
    DeepseekV41VisionTransformer,
    llm_grid,
    parse_image_grid,
)

# Roles of the positions of an image span (`inference/image_processor.py` constants).
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


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


def image_span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of one image span: ``n_llm_h * (n_llm_w + 1) + 2`` (a newline after every row)."""
    return n_llm_h * (n_llm_w + 1) + 2


def image_token_roles(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    downsample_ratio: int,
) -> torch.Tensor:
    """Role of every position: TEXT -1, IMAGE_START 0, IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3.

    These are the reference's `token_types` (`image_processor.image_token_types`), rebuilt from the
    transformers-style inputs.

    Args:
        mm_token_type_ids: int ``[B, S]``, 1 on every position of an image span, 0 elsewhere.
        image_grid_thw: int ``[n_images, 3]`` rows ``(1, n_vit_h, n_vit_w)``, the images in span
            order (batch row by batch row, left to right); None when there is no span.
        downsample_ratio: the aligner's merge factor (3).

    Returns:
        int64 ``[B, S]``.

    Raises:
        DeepseekV41ModelError: values other than 0/1, more or fewer spans than images, or a span
            whose length is not the one its image's grid implies.
    """
    if mm_token_type_ids.dim() != 2:
        raise DeepseekV41ModelError(f"mm_token_type_ids must be [batch, seq], got {tuple(mm_token_type_ids.shape)}")
    if ((mm_token_type_ids != 0) & (mm_token_type_ids != 1)).any():
        raise DeepseekV41ModelError("mm_token_type_ids must hold only 0 (text) and 1 (image span)")
    grids = [] if image_grid_thw is None else parse_image_grid(image_grid_thw)
    llm = [llm_grid(h, w, downsample_ratio) for h, w in grids]
    roles = torch.full(mm_token_type_ids.shape, TEXT, dtype=torch.int64)
    flags = mm_token_type_ids.bool().cpu()
    image = 0
    for b in range(flags.size(0)):
        row = flags[b]
        # runs of consecutive span positions; one run may hold several images back to back
        zero = torch.zeros(1, dtype=torch.int8)
        edges = torch.diff(row.to(torch.int8), prepend=zero, append=zero)
        starts = torch.nonzero(edges == 1).flatten().tolist()
        ends = torch.nonzero(edges == -1).flatten().tolist()
        for run_start, run_end in zip(starts, ends):
            pos = run_start
            while pos < run_end:
                if image >= len(llm):
                    raise DeepseekV41ModelError(
                        f"mm_token_type_ids marks more image spans than the {len(llm)} images of image_grid_thw "
                        f"(batch row {b}, position {pos})"
                    )
                n_h, n_w = llm[image]
                length = image_span_length(n_h, n_w)
                if pos + length > run_end:
                    raise DeepseekV41ModelError(
                        f"image {image} (llm grid {n_h}x{n_w}) needs a span of {length} positions, but the span at "
                        f"batch row {b}, position {pos} has only {run_end - pos}"
                    )
                body = torch.full((n_h, n_w + 1), IMAGE, dtype=torch.int64)
                body[:, -1] = IMAGE_NEW_LINE
                roles[b, pos] = IMAGE_START
                roles[b, pos + 1 : pos + length - 1] = body.flatten()
                roles[b, pos + length - 1] = IMAGE_END
                pos += length
                image += 1
    if image != len(llm):
        raise DeepseekV41ModelError(f"image_grid_thw has {len(llm)} images but mm_token_type_ids marks {image} spans")
    return roles.to(mm_token_type_ids.device)


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
        self.attn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        self.attn = DeepseekV41Attention(config, layer_idx, config.weight_dtype)
        self.ffn_norm = DeepseekV41RMSNorm(dim, config.rms_norm_eps)
        self.ffn = DeepseekV41MoE(config, layer_idx, _moe_quantization(config))
        self.engram = (
            DeepseekV41Engram(config, layer_idx, config.weight_dtype) if layer_idx in config.engram_layer_ids else None
        )
        self.hc = DeepseekV41HyperConnection(hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, hc * dim, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))

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
        hc = self.hc
        attn_pre, attn_post, attn_comb = hc.mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        f = self.attn(self.attn_norm(hc.pre(x, pre_mix_in)), attention_state)
        x1 = hc.post(f, x, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = hc.mixes(x1, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        f = self.ffn(self.ffn_norm(hc.pre(x1, attn_pre)), image_mask)
        return hc.post(f, x1, ffn_post, ffn_comb), ffn_pre


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
        self.norm = DeepseekV41RMSNorm(dim, text.rms_norm_eps)
        self.head = DeepseekV41Head(text.vocab_size, dim)
        self.hc = DeepseekV41HyperConnection(text.hc_mult, text.hc_sinkhorn_iters, text.hc_eps, text.rms_norm_eps)
        self.engram_hash = DeepseekV41EngramHash(text) if text.engram_layer_ids else None
        self.vision_enabled = config.vision_config.num_hidden_layers > 0
        if self.vision_enabled:
            with _default_dtype(torch.bfloat16):
                self.vision = DeepseekV41VisionTransformer(config.vision_config)
                self.aligner = DeepseekV41VisionAligner(config.vision_config)
            for name in ("image_start", "image_end", "image_newline"):
                self.register_parameter(name, nn.Parameter(torch.empty(dim, dtype=torch.bfloat16)))

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
        return h.masked_scatter(image_positions.unsqueeze(-1), image_features.to(dtype))

    # -- forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        cache: DeepseekV41Cache | None = None,
        logits_to_keep: int = 1,
    ) -> DeepseekV41TransformerOutput:
        """Prefill (cache empty) or one-token decode step. Mirrors `Transformer.forward`.

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

        Returns:
            :class:`DeepseekV41TransformerOutput`.

        Raises:
            DeepseekV41ModelError: images after position 0 or without span marks, spans that do
                not fit the images or hold other ids than `image_token_id`.
            DeepseekV41AttentionError: more than one token per decode step.
        """
        if input_ids.dim() != 2:
            raise DeepseekV41ModelError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
        start_pos = cache.get_seq_length() if cache is not None else 0

        image_mask = engram_mask = roles = None
        if mm_token_type_ids is not None:
            if mm_token_type_ids.shape != input_ids.shape:
                raise DeepseekV41ModelError(
                    f"mm_token_type_ids {tuple(mm_token_type_ids.shape)} must match input_ids {tuple(input_ids.shape)}"
                )
            if pixel_values is None and bool((mm_token_type_ids != 0).any()):
                raise DeepseekV41ModelError("mm_token_type_ids marks image spans but no pixel_values were given")
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
            if start_pos != 0:
                raise DeepseekV41ModelError("images must be prefilled in one chunk at position 0")

        hash_ids = None
        if self.engram_hash is not None:
            history = cache.engram_history if cache is not None else None
            if start_pos > 0 and history is None:
                raise DeepseekV41ModelError("decode step with a cache that holds no Engram history")
            hash_ids, history = self.engram_hash(input_ids, token_mask=engram_mask, history=history)
            if cache is not None:
                cache.engram_history = history

        h = self.embed(input_ids)
        if pixel_values is not None:
            h = self.merge_image_embeddings(h, roles, self.get_image_features(pixel_values, image_grid_thw))

        x = h.unsqueeze(2).repeat(1, 1, self.hc_mult, 1)
        pre_mix = identity_pre_mix(x, self.hc_mult)
        attention_cache = cache.attention if cache is not None else DeepseekV41AttentionCache()
        state = DeepseekV41AttentionState(start_pos=start_pos, cache=attention_cache)
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


__all__ = [
    "DeepseekV41DecoderLayer",
    "DeepseekV41Head",
    "DeepseekV41ModelError",
    "DeepseekV41Transformer",
    "DeepseekV41TransformerOutput",
    "capture_intermediates",
    "image_span_length",
    "image_token_roles",
]
