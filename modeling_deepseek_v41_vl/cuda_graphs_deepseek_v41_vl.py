"""CUDA graphs: a function of tensors captured once per input signature and replayed.

:class:`GraphedSegment` captures a function of tensors, once per input signature (and layout key),
into a graph and replays it: the arguments are copied into the graph's static inputs, the graph is
replayed, and the outputs are returned, as fresh tensors (clones) when the caller may keep them
past the segment's next replay. :func:`graph_pool` gives one memory pool per device, shared by
graphs that replay one after another on one stream.

This file knows tensors and callables only: what is captured, and when a capture is replayed,
is the decode runner's (`decode_step_deepseek_v41_vl.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device, reused by every capture on it. It must be on the device of
    the captured work: torch.cuda.graph's default capture stream is created once, on whichever
    device was current then, and capturing on it switches to that device (the kernels of a layer
    on GPU 1 would be captured on GPU 0)."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


class GraphedSegment:
    """Replay `fn` from CUDA graphs captured per input signature.

    Args:
        fn: a function of tensors (and None) returning a tensor or a tuple of tensors; it must be
            pure (no side effects the graph would not repeat), with no host synchronisation and
            no shape that depends on tensor values.
        pool: a graph memory pool handle (`torch.cuda.graph_pool_handle()`) shared with other
            segments, or None for a private one.
        owner_key: called at every call; its value is part of the cache key, so a change (new
            weights' addresses after `.to()`, other numerics) drops the stale graphs.
        clone_outputs: return clones of the graph's static outputs (which the next replay
            overwrites); False when every output is consumed before that.
        borrowed: positions of arguments that are another graph's static tensors (the same
            storage at every call, e.g. the outputs of the segment before): the capture reads them
            in place, and a call that passes that storage again copies nothing.
        clone_first: with `clone_outputs`, clone only this many leading outputs. The rest are
            copied, inside the graph, into buffers of their own outside the memory pool: they
            stay valid until this segment's next replay of the same graph, whatever other graphs
            of the pool replay meanwhile (a graph's pool memory is another graph's scratch: an
            output left there would be overwritten by the next graph captured over it).
        max_graphs: graphs kept, least recently used dropped first (each holds its own
            intermediates in the pool).
    """

    def __init__(
        self,
        fn: Callable,
        pool=None,
        owner_key: Callable[[], object] | None = None,
        clone_outputs: bool = True,
        borrowed: tuple[int, ...] = (),
        clone_first: int | None = None,
        max_graphs: int = 8,
    ):
        self.fn = fn
        self.clone_outputs = clone_outputs
        self.clone_first = clone_first
        self.borrowed = frozenset(borrowed)
        self.pool = pool
        self.owner_key = owner_key
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list, object]] = OrderedDict()
        self._owner: object = None
        self.captures = 0  # graphs captured so far (kept or dropped)

    @staticmethod
    def _signature(args) -> tuple:
        return tuple(
            None if a is None else (tuple(a.shape), a.dtype, a.device, a.stride()) for a in args
        )

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, args, context) -> tuple[torch.cuda.CUDAGraph, list, object]:
        fn = self.fn if context is None else (lambda *a: self.fn(context, *a))
        # the graph's own input buffers are normal tensors even when the capture runs under
        # torch.inference_mode(): later replays outside it (generate() runs under no_grad) copy
        # into them, which an inference tensor refuses
        with torch.inference_mode(False):
            inputs = [a if (a is None or i in self.borrowed) else a.clone() for i, a in enumerate(args)]
        stream = torch.cuda.Stream(device=next(a for a in args if a is not None).device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm-up outside the capture: Triton compiles and autotunes, lazy tables and cuBLAS
            # handles are created here, not inside the graph. Its side effects on caches are
            # repeated by the replay that follows, which writes the same values again.
            warm = fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        kept = {}
        if self.clone_outputs and self.clone_first is not None and isinstance(warm, tuple):
            with torch.inference_mode(False):
                kept = {i: torch.empty_like(o) for i, o in enumerate(warm) if i >= self.clone_first and o is not None}
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=_capture_stream(stream.device)):
            outputs = fn(*inputs)
            for i, buffer in kept.items():
                buffer.copy_(outputs[i])
        if kept:
            outputs = tuple(kept.get(i, o) for i, o in enumerate(outputs))
        return graph, inputs, outputs

    def __call__(self, *args, key: tuple = (), context=None):
        """Replay (capturing first if needed) for these arguments.

        Args:
            key: hashable layout the graph depends on besides the arguments' signatures (e.g. the
                addresses of cache buffers it reads and writes in place).
            context: passed as ``fn(context, *args)`` when not None; only used when capturing, so
                everything of it the graph depends on must be in `key`.
        """
        tensors = [a for a in args if a is not None]
        if not tensors:
            raise ValueError("GraphedSegment needs at least one tensor argument")
        device = tensors[0].device
        if device.index is not None and device.index != torch.cuda.current_device():
            # a layer placed on another GPU (a device_map): capture and replay on its device
            # and stream
            with torch.cuda.device(device):
                return self._call(args, key, context)
        return self._call(args, key, context)

    def _call(self, args, key, context):
        owner = self.owner_key() if self.owner_key is not None else None
        if owner != self._owner:
            self._graphs.clear()
            self._owner = owner
        key = (self._signature(args), key)
        entry = self._graphs.get(key)
        if entry is None:
            while len(self._graphs) >= self.max_graphs:
                self._graphs.popitem(last=False)
            entry = self._graphs[key] = self._capture(args, context)
            self.captures += 1
        else:
            self._graphs.move_to_end(key)
        graph, inputs, outputs = entry
        for static, a in zip(inputs, args):
            if static is not None and static.data_ptr() != a.data_ptr():
                static.copy_(a)
        graph.replay()
        if not self.clone_outputs:
            return outputs
        if isinstance(outputs, tuple):
            n = len(outputs) if self.clone_first is None else self.clone_first
            return tuple(o.clone() if (i < n and o is not None) else o for i, o in enumerate(outputs))
        return outputs.clone()


_GRAPH_POOLS: dict = {}


def graph_pool(device: torch.device):
    """One CUDA-graph memory pool per device, shared by the decode graphs of every layer (they
    replay one after another on one stream, so their intermediates may share memory)."""
    key = torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device()
    if key not in _GRAPH_POOLS:
        handle = torch.cuda.graph_pool_handle()
        # a pool lives while a graph uses it: once the last one is freed (graphs dropped after
        # `.to()`, or collected when a capture starts), capturing into its handle again fails
        # inside torch. A one-kernel graph kept here keeps the pool alive (so memory the decode
        # graphs held stays reserved in it for the process's life, `empty_cache()` included).
        with torch.cuda.device(key):
            stream = torch.cuda.Stream()
            keeper, scratch = torch.cuda.CUDAGraph(), torch.zeros(1, device=torch.device("cuda", key))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(keeper, pool=handle, stream=stream):
                scratch.add_(1)
            torch.cuda.current_stream().wait_stream(stream)
        _GRAPH_POOLS[key] = (handle, keeper, scratch)
    return _GRAPH_POOLS[key][0]


__all__ = ["GraphedSegment", "graph_pool"]
