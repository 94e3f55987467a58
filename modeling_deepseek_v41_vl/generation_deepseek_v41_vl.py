"""Generation around the DeepSeek-V4.1 model: the cache `generate` uses, image inputs expanded per
row for beam search and several samples, the image token kept out of the output, and a warning
when a thinking-mode generation stops inside the reasoning.

:class:`DeepseekV41GenerationMixin` is what `DeepseekV41ForConditionalGeneration` (and the
text-only class) add to transformers' `GenerationMixin`; the model itself is in
`modeling_deepseek_v41_vl.py`.
"""

from __future__ import annotations

import warnings

import torch
from transformers import GenerationMixin
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from .cache_deepseek_v41_vl import DeepseekV41Cache
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .image_spans_deepseek_v41_vl import image_span_length


class DeepseekV41GenerationMixin(GenerationMixin):
    """`GenerationMixin` with the model's own cache, per-row image expansion, the image token
    suppressed, and the reasoning-cut warning. Expects `self.model` (`DeepseekV41Transformer`)."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, plus a `UserWarning` when a thinking-mode row stopped before
        `</think>` (its left-padded prompt ends with `<think>`, and it generated neither `</think>`
        nor EOS). The `<think>` / `</think>` ids come from the model's generation config
        (`think_start_token_id` / `think_end_token_id`, written by the conversion); without them
        there is no check."""
        output = super().generate(*args, **kwargs)
        prompt = args[0] if args else kwargs.get("inputs")
        if prompt is None:
            prompt = kwargs.get("input_ids")
        user = kwargs.get("generation_config")
        eos = kwargs.get("eos_token_id", getattr(user, "eos_token_id", None))
        if eos is None:
            eos = self.generation_config.eos_token_id
        _warn_if_reasoning_cut(self.generation_config, eos, prompt, output)
        return output

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

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False, input_ids=None, **kwargs):
        # pixel_values / image_grid_thw are per image, not per batch row: each row's images are
        # repeated with it (as Qwen2-VL does), then the per-row tensors are repeated as usual
        pixel_values, grid = kwargs.pop("pixel_values", None), kwargs.pop("image_grid_thw", None)
        if expand_size > 1 and pixel_values is not None:
            pixel_values, grid = self._expand_images(pixel_values, grid, kwargs.get("mm_token_type_ids"), expand_size)
        input_ids, kwargs = super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids, **kwargs)
        if pixel_values is not None or grid is not None:
            kwargs["pixel_values"], kwargs["image_grid_thw"] = pixel_values, grid
        return input_ids, kwargs

    def _expand_images(self, pixel_values, image_grid_thw, mm_token_type_ids, expand_size: int):
        """Repeat each batch row's images (their patch rows and grid rows) `expand_size` times."""
        if image_grid_thw is None or mm_token_type_ids is None:
            raise DeepseekV41ModelError("pixel_values need image_grid_thw and mm_token_type_ids to be expanded per row")
        grid = torch.as_tensor(image_grid_thw)
        images = images_per_row(self.model, grid, (mm_token_type_ids != 0).sum(-1).tolist())
        order = [i for row in images for _ in range(expand_size) for i in row]
        return _select_images(pixel_values, grid, order)

    def _get_logits_processor(self, generation_config, *args, **kwargs):
        processors = super()._get_logits_processor(generation_config, *args, **kwargs)
        suppressed = generation_config.suppress_tokens or []
        if self.config.image_token_id not in suppressed:
            # also when a caller's generation config dropped it: the image id is never a valid output
            device = kwargs.get("device") or self.device
            processors.append(SuppressTokensLogitsProcessor([self.config.image_token_id], device=device))
        return processors


def images_per_row(transformer, grid: torch.Tensor, positions_per_row: list[int], skip: list[int] | None = None) -> list[range]:
    """Which images (indices into `grid`, in order) fill each batch row's image positions, for
    `transformer` (`DeepseekV41Transformer`, whose aligner fixes the span lengths).

    `skip[r]` images of row r come first and are not counted in its positions (those already
    in the cache, when `pixel_values` hold a whole conversation's images).

    Raises:
        DeepseekV41ModelError: the images' spans do not fill the rows' positions exactly.
    """
    span = [image_span_length(n_h, n_w) for n_h, n_w in transformer.image_llm_grids(grid)]
    images, start = [], 0
    for row, n_positions in enumerate(positions_per_row):
        start += skip[row] if skip is not None else 0
        end, covered = start, 0
        while covered < n_positions and end < len(span):
            covered, end = covered + span[end], end + 1
        if covered != n_positions:
            raise DeepseekV41ModelError(
                f"a row has {n_positions} image positions, which the images' spans {span[start:]} do not fill"
            )
        images.append(range(start, end))
        start = end
    if start != len(span):
        raise DeepseekV41ModelError(f"{len(span)} images for {start} image spans in the batch")
    return images


def continuation_images(transformer, input_ids, mm_token_type_ids, pixel_values, image_grid_thw, cache: DeepseekV41Cache):
    """The image inputs of a forward on a filled cache (the next turn of a conversation).

    `mm_token_type_ids` covers the new tokens (`generate` slices it); its image spans take
    `pixel_values` holding either the new turn's images only, or the whole conversation's
    (as the processor renders it), whose first images (`cache.image_counts` per row) are
    already in the cache and are dropped. Returns ``(mm_token_type_ids, pixel_values,
    image_grid_thw)`` for the forward (all None when the new tokens hold no image).

    Raises:
        DeepseekV41ModelError: `mm_token_type_ids` not as long as the new tokens; images that
            are neither the new ones nor all of them.
    """
    if mm_token_type_ids is not None and mm_token_type_ids.shape != input_ids.shape:
        raise DeepseekV41ModelError(
            f"on a filled cache mm_token_type_ids must cover the new tokens {tuple(input_ids.shape)}, "
            f"got {tuple(mm_token_type_ids.shape)}"
        )
    if mm_token_type_ids is None or not bool((mm_token_type_ids != 0).any()):
        # decode steps, or a text turn: the images given (the conversation's) must all be cached
        given = 0 if image_grid_thw is None else len(torch.as_tensor(image_grid_thw))
        cached = 0 if cache.image_counts is None else int(cache.image_counts.sum())
        if pixel_values is not None and given != cached:
            raise DeepseekV41ModelError(
                f"{given} images for a cache that holds {cached} and new tokens with no image span: mark the new "
                "turn's image spans in mm_token_type_ids"
            )
        return None, None, None
    if pixel_values is None or image_grid_thw is None:
        return mm_token_type_ids, pixel_values, image_grid_thw  # the forward names what is missing
    grid = torch.as_tensor(image_grid_thw)
    positions = (mm_token_type_ids != 0).sum(-1).tolist()
    cached = [0] * len(positions) if cache.image_counts is None else cache.image_counts.tolist()
    if sum(cached) and len(grid) > sum(cached):
        try:  # the whole conversation's images: keep each row's new ones
            order = [i for row in images_per_row(transformer, grid, positions, cached) for i in row]
            return (mm_token_type_ids, *_select_images(pixel_values, grid, order))
        except DeepseekV41ModelError:
            pass  # not the whole conversation's: the check below names the mismatch
    images_per_row(transformer, grid, positions)
    return mm_token_type_ids, pixel_values, grid


def count_images(transformer, cache: DeepseekV41Cache | None, mm_token_type_ids, image_grid_thw) -> None:
    """Add each row's images of a successful forward to `cache.image_counts`."""
    if cache is None or mm_token_type_ids is None or image_grid_thw is None:
        return
    grid = torch.as_tensor(image_grid_thw)
    rows = images_per_row(transformer, grid, (mm_token_type_ids != 0).sum(-1).tolist())
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    cache.image_counts = counts if cache.image_counts is None else cache.image_counts + counts


def _select_images(pixel_values: torch.Tensor, grid: torch.Tensor, order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The patch rows and grid rows of images `order` (indices, in that order)."""
    offsets = [0, *grid.prod(-1).cumsum(0).tolist()]  # pixel_values rows of each image
    rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in order]).to(pixel_values.device)
    return pixel_values.index_select(0, rows), grid[torch.tensor(order, dtype=torch.long)].to(grid.device)


def _warn_if_reasoning_cut(generation_config, eos_token_id, prompt, output) -> None:
    start = getattr(generation_config, "think_start_token_id", None)
    end = getattr(generation_config, "think_end_token_id", None)
    if start is None or end is None or not isinstance(prompt, torch.Tensor) or prompt.dim() != 2:
        return
    sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
    if sequences is None or sequences.size(0) % prompt.size(0):
        return
    thinking = (prompt[:, -1] == start).repeat_interleave(sequences.size(0) // prompt.size(0))
    new = sequences[:, prompt.size(1) :]
    stops = [end] + torch.tensor(eos_token_id if eos_token_id is not None else []).flatten().tolist()
    cut = thinking & ~torch.isin(new, torch.tensor(stops, device=new.device)).any(-1)
    if bool(cut.any()):
        warnings.warn(
            f"generation stopped inside the reasoning of {int(cut.sum())} of {cut.numel()} rows: "
            f"{new.size(1)} new tokens and no `</think>`; if max_new_tokens cut it, raise it to get the answer",
            UserWarning,
            stacklevel=3,
        )


__all__ = ["DeepseekV41GenerationMixin"]
