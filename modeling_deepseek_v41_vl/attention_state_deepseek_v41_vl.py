"""What one forward of the attention stack shares, and the index lists its layers build.

- :class:`DeepseekV41DecodeStep`: the same for one step of the decode engine, from device
  tensors only (each row's position, the index-key publisher), so the step can be captured once.
- :class:`DeepseekV41AttentionState`: the hand-down slots of one forward (compressed KV and index
  keys published by kv sources, top-k indices by index sources, candidate blocks by the candidate
  source), around the :class:`DeepseekV41AttentionCache` that persists across forwards. The
  caller makes one per forward and passes it to every layer in order; nothing is kept in module
  globals. Mirrors `inference/model.py: SharedAttentionRuntime` (`shared_attn`).
- Padding (:func:`read_padding`, one backbone forward's): every mask is ``[B, past + S]``
  (:func:`check_mask_shape`, the one shape rule). Left padding: :func:`left_padding_offsets`
  reads it from a transformers attention mask and :func:`check_same_padding` checks a later
  forward against the cache; every row then runs as if it started at its first real token (see
  `attention_deepseek_v41_vl.py`). Right padding (:func:`right_padding_lengths`, without a cache
  only, so read at the start of a sequence, never per decode step) runs the pads as tokens after
  each row's last one and ranks each row's index lists over its own length.
- The window index lists of prefills, prefill chunks and one-token steps
  (:func:`window_topk_idxs`, :func:`chunk_window_idxs`, :func:`decode_window_idxs`,
  :func:`decode_window_idxs_at`). Mirrors `inference/model.py: get_window_topk_idxs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache_deepseek_v41_vl import DeepseekV41AttentionCache
from .cuda_graphs_deepseek_v41_vl import in_line
from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError


@dataclass
class DeepseekV41AttentionState:
    """Hand-down slots of one forward pass, created by the caller and passed to every layer in order.

    Mirrors `inference/model.py: SharedAttentionRuntime` (`shared_attn`), without the module global.

    Attributes:
        start_pos: absolute position of the first token of this forward (0 = prefill).
        cache: persistent per-layer caches (a fresh one when not given).
        topk_idxs: index source layer -> its top-k compressed indices ``[B, S, k]`` (int32, already
            offset into the concatenated KV, -1 = none).
        candidates: ``numerics="exact"``: the candidate source's bool mask ``[B, S, T]``, as the
            reference keeps it (None until it ran).
        candidate_blocks: ``numerics="fast"``: the candidate source's kept block ids
            ``[B, S, min(candidate_topk_blocks, ceil(T / candidate_block_size))]``, -1 = none,
            int16 (int32 past 32767 blocks) (None until it ran). The same set as `candidates`, in
            O(S x candidate_topk_blocks) memory instead of O(S x T).
        record_index_scores: keep each indexer's masked scores in `index_scores` (tests, analysis).
        pad_offsets: int64 ``[B]`` pad tokens before each row's first real token (left padding;
            positions are then counted per row from its first real token), or None. `start_pos`
            stays the padded column index of the first token of this forward.
        row_lengths: right padding (a forward from position 0 without a cache): each row's real
            tokens, the rest of the row padding after them (see :func:`right_padding_lengths`),
            or None. The pads run as tokens that no real token reads, and each row's index lists
            take the widths of its own length, so a row computes what it computes alone.
        hidden_taps: the layers whose input the draft head reads (``dspark_target_layer_ids``)
            -> the mean over the mHC copies of that input, after the layer's Engram, bf16
            ``[B, S, D]`` (filled by the layers); None: nobody drafts, nothing is taken.
    """

    start_pos: int = 0
    cache: DeepseekV41AttentionCache = field(default_factory=DeepseekV41AttentionCache)
    topk_idxs: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    record_index_scores: bool = False
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_blocks: torch.Tensor | None = None  # last: keeps the older fields' positions
    pad_offsets: torch.Tensor | None = None
    _pads: list[int] | None = field(default=None, init=False, repr=False)  # pad_offsets on the host
    row_lengths: list[int] | None = None
    hidden_taps: dict[int, torch.Tensor | None] | None = None

    def shared_snapshot(self, layer_id: int) -> tuple:
        """What a layer reads of the state other layers write within a forward, as it is now (for
        a gradient-checkpointing replay of `layer_id`): the index sources' top-k, the candidate
        source's choice, the last index-key publisher, and whether the layer's own cache exists."""
        cache = self.cache
        own = cache.layers.get(layer_id)
        return (dict(self.topk_idxs), self.candidates, self.candidate_blocks,
                cache.index_k_publisher, cache.index_k_publisher_rows, own)

    def restore_shared(self, snapshot: tuple, layer_id: int) -> None:
        """Put back a :meth:`shared_snapshot` of `layer_id` (its own cache as it was then)."""
        topk_idxs, self.candidates, self.candidate_blocks, publisher, rows, own = snapshot
        self.topk_idxs = dict(topk_idxs)
        self.cache.index_k_publisher, self.cache.index_k_publisher_rows = publisher, rows
        if own is None:
            self.cache.layers.pop(layer_id, None)
        else:
            self.cache.layers[layer_id] = own

    def positions(self, seqlen: int, device=None) -> torch.Tensor:
        """Positions of this forward's tokens: int64 ``[S]`` (start_pos .. start_pos + S - 1), or
        with `pad_offsets` ``[B, S]`` counted from each row's first real token (pads negative)."""
        pos = torch.arange(self.start_pos, self.start_pos + seqlen, device=device)
        if self.pad_offsets is None:
            return pos
        return pos - self.pad_offsets.to(device=pos.device, dtype=torch.int64).unsqueeze(1)

    def _host_pads(self) -> list[int]:
        if self.pad_offsets is None:
            return [0]
        if self._pads is None:
            if self.pad_offsets is self.cache.pad_offsets and self.cache.host_pads is not None:
                self._pads = self.cache.host_pads  # read when the cache took the padding
            else:
                self._pads = self.pad_offsets.tolist()  # one device sync per forward
        return self._pads

    def real_ends(self, seqlen: int) -> list[int]:
        """Per batch row: real tokens up to the end of this forward of `seqlen` tokens (the row's
        sequence length so far). Without padding a single entry, ``start_pos + S``."""
        end = self.start_pos + seqlen
        if self.row_lengths is not None:
            return [min(end, length) for length in self.row_lengths]
        return [max(0, end - pad) for pad in self._host_pads()]

    def per_row(self) -> bool:
        """Whether the batch rows have lengths of their own (left or right padding)."""
        return self.pad_offsets is not None or self.row_lengths is not None

    def min_pad(self) -> int:
        """The fewest pad tokens of any batch row (0 without padding)."""
        return min(self._host_pads())

    def rank_ends(self, seqlen: int) -> list[int]:
        """Per batch row: the sequence length whose widths this forward's index lists take (see
        `DeepseekV41AttentionCache.prefill_length`): the real length so far, or for a chunk of a
        prompt of known length the row's length at the end of the prompt."""
        ends = self.real_ends(seqlen)
        total = self.cache.prefill_length
        if total is None or seqlen == 1 or self.start_pos + seqlen > total or self.row_lengths is not None:
            return ends
        return [max(end, total - pad) for end, pad in zip(ends, self._host_pads())]

    def window_span(self, seqlen: int) -> int:
        """Padded columns whose window layout this multi-token forward takes (one prefill's)."""
        total = self.cache.prefill_length
        end = self.start_pos + seqlen
        return max(end, total) if total is not None and end <= total else end

    def max_real_end(self, seqlen: int) -> int:
        """The longest row's sequence length after this forward (``start_pos + S`` unpadded)."""
        return max(self.real_ends(seqlen))


@dataclass
class DeepseekV41DecodeStep:
    """What every layer of one decode step (`DeepseekV41Attention.decode_step`) reads and hands
    down: device tensors and values fixed for the whole sequence only, so that the step is one
    function a CUDA graph captures once and replays at every position.

    Attributes:
        cache: the :class:`DeepseekV41AttentionCache` the step reads and writes in place.
        column: int64 ``[1]``, the padded column of the step's token (the cache's length).
        positions: int64 ``[B]``, each row's position, counted from its first real token.
        pads: int64 ``[B]`` left padding of the rows, or None.
        publisher: int64 ``[B]``, each row's last index-key publisher (-1: none), updated in place
            by the owners of keys whose group ends at the step.
        widths: compress ratio -> the compressed rows (and index keys) the step reads: fixed for
            the sequence (a static cache's capacity) or a bucket of a growing cache.
        key_owners: the layers whose index keys a row's publisher may be, in layer order.
        engram_hash_ids: the step's Engram hash ids ``[B, 1, n_engram_layers, cols]`` or None.
        topk_idxs, candidate_blocks: the hand-downs of the index sources and the candidate source
            within the step (`inference/model.py: SharedAttentionRuntime`).
        hidden_taps: as `DeepseekV41AttentionState.hidden_taps` (the draft head's `main_hidden`).
        aside: ``aside(fn, *args) -> handle`` (``handle.join()`` gives ``fn(*args)``), how a layer
            runs work that what comes next does not read (the mHC mixes and their Sinkhorn, the
            attention's keys, the shared expert): in a CUDA graph (its warm-up and capture) the
            device's `cuda_graphs_deepseek_v41_vl.SideStream`, so that it overlaps; otherwise
            `in_line`.
            The step's tables (:meth:`freqs`, :meth:`window_slot`, :meth:`window_idxs`) are
            built before a fork, on the current stream; :meth:`attended_idxs` on it after the
            keys' join (no side work reads it).
    """

    cache: DeepseekV41AttentionCache
    column: torch.Tensor
    positions: torch.Tensor
    publisher: torch.Tensor
    widths: dict[int, int]
    key_owners: tuple[int, ...]
    pads: torch.Tensor | None = None
    engram_hash_ids: torch.Tensor | None = None
    topk_idxs: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_blocks: torch.Tensor | None = None
    hidden_taps: dict[int, torch.Tensor | None] | None = None
    aside: Callable = in_line
    _tables: dict = field(default_factory=dict, repr=False)

    def width(self, ratio: int) -> int:
        return self.widths[ratio]

    def freqs(self, rotary) -> torch.Tensor:
        """The RoPE table of every row's position, complex64 ``[B, 1, rd/2]`` (built once per step
        for the layers that share `rotary`'s tables)."""
        key = ("freqs", rotary.table_key)
        if key not in self._tables:
            self._tables[key] = rotary(self.positions.view(-1, 1))
        return self._tables[key]

    def window_slot(self, window: int) -> torch.Tensor:
        """The ring slot this step's token is written to, ``column % window``, int64 ``[1]`` (built
        once per step for the layers of one window)."""
        key = ("slot", window)
        if key not in self._tables:
            self._tables[key] = self.column % window
        return self._tables[key]

    def window_idxs(self, window: int) -> torch.Tensor:
        """The ring slots each row's query reads, oldest first, int32 ``[B, 1, window]`` (-1 for
        slots of no position yet or of a row's padding; built once per step)."""
        key = ("window", window)
        if key not in self._tables:
            idxs = decode_window_idxs_at(window, self.positions.size(0), self.column)
            if self.pads is not None:
                held = self.column - window + 1 + torch.arange(window, device=idxs.device)  # column of each slot
                idxs = torch.where(held < self.pads.view(-1, 1, 1), -1, idxs).int()
            self._tables[key] = idxs
        return self._tables[key]

    def attended_idxs(self, window: int, source: int) -> torch.Tensor:
        """What a query of a layer with `window` and index source `source` reads: the ring's slots
        (:meth:`window_idxs`), then the source's compressed picks (``topk_idxs[source]``), int32
        ``[B, 1, window + k]``; built once per step for the layers that share both."""
        key = ("attended", window, source)
        if key not in self._tables:
            self._tables[key] = torch.cat([self.window_idxs(window), self.topk_idxs[source]], dim=-1)
        return self._tables[key]

    def published_keys(self, width: int) -> torch.Tensor:
        """The first `width` stored index keys of each row's publisher ``[B, width, Id]`` (rows
        without one: the first owner's; they see no compressed position)."""
        keys = None
        for owner in self.key_owners:
            held = self.cache.layer(owner).index_k
            if held is None:
                continue
            rows = held.storage(width)
            keys = rows if keys is None else torch.where((self.publisher == owner).view(-1, 1, 1), rows, keys)
        if keys is None:
            raise DeepseekV41AttentionError("a decode step's indexer found no index keys: the prefill published none")
        return keys


# --------------------------------------------------------------------------- padding


def check_mask_shape(attention_mask: torch.Tensor | None, past_length: int, seqlen: int, batch: int | None = None) -> None:
    """The rule every attention mask of a forward follows, left or right padded: ``[B, past + S]``,
    one column per position so far (read from the shape only: no device sync).

    Args:
        attention_mask: the mask, or None (nothing to check).
        past_length: positions processed before this forward; seqlen: S, the tokens of this forward.
        batch: B, the forward's batch rows; None: any.

    Raises:
        DeepseekV41AttentionError: a mask of another shape.
    """
    if attention_mask is None:
        return
    rows = attention_mask.size(0) if batch is None else batch
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (rows, past_length + seqlen):
        raise DeepseekV41AttentionError(
            f"attention_mask must be [batch, past + seq] = [{'B' if batch is None else batch}, {past_length + seqlen}], "
            f"got {tuple(attention_mask.shape)}"
        )


def is_right_padding(attention_mask: torch.Tensor | None) -> bool:
    """True for a [B, S] 0/1 mask with a 0 after a 1 in some row and no 1 after a 0 in any row (a
    mask whose only 0s fill whole rows is left padding). Reads the mask back (one device sync):
    called at the start of a sequence without a cache only, or on an error path."""
    if attention_mask is None or attention_mask.dim() != 2:
        return False
    mask = attention_mask.to(torch.int64)
    steps = mask[:, 1:] - mask[:, :-1]
    return bool(_zeros_and_ones(attention_mask) & (steps <= 0).all() & (steps < 0).any())  # one sync


def _zeros_and_ones(attention_mask: torch.Tensor) -> torch.Tensor:
    # bool scalar tensor: every value is 0 or 1, read on the mask's own dtype (an integer cast
    # first would turn a fractional float into 0)
    return ((attention_mask == 0) | (attention_mask == 1)).all()


def _right_padding_with_a_cache() -> DeepseekV41AttentionError:
    return DeepseekV41AttentionError(
        "only left padding is supported with a cache: attention_mask pads on the right, and the cache would "
        "hold the pads as tokens of their rows; pad the batch on the left (padding_side=\"left\", as for "
        "generation) or run without a cache (use_cache=False)"
    )


def right_padding_lengths(attention_mask: torch.Tensor | None, cached: bool) -> list[int] | None:
    """Each row's real tokens when `attention_mask` pads on the right (:func:`is_right_padding`).

    Every position reads only earlier ones (window, compressor groups, indexer, Engram), so the
    pads after a row's last token never reach it when they run as tokens; the row's index lists
    then rank its own length (`DeepseekV41AttentionState.row_lengths`). A cache would hold the
    pads as tokens of their rows, read by every later forward: right padding runs without one.
    Reads the mask back: for a forward from position 0 (a forward with a cache leaves the check
    to :func:`left_padding_offsets`, which refuses right padding on its error path).

    Args:
        attention_mask: ``[B, S]`` (1 = token, 0 = padding), or None.
        cached: whether the forward runs with a cache.

    Returns:
        The ``B`` row lengths (the 1s of each row), or None when the mask does not pad on the right.

    Raises:
        DeepseekV41AttentionError: right padding with a cache.
    """
    if not is_right_padding(attention_mask):
        return None
    if cached:
        raise _right_padding_with_a_cache()
    return attention_mask.to(torch.int64).sum(dim=1).tolist()


def left_padding_offsets(attention_mask: torch.Tensor | None, past_length: int, seqlen: int) -> torch.Tensor | None:
    """Pad tokens before each row's first real token, from a transformers attention mask.

    Args:
        attention_mask: ``[B, past_length + S]`` (1 = token, 0 = padding) covering every position
            so far, as `generate` passes it; None = no padding.
        past_length: positions processed before this forward.
        seqlen: S, the tokens of this forward.

    Returns:
        int64 ``[B]`` (the leading zeros of each row; a row padded throughout gets the mask width),
        or None when no row has padding.

    Raises:
        DeepseekV41AttentionError: a mask of another width (:func:`check_mask_shape`), values other
            than 0/1, or padding that is not on the left (a 0 after a 1; right padding is refused
            naming its fixes, left padding or no cache).
    """
    if attention_mask is None:
        return None
    check_mask_shape(attention_mask, past_length, seqlen)
    mask = attention_mask.to(torch.int64)
    pads = (mask == 0).sum(dim=1)
    # one device sync for the three reads: values other than 0/1, a 0 after a 1, any padding
    bad_values, not_left, padded = torch.stack(
        [~_zeros_and_ones(attention_mask), (mask[:, 1:] < mask[:, :-1]).any(), pads.any()]
    ).tolist()
    if bad_values:
        raise DeepseekV41AttentionError("attention_mask must hold only 0 (padding) and 1 (token)")
    if not_left:
        if is_right_padding(attention_mask):
            raise _right_padding_with_a_cache()
        raise DeepseekV41AttentionError(
            "only left padding is supported: attention_mask has a 0 after a 1 (pad the batch on the left)"
        )
    return pads if padded else None


def read_padding(
    attention_mask: torch.Tensor | None,
    cache: DeepseekV41AttentionCache | None,
    start_pos: int,
    shape: tuple[int, int],
    row_lengths: list[int] | None = None,
) -> tuple[torch.Tensor | None, list[int] | None]:
    """The padding of one backbone forward, from its attention mask: ``(pad_offsets, row_lengths)``
    of :class:`DeepseekV41AttentionState`.

    One shape rule for every mask (:func:`check_mask_shape`). Without a cache (a forward from
    position 0) the mask may pad on the right (:func:`right_padding_lengths`, unless the caller
    read it already and passes `row_lengths`) or on the left. With a cache it pads on the left
    (:func:`left_padding_offsets`, which refuses right padding on its error path only, so that a
    decode step does not read the mask back for it); the padding is recorded at the prefill and
    every later mask must agree (:func:`check_same_padding`).

    Args:
        attention_mask: ``[B, past + S]``, or None (no padding, or the padding the cache recorded).
        cache: the attention cache the forward continues or fills, or None.
        start_pos: positions already in `cache`. shape: ``(B, S)`` of the forward's `input_ids`.
        row_lengths: right padding the caller already read from `attention_mask`, or None.

    Raises:
        DeepseekV41AttentionError: as :func:`check_mask_shape`, :func:`left_padding_offsets`,
            :func:`check_same_padding`.
    """
    batch, seqlen = shape
    check_mask_shape(attention_mask, start_pos, seqlen, batch)
    if cache is None:
        if row_lengths is None:
            row_lengths = right_padding_lengths(attention_mask, cached=False)
        if row_lengths is not None:  # the pads run as tokens after each row's last one
            return None, row_lengths
        return left_padding_offsets(attention_mask, start_pos, seqlen), None
    if attention_mask is not None or start_pos == 0:
        pads = left_padding_offsets(attention_mask, start_pos, seqlen)
        if start_pos > 0:
            check_same_padding(cache.pad_offsets, pads, start_pos, batch)
        cache.pad_offsets = pads
    return cache.pad_offsets, None


def check_same_padding(recorded: torch.Tensor | None, pads: torch.Tensor | None, start_pos: int, batch: int) -> None:
    """A forward after position 0: its attention mask must pad the cached positions as the cache
    records (left padding per row; a row still padded throughout may stay so).

    Raises:
        DeepseekV41AttentionError: a row whose padding differs.
    """
    if recorded is None and pads is None:
        return
    device = (pads if pads is not None else recorded).device
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    old = zeros if recorded is None else recorded.to(device=device, dtype=torch.int64)
    new = zeros if pads is None else pads.to(torch.int64)
    if old.shape != new.shape:
        raise DeepseekV41AttentionError(f"attention_mask has {new.numel()} rows, the cache {old.numel()}")
    started = old < start_pos  # rows with a real token in the cache
    bad = torch.where(started, new != old, new < start_pos)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise DeepseekV41AttentionError(
            f"attention_mask row {row} pads {int(new[row])} leading positions; the cache holds that row with "
            f"{int(old[row])} (padding is fixed at the prefill: pass the mask of every position so far)"
        )


# --------------------------------------------------------------------------- window index lists


def window_topk_idxs(window: int, batch: int, seqlen: int, start_pos: int, device=None) -> torch.Tensor:
    """Window KV rows each query attends to, int32 ``[B, S, min(S, W)]`` (prefill) or ``[B, 1, W]``.

    Prefill: query t sees rows max(0, t-W+1) .. t of the chunk (-1 pads t < W-1). Decode: the ring
    slots oldest to newest, -1 for slots not yet written. Mirrors `model.py: get_window_topk_idxs`.
    """
    if start_pos == 0:
        last = torch.arange(seqlen, device=device).unsqueeze(1)
        idxs = (last - window + 1).clamp(0) + torch.arange(min(seqlen, window), device=device)
        idxs = torch.where(idxs > last, -1, idxs)
    else:
        oldest = start_pos % window + 1
        idxs = torch.cat([torch.arange(oldest, window, device=device), torch.arange(oldest, device=device)])
        idxs = torch.where(idxs > start_pos, -1, idxs).unsqueeze(0)
    return idxs.int().unsqueeze(0).expand(batch, -1, -1).contiguous()


def chunk_window_idxs(
    window: int,
    batch: int,
    seqlen: int,
    start_pos: int,
    pad_offsets: torch.Tensor | None = None,
    device=None,
    span: int | None = None,
) -> torch.Tensor:
    """Window rows of a multi-token forward (a prefill, or a prefill chunk after position 0).

    The KV rows are this forward's S rows, preceded (start_pos > 0) by the `window` ring slots of
    the earlier positions (slot = position % window). Query t (padded column start_pos + i) sees
    the positions max(t - window + 1, first real position of its row) .. t, ascending in columns
    0, 1, ..., then -1: the layout of a one-shot prefill, so a chunk's rows match it.

    Returns:
        int32 ``[B, S, min(window, span)]`` (`span` defaults to start_pos + S: the layout of a
        prefill ending here); at start_pos 0 without padding exactly :func:`window_topk_idxs`.
    """
    pos = torch.arange(start_pos, start_pos + seqlen, device=device)
    width = min(window, max(start_pos + seqlen, span or 0))
    low = (pos - window + 1).clamp_min(0).unsqueeze(0)  # [1, S]
    if pad_offsets is not None:
        low = torch.maximum(low, pad_offsets.to(device=pos.device, dtype=torch.int64).unsqueeze(1))  # [B, S]
    seen = low.unsqueeze(-1) + torch.arange(width, device=pos.device)  # positions, [.., S, width]
    if start_pos > 0:
        rows = torch.where(seen < start_pos, seen % window, window + seen - start_pos)
    else:
        rows = seen
    idxs = torch.where(seen > pos.unsqueeze(-1), -1, rows).int()
    return idxs.expand(batch, -1, -1).contiguous()


def decode_window_idxs(window: int, batch: int, start_pos: int, pad_offsets: torch.Tensor | None = None, device=None):
    """Ring slots of a one-token step, oldest to newest (:func:`window_topk_idxs`), with the slots
    of a left-padded row's pad positions set to -1. int32 ``[B, 1, window]``."""
    idxs = window_topk_idxs(window, batch, 1, start_pos, device)
    if pad_offsets is None:
        return idxs
    # column c holds position start_pos - window + 1 + c
    held = torch.arange(start_pos - window + 1, start_pos + 1, device=idxs.device)
    pads = pad_offsets.to(device=idxs.device, dtype=torch.int64).view(-1, 1, 1)
    return torch.where(held < pads, -1, idxs).int()


def decode_window_idxs_at(window: int, batch: int, pos: torch.Tensor) -> torch.Tensor:
    """:func:`decode_window_idxs` without padding, from the step's position as a device tensor
    (int64 ``[1]``): the same int32 ``[B, 1, window]``, built without the host (graph-safe)."""
    slots = (pos % window + 1 + torch.arange(window, device=pos.device)) % window  # oldest first
    slots = torch.where(slots > pos, -1, slots).int()
    return slots.view(1, 1, window).expand(batch, 1, window).contiguous()


__all__ = [
    "DeepseekV41AttentionState",
    "DeepseekV41DecodeStep",
    "check_mask_shape",
    "check_same_padding",
    "chunk_window_idxs",
    "decode_window_idxs",
    "decode_window_idxs_at",
    "is_right_padding",
    "left_padding_offsets",
    "read_padding",
    "right_padding_lengths",
    "window_topk_idxs",
]
