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
that held it was collected) and no view of its storage. Free tensors beyond
:data:`POOL_FREE_BYTES` are released, least recently used first; :func:`clear_buffer_pool`
releases every free one (their graphs are then captured again on next use).

Buffers are ordinary tensors even when taken under `torch.inference_mode()` (a later step outside
it writes them in place), and the pool is bypassed while autograd records (a buffer saved for a
backward pass must not be handed to another cache) and off CUDA (no graphs there).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch

# free pooled bytes kept for later caches; the rest goes back to torch's allocator
POOL_FREE_BYTES = 4 << 30
# `sys.getrefcount` of a pooled tensor that only the pool holds, as `_free` sees it: its list
# entry, the local name and the call's argument
_FREE_REFS = 3
# `torch._C._storage_Use_Count` of its storage then: the tensor and the temporary storage object
_FREE_STORAGE_USES = 2


class DeepseekV41BufferPool:
    """Tensors kept by (role, shape, dtype, device), handed out again once free (module docstring).

    Args:
        max_free_bytes: free bytes kept; past it the least recently used free tensors are released.
    """

    def __init__(self, max_free_bytes: int = POOL_FREE_BYTES):
        self.max_free_bytes = max_free_bytes
        self._tensors: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()

    def take(self, role: tuple, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of `shape` / `dtype` on `device` for `role` (uninitialised: the caller fills
        it): a free pooled one if there is one, else a new one, kept by the pool."""
        key = (role, tuple(shape), dtype, torch.device(device))
        entries = self._tensors.get(key)
        if entries is not None:
            self._tensors.move_to_end(key)
            for index in range(len(entries)):
                if _free(entries, index):
                    return entries[index]
        with torch.inference_mode(False):  # writable outside inference mode later
            tensor = torch.empty(shape, dtype=dtype, device=device)
        self._tensors.setdefault(key, []).append(tensor)
        self._release(self.max_free_bytes)
        return tensor

    def free_bytes(self) -> int:
        """Bytes of the pooled tensors that are free now."""
        return sum(entries[i].nbytes for entries in self._tensors.values() for i in range(len(entries)) if _free(entries, i))

    def clear(self) -> None:
        """Release every free tensor (tensors in use stay pooled)."""
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
    tensor = entries[index]
    return (
        sys.getrefcount(tensor) <= _FREE_REFS
        and torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= _FREE_STORAGE_USES
    )


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
    if role is None or device.type != "cuda" or torch.is_grad_enabled():
        return torch.full(shape, fill, dtype=dtype, device=device)
    return _POOL.take(role, shape, dtype, device).fill_(fill)


def clear_buffer_pool() -> None:
    """Release the free pooled cache buffers to torch's allocator (e.g. before
    `torch.cuda.empty_cache()`); decode graphs captured for them are captured again on next use."""
    _POOL.clear()


__all__ = ["DeepseekV41BufferPool", "POOL_FREE_BYTES", "cache_buffer", "clear_buffer_pool"]
