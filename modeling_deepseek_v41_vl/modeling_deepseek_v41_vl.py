"""DeepSeek-V4.1-Flash with image input: the backbone and the transformers classes (REFERENCE.md
sections 3, 4 and 9).

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

Image spans (REFERENCE.md section 15): `mm_token_type_ids` is 1 on every span position; each span
is ``[START] ([IMAGE] * n_llm_w [NEWLINE]) * n_llm_h [END]`` with ``n_llm = ceil(n_vit /
downsample_ratio)`` (`image_spans_deepseek_v41_vl.py` owns that geometry). The merge is the one
of transformers' VLMs: the span rows of every image (aligner rows with the START / NEWLINE / END
vectors in place, :meth:`DeepseekV41Transformer.get_image_span_embeddings`), one check that the
marked positions hold exactly those spans, one `masked_scatter`. The whole span is the "image
rows" mask: it selects the MoE `bias_vl` and shuts the Engram gate.

The pieces live beside this file: the decoder layer (`decoder_layer_deepseek_v41_vl.py`), the
CUDA-graph decode machinery (`cuda_graphs_deepseek_v41_vl.py`), every loading and saving hook
(`loading_deepseek_v41_vl.py`), the numerics plan (`numerics_deepseek_v41_vl.py`) and the capture
hooks for golden comparisons (`debug_deepseek_v41_vl.py`).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPooling as ImageOutput
from transformers.modeling_outputs import MultimodalBaseModelOutputWithPast

from .attention_deepseek_v41_vl import DeepseekV41Attention
from .attention_state_deepseek_v41_vl import DeepseekV41AttentionState, read_padding, right_padding_lengths
from .cache_deepseek_v41_vl import DeepseekV41AttentionCache, DeepseekV41Cache
from .configuration_deepseek_v41_vl import DeepseekV41Config
from .decode_step_deepseek_v41_vl import DeepseekV41DecodeRunner, check_step_inputs
from .decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer
from .dspark_deepseek_v41_vl import DeepseekV41DraftMixin, draft_blocks, gather_main_hidden, main_hidden_taps
from .engram_deepseek_v41_vl import DeepseekV41Engram, DeepseekV41EngramEmbedding, DeepseekV41EngramHash
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .conversation_deepseek_v41_vl import continuation_images, count_images
from .generation_deepseek_v41_vl import DeepseekV41GenerationMixin
from .hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection, identity_pre_mix
from .image_inputs_deepseek_v41_vl import DeepseekV41ImageInputsMixin
from .layers_deepseek_v41_vl import (
    AbsentAttribute, DeepseekV41DtypeCastMixin, DeepseekV41EmbeddingsMixin, DeepseekV41Head, DeepseekV41RMSNorm,
    default_dtype,
)
from .loading_deepseek_v41_vl import DeepseekV41LoadingMixin
from .moe_deepseek_v41_vl import DeepseekV41Gate
from .numerics_deepseek_v41_vl import DeepseekV41Numerics, apply_numerics
from .outputs_deepseek_v41_vl import (
    DeepseekV41CausalLMOutputWithPast, DeepseekV41TransformerOutput, image_encoder_output, refuse_output_attentions,
)
from .quantization_deepseek_v41_vl import DeepseekV41Linear, init_quantized_storage
from .verification_deepseek_v41_vl import forward_as_steps, join_forwards
from .vision_deepseek_v41_vl import DeepseekV41VisionAligner, DeepseekV41VisionTransformer


class DeepseekV41Transformer(DeepseekV41ImageInputsMixin, DeepseekV41DraftMixin, nn.Module):
    """The complete V4.1 VL network with the checkpoint's module names and no prefix.

    Mirrors `inference/model.py: Transformer`.

    Submodules / parameters: `embed` (bf16 ``[V, D]``), `layers`, `norm`, `head` (fp32), `mtp` (the
    DSpark draft blocks, `dspark_deepseek_v41_vl.py`; None without a draft head),
    `image_start` / `image_end` / `image_newline` (bf16 ``[D]``), `vision`, `aligner` (when the
    vision tower has layers), `engram_hash` (buffer `token_map`, when Engram layers exist).

    Args:
        config: the composite :class:`DeepseekV41Config`; `text_config.numerics` picks
            ``"exact"`` (bitwise the reference on CPU) or ``"fast"``, resolved once into the
            :class:`DeepseekV41Numerics` plan every module holds (:meth:`set_numerics`).
    """

    def __init__(self, config: DeepseekV41Config):
        super().__init__()
        self.config = config
        text = config.text_config
        self.text_config = text
        self.numerics = numerics = DeepseekV41Numerics.resolve(text.numerics)
        dim = text.hidden_size
        self.hc_mult = text.hc_mult
        self.embed = nn.Embedding(text.vocab_size, dim, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(DeepseekV41DecoderLayer(text, i, numerics) for i in range(text.num_hidden_layers))
        self.mtp = draft_blocks(text, numerics)  # None without a draft head
        self.norm = DeepseekV41RMSNorm(dim, text.rms_norm_eps, numerics)
        self.head = DeepseekV41Head(text.vocab_size, dim)
        self.hc = DeepseekV41HyperConnection(text.hc_mult, text.hc_sinkhorn_iters, text.hc_eps, text.rms_norm_eps, numerics)
        self.engram_hash = DeepseekV41EngramHash(text, numerics) if text.engram_layer_ids else None
        self.vision_enabled = config.vision_config.num_hidden_layers > 0
        if self.vision_enabled:
            with default_dtype(torch.bfloat16):
                self.vision = DeepseekV41VisionTransformer(config.vision_config, numerics)
                self.aligner = DeepseekV41VisionAligner(config.vision_config, numerics)
            for name in ("image_start", "image_end", "image_newline"):
                self.register_parameter(name, nn.Parameter(torch.empty(dim, dtype=torch.bfloat16)))

        self.compress_ratios = tuple(sorted({r for r in text.compress_ratios[: text.num_hidden_layers] if r}))
        # the layers whose index keys an index source may read (`DeepseekV41DecodeStep.published_keys`)
        self.index_key_owners = tuple(
            layer.layer_idx for layer in self.layers if layer.attn.indexer is not None and layer.attn.indexer.owns_k
        )
        self.weights_epoch = 0
        self.decode_identity = object()  # in a captured step's key: a copy of the model gets its own
        self.decode_runner = DeepseekV41DecodeRunner()

    def _apply(self, fn, *args, **kwargs):
        # `.to()`, `.cuda()`, casts move the weights: captured decode steps read the old addresses
        self.weights_epoch += 1
        return super()._apply(fn, *args, **kwargs)

    def set_numerics(self, numerics: str | None = None, **backends: str) -> DeepseekV41Numerics:
        """Make a new numerics plan and hand it to every module at once; `text_config.numerics`
        follows. Assigning ``config.numerics`` (or ``config.text_config.numerics``) has the same
        effect at the next forward.

        Args:
            numerics: ``"fast"`` or ``"exact"``; None keeps the config's mode.
            backends: op name -> ``"auto"`` / ``"triton"`` / ``"torch"`` (`numerics_deepseek_v41_vl.
                KERNEL_ENV` names the ops), or a kernel option -> its value (`KERNEL_OPTION_ENV`:
                ``moe_experts_mma="scaled"`` / ``"manual"``); the rest keep the current plan's.

        Returns:
            The new plan.

        Raises:
            DeepseekV41NumericsError: an unknown mode, op or backend name.
        """
        plan = self.numerics.replace(self.text_config.numerics if numerics is None else numerics, **backends)
        apply_numerics(self, plan)
        self.text_config.numerics = plan.mode
        return plan

    def _follow_config_numerics(self) -> None:
        # `config.numerics` was assigned since the plan was made: every entry point (forward and
        # the image encoders) switches before it computes anything
        if self.text_config.numerics != self.numerics.mode:
            self.set_numerics()

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
        output_hidden_states: bool = False,
        row_lengths: list[int] | None = None,
        output_main_hidden: bool = False,
    ) -> DeepseekV41TransformerOutput:
        """Prefill (cache empty), prefill chunk or one-token decode step. Mirrors `Transformer.forward`.

        A forward of S > 1 tokens on a non-empty cache is a prefill chunk: it continues the
        sequence exactly like one prefill would (see `attention_deepseek_v41_vl.py`). Images in a
        chunked prefill: compute :meth:`get_image_span_embeddings` once and pass each chunk the
        rows of the span positions it holds as `image_span_embeds` (with `mm_token_type_ids` of
        the chunk), so a span may be split between chunks; `pixel_values` need whole spans.
        Setting ``cache.attention.prefill_length`` to the prompt length before the first chunk
        makes exact numerics rank the indexer like one prefill (bitwise the same logits; see
        `DeepseekV41AttentionCache`).

        Args:
            input_ids: int64 ``[B, S]``; image-span positions carry `image_token_id`.
            mm_token_type_ids: int ``[B, S]``, 1 on every image-span position; None for text.
            pixel_values: ``[total_patches, 588]`` (or ``[total_patches, 3, 14, 14]``), the images
                of this forward's spans in order (whole spans; at any position).
            image_grid_thw: int ``[n_images, 3]``, rows ``(1, n_vit_h, n_vit_w)``.
            cache: a :class:`DeepseekV41Cache` to continue (decode) or fill (prefill);
                None runs a standalone prefill.
            logits_to_keep: logits of the last K positions; 0 keeps all. The default 1 is what
                the reference returns (its GEMM over ``[B, D]``, bitwise the same).
            attention_mask: ``[B, past + S]``, 0 on left padding (every position so far, as
                `generate` passes it). Each row then runs as if it started at its first real token
                (positions, window, compressor groups, Engram look-back); None: the padding the
                cache recorded, or none. Without a cache it may pad on the right instead: each row
                computes what it computes alone (`right_padding_lengths`).
            image_span_embeds: ``[n, D]`` rows for the n image-span positions of this forward
                (``mm_token_type_ids == 1``, in (batch row, position) order), a slice of
                :meth:`get_image_span_embeddings`; instead of `pixel_values`, at any position.
            output_hidden_states: also return every block's collapsed output (see
                :class:`DeepseekV41TransformerOutput`; costs one ``hc_pre`` per block).
            row_lengths: without a cache, the right padding of `attention_mask` that the caller
                read already (`right_padding_lengths`), so it is not read back twice; None: read here.
            output_main_hidden: also return `main_hidden`, what :meth:`draft` reads (refused without a draft head).

        Returns:
            :class:`DeepseekV41TransformerOutput`.

        Raises:
            DeepseekV41ModelError: `input_ids` that are not integer ids in ``[0, vocab_size)`` or
                hold no token; images without span marks, spans that do not fit the images or hold other
                ids than `image_token_id`, `image_span_embeds` rows that do not match the marked
                positions.
            DeepseekV41AttentionError: a forward after position 0 on a cache without a prefill,
                an attention mask that is not a left padding of every position so far (nor a
                right padding without a cache), or one whose padding of the positions already
                cached differs from the cache's.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise DeepseekV41ModelError(f"input_ids must be a [batch, seq] tensor (processor: return_tensors='pt'), got {got}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise DeepseekV41ModelError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.numel() == 0:
            raise DeepseekV41ModelError(f"input_ids holds no token: shape {tuple(input_ids.shape)}")
        self._follow_config_numerics()
        if output_main_hidden:
            self._check_main_hidden(cache, attention_mask)
        if pixel_values is None and image_span_embeds is None \
                and self.decode_runner.applies(self, cache, input_ids, output_hidden_states):
            # `generate`'s own steps were checked at its entry and at the prefill: nothing to read back
            check_step_inputs(self, input_ids, mm_token_type_ids, attention_mask, cache, read_back=not self.decode_runner.trusted)
            logits, hidden, main_hidden = self.decode_runner.step(self, input_ids, cache, output_main_hidden)
            return DeepseekV41TransformerOutput(logits=logits, cache=cache, last_hidden_state=hidden, main_hidden=main_hidden)
        vocab = self.text_config.vocab_size
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise DeepseekV41ModelError(
                f"input_ids must lie in [0, {vocab}) (vocab_size); got values from {int(input_ids.min())} to {int(input_ids.max())}"
            )
        if cache is not None:
            cache.make_room(input_ids.size(1))
        start_pos = cache.get_seq_length() if cache is not None else 0

        if pixel_values is not None and image_span_embeds is not None:
            raise DeepseekV41ModelError("pass pixel_values or image_span_embeds, not both")
        image_mask, span_rows, image_outputs = self._image_positions(
            input_ids, mm_token_type_ids, pixel_values, image_grid_thw, image_span_embeds, output_hidden_states
        )
        engram_mask = None if image_mask is None else ~image_mask
        pad_offsets, row_lengths = read_padding(  # right padding only without a cache
            attention_mask, cache.attention if cache is not None else None, start_pos, tuple(input_ids.shape), row_lengths
        )
        if row_lengths is not None:  # the pads run as tokens after each row's last one
            attention_mask = None

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
        if span_rows is not None:
            # the reference's `merge_image_embeddings`: START / NEWLINE / END vectors and aligner rows
            h = h.masked_scatter(image_mask.unsqueeze(-1), span_rows.to(h.device, h.dtype))

        x = h.unsqueeze(2).repeat(1, 1, self.hc_mult, 1)
        pre_mix = identity_pre_mix(x, self.hc_mult)
        attention_cache = cache.attention if cache is not None else DeepseekV41AttentionCache()
        taps = main_hidden_taps(self.text_config) if output_main_hidden else None
        state = DeepseekV41AttentionState(start_pos=start_pos, cache=attention_cache, pad_offsets=pad_offsets,
                                          row_lengths=row_lengths, hidden_taps=taps)
        collected = [h] if output_hidden_states else None
        for index, layer in enumerate(self.layers):
            x, pre_mix = layer(x, pre_mix, state, image_mask, hash_ids, engram_mask)
            if collected is not None and index < len(self.layers) - 1:
                collected.append(self.hc.pre(x, pre_mix))
        hidden = self.norm(self.hc.pre(x, pre_mix))
        if collected is not None:
            collected.append(hidden)
        main_hidden = None if taps is None else gather_main_hidden(taps, hidden.device)
        if cache is not None:
            if pixel_values is not None:  # a later turn given the conversation's images skips these
                count_images(self, cache, mm_token_type_ids, image_grid_thw)
            cache.record_tokens(input_ids.size(1), took_images=span_rows is not None, main_hidden=main_hidden)

        if logits_to_keep == 1:
            # the reference's default: the GEMM over [B, D] (bitwise what it returns)
            logits = self.head(hidden[:, -1]).unsqueeze(1)
        elif logits_to_keep == 0:
            logits = self.head(hidden)
        else:
            logits = self.head(hidden[:, -logits_to_keep:])
        return DeepseekV41TransformerOutput(
            logits=logits, cache=cache, last_hidden_state=hidden,
            hidden_states=None if collected is None else tuple(collected), image_outputs=image_outputs,
            main_hidden=main_hidden,
        )

class DeepseekV41PreTrainedModel(DeepseekV41DtypeCastMixin, DeepseekV41LoadingMixin, PreTrainedModel):
    """Base class: config class, weight init, loading rules and device-map constraints.

    - `base_model_prefix` ``"model"`` holds the :class:`DeepseekV41Transformer`, whose parameter
      names are the official checkpoint names, so a converted folder (``model.`` + official name)
      loads without any renaming.
    - Module dtypes are fixed by the modules (fp8 linears with e8m0 scales, packed fp4 experts, fp32
      mHC / sink / head / gate biases / ratio-2 compressor / ViT norms, bf16 elsewhere) whatever the
      `dtype` passed to `from_pretrained`: the loader casts each stored tensor to the dtype of the
      parameter it fills, which for a converted folder is always its own dtype (no value change), and
      packed fp4 is viewed, never cast (`loading_deepseek_v41_vl.py`: :class:`DeepseekV41LoadingMixin`
      holds every loading and saving hook). A dtype cast (`.float()`, `.to(torch.float32)`, ...)
      does the same (:class:`DeepseekV41DtypeCastMixin`).
    - `_keep_in_fp32_modules` lists the exact fp32 parameters of the instance (a name pattern such
      as ``compressor.wkv`` would also catch the bf16 ratio-1 compressors).
    - `_no_split_modules`: a decoder layer (its mHC, attention, MoE and Engram) and a ViT block
      always sit on one device.
    """

    config_class = DeepseekV41Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    input_modalities = ("image", "text")
    # ViT blocks and decoder layers are GradientCheckpointingLayers (a decoder layer's replay first
    # restores the per-forward attention state it read)
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV41DecoderLayer", "DeepseekV41DSparkBlock", "DeepseekV41VisionBlock"]
    _keys_to_ignore_on_load_missing = [r"^model\.mtp\."]  # a folder without a draft head: `settle_draft_head`
    # a `convert --link` folder's fp8 wo_a scales, which `load_official_layout` consumes after
    # transformers' own pass (which would report them unexpected)
    _keys_to_ignore_on_load_unexpected = [r"(^|\.)attn\.wo_a\.scale$"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    _can_compile_fullgraph = False
    # the decode state rolls back once the cache records its past (assisted decoding, DSpark):
    # verification forwards run as one-token steps, each of which `DeepseekV41Cache.crop` can return to
    _is_stateful = False

    def _build_transformer(self, config: DeepseekV41Config) -> None:
        self.model = DeepseekV41Transformer(config)
        self._keep_in_fp32_modules = [f"model.{n}" for n, p in self.model.named_parameters() if p.dtype == torch.float32]

    def _suppress_image_token(self) -> None:
        generation_config = getattr(self, "generation_config", None)
        if generation_config is None or not self.can_generate():
            return
        suppress = list(generation_config.suppress_tokens or [])
        if self.config.image_token_id not in suppress:
            generation_config.suppress_tokens = suppress + [self.config.image_token_id]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fresh values for parameters a checkpoint did not provide (and for `Model(config)`); fp8 / fp4
        weights and Engram tables get valid codes and e8m0 scales (`init_quantized_storage`). A token
        map is set to -1, which the model refuses; `from_pretrained` and `init_weights` settle it
        (`load_checks_deepseek_v41_vl.refuse_a_made_up_token_map`: a made-up map beside loaded Engram tables is refused)."""
        std = self.config.text_config.initializer_range
        if isinstance(module, (DeepseekV41Linear, DeepseekV41EngramEmbedding)) and module.scale is not None:
            init_quantized_storage(module.weight, module.scale, std)
        elif isinstance(module, DeepseekV41Linear):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, (nn.Embedding, DeepseekV41Head)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, DeepseekV41RMSNorm):  # the vision tower's fp32 norms included
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

    def _returns_dict(self, return_dict: bool | None) -> bool:
        return self.config.return_dict if return_dict is None else bool(return_dict)

    def set_numerics(self, numerics: str | None = None, **backends: str) -> DeepseekV41Numerics:
        """Switch the numerics of the loaded model everywhere at once
        (:meth:`DeepseekV41Transformer.set_numerics`)."""
        return self.model.set_numerics(numerics, **backends)

    # -- embeddings -----------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_image_features(
        self,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor | Sequence[Sequence[int]],
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,  # accepted for transformers' callers, unused
    ) -> ImageOutput | tuple:
        """The images' features, as transformers v5 VLMs return them.

        Args:
            pixel_values: float ``[total_patches, 588]`` (or ``[total_patches, 3, 14, 14]``).
            image_grid_thw: int ``[n_images, 3]``, rows ``(1, n_vit_h, n_vit_w)``.
            output_hidden_states / output_attentions / return_dict: None follows the config;
                hidden states are the ViT's, attentions are refused, False gives `to_tuple()`.

        Returns:
            `BaseModelOutputWithPooling` (bf16; :func:`image_encoder_output`): the ViT output, one
            ``[n_llm_h * n_llm_w, hidden_size]`` of aligner rows per image, with
            `output_hidden_states` the ViT's hidden states; a tuple when `return_dict` is False.

        Raises:
            DeepseekV41ModelError: `output_attentions` (no dense weights exist); no vision tower.
            DeepseekV41VisionInputError: malformed `pixel_values` or `image_grid_thw`.
        """
        refuse_output_attentions(self.config, output_attentions)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        vit, rows, states = self.model.encode_images(pixel_values, image_grid_thw, bool(output_hidden_states))
        output = image_encoder_output(vit, rows, states, self.model.image_llm_grids(image_grid_thw))
        return output if self._returns_dict(return_dict) else output.to_tuple()

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
        output_hidden_states: bool | None = None,
        output_main_hidden: bool = False,
        one_token_steps: bool | int = False,
        verify_stop=None,
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
        row_lengths = None
        if use_cache is None:  # right padding runs without a cache unless asked (it would hold the pads)
            use_cache = self.config.text_config.use_cache
            if use_cache and cache is None:  # a new sequence: read the mask once, for the backbone too
                row_lengths = right_padding_lengths(attention_mask, cached=False)
                use_cache = row_lengths is None
        if cache is None and use_cache:
            cache = DeepseekV41Cache(self.config)
        engine_step = self.model.decode_runner.trusted and input_ids.size(1) == 1 and pixel_values is None
        if cache is not None and cache.get_seq_length() > 0 and not engine_step:  # a conversation's next turn
            mm_token_type_ids, pixel_values, image_grid_thw = continuation_images(
                self.model, input_ids, mm_token_type_ids, pixel_values, image_grid_thw, cache
            )
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        forward = dict(
            mm_token_type_ids=mm_token_type_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            cache=cache, logits_to_keep=logits_to_keep, output_hidden_states=output_hidden_states,
            row_lengths=row_lengths, output_main_hidden=output_main_hidden,
        )
        if not one_token_steps:
            return self.model(input_ids, attention_mask=attention_mask, **forward)
        return self._forward_then_steps(input_ids, attention_mask, one_token_steps, forward, verify_stop)

    def _forward_then_steps(self, input_ids, attention_mask, one_token_steps, forward: dict,
                            verify_stop=None) -> DeepseekV41TransformerOutput:
        """The first new tokens as one forward of the backbone, the last `one_token_steps` (all for
        True) as one-token steps (`forward_as_steps`), one output for both."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return self.model(input_ids, attention_mask=attention_mask, **forward)  # refused there, by name
        length = input_ids.size(1)
        steps = _step_count(one_token_steps, length) if length > 1 else 0  # one token is a step as it is
        head = length - steps
        keep, types = forward["logits_to_keep"], forward["mm_token_type_ids"]
        if not steps:
            return self.model(input_ids, attention_mask=attention_mask, **forward)
        if forward["pixel_values"] is not None and not head:
            raise DeepseekV41ModelError("one_token_steps takes text tokens only: these hold new images")
        first = None
        if head:
            first = self.model(
                input_ids[:, :head],
                attention_mask=None if attention_mask is None else attention_mask[:, : attention_mask.size(1) - steps],
                **{**forward, "mm_token_type_ids": None if types is None else types[:, :head],
                   "logits_to_keep": max(keep - steps, 1) if keep else 0},
            )
        then = forward_as_steps(
            self.model, input_ids[:, head:], attention_mask, None if types is None else types[:, head:],
            forward["cache"], min(keep, steps) if keep else 0, forward["output_hidden_states"],
            forward["output_main_hidden"], verify_stop,
        )
        return then if first is None else join_forwards(first, then, keep)


def _step_count(one_token_steps, length: int) -> int:
    """How many of `length` new tokens run as one-token steps: all for True, the last n for an int n."""
    if one_token_steps is True:
        return length
    if one_token_steps is False or one_token_steps is None:
        return 0
    if isinstance(one_token_steps, bool) or not isinstance(one_token_steps, int) or not 0 <= one_token_steps <= length:
        raise DeepseekV41ModelError(
            f"one_token_steps must be a bool or an int in [0, {length}] (the last new tokens run as steps), got "
            f"{one_token_steps!r}"
        )
    return one_token_steps


class DeepseekV41Model(DeepseekV41EmbeddingsMixin, DeepseekV41PreTrainedModel):
    """The backbone for `AutoModel`: returns the final normed hidden states (the head input).

    Forward args as :meth:`DeepseekV41ForConditionalGeneration.forward`; returns
    `MultimodalBaseModelOutputWithPast` (``last_hidden_state`` bf16 ``[B, S, D]``, ``cache``,
    ``hidden_states``, ``image_outputs``).
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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MultimodalBaseModelOutputWithPast | tuple:
        refuse_output_attentions(self.config, output_attentions)
        out = self._run(
            input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw,
            cache if cache is not None else past_key_values, use_cache, inputs_embeds, 1, output_hidden_states,
        )
        output = MultimodalBaseModelOutputWithPast(last_hidden_state=out.last_hidden_state, cache=out.cache,
                                                   hidden_states=out.hidden_states, image_outputs=out.image_outputs)
        return output if self._returns_dict(return_dict) else output.to_tuple()


class DeepseekV41ForConditionalGeneration(DeepseekV41EmbeddingsMixin, DeepseekV41PreTrainedModel, DeepseekV41GenerationMixin):
    """DeepSeek-V4.1-Flash with image input, for `generate`, `AutoModelForImageTextToText` and the
    ``image-text-to-text`` pipeline. Mirrors `inference/model.py: Transformer` + `generate.py`.

    Generation follows the reference: one prefill (images are encoded there, once each), then one
    token per step through :class:`DeepseekV41Cache`; `mm_token_type_ids` is extended with zeros by
    `generate` and the new positions are text. A conversation's next turn (new images included)
    continues a filled cache. The image token id is never generated (it is suppressed).

    Padding: batches are left-padded by the processor and `attention_mask` reaches the backbone,
    where positions, the window, the compressors' groups and the Engram look-back count from each
    row's first real token, so a padded row computes what it computes alone.
    """

    def __init__(self, config: DeepseekV41Config):
        super().__init__(config)
        self._build_transformer(config)
        self.post_init()
        self._suppress_image_token()


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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        output_main_hidden: bool = False,
        one_token_steps: bool | int = False,
        verify_stop=None,
        **kwargs,
    ) -> DeepseekV41CausalLMOutputWithPast | tuple:
        """Prefill (empty or no cache), a next turn on a filled cache, or a one-token decode step.

        Args:
            input_ids: int64 ``[B, S]``; every image-span position carries `image_token_id`.
            attention_mask: int ``[B, S]``; 0 marks padding. Left padding (generation) runs the
                pads as tokens, see the class doc; right padding gives each row its logits alone,
                without a cache (none is made unless `use_cache` is True, which it refuses).
            mm_token_type_ids: int ``[B, S]``, 1 on image-span positions (processor output).
            pixel_values: float ``[total_patches, 588]``, the new spans' images (on a filled cache
                also the whole conversation's: `continuation_images`). image_grid_thw: int
                ``[n_images, 3]`` rows ``(1, n_vit_h, n_vit_w)``.
            cache / past_key_values: a :class:`DeepseekV41Cache`; a new one is made when
                `use_cache` (default `text_config.use_cache`) and none is given.
            labels: int64 ``[B, S]`` for the causal LM loss (-100 ignored, as is every padded
                position); computes all logits and builds no cache unless `use_cache` is True.
            logits_to_keep: logits of the last K positions (0: all). `generate` passes 1, which
                computes the head exactly as the reference (a GEMM over ``[B, D]``).
            position_ids: ignored (positions follow the cache). inputs_embeds: refused.
            output_hidden_states: return ``hidden_states``, ``num_hidden_layers + 1`` bf16
                ``[B, S, D]`` (the mHC stream collapsed; see `DeepseekV41TransformerOutput`), and the
                vision tower's in ``image_outputs.hidden_states``.
            output_attentions: refused when true (or None and `config.output_attentions`).
            return_dict: False returns the output's `to_tuple()` (loss first when labels are
                given); None follows `config.return_dict`.
            output_main_hidden: also return ``main_hidden``, what the draft head reads (see
                `DeepseekV41Transformer.draft`; refused without a draft head or with left padding).
            one_token_steps: run the new tokens (True) or the last n of them (an int n) as
                successive one-token decode steps after one forward of the others
                (`verification_deepseek_v41_vl.forward_as_steps`): each stepped position's logits
                and cache state are plain decoding's, and the cache can be cropped after any of
                them. Speculative decoding's verification forward; `generate` sets it there.
            verify_stop: with `one_token_steps`, ``verify_stop(j, logits, input_ids) -> bool``
                ends the steps after step j (`forward_as_steps`'s `stop`; greedy DSpark
                generation passes it to skip the steps after a rejected draft).
            kwargs: reach `loss_function` (`num_items_in_batch`, `shift_labels`, ...).

        Returns:
            `DeepseekV41CausalLMOutputWithPast` (transformers' `MultimodalCausalLMOutputWithPast`
            and ``main_hidden``): ``logits`` fp32 ``[B, K, V]``, ``cache``, ``loss``,
            ``image_outputs`` (as :meth:`get_image_features`; None without `pixel_values`),
            ``main_hidden`` bf16 ``[B, S, T*D]`` with `output_main_hidden`; or its tuple.

        Raises:
            DeepseekV41ModelError: `output_attentions`, inputs_embeds, a cache of another type,
                image spans that do not fit the images (see `continuation_images` for a filled cache);
                `one_token_steps` with labels, without a filled cache or with images.
            DeepseekV41AttentionError: more than one token per decode step; right padding with a cache.
        """
        refuse_output_attentions(self.config, output_attentions)
        if labels is not None and one_token_steps:
            raise DeepseekV41ModelError("one_token_steps is a decoding forward: it takes no labels")
        if labels is not None:
            logits_to_keep = 0
            use_cache = False if use_cache is None else use_cache  # training: no cache unless asked
            if attention_mask is not None:
                # never score padding, nor a token predicted from a pad (the loss shifts by one)
                real = attention_mask[:, -labels.size(1) :] != 0
                labels = labels.masked_fill(~(real & torch.cat([real[:, :1], real[:, :-1]], dim=1)), -100)
        out = self._run(
            input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw,
            cache if cache is not None else past_key_values, use_cache, inputs_embeds, logits_to_keep,
            output_hidden_states, output_main_hidden, one_token_steps, verify_stop,
        )
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=out.logits, labels=labels, vocab_size=self.config.text_config.vocab_size, **kwargs
            )
        output = DeepseekV41CausalLMOutputWithPast(loss=loss, logits=out.logits, cache=out.cache,
                                                   hidden_states=out.hidden_states, image_outputs=out.image_outputs,
                                                   main_hidden=out.main_hidden)
        return output if self._returns_dict(return_dict) else output.to_tuple()


class DeepseekV41ForCausalLM(DeepseekV41ForConditionalGeneration):
    """Text-only DeepSeek-V4.1-Flash for `AutoModelForCausalLM`: the same backbone without the
    vision tower (a folder with vision weights loads; they are left unused)."""

    input_modalities = ("text",)
    # a VL folder loads: its vision weights are expected to be left unused
    _keys_to_ignore_on_load_unexpected = [
        *DeepseekV41PreTrainedModel._keys_to_ignore_on_load_unexpected,
        r"^model\.(vision|aligner)\.", r"^model\.image_(start|end|newline)$",
    ]

    def __init__(self, config: DeepseekV41Config):
        if config.vision_config.num_hidden_layers:
            config = copy.deepcopy(config)
            config.vision_config.num_hidden_layers = 0
            config.architectures = ["DeepseekV41ForCausalLM"]
        super().__init__(config)

    get_image_features = AbsentAttribute("DeepseekV41ForCausalLM is text-only: it has no get_image_features")

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: DeepseekV41Cache | None = None,
        past_key_values: DeepseekV41Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        **kwargs,
    ) -> DeepseekV41CausalLMOutputWithPast | tuple:
        """Text-only :meth:`DeepseekV41ForConditionalGeneration.forward` (same arguments, no images).

        Raises:
            DeepseekV41ModelError: `pixel_values` given.
        """
        if pixel_values is not None:
            raise DeepseekV41ModelError("DeepseekV41ForCausalLM is text-only; use DeepseekV41ForConditionalGeneration")
        return super().forward(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, past_key_values=past_key_values,
            use_cache=use_cache, labels=labels, logits_to_keep=logits_to_keep, inputs_embeds=inputs_embeds,
            position_ids=position_ids, output_hidden_states=output_hidden_states, return_dict=return_dict, **kwargs,
        )


__all__ = [
    "DeepseekV41ForCausalLM",
    "DeepseekV41ForConditionalGeneration",
    "DeepseekV41Model",
    "DeepseekV41PreTrainedModel",
    "DeepseekV41Transformer",
    "DeepseekV41TransformerOutput",
]
