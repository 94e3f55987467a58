"""Prefilled caches keyed by their content, so that a prompt sharing a stored prefix skips it.

The key of a prompt is its token ids and, per image, a full SHA-256 digest of the image's
processed pixels (`pixel_values` rows, dtype and shape) and its `image_grid_thw` row: two prompts
with the same text and different images never share an entry, and nothing is truncated. A hit is
a deep copy of the stored cache (the entry stays as stored), continued by the model as a fresh
prefill of the prefix would have left it: pass it as `cache` with the whole prompt
(`generate` feeds only the tokens after it; the cached images are skipped, see
`conversation_deepseek_v41_vl.py`).
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Mapping

import torch

from .cache_deepseek_v41_vl import DeepseekV41Cache


class DeepseekV41PrefixStoreError(ValueError):
    """A prompt the store cannot key (batch > 1, images without their grid, a cache of another length)."""


class DeepseekV41PrefixStore:
    """A small least-recently-used store of prefilled :class:`DeepseekV41Cache` objects, batch 1.

    Args:
        max_entries (`int`): entries kept; the least recently used one goes first.
    """

    def __init__(self, max_entries: int = 8):
        if not isinstance(max_entries, int) or max_entries < 1:
            raise DeepseekV41PrefixStoreError(f"max_entries must be a positive int, got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, DeepseekV41Cache] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(inputs: Mapping) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``(token ids, image digests)`` of a batch-1 prompt (processor output: `input_ids`, and
        `pixel_values` + `image_grid_thw` with images).

        Raises:
            DeepseekV41PrefixStoreError: a batch of several prompts, or images without their grid.
        """
        ids = torch.as_tensor(inputs["input_ids"])
        if ids.dim() != 2 or ids.size(0) != 1:
            raise DeepseekV41PrefixStoreError(f"the store keys one prompt at a time: input_ids [1, S], got {tuple(ids.shape)}")
        pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
        if (pixels is None) != (grid is None):
            raise DeepseekV41PrefixStoreError("pixel_values and image_grid_thw come together")
        digests = []
        if pixels is not None:
            pixels, grid = torch.as_tensor(pixels), torch.as_tensor(grid)
            start = 0
            for row in grid.tolist():
                rows = pixels[start : start + row[0] * row[1] * row[2]].contiguous().cpu()
                start += rows.size(0)
                digest = hashlib.sha256(f"{rows.dtype} {tuple(rows.shape)} {row}".encode())
                digest.update(rows.view(torch.uint8).numpy().tobytes())
                digests.append(digest.hexdigest())
        return tuple(ids[0].tolist()), tuple(digests)

    def put(self, inputs: Mapping, cache: DeepseekV41Cache) -> None:
        """Store a deep copy of `cache`, which holds exactly the prompt `inputs` (its lengths, tokens
        and images, are checked; that they are this prompt's is the caller's word).

        Raises:
            DeepseekV41PrefixStoreError: the cache holds another number of tokens or images than
                the prompt.
        """
        key = self.key(inputs)
        images = 0 if cache.image_counts is None else int(cache.image_counts.sum())
        if cache.get_seq_length() != len(key[0]) or images != len(key[1]):
            raise DeepseekV41PrefixStoreError(
                f"the cache holds {cache.get_seq_length()} tokens and {images} images, the prompt {len(key[0])} and "
                f"{len(key[1])}: store the cache of exactly this prompt"
            )
        self._entries[key] = copy.deepcopy(cache)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def lookup(self, inputs: Mapping) -> tuple[DeepseekV41Cache, int] | None:
        """The longest stored prefix of the prompt `inputs` (its tokens and the images among them):
        ``(a deep copy of its cache, its length)``, or None."""
        ids, digests = self.key(inputs)
        best = None
        for key in self._entries:
            n, images = len(key[0]), key[1]
            # a proper prefix: at least one new token must remain to be fed
            if n < len(ids) and ids[:n] == key[0] and digests[: len(images)] == images and (best is None or n > len(best[0])):
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return copy.deepcopy(self._entries[best]), len(best[0])


__all__ = ["DeepseekV41PrefixStore", "DeepseekV41PrefixStoreError"]
