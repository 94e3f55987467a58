"""Cache storage that outlives one cache on CUDA, so that decode graphs are replayed, not recaptured.

A layer's decode step is captured in a CUDA graph per cache layout: the addresses of the buffers
it reads and writes in place (the window ring, the compressor's partial group, the compressed KV
and index-key rows at a capacity bucket) are part of the graph's key
(`attention_deepseek_v41_vl.py: DeepseekV41Attention.decode_plan`). A new cache (every
`generate()` call makes one) would allocate new buffers at new addresses, and its first steps
would capture the whole model's graphs again (~10 ms per layer). Instead, on CUDA every cache
buffer is taken from this pool, keyed by its role (layer and kind), shape, dtype and device: a
cache of the same batch size and capacity bucket gets back the very buffers an earlier cache
used, once that cache is gone, and the graphs captured for them replay.

A pooled tensor is free when nothing but the pool refers to it: no Python reference (the cache
that held it is gone: caches hold no reference cycle, so they die when their last reference
does) and no view of its storage. Free tensors beyond :data:`POOL_FREE_BYTES` are released, least
recently used first, and all of them when an allocation runs out of memory;
:func:`clear_buffer_pool` releases every free one (their graphs are then captured again on next
use). Like the decode graphs, the pool assumes one decoding stream per device: a buffer is handed
on without waiting for work another stream may still have queued on it.

Buffers are ordinary tensors even when taken under `torch.inference_mode()` (a later step outside
it writes them in place), and the pool is bypassed while autograd records (a buffer saved for a
backward pass must not be handed to another cache) and off CUDA (no graphs there).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import torch

# free pooled bytes kept for later caches; the rest goes back to torch's allocator
POOL_FREE_BYTES = 4 << 30


def _holders(entries: list[torch.Tensor], index: int) -> tuple[int, int]:
    # (Python references to the tensor, uses of its storage: the tensor, its views and the
    # temporary storage object), counted the same way for the baseline and for every check
    tensor = entries[index]
    return sys.getrefcount(tensor), _storage_uses(tensor.untyped_storage()._cdata)


_storage_uses = getattr(torch._C, "_storage_Use_Count", None)
# what `_holders` reads for a tensor only the pool's list holds, measured on this interpreter
# (reference counts differ between Python versions); None: the pool is off (no use count)
_ONLY_POOLED = None if _storage_uses is None else _holders([torch.empty(1)], 0)


class DeepseekV41BufferPool:
    """Tensors kept by (role, shape, dtype, device), handed out again once free (module docstring).

    Args:
        max_free_bytes: free bytes kept; past it the least recently used free tensors are released.
    """

    def __init__(self, max_free_bytes: int = POOL_FREE_BYTES):
        self.max_free_bytes = max_free_bytes
        self._tensors: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # a free tensor is handed to one taker only

    def take(self, role: tuple, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape` / `dtype` on `device` for `role` (uninitialised: the caller fills
        it): a free pooled one if there is one, else a new one, kept by the pool. Out of memory,
        the free pooled tensors are released and the allocation tried once more.

        Raises:
            torch.OutOfMemoryError: the allocation fails with no free pooled tensor left.
        """
        key = (role, tuple(shape), dtype, torch.device(device))
        with self._lock:
            entries = self._tensors.get(key)
            if entries is not None:
                self._tensors.move_to_end(key)
                for index in range(len(entries)):
                    if _free(entries, index):
                        return entries[index]
            try:
                tensor = _allocate(shape, dtype, device)
            except torch.OutOfMemoryError:
                self._release(0)
                tensor = _allocate(shape, dtype, device)
            self._tensors.setdefault(key, []).append(tensor)
            self._release(self.max_free_bytes)
            return tensor

    def free_bytes(self) -> int:
        """Bytes of the pooled tensors that are free now."""
        return sum(entries[i].nbytes for entries in self._tensors.values() for i in range(len(entries)) if _free(entries, i))

    def clear(self) -> None:
        """Release every free tensor (tensors in use stay pooled)."""
        with self._lock:
            self._release(0)

    def _release(self, keep_bytes: int) -> None:
        kept = 0
        for key in reversed(list(self._tensors)):  # most recently used first
            entries = self._tensors[key]
            for index in reversed(range(len(entries))):
                if not _free(entries, index):
                    continue
                if kept + entries[index].nbytes <= keep_bytes:
                    kept += entries[index].nbytes
                else:
                    del entries[index]
            if not entries:
                del self._tensors[key]


def _free(entries: list[torch.Tensor], index: int) -> bool:
    # only the pool refers to the tensor, and no view to its storage
    holders = _holders(entries, index)
    return holders[0] <= _ONLY_POOLED[0] and holders[1] <= _ONLY_POOLED[1]


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # writable outside inference mode later
        return torch.empty(shape, dtype=dtype, device=device)


_POOL = DeepseekV41BufferPool()


def cache_buffer(role: tuple | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 fill: float) -> torch.Tensor:
    """A cache buffer filled with `fill`: from the pool on CUDA (`role` given, autograd not
    recording), else a new tensor.

    Args:
        role: what the buffer is, e.g. ``(layer_id, "window_kv")``; None: not pooled.
        shape, dtype, device: the tensor's.
        fill: its initial value (0 for rows and rings, -inf for compressor scores).
    """
    device = torch.device(device)
    # while autograd records, a buffer may be saved for a backward pass: it must not pass to
    # another cache, so it is not pooled
    if role is None or device.type != "cuda" or torch.is_grad_enabled() or _ONLY_POOLED is None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    return _POOL.take(role, shape, dtype, device).fill_(fill)


def clear_buffer_pool() -> None:
    """Release the free pooled cache buffers to torch's allocator (e.g. before
    `torch.cuda.empty_cache()`); decode graphs captured for them are captured again on next use."""
    _POOL.clear()


__all__ = ["DeepseekV41BufferPool", "POOL_FREE_BYTES", "cache_buffer", "clear_buffer_pool"]
