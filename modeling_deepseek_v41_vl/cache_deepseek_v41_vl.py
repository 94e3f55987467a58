"""Generation cache of DeepSeek-V4.1: a transformers :class:`Cache` over the model's decode state.

What the reference keeps in preallocated module buffers (`inference/model.py: Attention.window_kv_cache`,
`compress_kv_cache`, `Compressor.kv_state/score_state`, `Indexer.k_cache`, `NgramHashState.cache`)
lives here, per sequence batch:

- per layer (:class:`DeepseekV41LayerAttentionCache`, seen by transformers through
  :class:`DeepseekV41CacheLayer`): the sliding-window ring (bf16 ``[B, W, D]``, slot =
  position % W), the ratio>1 compressor's partial group (fp32 ``[B, ratio, D]``), and on KV-source
  layers the compressed KV and index keys (rows appended as groups complete);
- globally: which KV source last published index keys (a reference detail the indexer reads), the
  number of positions seen, the Engram hash history (the last ``max_ngram_size - 1``
  compressed ids per row, DEAD after image positions), and how many images each row has taken
  (``image_counts``, so that a later turn may pass the whole conversation's images).

Besides the reference's prefill at position 0 followed by one-token steps, a prefill may come in
chunks (forwards of several tokens on a non-empty cache) and batches may be left-padded (the rows'
pad counts are kept in ``attention.pad_offsets``); see `attention_deepseek_v41_vl.py`. A cache made
with ``max_crop=N`` can be cropped back to the end of any of its forwards of the last N positions
(:meth:`DeepseekV41Cache.crop`, what it keeps: `crop_deepseek_v41_vl.py`).
"""

from __future__ import annotations

import numbers
import weakref

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .buffer_pool_deepseek_v41_vl import cache_buffer
from .crop_deepseek_v41_vl import DeepseekV41CropHistory
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError, DeepseekV41CacheError


def select_batch_rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """`tensor`'s batch rows `index` (dim 0), in place when the batch size is unchanged."""
    if tensor is None:
        return None
    rows = tensor.index_select(0, index.to(tensor.device))
    writable = not tensor.is_inference() or torch.is_inference_mode_enabled()
    if rows.shape == tensor.shape and tensor.is_contiguous() and writable:
        # same batch size (beam search reorders every step): keep the storage, so that decode
        # steps captured in CUDA graphs (which address the cache buffers) are replayed, not
        # captured again
        return tensor.copy_(rows)
    return rows


def _capacity(rows: int) -> int:
    """Storage rows for `rows`: the power of two at or above it (0 for none), so that caches of
    similar lengths share buffer shapes (and, on CUDA, pooled buffers and their decode graphs)."""
    return 0 if rows <= 0 else 1 << (rows - 1).bit_length()


class DeepseekV41RowBuffer:
    """Rows ``[B, n, D]`` appended along dim 1, stored in a capacity of a power of two rows
    (doubling as it grows), zeros past the rows written.

    `length` is the number of rows of the longest batch row; with left padding a shorter batch row
    holds zeros past its own end (nothing reads them: they are never visible to its queries).
    `role` (e.g. ``(layer_id, "compressed_kv")``) names the buffer for the cache buffer pool
    (`buffer_pool_deepseek_v41_vl.py`); None keeps it out of the pool.
    """

    def __init__(self, rows: torch.Tensor, role: tuple | None = None):
        self.role = role
        # a copy, never a view: the rows may be a CUDA graph's output, rewritten by its next replay
        self._data = self._storage(rows.size(0), _capacity(rows.size(1)), rows)
        self._data[:, : rows.size(1)] = rows
        self.length = rows.size(1)

    @classmethod
    def empty(cls, like: torch.Tensor, role: tuple | None = None) -> "DeepseekV41RowBuffer":
        """A buffer with no rows, for `like`'s batch, width, dtype and device."""
        return cls(like.new_zeros(like.size(0), 0, like.size(-1)), role)

    def _storage(self, batch: int, capacity: int, like: torch.Tensor) -> torch.Tensor:
        role = self.role if capacity else None
        return cache_buffer(role, (batch, capacity, like.size(2)), like.dtype, like.device, 0.0)

    def _grow(self, end: int) -> None:
        if end > self._data.size(1):
            grown = self._storage(self._data.size(0), _capacity(max(end, 2 * self._data.size(1))), self._data)
            grown[:, : self.length] = self._data[:, : self.length]
            self._data = grown

    def write(self, start: int, rows: torch.Tensor) -> None:
        if start != self.length:
            raise DeepseekV41AttentionError(f"cache rows must be appended in order: row {start} after {self.length}")
        end = start + rows.size(1)
        self._grow(end)
        self._data[:, start:end] = rows
        self.length = end

    def scatter(self, index: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> None:
        """Per batch row writes: ``data[b, index[b, i]] = rows[b, i]`` where ``valid[b, i]``.

        index: int64 ``[B, n]`` (each batch row's own group indices), rows ``[B, n, D]``, valid bool
        ``[B, n]``.
        """
        if not bool(valid.any()):
            return
        end = int(index[valid].max()) + 1
        self._grow(end)
        batch = torch.arange(index.size(0), device=index.device).unsqueeze(1).expand_as(index)
        self._data[batch[valid], index[valid]] = rows[valid].to(self._data.dtype)
        self.length = max(self.length, end)

    def rows(self, n: int) -> torch.Tensor:
        if n > self.length:
            raise DeepseekV41AttentionError(f"asked for {n} cached rows, only {self.length} exist")
        return self._data[:, :n]

    def truncate(self, length: int, counts: list[int]) -> None:
        """Keep the first `length` rows (a crop), batch row b only its first ``counts[b]``: the
        storage past them is zeroed, as a buffer that never held them has it (in place)."""
        self.length = length
        for row, count in enumerate(counts):
            self._data[row, count:] = 0

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` rows (the storage moves only when it grows)."""
        self._grow(capacity)

    def storage(self, n: int) -> torch.Tensor:
        """The first `n` rows of the storage, written or not (``n <= capacity``; a decode step
        captured in a CUDA graph reads a fixed width and masks the rows past `length`)."""
        if n > self._data.size(1):
            raise DeepseekV41AttentionError(f"asked for {n} storage rows, the capacity is {self._data.size(1)}")
        return self._data[:, :n]

    def write_at(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Write `rows` ``[B, n, D]`` at the storage rows `index` (int64 ``[n]``, on the device):
        no host synchronisation, so a CUDA graph may capture it. `length` is left to the caller,
        who knows the step's position on the host."""
        self._data.index_copy_(1, index, rows.to(self._data.dtype))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows `index` (int ``[n]``) of the storage (beam search,
        batch selection); see :func:`select_batch_rows`."""
        self._data = select_batch_rows(self._data, index)

    @property
    def address(self) -> int:
        return self._data.data_ptr()

    @property
    def device(self) -> torch.device:
        return self._data.device


@dataclass
class DeepseekV41LayerAttentionCache:
    """What one attention layer keeps between forwards (decode).

    Attributes:
        window_kv: bf16 ``[B, W, D]`` ring buffer, position p in slot p % W (fp8-fake-quantized KV).
        compressed_kv: kv sources: RoPE'd, fp4-fake-quantized latents ``[B, T, D]``.
        index_k: kv sources: index keys ``[B, T, index_head_dim]``.
        compressor_kv / compressor_score: ratio>1 kv sources: fp32 ``[B, ratio, D]`` partial group
            (score initialised to -inf), slot = position % ratio.
    """

    window_kv: torch.Tensor | None = None
    compressed_kv: DeepseekV41RowBuffer | None = None
    index_k: DeepseekV41RowBuffer | None = None
    compressor_kv: torch.Tensor | None = None
    compressor_score: torch.Tensor | None = None
    layer_id: int | None = None

    def role(self, kind: str) -> tuple | None:
        """The pool role of this layer's buffer `kind` (None when the layer is unnamed)."""
        return None if self.layer_id is None else (self.layer_id, kind)

    def buffer(self, kind: str, shape: tuple[int, ...], like: torch.Tensor, fill: float = 0.0,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new buffer `kind` of this layer filled with `fill` (`like`'s dtype unless given, its
        device): pooled on CUDA (`buffer_pool_deepseek_v41_vl.py`)."""
        return cache_buffer(self.role(kind), shape, dtype or like.dtype, like.device, fill)

    def start_compressor(self, like: torch.Tensor, ratio: int, head_dim: int) -> None:
        """An empty partial group for a new sequence of `like`'s batch: kv zeros, score -inf."""
        shape = (like.size(0), ratio, head_dim)
        self.compressor_kv = self.buffer("compressor_kv", shape, like, 0.0, torch.float32)
        self.compressor_score = self.buffer("compressor_score", shape, like, -torch.inf, torch.float32)

    def park(self, slot, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Write a step's compressor projections ``[B, 1, D]`` into the partial-group slot `slot`
        (an int, or an int64 ``[1]`` device tensor: no host synchronisation, graph-safe)."""
        if isinstance(slot, torch.Tensor):
            self.compressor_kv.index_copy_(1, slot, kv)
            self.compressor_score.index_copy_(1, slot, score)
        else:
            self.compressor_kv[:, slot] = kv.squeeze(1)
            self.compressor_score[:, slot] = score.squeeze(1)

    def reset(self) -> None:
        self.window_kv = self.compressed_kv = self.index_k = self.compressor_kv = self.compressor_score = None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows `index` of every tensor of this layer's state."""
        self.window_kv = select_batch_rows(self.window_kv, index)
        self.compressor_kv = select_batch_rows(self.compressor_kv, index)
        self.compressor_score = select_batch_rows(self.compressor_score, index)
        for buffer in (self.compressed_kv, self.index_k):
            if buffer is not None:
                buffer.select_rows(index)


class DeepseekV41AttentionCache:
    """Per-sequence-batch attention cache: one :class:`DeepseekV41LayerAttentionCache` per layer.

    `index_k_publisher` reproduces a reference detail: index keys are read from the kv source that
    most recently *published* keys (`shared_attn.index_k`), and a ratio-2 source publishes only when
    its group completes. On a decode step that completes no group, a ratio-2 indexer therefore reads
    the keys of the last publisher of the previous forward (the ratio-1 source). Kept so decode
    matches the reference tensor for tensor.

    With left padding the batch rows reach their group boundaries at different steps, so the
    publisher is per batch row: `index_k_publisher_rows` (int64 ``[B]``, -1 = none yet) when the
    rows differ, None when they agree (then `index_k_publisher` is every row's).

    Attributes:
        layers: layer id -> :class:`DeepseekV41LayerAttentionCache`.
        index_k_publisher: the layer whose index keys were published last (None before any).
        index_k_publisher_rows: per batch row publisher when the rows differ, else None.
        pad_offsets: int64 ``[B]`` left-padding of the batch rows as last given by the caller
            (:func:`left_padding_offsets`), reused by forwards that pass none; None = no padding.
        prefill_length: optional, set by a caller that prefills a prompt of this many (padded)
            columns in several chunks. Exact numerics then give each chunk's index lists the
            widths one prefill of the whole prompt has (window columns, top-k columns) and rank
            the indexer scores over the same width, padding with -inf: `torch.topk` breaks exact
            ties depending on the width it ranks, so this makes chunks pick what one prefill
            picks. Without it a chunk ranks the positions that exist so far (the same selection
            up to tie choices).
    """

    def __init__(self):
        self.layers: dict[int, DeepseekV41LayerAttentionCache] = {}
        self.seen_tokens = 0  # kept up to date by the owning transformers cache
        self.index_k_publisher: int | None = None
        self.index_k_publisher_rows: torch.Tensor | None = None
        self.pad_offsets: torch.Tensor | None = None
        self.prefill_length: int | None = None

    def layer(self, layer_id: int) -> DeepseekV41LayerAttentionCache:
        if layer_id not in self.layers:
            self.layers[layer_id] = DeepseekV41LayerAttentionCache(layer_id=layer_id)
        return self.layers[layer_id]

    def publish_index_keys(self, layer_id: int, rows: torch.Tensor | None = None) -> None:
        """Record that `layer_id` published index keys, for all batch rows or those where `rows`
        (bool ``[B]``) is True."""
        if rows is None or bool(rows.all()):
            self.index_k_publisher, self.index_k_publisher_rows = layer_id, None
            return
        if not bool(rows.any()):
            return
        current = self.index_k_publisher_rows
        if current is None:
            current = torch.full(rows.shape, -1 if self.index_k_publisher is None else self.index_k_publisher,
                                 dtype=torch.int64, device=rows.device)
        self.index_k_publisher_rows = torch.where(rows, layer_id, current)
        self.index_k_publisher = layer_id

    def index_keys(self, n: int, reader: int, device: torch.device | None = None) -> torch.Tensor:
        """The first `n` published index keys ``[B, n, index_head_dim]``, each batch row's from its
        own last publisher (rows without one get zeros; they see no compressed position), on
        `device` when given (the publisher may sit on another GPU).

        Raises:
            DeepseekV41AttentionError: nothing published yet (`reader` names the asking layer).
        """
        if self.index_k_publisher is None:
            raise DeepseekV41AttentionError(f"layer {reader}: no index keys were published before its indexer")
        if self.index_k_publisher_rows is None:
            rows = self.layer(self.index_k_publisher).index_k.rows(n)
            return rows if device is None else rows.to(device)
        publishers = self.index_k_publisher_rows
        keys = None
        for layer_id in sorted(set(publishers.tolist()) - {-1}):
            rows = self.layer(layer_id).index_k.rows(n)
            rows = rows.to(publishers.device if device is None else device)
            publishers = publishers.to(rows.device)
            if keys is None:
                keys = torch.where((publishers == layer_id).view(-1, 1, 1), rows, torch.zeros_like(rows))
            else:
                keys = torch.where((publishers == layer_id).view(-1, 1, 1), rows, keys)
        return keys


class DeepseekV41CacheLayer(CacheLayerMixin):
    """transformers' view of one layer's decode state (:class:`DeepseekV41LayerAttentionCache`).

    The attention module writes the state itself (the compressed KV of a layer is shared by the
    layers after it), so :meth:`update` is not part of this cache's protocol.
    """

    is_compileable = False
    # transformers reads it as "crop can undo any part of a forward" (assisted decoding crops
    # inside its verification forward); this cache rewinds only to the end of a forward
    is_croppable = False
    supports_early_init = False

    def __init__(self, state: DeepseekV41LayerAttentionCache, owner: "DeepseekV41Cache"):
        super().__init__()
        self.state = state
        # weak: a strong one would make a cycle with the cache's `layers`, which only the cyclic
        # garbage collector frees; reference counting must free a dead cache at once, so that
        # the next cache gets its pooled buffers (and their decode graphs) back
        self._owner = weakref.ref(owner)

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.state.window_kv is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        # CacheLayerMixin.__init__ assigns it; the truth is whether the ring exists
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise DeepseekV41CacheError("DeepseekV41 cache layers are filled by the attention module, not lazily")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise DeepseekV41CacheError(
            "DeepseekV41CacheLayer.update is not used: DeepseekV41Attention writes its window ring, compressed "
            "KV and index keys through the DeepseekV41AttentionState it is given"
        )

    def get_seq_length(self) -> int:
        owner = self._owner()
        if owner is None:
            raise DeepseekV41CacheError("this cache layer outlived its DeepseekV41Cache")
        return owner.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the attention builds its own index lists; this is what a full-attention layer would report
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.state.window_kv.size(0) if self.state.window_kv is not None else 0
        self.batch_select_indices(torch.arange(batch).repeat_interleave(repeats))


class DeepseekV41Cache(Cache):
    """Decode state of one batch of sequences for :class:`DeepseekV41Transformer`.

    Args:
        config: the composite or text config (reads `num_hidden_layers`; with `max_crop`, the
            layers' compress ratios).
        max_crop: how many positions back :meth:`crop` may rewind (int >= 0). 0 (the default)
            keeps no history: the cache cannot be cropped. N > 0 keeps the window rows of the
            last ``window + N`` positions per layer and a small state per forward (see
            `crop_deepseek_v41_vl.py`), so that a crop back to the end of any forward within the
            last N positions is exact.

    Attributes:
        attention: :class:`DeepseekV41AttentionCache` handed to the attention modules.
        engram_history: int64 ``[B, max_ngram_size - 1]`` or None before the prefill.
        image_counts: int64 ``[B]``, the images each row has taken so far (None before any), so
            that a later turn given the whole conversation's `pixel_values` encodes only its own.
        crop_history: :class:`DeepseekV41CropHistory` with ``max_crop > 0``, else None.

    Raises:
        DeepseekV41CacheError: `max_crop` that is not an int >= 0.
    """

    def __init__(self, config, max_crop: int = 0):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if isinstance(max_crop, bool) or not isinstance(max_crop, int) or max_crop < 0:
            raise DeepseekV41CacheError(f"max_crop must be an int >= 0 (positions a crop may go back), got {max_crop!r}")
        self.attention = DeepseekV41AttentionCache()
        self.engram_history: torch.Tensor | None = None
        self.image_counts: torch.Tensor | None = None
        self._seen_tokens = 0
        self.crop_history = DeepseekV41CropHistory(max_crop, text.compress_ratio) if max_crop else None
        layers = [DeepseekV41CacheLayer(self.attention.layer(i), self) for i in range(text.num_hidden_layers)]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions already processed (the next token's absolute position)."""
        return self._seen_tokens

    def record_tokens(self, n: int, took_images: bool = False) -> None:
        """Advance the position after a forward of `n` tokens (called by the model, last, once the
        forward's state, its image counts included, is in the cache); `took_images`: the forward
        held image-span positions (a crop inside it would cut a span)."""
        start = self._seen_tokens
        self._seen_tokens += n
        self.attention.seen_tokens = self._seen_tokens
        if self.crop_history is not None:
            with torch.no_grad():
                self.crop_history.record(self, start, self._seen_tokens, took_images)

    def reset(self) -> None:
        super().reset()
        self.attention.index_k_publisher = None
        self.attention.index_k_publisher_rows = None
        self.attention.pad_offsets = None
        self.attention.prefill_length = None
        self.engram_history = None
        self.image_counts = None
        self._seen_tokens = 0
        self.attention.seen_tokens = 0
        if self.crop_history is not None:
            self.crop_history.clear()

    def _drop_crop_history(self, reason: str) -> None:
        # the kept rows and points are of the old batch rows: start again from the new rows, as
        # at the end of a forward (the current window rings seed the kept window rows)
        if self.crop_history is not None:
            with torch.no_grad():
                self.crop_history.restart(self, reason)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows `indices` (int ``[n]``) of every layer's state (the
        crop history starts again: a later crop goes back at most to the current length).

        Raises:
            DeepseekV41CacheError: indices that are not integers in ``[0, batch)``.
        """
        batch = self.engram_history.size(0) if self.engram_history is not None else None
        for layer in self.layers:
            if layer.state.window_kv is not None:
                batch = layer.state.window_kv.size(0)
                break
        if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.dim() != 1:
            raise DeepseekV41CacheError(f"batch indices must be a 1-D integer tensor, got {indices.dtype} {tuple(indices.shape)}")
        if batch is not None and indices.numel() and bool(((indices < 0) | (indices >= batch)).any()):
            raise DeepseekV41CacheError(f"batch indices must lie in [0, {batch}), got {indices.tolist()}")
        super().batch_select_indices(indices)
        self.engram_history = select_batch_rows(self.engram_history, indices)
        self.image_counts = select_batch_rows(self.image_counts, indices)
        # per batch row attention state (left padding)
        self.attention.pad_offsets = select_batch_rows(self.attention.pad_offsets, indices)
        self.attention.index_k_publisher_rows = select_batch_rows(self.attention.index_k_publisher_rows, indices)
        self._drop_crop_history("a batch selection (batch_select_indices / reorder_cache)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        for name in ("engram_history", "image_counts"):
            rows = getattr(self, name)
            if rows is not None:
                setattr(self, name, rows.repeat_interleave(repeats, dim=0))
        for name in ("pad_offsets", "index_k_publisher_rows"):
            rows = getattr(self.attention, name)
            if rows is not None:
                setattr(self.attention, name, rows.repeat_interleave(repeats, dim=0))
        self._drop_crop_history("batch_repeat_interleave")

    def crop(self, max_length: int) -> None:
        """Rewind the cache to `max_length` positions, as the same forwards without those after it
        left it, bit for bit. Like transformers' `DynamicCache.crop`, a negative value removes
        that many positions; unlike it, a positive value is the length to keep.

        Args:
            max_length: the new length (padded columns, as :meth:`get_seq_length` counts them);
                negative: remove that many positions. A length >= the current one, and 0
                (transformers' generation calls ``crop(0)`` to remove nothing), leave the cache
                as it is; to empty it call :meth:`reset`.

        The new length must be the end of one of the forwards of the last `max_crop` positions
        (a cache made with ``DeepseekV41Cache(config, max_crop=N)``): the state inside a forward
        never existed (partial compressor groups, Engram history and image spans are known only
        between forwards). Removing every position resets the cache.

        Raises:
            DeepseekV41CacheError: `max_length` that is not an int; more positions removed than the
                cache holds; a length the cache cannot rewind to (no history, beyond the last
                `max_crop` positions, inside a forward, inside an image span): the message names
                the smallest length it can crop to and all those it can.
        """
        if isinstance(max_length, torch.Tensor) and max_length.dim() == 0 and not max_length.is_floating_point() \
                and max_length.dtype != torch.bool:
            max_length = int(max_length)
        if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
            raise DeepseekV41CacheError(f"crop takes an int length (negative: positions to remove), got {max_length!r}")
        max_length = int(max_length)
        current = self._seen_tokens
        target = current + max_length if max_length < 0 else max_length
        if target < 0:
            raise DeepseekV41CacheError(f"crop({max_length}) removes {-max_length} positions, the cache holds {current}")
        if max_length == 0 or target >= current:
            return
        if target == 0:
            self.reset()  # every position removed: a fresh cache, exactly
            return
        history = self.crop_history
        if history is None:
            raise DeepseekV41CacheError(
                f"cannot crop the cache of length {current} to {target}: it keeps no history to rewind (make it as "
                f"DeepseekV41Cache(config, max_crop=N) to crop back up to N positions); the smallest length it can "
                f"crop to is {current}"
            )
        if target not in history.lengths(current):
            raise DeepseekV41CacheError(history.refusal(current, target))
        tensors = [s.window_kv for s in self.attention.layers.values() if s.window_kv is not None]
        # a cache filled under inference_mode holds inference tensors, writable only inside it
        with torch.inference_mode(any(t.is_inference() for t in tensors)), torch.no_grad():
            history.restore(self, target)
        self._seen_tokens = target
        self.attention.seen_tokens = target


__all__ = [
    "DeepseekV41AttentionCache",
    "DeepseekV41Cache",
    "DeepseekV41CacheError",
    "DeepseekV41CacheLayer",
    "DeepseekV41LayerAttentionCache",
    "DeepseekV41RowBuffer",
    "select_batch_rows",
]
