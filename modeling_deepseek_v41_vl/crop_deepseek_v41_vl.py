"""What :meth:`DeepseekV41Cache.crop` needs to rewind the decode state exactly.

The cache's state is lossy: the window ring keeps only the last `window` positions, a pooling
compressor's partial group is overwritten slot by slot (its stale slots, left from the previous
group, are part of the state too), and the Engram history keeps only the last
``max_ngram_size - 1`` ids. A cache made with ``max_crop=N`` therefore keeps, at the end of every
forward (:meth:`DeepseekV41CropHistory.record`, called where the cache advances its length, so
every forward path records, the CUDA-graph decode steps included):

- per layer, the window KV rows of the last ``window + N`` positions (a second ring, slot =
  position % (window + N), copied from the window ring after the forward wrote it);
- a :class:`DeepseekV41CropPoint` per forward ending within the last N positions: each pooling
  compressor's partial group (kv and score), the row counts of the compressed KV and index keys
  (rows are only ever appended, so truncating them rewinds them), the last index-key publisher,
  the Engram history, the image counts, the left padding and the prompt length of chunked
  prefills.

A crop goes back to the end of one of those forwards, bit for bit the state the cache had there
(what the same forwards without the detour leave). Inside a forward the state never existed (a
partial group and the Engram history of a length inside a chunk are not kept), so a length there
is refused, as is one further back than N positions; the error names the lengths the cache can
crop to. Cost: ``(window + N) x head_dim`` bf16 per layer and batch row, plus one small point per
forward (``2 x ratio x head_dim`` fp32 per pooling layer and batch row), and in time a few small
copies per layer after every forward, run eagerly outside the decode graphs (not measured on a
GPU yet); the default ``max_crop=0`` keeps nothing and costs one check per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


@dataclass
class DeepseekV41CropPoint:
    """The small part of the cache state at the end of one forward.

    Attributes:
        length: the cache length (padded columns) after the forward.
        partial: pooling layer id -> its partial group ``(kv, score)``, fp32 ``[B, ratio, D]``.
        rows: layer id -> ``(compressed_kv.length, index_k.length)``, None where the buffer did not
            exist.
        publisher, publisher_rows, pad_offsets, prefill_length: the attention cache's fields.
        engram_history: int64 ``[B, max_ngram_size - 1]`` or None; image_counts: int64 ``[B]`` or None.
        took_images: the forward that ended here took images (a crop inside it would cut a span).
    """

    length: int
    partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rows: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    publisher: int | None = None
    publisher_rows: torch.Tensor | None = None
    pad_offsets: torch.Tensor | None = None
    prefill_length: int | None = None
    engram_history: torch.Tensor | None = None
    image_counts: torch.Tensor | None = None
    took_images: bool = False


class DeepseekV41CropHistory:
    """The rewind history of one :class:`DeepseekV41Cache` (see the module doc).

    Args:
        max_crop: how many positions back a crop may go (> 0).
        compress_ratio: layer id -> its compress ratio (the text config's `compress_ratio`): a
            row's compressed rows and index keys at a length are its real positions // ratio.
    """

    def __init__(self, max_crop: int, compress_ratio):
        self.max_crop = max_crop
        self.compress_ratio = compress_ratio
        self.points: list[DeepseekV41CropPoint] = []
        self.windows: dict[int, torch.Tensor] = {}  # layer id -> [B, window + max_crop, D]
        self.dropped: str | None = None  # why the history was started again (a batch selection)
        self.start = 0  # where the first kept forward starts

    def clear(self, reason: str | None = None) -> None:
        self.points, self.windows, self.dropped, self.start = [], {}, reason, 0

    def restart(self, cache, reason: str) -> None:
        """Start the history again at the cache's current length (its batch rows were selected or
        repeated): the only point is the current state; `reason` is named to a crop further back."""
        length = cache.get_seq_length()
        self.clear()
        if length:
            self.record(cache, 0, length, False)  # the rings hold the last `window` positions
        self.start, self.dropped = length, reason

    def record(self, cache, start: int, end: int, took_images: bool) -> None:
        """Keep what a crop back to `end` needs, after a forward of positions [start, end)
        (`took_images`: it held image-span positions)."""
        attention = cache.attention
        if start == 0:
            self.clear()  # a new sequence: nothing before it can be cropped to
        point = DeepseekV41CropPoint(
            end, publisher=attention.index_k_publisher, publisher_rows=_copy(attention.index_k_publisher_rows),
            pad_offsets=_copy(attention.pad_offsets), prefill_length=attention.prefill_length,
            engram_history=_copy(cache.engram_history), image_counts=_copy(cache.image_counts),
            took_images=took_images,
        )
        for layer_id, state in attention.layers.items():
            if state.window_kv is not None:
                self._keep_window(layer_id, state.window_kv, start, end)
            if state.compressor_kv is not None:
                point.partial[layer_id] = (state.compressor_kv.clone(), state.compressor_score.clone())
            point.rows[layer_id] = tuple(None if b is None else b.length for b in (state.compressed_kv, state.index_k))
        dropped = [p.length for p in self.points if p.length < end - self.max_crop]
        if dropped:
            # the end of the last forward given up: the first kept one starts there
            self.start, self.dropped = dropped[-1], None
        self.points = [p for p in self.points if p.length >= end - self.max_crop] + [point]

    def widen(self, max_crop: int, current: int) -> None:
        """Reach `max_crop` (> the present one) positions back from now on; the kept window rows of
        positions before `current` (the cache length) move to the wider rings."""
        span = self.max_crop
        self.max_crop = max_crop
        for layer_id, kept in list(self.windows.items()):
            wide = kept.new_zeros(kept.size(0), kept.size(1) - span + max_crop, kept.size(2))
            pos = torch.arange(max(0, current - kept.size(1)), current, device=kept.device)
            wide[:, pos % wide.size(1)] = kept[:, pos % kept.size(1)]
            self.windows[layer_id] = wide

    def _keep_window(self, layer_id: int, ring: torch.Tensor, start: int, end: int) -> None:
        window = ring.size(1)
        kept = self.windows.get(layer_id)
        span = window + self.max_crop
        if kept is None or kept.shape != (ring.size(0), span, ring.size(2)) or kept.device != ring.device:
            kept = self.windows[layer_id] = ring.new_zeros(ring.size(0), span, ring.size(2))
        # the ring holds this forward's last `window` rows (earlier rows of a long chunk are never
        # needed: a crop to the chunk's start reads only positions before it)
        pos = torch.arange(max(start, end - window), end, device=ring.device)
        kept[:, pos % span] = ring[:, pos % window]

    def lengths(self, current: int) -> list[int]:
        """The lengths a crop can go back to (ascending; `current` last)."""
        return [p.length for p in self.points if p.length >= current - self.max_crop]

    def refusal(self, current: int, target: int) -> str:
        """Why `target` cannot be reached from `current`, naming what can."""
        lengths = self.lengths(current) or [current]
        smallest = lengths[0]
        bounds = [self.start, *lengths]
        inside = next(((a, b) for a, b in zip(bounds, bounds[1:]) if a < target < b), None)
        if inside is not None:
            took = next((p.took_images for p in self.points if p.length == inside[1]), False)
            why = (
                f"{target} lies inside the forward of positions [{inside[0]}, {inside[1]})"
                + (", which took images (a crop there would cut an image span)" if took else "")
                + ": the cache has a state only at the end of a forward"
            )
        elif self.dropped is not None and target <= self.start:
            why = f"its history was started again at length {self.start} by {self.dropped}"
        else:
            why = f"its history reaches back to {smallest} (max_crop={self.max_crop})"
        return (
            f"cannot crop the cache of length {current} to {target}: {why}; the smallest length it can crop to is "
            f"{smallest} (it can crop to {lengths}, or reset() to empty it)"
        )

    def restore(self, cache, target: int) -> None:
        """Put `cache` back as it was at the end of the forward that ended at `target` (one of
        :meth:`lengths`)."""
        point = next(p for p in self.points if p.length == target)
        attention = cache.attention
        # each batch row's real positions at `target` (left padding is not pooled), read once
        real_ends = None if point.pad_offsets is None else [max(target - pad, 0) for pad in point.pad_offsets.tolist()]
        for layer_id, state in attention.layers.items():
            if state.window_kv is not None and layer_id in self.windows:
                ring, kept = state.window_kv, self.windows[layer_id]
                window = ring.size(1)
                pos = torch.arange(max(0, target - window), target, device=ring.device)
                rows = kept[:, pos % kept.size(1)]
                ring.zero_()  # slots of no position yet (target < window) are zeros, as after a prefill
                ring[:, pos % window] = rows
            if layer_id in point.partial:
                for name, saved in zip(("compressor_kv", "compressor_score"), point.partial[layer_id]):
                    now = getattr(state, name)
                    if now is not None and now.shape == saved.shape:
                        now.copy_(saved)  # in place: a captured CUDA graph addresses these
                    else:
                        with torch.inference_mode(False):
                            setattr(state, name, saved.clone())
                        state.epoch.advance()  # a new tensor: a captured step addressed the old one
            counts = point.rows.get(layer_id, (None, None))
            ratio = max(self.compress_ratio(layer_id), 1)
            for name, length in zip(("compressed_kv", "index_k"), counts):
                buffer = getattr(state, name)
                if length is None or buffer is None:
                    setattr(state, name, None if length is None else buffer)
                    continue
                ends = real_ends if real_ends is not None else [target] * buffer._data.size(0)
                buffer.truncate(length, [end // ratio for end in ends])
        attention.index_k_publisher = point.publisher
        attention.index_k_publisher_rows = _copy(point.publisher_rows)
        attention.pad_offsets = _copy(point.pad_offsets)
        attention.prefill_length = point.prefill_length
        cache.engram_history = _copy(point.engram_history)
        cache.image_counts = _copy(point.image_counts)
        self.points = [p for p in self.points if p.length <= target]


__all__ = ["DeepseekV41CropHistory", "DeepseekV41CropPoint"]
