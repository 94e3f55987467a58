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

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .crop_deepseek_v41_vl import DeepseekV41CropHistory
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError, DeepseekV41CacheError
from .row_buffer_deepseek_v41_vl import (
    DeepseekV41RowBuffer, DeepseekV41StorageEpoch, _new_state_tensor, select_batch_rows,
)


# how far back a crop reaches while assisted decoding records the past (more than the checkpoint's
# 5 drafts or prompt lookup's 10; a longer verification widens it: `DeepseekV41Cache.keep_crops`)
PAST_RECORDING_CROP = 16


@dataclass
class DeepseekV41LayerAttentionCache:
    """What one attention layer keeps between forwards (decode). Its tensors are allocated through
    :meth:`buffer` and :meth:`row_buffer`, which reuse this layer's earlier storage of the same
    kind and shape (a cache reset and filled again keeps its addresses) and advance the cache's
    :class:`DeepseekV41StorageEpoch` when they allocate.

    Attributes:
        window_kv: bf16 ``[B, W, D]`` ring buffer, position p in slot p % W (fp8-fake-quantized KV).
        compressed_kv: kv sources: RoPE'd, fp4-fake-quantized latents ``[B, T, D]``.
        index_k: kv sources: index keys ``[B, T, index_head_dim]``.
        compressor_kv / compressor_score: ratio>1 kv sources: fp32 ``[B, ratio, D]`` partial group
            (score initialised to -inf), slot = position % ratio.
        max_cache_len: positions the cache holds when static (row buffers of fixed capacity), else None.
    """

    window_kv: torch.Tensor | None = None
    compressed_kv: DeepseekV41RowBuffer | None = None
    index_k: DeepseekV41RowBuffer | None = None
    compressor_kv: torch.Tensor | None = None
    compressor_score: torch.Tensor | None = None
    layer_id: int | None = None
    epoch: DeepseekV41StorageEpoch = field(default_factory=DeepseekV41StorageEpoch, repr=False)
    max_cache_len: int | None = None
    _storage: dict = field(default_factory=dict, repr=False)

    def buffer(self, kind: str, shape: tuple[int, ...], like: torch.Tensor, fill: float = 0.0,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """This layer's state tensor `kind` filled with `fill` (`like`'s dtype unless given, its
        device): the storage this layer held for `kind` when it has that shape, else a new one.
        While autograd records, always a new one (a tensor saved for a backward pass must not be
        written again)."""
        dtype = dtype or like.dtype
        shape = tuple(shape)
        held = self._storage.get(kind)
        if held is not None and tuple(held.shape) == shape and held.dtype == dtype and held.device == like.device \
                and not torch.is_grad_enabled():
            return held.fill_(fill)
        tensor = _new_state_tensor(shape, dtype, like.device, fill)
        if not torch.is_grad_enabled():
            self._storage[kind] = tensor
        self.epoch.advance()
        return tensor

    def row_buffer(self, kind: str, like: torch.Tensor, ratio: int) -> DeepseekV41RowBuffer:
        """An empty row buffer `kind` (``"compressed_kv"``, ``"index_k"``) for `like`'s batch, width
        and dtype: of ``ceil(max_cache_len / ratio)`` rows when the cache is static, else growing."""
        batch, width, dtype = like.size(0), like.size(-1), like.dtype
        allocate = lambda shape: self.buffer(kind, shape, like, 0.0, dtype)  # noqa: E731
        if self.max_cache_len is None:
            buffer = DeepseekV41RowBuffer(allocate((batch, 0, width)), allocate)
        else:
            rows = -(-self.max_cache_len // max(ratio, 1))
            buffer = DeepseekV41RowBuffer(allocate((batch, rows, width)), fixed_capacity=True)
        buffer.ratio = ratio
        return buffer

    def regrow_rows(self) -> None:
        """Move the row buffers to the capacity of the current `max_cache_len`, keeping their rows."""
        for kind in ("compressed_kv", "index_k"):
            old = getattr(self, kind)
            if old is None or not old.fixed_capacity or old.capacity >= -(-self.max_cache_len // old.ratio):
                continue  # (the same capacity: `buffer` would hand back the storage being copied)
            new = self.row_buffer(kind, old.storage(), old.ratio)
            new.storage(old.capacity).copy_(old.storage())
            new.length = old.length
            setattr(self, kind, new)

    def start_window(self, like: torch.Tensor, window: int) -> torch.Tensor:
        """A zeroed window ring ``[B, window, D]`` for a new sequence of `like`'s batch."""
        self.window_kv = self.buffer("window_kv", (like.size(0), window, like.size(-1)), like)
        return self.window_kv

    def start_compressor(self, like: torch.Tensor, ratio: int, head_dim: int) -> None:
        """An empty partial group for a new sequence of `like`'s batch: kv zeros, score -inf."""
        shape = (like.size(0), ratio, head_dim)
        self.compressor_kv = self.buffer("compressor_kv", shape, like, 0.0, torch.float32)
        self.compressor_score = self.buffer("compressor_score", shape, like, -torch.inf, torch.float32)

    def park(self, slot, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Write a step's compressor projections ``[B, 1, D]`` into the partial-group slot `slot`:
        an int (every batch row), or an int64 ``[B]`` device tensor of each row's slot (no host
        synchronisation)."""
        if isinstance(slot, torch.Tensor):
            target = slot.view(-1, 1, 1).expand(-1, 1, kv.size(-1))
            self.compressor_kv.scatter_(1, target, kv)
            self.compressor_score.scatter_(1, target, score)
        else:
            self.compressor_kv[:, slot] = kv.squeeze(1)
            self.compressor_score[:, slot] = score.squeeze(1)

    def reset(self) -> None:
        """Forget the sequence; the storage is kept for the next one."""
        self.window_kv = self.compressed_kv = self.index_k = self.compressor_kv = self.compressor_score = None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows `index` of every tensor of this layer's state."""
        moved = False
        for name in ("window_kv", "compressor_kv", "compressor_score"):
            old = getattr(self, name)
            setattr(self, name, select_batch_rows(old, index))
            moved |= getattr(self, name) is not old
        for buffer in (self.compressed_kv, self.index_k):
            if buffer is not None:
                moved |= buffer.select_rows(index)
        if moved:
            self._storage.clear()
            self.epoch.advance()


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
        host_pads: `pad_offsets` on the host (a list of ints), read once when the padding is set.
        max_cache_len: positions a static cache holds (fixed row buffers), None for a growing one.
        epoch: advanced whenever a state tensor is allocated or replaced
            (:class:`DeepseekV41StorageEpoch`).
        decode_graphs: captured decode steps of this cache (kept by the decode runner; they
            address this cache's tensors and die with it).
    """

    def __init__(self, max_cache_len: int | None = None):
        self.layers: dict[int, DeepseekV41LayerAttentionCache] = {}
        self.seen_tokens = 0  # kept up to date by the owning transformers cache
        self.index_k_publisher: int | None = None
        self.index_k_publisher_rows: torch.Tensor | None = None
        self._pad_offsets: torch.Tensor | None = None
        self.host_pads: list[int] | None = None
        self.prefill_length: int | None = None
        self.max_cache_len = max_cache_len
        self.epoch = DeepseekV41StorageEpoch()
        self.decode_graphs: dict = {}
        self._publisher_storage: torch.Tensor | None = None

    @property
    def pad_offsets(self) -> torch.Tensor | None:
        return self._pad_offsets

    @pad_offsets.setter
    def pad_offsets(self, value: torch.Tensor | None) -> None:
        if value is not self._pad_offsets:
            # the host copy is read here, once per prefill, never per decode step
            self.host_pads = None if value is None else [int(p) for p in value.tolist()]
        self._pad_offsets = value

    def layer(self, layer_id: int) -> DeepseekV41LayerAttentionCache:
        if layer_id not in self.layers:
            self.layers[layer_id] = DeepseekV41LayerAttentionCache(
                layer_id=layer_id, epoch=self.epoch, max_cache_len=self.max_cache_len
            )
        return self.layers[layer_id]

    def publisher_rows(self, batch: int, device: torch.device) -> torch.Tensor:
        """A device tensor int64 ``[batch]`` holding each batch row's index-key publisher now
        (-1: none), kept at one address for the decode step to update in place."""
        held = self._publisher_storage
        if held is None or held.numel() != batch or held.device != torch.device(device):
            held = self._publisher_storage = _new_state_tensor((batch,), torch.int64, device, -1)
            self.epoch.advance()
        rows = self.index_k_publisher_rows
        if rows is None:
            held.fill_(-1 if self.index_k_publisher is None else self.index_k_publisher)
        elif rows is not held:
            held.copy_(rows)
        return held

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
    supports_early_init = False

    def __init__(self, state: DeepseekV41LayerAttentionCache, owner: "DeepseekV41Cache"):
        super().__init__()
        self.state = state
        # weak: a strong one would make a cycle with the cache's `layers`, which only the cyclic
        # garbage collector frees; reference counting frees a dead cache (and its GPU state) at once
        self._owner = weakref.ref(owner)

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.state.window_kv is not None


    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        # CacheLayerMixin.__init__ assigns it; the truth is whether the ring exists
        pass

    @property
    def is_croppable(self) -> bool:
        """transformers' "a crop puts the layer back as it was": true while the cache keeps a crop
        history (``max_crop`` or :meth:`DeepseekV41Cache.activate_past_recording`). Assisted
        decoding crops inside its verification forward, which the model then runs as one-token
        steps (``one_token_steps``), each the end of a forward."""
        owner = self._owner()
        return owner is not None and owner.crop_history is not None

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
        owner = self._owner()
        limit = None if owner is None else owner.max_cache_len
        return -1 if limit is None else limit

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
        max_cache_len: positions the cache holds, or None (the default) for a cache that grows.
            With it every state tensor is allocated at its full size by the prefill and never
            moves (transformers' `StaticCache` semantics): a captured decode step of the whole
            model replays on it from the first step to the last, and after :meth:`reset` the
            next sequence reuses the same storage (`generate` keeps such a cache on the model).
            A forward past it makes the cache longer (:meth:`make_room`).

    Attributes:
        attention: :class:`DeepseekV41AttentionCache` handed to the attention modules.
        engram_history: int64 ``[B, max_ngram_size - 1]`` or None before the prefill.
        image_counts: int64 ``[B]``, the images each row has taken so far (None before any), so
            that a later turn given the whole conversation's `pixel_values` encodes only its own.
        max_crop: as made.
        crop_history: :class:`DeepseekV41CropHistory` with ``max_crop > 0`` (or while an assisted
            generation records the past, :meth:`activate_past_recording`), else None.
        draft: the draft head's rings for this sequence (`DeepseekV41DraftCache`, made by DSpark
            generation), or None; a crop rewinds them with the rest, a reset or a batch selection
            drops them.

    Raises:
        DeepseekV41CacheError: `max_crop` that is not an int >= 0, `max_cache_len` that is not
            None or an int >= 1.
    """

    def __init__(self, config, max_crop: int = 0, max_cache_len: int | None = None):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if isinstance(max_crop, bool) or not isinstance(max_crop, int) or max_crop < 0:
            raise DeepseekV41CacheError(f"max_crop must be an int >= 0 (positions a crop may go back), got {max_crop!r}")
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise DeepseekV41CacheError(f"max_cache_len must be None or an int >= 1 (positions held), got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        self._in_generate: int | None = None  # a model's kept cache: the thread whose `generate` holds it
        self.attention = DeepseekV41AttentionCache(max_cache_len)
        self._engram_history: torch.Tensor | None = None
        self._engram_storage: torch.Tensor | None = None
        self.image_counts: torch.Tensor | None = None
        self._seen_tokens = 0
        self._compress_ratio = text.compress_ratio
        self.max_crop = max_crop
        self._unrun = 0  # positions a stopped verification did not run (`skip_steps`)
        self.crop_history = DeepseekV41CropHistory(max_crop, text.compress_ratio) if max_crop else None
        self.draft = None
        layers = [DeepseekV41CacheLayer(self.attention.layer(i), self) for i in range(text.num_hidden_layers)]
        super().__init__(layers=layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions already processed (the next token's absolute position), counting those a
        verification forward stopped before (:meth:`skip_steps`) until a crop removes them."""
        return self._seen_tokens + self._unrun

    def skip_steps(self, n: int) -> None:
        """A verification run as one-token steps stopped `n` positions early, after a rejected
        draft (greedy: what follows is never kept): they count as run until the crop after the
        verification removes them, so that transformers' crop, relative to the whole forward,
        lands on the steps run. Any forward before that crop is refused."""
        self._unrun = n

    @property
    def batch_size(self) -> int:
        """The batch rows the cache holds (-1 before a prefill, as transformers' caches)."""
        for state in self.attention.layers.values():
            if state.window_kv is not None:
                return state.window_kv.size(0)
        return -1 if self._engram_history is None else self._engram_history.size(0)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """`max_cache_len`, or -1 for a growing cache (transformers' convention)."""
        return -1 if self.max_cache_len is None else self.max_cache_len

    def grow_to(self, max_cache_len: int) -> None:
        """Make a static cache hold at least `max_cache_len` positions (its row buffers move, with
        their rows; a growing cache is left as it is)."""
        if self.max_cache_len is None or max_cache_len <= self.max_cache_len:
            return
        self.max_cache_len = self.attention.max_cache_len = max_cache_len
        for state in self.attention.layers.values():
            state.max_cache_len = max_cache_len
            state.regrow_rows()

    def make_room(self, n: int) -> None:
        """Before a forward of `n` tokens: a static cache without room for them grows (to twice
        its length, or what they need if more; its row buffers move once, and a captured step
        is captured again). A growing cache needs nothing.

        Raises:
            DeepseekV41CacheError: positions a stopped verification did not run are not cropped yet
                (:meth:`skip_steps`)."""
        if self._unrun:
            raise DeepseekV41CacheError(
                f"a forward on a cache whose last verification stopped {self._unrun} positions early: crop them "
                "first (crop(-n) as transformers' assisted decoding does)"
            )
        needed = self._seen_tokens + n
        if self.max_cache_len is not None and needed > self.max_cache_len:
            self.grow_to(max(needed, 2 * self.max_cache_len))

    @property
    def engram_history(self) -> torch.Tensor | None:
        """int64 ``[B, max_ngram_size - 1]``, the last compressed ids of each row (None before a
        prefill). Assigning writes into the held tensor when the shape agrees, so that a captured
        decode step keeps addressing it."""
        return self._engram_history

    @engram_history.setter
    def engram_history(self, value: torch.Tensor | None) -> None:
        if value is None:
            self._engram_history = None  # the storage is kept for the next sequence
            return
        held = self._engram_storage
        if held is None or held.shape != value.shape or held.device != value.device or held.dtype != value.dtype \
                or torch.is_grad_enabled():
            with torch.inference_mode(False):
                held = value.clone()
            if not torch.is_grad_enabled():
                self._engram_storage = held
            self.attention.epoch.advance()
        elif value is not held:
            held.copy_(value)
        self._engram_history = held

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """transformers' switch before assisted decoding: keep a crop history until
        :meth:`end_past_recording`, reaching at least `recurrent_states_to_keep` positions back
        (transformers 5.25 passes its drafts per step; default :data:`PAST_RECORDING_CROP`), so
        that a verification forward can be cropped. A cache made with a larger `max_crop` keeps
        it. A filled cache starts its history at its current length."""
        self.keep_crops(max(recurrent_states_to_keep or 0, PAST_RECORDING_CROP))

    def end_past_recording(self) -> None:
        """After an assisted generation: the crop history is as the cache was made (none with
        ``max_crop=0``)."""
        if not self.max_crop:
            self.crop_history = None

    def keep_crops(self, max_crop: int) -> None:
        """Make the crop history reach at least `max_crop` positions back (one is started when the
        cache has none; what it holds is kept)."""
        if self.crop_history is None:
            self.crop_history = DeepseekV41CropHistory(max_crop, self._compress_ratio)
            with torch.no_grad():
                self.crop_history.restart(self, "the start of the crop history")
        elif max_crop > self.crop_history.max_crop:
            self.crop_history.widen(max_crop, self._seen_tokens)

    def record_tokens(self, n: int, took_images: bool = False, main_hidden: torch.Tensor | None = None) -> None:
        """Advance the position after a forward of `n` tokens (called by the model, last, once the
        forward's state, its image counts included, is in the cache); `took_images`: the forward
        held image-span positions (a crop inside it would cut a span); `main_hidden`: the forward's
        (``output_main_hidden``), handed to the draft rings when the cache has them."""
        start = self._seen_tokens
        self._seen_tokens += n
        self.attention.seen_tokens = self._seen_tokens
        if self.draft is not None:
            self.draft.record_forward(start, main_hidden, n)
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
        self._unrun = 0
        self.attention.seen_tokens = 0
        if self.draft is not None:
            self.draft.clear()  # kept, at the same addresses, with its captured draft forward
        self.end_past_recording()
        if self.crop_history is not None:
            self.crop_history.clear()

    def _drop_crop_history(self, reason: str) -> None:
        # the kept rows and points are of the old batch rows: start again from the new rows, as
        # at the end of a forward (the current window rings seed the kept window rows); the
        # draft rings are of the old rows too
        self.draft = None
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
        # per batch row attention state (left padding; its host copy follows the rows)
        host_pads = self.attention.host_pads
        self.attention.pad_offsets = select_batch_rows(self.attention.pad_offsets, indices)
        if host_pads is not None:
            self.attention.host_pads = [host_pads[i] for i in indices.tolist()]
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
        # (`pad_offsets` re-reads its host copy: a new tensor)
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
        current = self.get_seq_length()
        target = current + max_length if max_length < 0 else max_length
        if target < 0:
            raise DeepseekV41CacheError(f"crop({max_length}) removes {-max_length} positions, the cache holds {current}")
        if self._unrun:
            if target > self._seen_tokens:
                raise DeepseekV41CacheError(
                    f"crop to {target} keeps positions a stopped verification did not run (it ran up to "
                    f"{self._seen_tokens}): crop to {self._seen_tokens} or less"
                )
            self._unrun, current = 0, self._seen_tokens
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
        if self.draft is not None and not self.draft.rewind(target):
            self.draft = None  # its rows of the positions kept are gone: DSpark generation refuses it


__all__ = [
    "DeepseekV41AttentionCache",
    "DeepseekV41Cache",
    "DeepseekV41CacheError",
    "DeepseekV41CacheLayer",
    "DeepseekV41LayerAttentionCache",
    "DeepseekV41RowBuffer",
    "select_batch_rows",
]
