"""The backbone's output and the image encoder's output as transformers v5 VLMs return it.

`DeepseekV41Transformer.forward` returns :class:`DeepseekV41TransformerOutput`; the transformers
classes hand its fields on in `MultimodalCausalLMOutputWithPast` / `MultimodalBaseModelOutputWithPast`
(``image_outputs`` where transformers' multimodal outputs carry it). `get_image_features` and the
forward build the image encoder's output with :func:`image_encoder_output`. Attention weights are
refused in one place, :func:`refuse_output_attentions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling, MultimodalCausalLMOutputWithPast
from transformers.utils import ModelOutput

from .exceptions_deepseek_v41_vl import DeepseekV41ModelError

if TYPE_CHECKING:
    from .cache_deepseek_v41_vl import DeepseekV41Cache


@dataclass
class DeepseekV41TransformerOutput(ModelOutput):
    """Output of :class:`DeepseekV41Transformer`.

    Attributes:
        logits: fp32 ``[B, K, V]``, the last K positions (``logits_to_keep``; all when 0).
        cache: the :class:`DeepseekV41Cache` holding the decode state (None without one).
        last_hidden_state: bf16 ``[B, S, D]``, the `norm` output (the head input).
        hidden_states: with `output_hidden_states`, ``num_hidden_layers + 1`` bf16 ``[B, S, D]``:
            the embedding output, then the residual stream after each block but the last
            collapsed by the mix the next block's attention reads it with (``hc_pre``), then
            `last_hidden_state` (transformers' convention: the last entry is after the final norm).
        image_outputs: the :func:`image_encoder_output` of the images this forward encoded from
            `pixel_values` (with the vision tower's hidden states under `output_hidden_states`),
            None when it encoded none.
        main_hidden: with `output_main_hidden`, bf16 ``[B, S, T*D]``: for each of the draft head's
            T target layers (``dspark_target_layer_ids``, in order), the mean over the mHC copies
            of its input after its Engram, concatenated (what `draft` reads).
    """

    logits: torch.Tensor | None = None
    cache: DeepseekV41Cache | None = None
    last_hidden_state: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    image_outputs: BaseModelOutputWithPooling | None = None
    main_hidden: torch.Tensor | None = None


@dataclass
class DeepseekV41CausalLMOutputWithPast(MultimodalCausalLMOutputWithPast):
    """transformers' `MultimodalCausalLMOutputWithPast` and the draft head's input.

    Attributes:
        main_hidden: with ``output_main_hidden=True``, bf16 ``[B, S, T*D]`` (see
            :class:`DeepseekV41TransformerOutput`), else None.
    """

    main_hidden: torch.Tensor | None = None


def image_encoder_output(
    vit: torch.Tensor,
    rows: torch.Tensor,
    hidden_states: tuple[torch.Tensor, ...] | None,
    llm_grids: list[tuple[int, int]],
) -> BaseModelOutputWithPooling:
    """The image encoder's output as transformers v5 VLMs return it from `get_image_features`.

    Args:
        vit: the ViT output, ``[sum n_vit_h * n_vit_w, vision hidden_size]``.
        rows: the aligner rows, ``[sum n_llm_h * n_llm_w, D]``, images in order.
        hidden_states: the ViT's hidden states, or None.
        llm_grids: each image's aligner grid ``(n_llm_h, n_llm_w)``.

    Returns:
        `BaseModelOutputWithPooling`: ``last_hidden_state`` `vit`; ``pooler_output`` a tuple of one
        2-D ``[n_llm_h * n_llm_w, D]`` per image (views of `rows`); ``hidden_states`` as given;
        ``attentions`` None (:func:`refuse_output_attentions`). With the ViT's hidden states these are
        ``vision num_hidden_layers + 1`` ``[sum n_vit_h * n_vit_w, vision hidden_size]``: the patch
        embedding, every block's output but the last, the final-norm output (= `vit`).
    """
    pooled = tuple(rows.split([n_h * n_w for n_h, n_w in llm_grids]))
    return BaseModelOutputWithPooling(last_hidden_state=vit, pooler_output=pooled, hidden_states=hidden_states)


def refuse_output_attentions(config, output_attentions: bool | None) -> None:
    """Raise when attention weights are asked for (the argument, else `config.output_attentions`).

    Raises:
        DeepseekV41ModelError: `output_attentions` is true.
    """
    if config.output_attentions if output_attentions is None else output_attentions:
        raise DeepseekV41ModelError(
            "output_attentions is not supported: the language model's attention is sparse (a sliding window "
            "plus top-k compressed blocks chosen per query, with a learned sink), so no dense attention weights "
            "exist to return, and the vision tower's attention runs as a fused SDPA that does not form them; "
            "use output_hidden_states, or forward hooks on the attention modules"
        )


__all__ = ["DeepseekV41CausalLMOutputWithPast", "DeepseekV41TransformerOutput", "image_encoder_output", "refuse_output_attentions"]
