"""The image inputs of the DeepSeek-V4.1 backbone: encoding images (ViT and aligner), the
embedding of every image-span position, and the checks that tie `pixel_values`, `image_grid_thw`,
`mm_token_type_ids` and the image token ids together. Mirrors `inference/model.py:
Transformer.encode_image` and `merge_image_embeddings`.

:class:`DeepseekV41ImageInputsMixin` is part of `DeepseekV41Transformer` (it reads the
backbone's `vision`, `aligner`, `embed`, `image_start` / `image_newline` / `image_end` and
`config`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .image_spans_deepseek_v41_vl import check_image_spans, image_span_length, llm_grid, parse_image_grid
from .outputs_deepseek_v41_vl import image_encoder_output


class DeepseekV41ImageInputsMixin:
    """Image encoding and image-span checks of `DeepseekV41Transformer`."""

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Aligner rows of all images, ``[sum n_llm_h * n_llm_w, D]`` bf16, images in order and
        each row-major. Mirrors `Transformer.encode_image`.

        Raises:
            DeepseekV41ModelError: the model has no vision tower.
        """
        return self.encode_images(pixel_values, image_grid_thw)[1]

    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]], output_hidden_states=False
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """(ViT output ``[sum n_vit_h * n_vit_w, vision width]``, aligner rows ``[sum n_llm_h *
        n_llm_w, D]``, with `output_hidden_states` the ViT's hidden states
        (:meth:`DeepseekV41VisionTransformer.forward_with_hidden_states`) else None), all bf16.

        Raises:
            DeepseekV41ModelError: the model has no vision tower.
            DeepseekV41VisionInputError: malformed `pixel_values` or `image_grid_thw`.
        """
        if not self.vision_enabled:
            raise DeepseekV41ModelError("this model has no vision tower (vision_config.num_hidden_layers == 0)")
        self._follow_config_numerics()
        vit, states = self.vision.forward_with_hidden_states(pixel_values, image_grid_thw, output_hidden_states)
        return vit, self.aligner(vit, image_grid_thw), states

    def get_image_span_embeddings(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """The embedding of every position of every image span, bf16 ``[sum span lengths, D]``.

        Per image ``[image_start, (aligner row) * n_llm_w + image_newline for each of n_llm_h grid
        rows, image_end]``, images in order: one row per span position (all carry
        `image_token_id`), in the (batch row, position) order of the spans. The forward scatters
        these rows into the marked positions (the reference's `merge_image_embeddings`); a chunked
        prefill passes them, sliced per chunk, as `image_span_embeds` (the images are encoded once).

        Raises:
            DeepseekV41ModelError: the model has no vision tower.
            DeepseekV41VisionInputError: malformed `pixel_values` or `image_grid_thw`.
        """
        return self._span_embeddings(self.get_image_features(pixel_values, image_grid_thw), image_grid_thw)

    def _span_embeddings(self, features: torch.Tensor, image_grid_thw) -> torch.Tensor:
        """:meth:`get_image_span_embeddings` from the aligner rows `features`."""
        dtype = self.embed.weight.dtype
        spans, row = [], 0
        for n_h, n_w in self.image_llm_grids(image_grid_thw):
            grid = features[row : row + n_h * n_w].to(dtype).view(n_h, n_w, -1)
            row += n_h * n_w
            newline = self.image_newline.to(dtype).expand(n_h, 1, -1)
            body = torch.cat([grid, newline], dim=1).flatten(0, 1)
            spans += [self.image_start.to(dtype)[None], body, self.image_end.to(dtype)[None]]
        return torch.cat(spans)

    def image_llm_grids(self, image_grid_thw) -> list[tuple[int, int]]:
        """The aligner grid ``(n_llm_h, n_llm_w)`` of each image (`image_spans_deepseek_v41_vl`).

        Raises:
            DeepseekV41ModelError: a malformed `image_grid_thw`.
        """
        ratio = self.config.vision_config.downsample_ratio
        return [llm_grid(h, w, ratio) for h, w in parse_image_grid(image_grid_thw, error=DeepseekV41ModelError)]

    def _image_positions(self, input_ids, mm_token_type_ids, pixel_values, image_grid_thw, image_span_embeds, output_hidden_states=False):
        """The image-span mask ``[B, S]`` (None without `mm_token_type_ids`), the rows to
        scatter into it (None without images) and the encoder output of `pixel_values`
        (:func:`image_encoder_output`, None without them), after the checks that tie them together: the
        marks, the placeholder count (and with `pixel_values` whole spans, in order), and the
        image token id exactly on the marked positions."""
        if mm_token_type_ids is None:
            if pixel_values is not None:
                raise DeepseekV41ModelError("pixel_values were given without mm_token_type_ids marking the image spans")
            if image_span_embeds is not None:
                raise DeepseekV41ModelError("image_span_embeds were given without mm_token_type_ids marking their positions")
            image_mask = None
        else:
            if mm_token_type_ids.shape != input_ids.shape:
                raise DeepseekV41ModelError(
                    f"mm_token_type_ids {tuple(mm_token_type_ids.shape)} must match input_ids {tuple(input_ids.shape)}"
                )
            if bool(((mm_token_type_ids != 0) & (mm_token_type_ids != 1)).any()):
                raise DeepseekV41ModelError("mm_token_type_ids must hold only 0 (text) and 1 (image span)")
            image_mask = mm_token_type_ids == 1
        span_rows = image_outputs = None
        if pixel_values is not None:
            lengths = [image_span_length(n_h, n_w) for n_h, n_w in self.image_llm_grids(image_grid_thw)]
            check_image_spans(image_mask, lengths, error=DeepseekV41ModelError)
            vit, rows, states = self.encode_images(pixel_values, image_grid_thw, output_hidden_states)
            span_rows = self._span_embeddings(rows, image_grid_thw)
            image_outputs = image_encoder_output(vit, rows, states, self.image_llm_grids(image_grid_thw))
        elif image_span_embeds is not None:
            # rows already hold each span position's vector; a chunk may hold part of a span
            n_slots = int(image_mask.sum())
            if image_span_embeds.dim() != 2 or image_span_embeds.size(0) != n_slots:
                raise DeepseekV41ModelError(
                    f"image_span_embeds must be [{n_slots}, D] (one row per marked span position of this "
                    f"forward), got {tuple(image_span_embeds.shape)}"
                )
            span_rows = image_span_embeds
        elif image_mask is not None and bool(image_mask.any()):
            raise DeepseekV41ModelError("mm_token_type_ids marks image spans but no pixel_values were given")
        # the image id stands exactly on the marked positions: one comparison, one host sync per
        # forward (decode steps included); the two ways to differ are told apart only on failure
        is_image_id = input_ids == self.config.image_token_id
        mismatch = is_image_id if image_mask is None else is_image_id != image_mask
        if not bool(mismatch.any()):
            return image_mask, span_rows, image_outputs
        if image_mask is not None and bool((image_mask & ~is_image_id).any()):
            raise DeepseekV41ModelError(f"every image-span position must carry image_token_id {self.config.image_token_id}")
        row, col = torch.nonzero(mismatch)[0].tolist()  # now an image id outside the marks
        raise DeepseekV41ModelError(
            f"input_ids holds image_token_id {self.config.image_token_id} outside an image span (batch row {row}, "
            f"position {col}): the image token stands only for the positions that mm_token_type_ids marks and "
            "pixel_values fill (the processor writes both)"
        )


__all__ = ["DeepseekV41ImageInputsMixin"]
