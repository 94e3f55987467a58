"""The layout of an image span in the prompt, shared by the processor and the model.

An image of aligner grid ``n_llm_h x n_llm_w`` occupies ``[START] ([IMAGE] * n_llm_w [NEWLINE]) *
n_llm_h [END]`` (REFERENCE.md section 15). Every position of the span carries the image token id
and ``mm_token_type_ids == 1``; the roles inside it follow from the images' grids alone.
Mirrors `inference/image_processor.py: image_token_types` and `num_image_tokens`.
"""

from __future__ import annotations

from typing import Sequence

import torch

# Roles of the positions of a prompt, in the reference's `token_types` codes.
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3


def llm_grid(n_vit_h: int, n_vit_w: int, downsample_ratio: int) -> tuple[int, int]:
    """The aligner's output grid ``(n_llm_h, n_llm_w)``: ceil of each patch-grid side / ratio (the
    aligner zero-pads the patch grid to a multiple of the ratio)."""
    return -(-n_vit_h // downsample_ratio), -(-n_vit_w // downsample_ratio)


def image_span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Positions of one image span: ``n_llm_h * (n_llm_w + 1) + 2`` (a NEWLINE after every row,
    START and END). Mirrors `inference/image_processor.py: num_image_tokens`."""
    return n_llm_h * (n_llm_w + 1) + 2


def image_span_roles(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Roles of one image span: ``[START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END]``."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def _grids(image_grid_thw, error: type[Exception]) -> list[tuple[int, int]]:
    if image_grid_thw is None:
        return []
    rows = torch.as_tensor(image_grid_thw).reshape(-1, 3).tolist() if len(image_grid_thw) else []
    grids = []
    for i, (t, h, w) in enumerate(rows):
        if t != 1:
            raise error(f"image_grid_thw[{i}] has t = {t}; only still images (t = 1) are supported")
        if h < 1 or w < 1 or int(h) != h or int(w) != w:
            raise error(f"image_grid_thw[{i}] = {(t, h, w)} must hold positive integer patch counts")
        grids.append((int(h), int(w)))
    return grids


def image_token_roles(
    mm_token_type_ids: torch.Tensor | Sequence,
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    downsample_ratio: int = 3,
    error: type[Exception] = ValueError,
) -> torch.Tensor:
    """Role of every position: TEXT -1, IMAGE_START 0, IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3 (the
    reference's `token_types`, rebuilt from transformers-style inputs).

    Images are assigned to spans in order (batch row by batch row, left to right, the order of
    `pixel_values`); an image of patch grid ``(1, n_vit_h, n_vit_w)`` owns the next
    :func:`image_span_length` span positions, so spans placed back to back are told apart by the
    grids alone.

    Args:
        mm_token_type_ids: int ``[B, S]`` (or ``[S]``), 1 on every image-span position, 0 elsewhere.
        image_grid_thw: int ``[n_images, 3]`` rows ``(1, n_vit_h, n_vit_w)``, or None without images.
        downsample_ratio: the aligner's merge factor (3 in V4.1).
        error: the exception class raised (the caller's own ValueError subclass).

    Returns:
        int64 tensor of the shape of `mm_token_type_ids` (on its device when it is a tensor).

    Raises:
        error: values other than 0/1, a grid row with t != 1 or a non-positive side, a span shorter
            than its image needs, or more / fewer spans than images.
    """
    types = torch.as_tensor(mm_token_type_ids)
    device = types.device
    squeeze = types.dim() == 1
    if squeeze:
        types = types.unsqueeze(0)
    if types.dim() != 2:
        raise error(f"mm_token_type_ids must be [batch, seq] or [seq], got shape {tuple(types.shape)}")
    if bool(((types != 0) & (types != 1)).any()):
        raise error("mm_token_type_ids must hold only 0 (text) and 1 (image span)")
    spans = [llm_grid(h, w, downsample_ratio) for h, w in _grids(image_grid_thw, error)]
    flags = types.to(device="cpu", dtype=torch.int8)
    roles = torch.full(flags.shape, TEXT, dtype=torch.int64)
    image = 0
    for b in range(flags.size(0)):
        # runs of consecutive span positions; one run may hold several images back to back
        zero = torch.zeros(1, dtype=torch.int8)
        edges = torch.diff(flags[b], prepend=zero, append=zero)
        starts = torch.nonzero(edges == 1).flatten().tolist()
        ends = torch.nonzero(edges == -1).flatten().tolist()
        for run_start, run_end in zip(starts, ends):
            pos = run_start
            while pos < run_end:
                if image >= len(spans):
                    raise error(
                        f"mm_token_type_ids marks more image spans than the {len(spans)} images of image_grid_thw "
                        f"(a span beyond the last image at batch row {b}, position {pos})"
                    )
                n_h, n_w = spans[image]
                length = image_span_length(n_h, n_w)
                if pos + length > run_end:
                    raise error(
                        f"image {image} (llm grid {n_h}x{n_w}) needs a span of {length} positions, but the span at "
                        f"batch row {b}, position {pos} has only {run_end - pos}"
                    )
                roles[b, pos : pos + length] = torch.tensor(image_span_roles(n_h, n_w))
                pos += length
                image += 1
    if image != len(spans):
        raise error(f"image_grid_thw has {len(spans)} rows (images) but mm_token_type_ids marks {image} spans")
    roles = roles.to(device)
    return roles[0] if squeeze else roles


__all__ = [
    "IMAGE",
    "IMAGE_END",
    "IMAGE_NEW_LINE",
    "IMAGE_START",
    "TEXT",
    "image_span_length",
    "image_span_roles",
    "image_token_roles",
    "llm_grid",
]
