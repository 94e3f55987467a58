"""CUDA graphs for the fixed-shape parts of a one-token decode step.

A decode step of one decoder layer launches a few hundred small kernels; eagerly, the host's launch
cost (not the GPU) sets its time. Most of the step has shapes that never change between steps (one
token per row: the mHC mixes, norms, projections, MoE), so it can be captured once in a CUDA graph
and replayed. Only the middle of the attention (ring write, compressor, indexer, sparse attention
over a KV that grows with the sequence) keeps running eagerly. This is the "piecewise" capture
that serving engines use; see :meth:`DeepseekV41DecoderLayer.decode_step`.

:class:`GraphedSegment` captures a pure function of tensors, once per input signature, into a graph
and replays it: the arguments are copied into the graph's static inputs, the graph is replayed,
and the outputs are returned, as fresh tensors (clones) when the caller may keep them past the
segment's next replay. The decode graphs of every layer (of every model) on one GPU share one
memory pool: safe because they replay one after another on one stream; decoding two models
concurrently from several threads or streams is not supported with graphs on (set
`decode_cuda_graphs = False` on their layers).
"""

from __future__ import annotations

from typing import Callable

import torch


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
    """

    def __init__(
        self,
        fn: Callable,
        pool=None,
        owner_key: Callable[[], object] | None = None,
        clone_outputs: bool = True,
        borrowed: tuple[int, ...] = (),
    ):
        self.fn = fn
        self.clone_outputs = clone_outputs
        self.borrowed = frozenset(borrowed)
        self.pool = pool
        self.owner_key = owner_key
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list, object]] = {}
        self._owner: object = None

    @staticmethod
    def _signature(args) -> tuple:
        return tuple(
            None if a is None else (tuple(a.shape), a.dtype, a.device, a.stride()) for a in args
        )

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, args) -> tuple[torch.cuda.CUDAGraph, list, object]:
        inputs = [a if (a is None or i in self.borrowed) else a.clone() for i, a in enumerate(args)]
        stream = torch.cuda.Stream(device=next(a for a in args if a is not None).device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm-up outside the capture: Triton compiles, lazy tables and cuBLAS handles
            # are created here, not inside the graph
            self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*inputs)
        return graph, inputs, outputs

    def __call__(self, *args):
        tensors = [a for a in args if a is not None]
        if not tensors:
            raise ValueError("GraphedSegment needs at least one tensor argument")
        device = tensors[0].device
        if device.index is not None and device.index != torch.cuda.current_device():
            # a layer placed on another GPU (a device_map): capture and replay on its device
            # and stream
            with torch.cuda.device(device):
                return self._call(args)
        return self._call(args)

    def _call(self, args):
        owner = self.owner_key() if self.owner_key is not None else None
        if owner != self._owner:
            self._graphs.clear()
            self._owner = owner
        key = self._signature(args)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(args)
        graph, inputs, outputs = entry
        for static, a in zip(inputs, args):
            if static is not None and static.data_ptr() != a.data_ptr():
                static.copy_(a)
        graph.replay()
        if not self.clone_outputs:
            return outputs
        if isinstance(outputs, tuple):
            return tuple(o.clone() for o in outputs)
        return outputs.clone()


__all__ = ["GraphedSegment"]
