"""CUDA graphs for one-token decode steps.

A decode step of one decoder layer launches a few hundred small kernels; eagerly, the host's launch
cost (not the GPU) sets its time. `DeepseekV41DecoderLayer.decode_step` therefore replays steps
from CUDA graphs, in one of two ways:

- the whole step in one graph (the usual case: fast numerics, no left padding). The attention
  reads and writes its caches in place at addresses that stay fixed between steps (buffers with
  a reserved capacity), and the step's position arrives as a device tensor; a graph is captured
  per cache layout (buffer addresses and the capacity bucket read), so a new one is needed only
  when a buffer grows or a new cache is allocated at other addresses;
- "piecewise" (left-padded batches, and the first steps before a compressed buffer exists): the
  fixed-shape head (mHC mixes, norms, projections) and tail (output projection, MoE) replayed, the
  cache-dependent middle of the attention run eagerly.

With `DeepseekV41Transformer.decode_layer_runs` (off by default), :func:`decode_layers` goes
further: the steps of consecutive layers on one GPU replay as one graph (one launch per run of
layers), all planned on the host first.

:class:`GraphedSegment` captures a function of tensors, once per input signature (and layout key),
into a graph and replays it: the arguments are copied into the graph's static inputs, the graph is
replayed, and the outputs are returned, as fresh tensors (clones) when the caller may keep them
past the segment's next replay. The decode graphs of every layer (of every model) on one GPU share one
memory pool: safe because they replay one after another on one stream, and because what a graph
hands on past other graphs' replays (a layer's top-k indices, read layers later) is copied into
buffers outside the pool (`clone_first`); decoding two models
concurrently from several threads or streams is not supported with graphs on (set
`decode_cuda_graphs = False` on their layers).

This file holds all of that machinery: :class:`GraphedSegment`, the per-device memory pools and
position tensors, the decisions whether a layer's step may replay (:func:`graphs_apply`,
:func:`submodules_hooked`, :func:`call_wrapped`, :func:`offloaded`), the segments a layer keeps
(:func:`layer_segment`) and the runs of layers (:func:`decode_layers`). The step functions the
graphs capture are the decoder layer's own (`decode_whole`, `decode_head`, `decode_tail`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from .attention_deepseek_v41_vl import DecodePlan
from .attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError


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
_DECODE_POSITIONS: dict = {}


def decode_position(device: torch.device, start_pos: int) -> torch.Tensor:
    """The position of a one-token step as int64 ``[1]`` on `device`, in one tensor per device
    rewritten in place at each step: the decode graphs read it where it is (no copy per layer).
    Like the shared graph pool, this assumes one decoding stream per device."""
    device = torch.device(device)
    pos = _DECODE_POSITIONS.get(device)
    if pos is None:
        # a normal tensor even when first asked for under torch.inference_mode(): an inference
        # tensor could not be rewritten by later steps outside it
        with torch.inference_mode(False):
            pos = _DECODE_POSITIONS[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return pos.fill_(start_pos)


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


def layer_segment(layer, name, device: torch.device, run: list | None = None) -> GraphedSegment:
    """The graphed segment `name` of decoder `layer` ("whole", "head", "tail", or ("run", ids) for a
    run of layers starting at it: `run` its layers), made on first use and kept on the layer
    (dropped when its weights move)."""
    if layer._decode_segments is None:
        layer._decode_segments = {}
    if name not in layer._decode_segments and run is not None:
        # a run of layers starting here (`decode_layers`): any layer's weights moving drops it
        layer._decode_segments[name] = GraphedSegment(
            _run_step,
            graph_pool(device),
            lambda: tuple(member.graph_owner_key() for member in run),
            clone_first=2,
            borrowed=(2,),
        )
    if name not in layer._decode_segments:
        pool = graph_pool(device)
        layer._decode_segments[name] = {
            # the step's output rows go to the caller; the hand-downs are read within the step
            # the position tensor is the same storage at every step (`decode_position`)
            "whole": lambda: GraphedSegment(
                layer.decode_whole, pool, layer.graph_owner_key, clone_first=2, borrowed=(2,)
            ),
            # the head's outputs are consumed within the step; the tail's go to the caller
            "head": lambda: GraphedSegment(layer.decode_head, pool, layer.graph_owner_key, clone_outputs=False),
            # the tail reads the head's x, freqs and mixes in place (no copies)
            "tail": lambda: GraphedSegment(
                layer.decode_tail, pool, layer.graph_owner_key, clone_outputs=True, borrowed=(1, 2, 3, 4, 5)
            ),
        }[name]()
    return layer._decode_segments[name]

def submodules_hooked(layer) -> bool:
    """Whether forward hooks watch a submodule of decoder `layer` (`capture_intermediates`, a user's hook). Then
    decode steps take the plain forward, which calls every submodule as a module: a graph
    replay, or the step's own function, would skip them."""
    modules = layer.__dict__.get("_hook_watch")
    if modules is None:
        # not the routed experts (~1500 modules at release width, too many to scan at every
        # step): the steps that skip module calls run them in the expert kernels, as the
        # plain forward does then, so hooks on them fire in neither; an eager step calls
        # them as modules, as the plain forward does
        experts = {id(m) for m in layer.ffn.experts.modules()}
        modules = layer.__dict__["_hook_watch"] = [m for m in layer.modules() if id(m) not in experts][1:]
    if _global_forward_hooks or _global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)

def call_wrapped(layer) -> bool:
    """Whether calling decoder `layer` does more than its forward: its own hooks, `compile()`, a
    replaced `forward`, or accelerate weights swapped in around each call. A run of layers
    (`decode_layers`) does not call the layer, so such a layer steps alone. accelerate's hook
    that only moves the inputs to the layer's GPU is no obstacle: a run moves them."""
    if layer._forward_hooks or layer._forward_pre_hooks or getattr(layer, "_compiled_call_impl", None) is not None:
        return True
    if getattr(layer, "_hf_hook", None) is None:
        return "forward" in layer.__dict__
    return offloaded(layer)

def offloaded(layer) -> bool:
    """Whether accelerate swaps decoder `layer`'s weights in and out around each call (offload)."""
    hook = getattr(layer, "_hf_hook", None)
    hooks = getattr(hook, "hooks", [hook]) if hook is not None else []
    return any(getattr(h, "offload", False) for h in hooks)

def graphs_apply(layer, batch: int, device: torch.device, state: DeepseekV41AttentionState) -> bool:
    """Whether decoder `layer`'s one-token step of `batch` rows on `device` replays from CUDA
    graphs: its `decode_cuda_graphs` switch, CUDA, fast numerics, no autograd, not inside a
    compile or another capture, an MoE path without host synchronisation, no offload."""
    if not (layer.decode_cuda_graphs and device.type == "cuda" and state.start_pos > 0):
        return False
    if layer.attn.numerics.exact or torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    if not layer.ffn.runs_without_host_sync(batch, device):
        return False  # e.g. a batch past the expert kernels' size: the MoE reads counts on the host
    # accelerate's offloading hooks swap the weights in and out around each forward: a graph
    # would keep reading the addresses of the first load
    return not offloaded(layer)

def run_plan(layer, batch: int, state: DeepseekV41AttentionState, graphs: bool) -> DecodePlan | None:
    """Decoder `layer`'s plan (:meth:`DeepseekV41Attention.decode_plan`) when its one-token step can
    join a run of layers replayed as one (:func:`decode_layers`), else None: Engram layers,
    hooked submodules, exact numerics, left padding, a cache not ready for the fixed-shape step,
    and with `graphs` whatever keeps its `block` from replaying the step on CUDA."""
    if layer.engram is not None or layer.attn.numerics.exact:
        return None
    if state.start_pos == 0 or torch.is_grad_enabled() or submodules_hooked(layer) or call_wrapped(layer):
        return None
    device = layer.weight_device
    if graphs and not (
        graphs_apply(layer, batch, device, state) and layer.attn.sparse_attention_graph_safe(device)
    ):
        return None
    return layer.attn.decode_plan(state, batch)


class _PendingHandDown:
    """Stands in the attention state for a hand-down (top-k indices, candidate blocks) of a layer
    planned into a run that has not been replayed yet: later layers' plans only ask whether it
    exists; the run's replay puts the tensor there."""

    def __repr__(self) -> str:
        return "<hand-down of a pending run>"


_PENDING = _PendingHandDown()


def _run_step(context, x, pre_mix_in, pos, image_mask, *outside):
    """The one-token steps of a run of layers, one after another (the function a run's graph
    captures). `context` = ``(entries, cache, outside_keys)``: ``(layer, plan)`` pairs, the
    attention cache, and what each of `outside` is (an index source's layer id, or "blocks" for
    the candidate blocks) for hand-downs made before the run. Returns ``(x, f_pre, *topk of the
    run's index sources in order, candidate blocks made in the run or None)``."""
    entries, cache, outside_keys = context
    handed = dict(zip(outside_keys, outside))
    made, blocks_made = [], None
    for layer, plan in entries:
        attn = layer.attn
        topk = handed[attn.index_source] if attn.ratio and not attn.is_index_source else None
        blocks = handed["blocks"] if attn.indexer is not None and attn.indexer.uses_candidates else None
        x, pre_mix_in, topk, blocks = layer.decode_whole((plan, cache), x, pre_mix_in, pos, image_mask, topk, blocks)
        if topk is not None:
            handed[layer.layer_idx] = topk
            made.append(topk)
        if blocks is not None:
            handed["blocks"] = blocks_made = blocks
    return (x, pre_mix_in, *made, blocks_made)


def _replay_run(entries, x, pre_mix_in, state: DeepseekV41AttentionState, image_mask, graphs: bool):
    """Run the planned `entries` (their plans already committed on the host) as one step: on one
    CUDA graph with `graphs`, else eagerly. Puts the run's hand-downs in `state`."""
    device = entries[0][0].weight_device
    x, pre_mix_in = x.to(device), pre_mix_in.to(device)
    image_mask = image_mask.to(device) if image_mask is not None else None
    pos = state.step_table(("decode_pos", device), lambda: decode_position(device, state.start_pos))
    inside, outside_keys = set(), []  # hand-downs made in the run so far; those it reads from before it
    for layer, _ in entries:
        attn, indexer = layer.attn, layer.attn.indexer
        wants = []
        if attn.ratio and not attn.is_index_source:
            wants.append(attn.index_source)
        if indexer is not None and indexer.uses_candidates:
            wants.append("blocks")
        outside_keys += [k for k in wants if k not in inside and k not in outside_keys]
        if attn.ratio and attn.is_index_source:
            inside.add(layer.layer_idx)
        if indexer is not None and indexer.is_candidate_source:
            inside.add("blocks")
    outside = [(state.candidate_blocks if k == "blocks" else state.topk_idxs[k]).to(device) for k in outside_keys]
    context = (entries, state.cache, tuple(outside_keys))
    args = (x, pre_mix_in, pos, image_mask, *outside)
    if graphs:
        ids = tuple(layer.layer_idx for layer, _ in entries)
        run = [layer for layer, _ in entries]
        segment = layer_segment(entries[0][0], ("run", ids), device, run)
        key = (tuple(outside_keys), *(plan.key for _, plan in entries))
        out = segment(*args, key=key, context=context)
    else:
        out = _run_step(context, *args)
    x, pre_mix_in, *made, blocks = out
    sources = [layer.layer_idx for layer, _ in entries if layer.attn.ratio and layer.attn.is_index_source]
    for layer_id, topk in zip(sources, made, strict=True):
        state.topk_idxs[layer_id] = topk
    if blocks is not None:
        state.candidate_blocks = blocks
    return x, pre_mix_in


def decode_layers(
    layers: Sequence,
    x: torch.Tensor,
    pre_mix_in: torch.Tensor,
    state: DeepseekV41AttentionState,
    image_mask: torch.Tensor | None = None,
    engram_hash_ids: torch.Tensor | None = None,
    engram_mask: torch.Tensor | None = None,
    graphs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token decode step through consecutive decoder `layers`, with each run of layers that
    share a device replayed from one CUDA graph: one launch for the run instead of one per layer,
    so the host's work per layer is only its plan (:func:`run_plan`).

    A layer that cannot join a run (an Engram layer, hooks on it or its submodules, a cache not
    ready for the fixed-shape step, graphs off for it: see :func:`run_plan`) ends the run before it and
    takes its own call (``layer(...)``, which may still replay its own graphs). The values are
    those of calling the layers one by one, bit for bit: a run executes each layer's
    `decode_whole` in order, handing top-k indices and candidate blocks from layer to layer
    inside the graph. A run that fails (an out-of-memory error at its capture, say) puts back the
    host bookkeeping of its layers before the error propagates: the cache is left as layer-by-layer
    steps failing at that layer would leave it.

    Args:
        layers: consecutive decoder layers (a model's `layers`, or a slice of them).
        x: bf16 ``[B, 1, hc, D]``; pre_mix_in: fp32 ``[B, 1, hc]``.
        state: the step's attention state (``start_pos > 0``).
        image_mask, engram_hash_ids, engram_mask: as `DeepseekV41DecoderLayer.forward`.
        graphs: replay runs from CUDA graphs (False: run them eagerly, the same computation;
            tests compare the two on the CPU).

    Returns:
        ``(x, f_pre)`` of the last layer, on its device.

    Raises:
        DeepseekV41ModelError: not one token per row, or position 0.
    """
    if x.dim() != 4 or x.size(1) != 1:
        raise DeepseekV41ModelError(f"decode_layers takes one token per row, x [B, 1, hc, D]; got {tuple(x.shape)}")
    if state.start_pos == 0:
        raise DeepseekV41ModelError("decode_layers follows a prefill: state.start_pos is 0")
    batch, pending, undo = x.size(0), [], []
    try:
        for layer in layers:
            plan = run_plan(layer, batch, state, graphs)
            if pending and (plan is None or layer.weight_device != pending[0][0].weight_device):
                x, pre_mix_in = _replay_run(pending, x, pre_mix_in, state, image_mask, graphs)
                pending, undo = [], []
            if plan is None:
                x, pre_mix_in = layer(x, pre_mix_in, state, image_mask, engram_hash_ids, engram_mask)
                continue
            # the host bookkeeping now: the next layers' plans read it (row counts, the publisher)
            undo.append(_commit_undo(layer, state))
            layer.attn.decode_commit(plan, state, None, None)
            if layer.attn.ratio and layer.attn.is_index_source:
                state.topk_idxs[layer.layer_idx] = _PENDING
            if layer.attn.indexer is not None and layer.attn.indexer.is_candidate_source:
                state.candidate_blocks = _PENDING
            pending.append((layer, plan))
        if pending:
            x, pre_mix_in = _replay_run(pending, x, pre_mix_in, state, image_mask, graphs)
    except BaseException:
        # a run that did not complete (out of memory at its capture, say): its layers' bookkeeping
        # is put back, so the cache holds what the layers before it wrote, as layer-by-layer steps
        # would leave it
        for restore in reversed(undo):
            restore()
        raise
    return x, pre_mix_in


_MISSING = object()


def _commit_undo(layer, state: DeepseekV41AttentionState):
    """A function that puts back what this layer's `decode_commit` and pending hand-downs change
    on the host: its buffers' row counts, the index-key publisher, the state's hand-downs."""
    cache = state.cache
    own = cache.layer(layer.layer_idx)
    lengths = [(buffer, buffer.length) for buffer in (own.compressed_kv, own.index_k) if buffer is not None]
    publisher = (cache.index_k_publisher, cache.index_k_publisher_rows)
    topk, blocks = state.topk_idxs.get(layer.layer_idx, _MISSING), state.candidate_blocks

    def restore() -> None:
        for buffer, length in lengths:
            buffer.length = length
        cache.index_k_publisher, cache.index_k_publisher_rows = publisher
        if topk is _MISSING:
            state.topk_idxs.pop(layer.layer_idx, None)
        else:
            state.topk_idxs[layer.layer_idx] = topk
        state.candidate_blocks = blocks

    return restore


__all__ = [
    "GraphedSegment",
    "call_wrapped",
    "decode_layers",
    "decode_position",
    "graph_pool",
    "graphs_apply",
    "layer_segment",
    "offloaded",
    "run_plan",
    "submodules_hooked",
]
