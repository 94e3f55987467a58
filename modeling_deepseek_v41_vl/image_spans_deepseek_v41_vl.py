"""The geometry of images in the prompt: the one place the processor, the model and the CLI
read it from.

- :func:`parse_image_grid`: the rows ``(1, n_vit_h, n_vit_w)`` of `image_grid_thw`, checked;
- :func:`llm_grid`: the aligner's token grid of a patch grid, ``ceil(n_vit / ratio)`` per side;
- :func:`image_span_length` / :func:`image_span_roles`: an image of aligner grid
  ``n_llm_h x n_llm_w`` occupies ``[START] ([IMAGE] * n_llm_w [NEWLINE]) * n_llm_h [END]``
  (REFERENCE.md section 15);
- :func:`image_token_roles`: the role of every prompt position, rebuilt from
  `mm_token_type_ids` and the grids (the processor's view of a prompt).

Every position of a span carries the image token id and ``mm_token_type_ids == 1``.
Mirrors `inference/image_processor.py: llm_grid`, `image_token_types` and `num_image_tokens`.
"""

from __future__ import annotations

import numbers
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


def parse_image_grid(
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    num_patches: int | None = None,
    error: type[Exception] = ValueError,
) -> list[tuple[int, int]]:
    """Per-image patch grids ``(n_vit_h, n_vit_w)`` from `image_grid_thw`.

    Args:
        image_grid_thw: int ``[n_images, 3]`` rows ``(t, h, w)``: a tensor or array of an integer
            dtype, or nested sequences of ints; t must be 1 (V4.1 takes still images only). None
            or no rows: no images.
        num_patches: when given, the total the grids must add up to (rows of `pixel_values`).
        error: the exception class raised (the caller's own ValueError subclass).

    Raises:
        error: not 2-D ``[n_images, 3]`` (a lone row ``(t, h, w)`` included: pass ``[[t, h, w]]``),
            a non-integer dtype or value, t != 1, a side < 1, or a patch-count mismatch.
    """
    if image_grid_thw is None:
        rows = []
    elif isinstance(image_grid_thw, torch.Tensor) or hasattr(image_grid_thw, "tolist"):
        shape = tuple(image_grid_thw.shape)
        if shape == (0,):  # an empty array of no images (as `[]` is)
            image_grid_thw = image_grid_thw.reshape(0, 3)
            shape = (0, 3)
        if len(shape) != 2 or shape[1] != 3:
            hint = "; for one image pass [[1, h, w]]" if shape == (3,) else ""
            raise error(f"image_grid_thw must be [n_images, 3] rows (t, h, w), got shape {shape}{hint}")
        rows = image_grid_thw.tolist()
    elif isinstance(image_grid_thw, (str, bytes)) or not isinstance(image_grid_thw, Sequence):
        raise error(f"image_grid_thw must be [n_images, 3] rows (t, h, w), got {type(image_grid_thw).__name__}")
    else:
        rows = list(image_grid_thw)
    grids = []
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != 3:
            hint = "; for one image pass [[1, h, w]]" if not isinstance(row, Sequence) else ""
            raise error(f"image_grid_thw must be [n_images, 3] rows (t, h, w), got row {i} = {row!r}{hint}")
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in row):
            # tolist() gives Python floats / bools for a float or bool tensor: refused here too
            raise error(f"image_grid_thw[{i}] = {tuple(row)} must hold integers")
        t, h, w = (int(v) for v in row)
        if t != 1:
            raise error(f"image_grid_thw[{i}] has t = {t}; only still images (t = 1) are supported")
        if h < 1 or w < 1:
            raise error(f"image_grid_thw[{i}] = {(t, h, w)} must hold positive patch counts")
        grids.append((h, w))
    if num_patches is not None and sum(h * w for h, w in grids) != num_patches:
        raise error(
            f"image_grid_thw describes {sum(h * w for h, w in grids)} patches but pixel_values has {num_patches} rows"
        )
    return grids


def check_image_spans(image_mask: torch.Tensor, span_lengths: Sequence[int], error: type[Exception] = ValueError) -> None:
    """Check that the positions `image_mask` marks hold the images' spans back to back, in order.

    Read batch row by batch row (the order of `pixel_values`), every run of marked positions must
    start and end at span boundaries: a run may hold several spans, never part of one. Vectorised
    (one host synchronisation); the roles inside each span then follow from the grids.

    Args:
        image_mask: bool ``[B, S]`` (``mm_token_type_ids == 1``).
        span_lengths: :func:`image_span_length` of each image, in order.
        error: the exception class raised.

    Raises:
        error: a total that differs from the spans', or a run that starts or ends inside a span.
    """
    lengths = [int(n) for n in span_lengths]
    total, need = int(image_mask.sum()), sum(lengths)
    if total != need:
        raise error(
            f"mm_token_type_ids marks {total} image-span positions, but the {len(lengths)} images of "
            f"image_grid_thw need {need} (spans of {lengths} positions)"
        )
    if total == 0:
        return
    marks = image_mask.to(torch.int8)
    edge = marks.new_zeros(marks.size(0), 1)
    steps = torch.diff(marks, dim=1, prepend=edge, append=edge)  # +1 where a run starts, -1 after it
    rank = (torch.cumsum(marks.flatten(), 0) - 1).view_as(marks)  # index among the marked positions
    bounds = torch.tensor([0] + lengths, device=marks.device).cumsum(0)
    run_starts, run_ends = steps[:, :-1] == 1, steps[:, 1:] == -1  # first and last position of each run
    bad_start = ~torch.isin(rank[run_starts], bounds[:-1])
    bad_end = ~torch.isin(rank[run_ends] + 1, bounds[1:])
    if not bool(torch.cat([bad_start, bad_end]).any()):
        return
    # the first offending run, for the message (nonzero lists positions in the order rank[...] did)
    where, which, what = (run_starts, bad_start, "starts") if bool(bad_start.any()) else (run_ends, bad_end, "ends")
    row, col = torch.nonzero(where)[int(which.nonzero()[0, 0])].tolist()
    raise error(
        f"the image-span positions do not hold whole spans: the run of marked positions that {what} at "
        f"batch row {row}, position {col} cuts through an image's span (the images' spans have {lengths} "
        "positions, in order)"
    )

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
    spans = [llm_grid(h, w, downsample_ratio) for h, w in parse_image_grid(image_grid_thw, error=error)]
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
    "check_image_spans",
    "image_span_length",
    "image_span_roles",
    "image_token_roles",
    "llm_grid",
    "parse_image_grid",
]
