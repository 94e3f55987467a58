"""CUDA graphs: a function of tensors captured once per input signature and replayed.

:class:`GraphedSegment` captures a function of tensors, once per input signature (and layout key),
into a graph and replays it: the arguments are copied into the graph's static inputs, the graph is
replayed, and the outputs are returned, as fresh tensors (clones) when the caller may keep them
past the segment's next replay. :func:`graph_pool` gives one memory pool per device, shared by
graphs that replay one after another on one stream. :class:`SideStream` runs work beside the
current stream (a branch of the graph when captured), :func:`in_line` the same call in line.

This file knows tensors and callables only: what is captured, and when a capture is replayed,
is the decode runner's (`decode_step_deepseek_v41_vl.py`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Callable

import torch


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _device_index(device) -> int:
    """The index of a CUDA device (``"cuda"`` alone: the current one)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device, reused by every capture on it. It must be on the device of
    the captured work: torch.cuda.graph's default capture stream is created once, on whichever
    device was current then, and capturing on it switches to that device (the kernels of a layer
    on GPU 1 would be captured on GPU 0)."""
    index = _device_index(device)
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


class GraphedSegment:
    """Replay `fn` from CUDA graphs captured per input signature and layout key.

    Args:
        fn: ``fn(context, *args)``, a function of tensors (and None) returning a tuple of tensors
            (or None); it must have no host synchronisation, no shape that depends on tensor
            values, and no side effect that a second run of the same inputs would change (the
            capture runs it once eagerly first, then the replay runs it again).
        pool: a graph memory pool handle (`torch.cuda.graph_pool_handle()`) shared with other
            segments, or None for a private one.
        max_graphs: graphs kept, least recently used dropped first (each holds its own
            intermediates in the pool).

    Every call copies its arguments into the graph's static inputs, replays the graph and returns
    clones of the outputs (the next replay rewrites the graph's own).
    """

    def __init__(self, fn: Callable, pool=None, max_graphs: int = 4):
        self.fn = fn
        self.pool = pool
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list, tuple]] = OrderedDict()
        self.captures = 0  # graphs captured so far (kept or dropped)

    @staticmethod
    def _signature(args) -> tuple:
        return tuple(
            None if a is None else (tuple(a.shape), a.dtype, a.device, a.stride()) for a in args
        )

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, args, context) -> tuple[torch.cuda.CUDAGraph, list, tuple]:
        # the graph's own input buffers are normal tensors even when the capture runs under
        # torch.inference_mode(): later replays outside it (generate() runs under no_grad) copy
        # into them, which an inference tensor refuses
        with torch.inference_mode(False):
            inputs = [None if a is None else a.clone() for a in args]
        stream = torch.cuda.Stream(device=next(a for a in args if a is not None).device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm-up outside the capture: Triton compiles and autotunes, lazy tables and cuBLAS
            # handles are created here, not inside the graph
            self.fn(context, *inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's eager work meanwhile (a prefill) neither fails nor
        # invalidates this capture
        with torch.cuda.graph(graph, pool=self.pool, stream=_capture_stream(stream.device), capture_error_mode="thread_local"):
            outputs = self.fn(context, *inputs)
        return graph, inputs, outputs

    def __call__(self, *args, key: tuple = (), context=None) -> tuple:
        """Replay (capturing first if needed) for these arguments.

        Args:
            key: hashable layout the graph depends on besides the arguments' signatures (the
                storage of what it reads and writes in place, the weights' version, ...).
            context: passed as ``fn(context, *args)``; read only when capturing, so everything
                of it the graph depends on must be in `key`.

        Raises:
            ValueError: no tensor argument.
        """
        tensors = [a for a in args if a is not None]
        if not tensors:
            raise ValueError("GraphedSegment needs at least one tensor argument")
        device = tensors[0].device
        # one replay at a time per device: the graphs share a memory pool, so another thread's
        # replay between this one and its output clones would overwrite the outputs
        with _replay_lock(device), torch.cuda.device(device):
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
                if static is not None:
                    static.copy_(a)
            graph.replay()
            return tuple(None if o is None else o.clone() for o in outputs)


class Joined:
    """A value computed in line: :meth:`join` returns it (what :func:`in_line` gives)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def join(self):
        return self.value


class _Beside(Joined):
    # the value of work enqueued on a side stream: join() makes the main stream wait for the event
    # recorded after that work (not for later work on the same stream); until then it holds the
    # work's arguments, so that no tensor the side stream still reads goes back to the main
    # stream's allocator and is rewritten meanwhile
    __slots__ = ("_main", "_done", "_args")

    def __init__(self, value, main: torch.cuda.Stream, done: torch.cuda.Event, args: tuple):
        super().__init__(value)
        self._main, self._done, self._args = main, done, args

    def join(self):
        if self._done is not None:
            self._main.wait_event(self._done)
            self._done = self._args = None
        return self.value


def in_line(fn: Callable, *args) -> Joined:
    """``fn(*args)`` now, as a :class:`Joined` (the `aside` of eager decode steps and of the layer path)."""
    return Joined(fn(*args))


class SideStream:
    """Work beside the current stream: ``side(fn, *args)`` enqueues ``fn(*args)`` on one of `lanes`
    streams of the device (in turn) once the current stream's work so far is done, and returns a
    handle whose ``join()`` makes the current stream wait for that work (an event recorded after
    it) and gives ``fn``'s result. Two works handed over one after the other run at once, each
    beside the current stream. Captured into a CUDA graph, each work is a parallel branch of it
    (forked and joined by events).

    Why no tensor is reused while another stream still reads it (eagerly and in a capture, whose
    private pool keeps per-stream free lists too), given these rules:

    - a lane's work is enqueued only here, right after the lane waits for the current stream: a
      block freed to the lane's allocator before that (a result of earlier work, read by the
      current stream) has every read of it enqueued before, so ordered before any reuse;
    - `fn` reaches tensors of the current stream only through `args` (or through long-lived
      tensors: weights, caches, a step's tables built before the fork), and the handle keeps
      `args` alive until the join, after which the current stream is ordered after `fn`;
    - the current stream neither writes what `fn` reads nor reads what `fn` writes before the
      join.

    Every handle must be joined before the current stream's capture ends, and a caller that may
    raise between a fork and its join calls :meth:`join_all` on the way out (`fn` must not
    synchronise with the host).
    """

    def __init__(self, device: torch.device, lanes: int = 2):
        self._lanes = [torch.cuda.Stream(device=device) for _ in range(lanes)]
        self._next = 0
        self._pending: list[_Beside] = []

    def __call__(self, fn: Callable, *args) -> Joined:
        lane = self._lanes[self._next]
        self._next = (self._next + 1) % len(self._lanes)
        main = torch.cuda.current_stream(lane.device)
        lane.wait_stream(main)
        handle = _Beside(None, main, torch.cuda.Event(), args)
        self._pending = [h for h in self._pending if h._done is not None] + [handle]
        try:
            with torch.cuda.stream(lane):
                handle.value = fn(*args)
        except BaseException:
            # what `fn` enqueued before raising is joined by join_all too; a capture that `fn`
            # broke may refuse the event, and `fn`'s error is the one to raise
            with contextlib.suppress(RuntimeError):
                handle._done.record(lane)
            raise
        handle._done.record(lane)
        return handle

    def join_all(self) -> None:
        """Join every handle not joined yet (the current stream then waits for all the work)."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.join()


_SIDE_STREAMS: dict[int, SideStream] = {}


def side_stream(device: torch.device) -> SideStream:
    """The :class:`SideStream` of `device` for the functions `GraphedSegment` captures (their
    warm-up and their capture). One per device: those run one at a time per device (under the
    replay lock), and nothing else enqueues on its lanes, so a capture never takes other work,
    and the per-stream state of its lanes (the quantized linears' split-K counters) is used by
    those warm-ups and the graphs' replays alone, one after another. Made right after the capture
    stream, so that its lanes are other streams of torch's pool than that one (the pool hands out
    its streams in turn: a lane that were the capture stream would serialise the work, not break
    it)."""
    index = _device_index(device)
    with _LOCKS_GUARD:
        if index not in _SIDE_STREAMS:
            _capture_stream(torch.device("cuda", index))
            _SIDE_STREAMS[index] = SideStream(torch.device("cuda", index))
        return _SIDE_STREAMS[index]


_GRAPH_POOLS: dict = {}
_REPLAY_LOCKS: dict = {}
_LOCKS_GUARD = threading.Lock()


def _replay_lock(device: torch.device) -> threading.RLock:
    """One lock per device: a replay and its output clones happen together (one stream assumed)."""
    with _LOCKS_GUARD:
        return _REPLAY_LOCKS.setdefault(torch.device(device).index, threading.RLock())


def graph_pool(device: torch.device):
    """One CUDA-graph memory pool per device, shared by the captured decode steps of every cache
    and model (they replay one after another on one stream, so their intermediates may share
    memory; each step's outputs are cloned out of the pool)."""
    key = _device_index(device)
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


__all__ = ["GraphedSegment", "Joined", "SideStream", "graph_pool", "in_line", "side_stream"]
