"""Images in a conversation's later turns: which images fill which batch row's spans, and the
image inputs of a forward on a filled cache.

A turn after the first may bring new images. `continuation_images` picks them out of
`pixel_values` holding either that turn's images or the whole conversation's (as the processor
renders it); `cache.image_counts` (updated by `count_images` after every forward with
`pixel_values`) says how many images each row's cache already holds. `images_per_row` also serves
`generate`'s per-row expansion of the images for beam search.
"""

from __future__ import annotations

import torch

from .cache_deepseek_v41_vl import DeepseekV41Cache
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .image_spans_deepseek_v41_vl import image_span_length


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
        DeepseekV41ModelError: `mm_token_type_ids` not as long as the new tokens; a cache of
            another batch size; images with no span among the new tokens that the cache does not
            hold; images that are neither the new turn's nor the whole conversation's.
    """
    if mm_token_type_ids is not None and mm_token_type_ids.shape != input_ids.shape:
        raise DeepseekV41ModelError(
            f"on a filled cache mm_token_type_ids must cover the new tokens {tuple(input_ids.shape)}, "
            f"got {tuple(mm_token_type_ids.shape)}"
        )
    counts = cache.image_counts
    if counts is not None and counts.numel() != input_ids.size(0):
        raise DeepseekV41ModelError(
            f"the cache holds {counts.numel()} batch rows, the new tokens {input_ids.size(0)}: continue a "
            "conversation with the batch that filled the cache"
        )
    cached = [0] * input_ids.size(0) if counts is None else counts.tolist()
    if mm_token_type_ids is None or not bool((mm_token_type_ids != 0).any()):
        # decode steps, or a text turn: the images given (the conversation's) must all be cached
        given = 0 if image_grid_thw is None else len(torch.as_tensor(image_grid_thw))
        if pixel_values is not None and given != sum(cached):
            raise DeepseekV41ModelError(
                f"{given} images for a cache that holds {sum(cached)} and new tokens with no image span: mark the "
                "new turn's image spans in mm_token_type_ids"
            )
        return None, None, None
    if pixel_values is None or image_grid_thw is None:
        return mm_token_type_ids, pixel_values, image_grid_thw  # the forward names what is missing
    grid = torch.as_tensor(image_grid_thw)
    positions = (mm_token_type_ids != 0).sum(-1).tolist()
    try:
        images_per_row(transformer, grid, positions)
        return mm_token_type_ids, pixel_values, grid  # the new turn's images
    except DeepseekV41ModelError as not_new:
        if not sum(cached):
            raise
        try:  # the whole conversation's: keep each row's images after those in the cache
            order = [i for row in images_per_row(transformer, grid, positions, cached) for i in row]
        except DeepseekV41ModelError:
            raise DeepseekV41ModelError(
                f"{len(grid)} images are neither the new tokens' ({not_new}) nor the whole conversation's "
                f"({sum(cached)} in the cache, then the new tokens')"
            ) from None
    return (mm_token_type_ids, *select_images(pixel_values, grid, order))


def count_images(transformer, cache: DeepseekV41Cache | None, mm_token_type_ids, image_grid_thw) -> None:
    """Add each row's images of a successful forward to `cache.image_counts`."""
    if cache is None or mm_token_type_ids is None or image_grid_thw is None:
        return
    grid = torch.as_tensor(image_grid_thw)
    rows = images_per_row(transformer, grid, (mm_token_type_ids != 0).sum(-1).tolist())
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    cache.image_counts = counts if cache.image_counts is None else cache.image_counts + counts


def select_images(pixel_values: torch.Tensor, grid: torch.Tensor, order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The patch rows and grid rows of images `order` (indices, in that order)."""
    offsets = [0, *grid.prod(-1).cumsum(0).tolist()]  # pixel_values rows of each image
    rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in order]).to(pixel_values.device)
    return pixel_values.index_select(0, rows), grid[torch.tensor(order, dtype=torch.long)].to(grid.device)


__all__ = ["continuation_images", "count_images", "images_per_row", "select_images"]
