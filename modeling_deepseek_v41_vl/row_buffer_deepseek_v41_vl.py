"""The storage of the decode cache's state: growing row buffers (compressed KV rows, index keys),
the epoch that tells a captured decode step its tensors moved, and batch-row selection that keeps
a tensor's storage where it can. `cache_deepseek_v41_vl.py` builds the cache from these.
"""

from __future__ import annotations

import torch

from .exceptions_deepseek_v41_vl import DeepseekV41AttentionError, DeepseekV41CacheError


def select_batch_rows(tensor: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """`tensor`'s batch rows `index` (dim 0), in place when the batch size is unchanged."""
    if tensor is None:
        return None
    with torch.inference_mode(False):  # an ordinary tensor: later steps outside inference mode write it
        rows = tensor.index_select(0, index.to(tensor.device))
    writable = not tensor.is_inference() or torch.is_inference_mode_enabled()
    if rows.shape == tensor.shape and tensor.is_contiguous() and writable:
        # same batch size (beam search reorders every step): keep the storage, so that a captured
        # decode step (which addresses the cache's tensors) is replayed, not captured again
        return tensor.copy_(rows)
    return rows


def _capacity(rows: int) -> int:
    """Storage rows of a growing buffer holding `rows`: the power of two at or above it (0 for none)."""
    return 0 if rows <= 0 else 1 << (rows - 1).bit_length()


class DeepseekV41StorageEpoch:
    """A counter shared by one cache's layers, advanced whenever one of its state tensors is
    allocated or replaced (never when one is written in place). A captured decode step addresses
    the cache's tensors: it stays valid while the epoch it was captured at is the current one."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def advance(self) -> None:
        self.value += 1


def _new_state_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, fill: float) -> torch.Tensor:
    # an ordinary tensor even under torch.inference_mode(): a later step outside it writes in place
    with torch.inference_mode(False):
        return torch.full(shape, fill, dtype=dtype, device=device)


class DeepseekV41RowBuffer:
    """Rows ``[B, n, D]`` appended along dim 1, zeros past the rows written.

    A static buffer (`fixed_capacity`, a cache made with ``max_cache_len``) holds its capacity from
    the start and never moves; a growing one holds a power of two rows and doubles (a new storage)
    as it grows. `length` is the number of rows of the longest batch row; with left padding a
    shorter batch row holds zeros past its own end (nothing reads them).

    Args:
        storage: the zero-filled ``[B, capacity, D]`` storage.
        allocate: ``allocate(shape)`` -> a new zero-filled storage of the same dtype and device
            (growing buffers only).
        fixed_capacity: True for a static buffer.
    """

    def __init__(self, storage: torch.Tensor, allocate=None, fixed_capacity: bool = False):
        self._data = storage
        self._allocate = allocate
        self.fixed_capacity = fixed_capacity
        self.length = 0
        self.ratio = 1  # positions per row (set by the layer cache that made it)

    @property
    def capacity(self) -> int:
        return self._data.size(1)

    def _grow(self, end: int) -> None:
        if end <= self._data.size(1):
            return
        if self.fixed_capacity or self._allocate is None:
            raise DeepseekV41CacheError(
                f"the cache's rows are full: {end} rows needed, {self._data.size(1)} held (a cache made with "
                "max_cache_len holds that many positions; make it longer)"
            )
        grown = self._allocate((self._data.size(0), _capacity(max(end, 2 * self._data.size(1))), self._data.size(2)))
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
        """Make room for `capacity` rows (a growing buffer moves when it grows).

        Raises:
            DeepseekV41CacheError: a static buffer holding fewer rows.
        """
        self._grow(capacity)

    def storage(self, n: int | None = None) -> torch.Tensor:
        """The first `n` rows of the storage (all of it by default), written or not: a decode step
        reads a fixed width and masks the rows past each batch row's visible ones."""
        if n is not None and n > self._data.size(1):
            raise DeepseekV41AttentionError(f"asked for {n} storage rows, the capacity is {self._data.size(1)}")
        return self._data if n is None else self._data[:, :n]

    def write_rows_at(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows[b, 0]`` at the storage row ``index[b]`` of every batch row b (int64 ``[B]``
        on the device; rows ``[B, 1, D]``): no host synchronisation, a captured step may hold it.
        `length` is the caller's to advance (it knows the step's positions on the host)."""
        target = index.view(-1, 1, 1).expand(-1, 1, self._data.size(2))
        self._data.scatter_(1, target, rows.to(self._data.dtype))

    def select_rows(self, index: torch.Tensor) -> bool:
        """Keep (and reorder) the batch rows `index` (int ``[n]``) of the storage (beam search,
        batch selection); see :func:`select_batch_rows`. Returns whether the storage moved."""
        old = self._data
        self._data = select_batch_rows(self._data, index)
        return self._data is not old

    @property
    def device(self) -> torch.device:
        return self._data.device


__all__ = ["DeepseekV41RowBuffer", "DeepseekV41StorageEpoch", "select_batch_rows"]
