"""The decode engine: one step of the whole model as one function, and the runner that replays it.

A one-token step of every row after a prefill::

    input_ids [B, 1] ─ Engram hash (history [B, n-1] in, out) ─┐
        └─ embed ─ hc copies ─ layer 0 .. L-1 `decode_step` ─ norm ─ head ─► logits fp32 [B, 1, V]
    column [1], pads [B] ─► positions [B] ─► RoPE, ring slot, compressor slot and row per row
    publisher [B] in ─► owners of index keys whose group ends update it ─► publisher out

:func:`decode_model_step` is that function. It reads no host value that changes between steps:
the widths of the compressed rows it reads are fixed for the sequence (a static cache's capacity,
or a power-of-two bucket of a growing one), each row's position arrives on the device, and the
state that a step reads and then replaces (the Engram history, the index-key publisher) goes in
and comes out as tensors, while the caches are written in place at the same addresses at every
step. So one CUDA graph of it serves every step of a sequence.

:class:`DeepseekV41DecodeRunner`, owned by the model, holds every replay decision: it runs the step
eagerly (CPU, a device the graphs cannot serve) or replays its graph (captured once per batch
size, widths, numerics plan and cache storage, kept on the cache it addresses), then does the
host bookkeeping the step leaves (row counts, the publisher, the position). The forward hands it
one-token steps on a cache in fast numerics (`DeepseekV41Transformer.forward`); exact numerics,
forward hooks, autograd and models spread over several devices keep the layer-by-layer forward.

In a CUDA graph each layer runs what its next part does not read on side streams, as branches of
the graph (`DeepseekV41DecodeStep.aside`): the mHC mixes of the block input (projection and
Sinkhorn, a latency chain of small launches) beside the attention, and the FFN's (all of their
projection and Sinkhorn; only the expand the FFN reads stays on the step's stream) beside the
FFN, which read the previous sublayer's mixes instead; the attention's keys (window ring row,
compressed row, index key) beside its queries; the shared expert beside the router and the
routed experts. Run eagerly, the step does that work
in line: the same values, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable

import torch
from torch.nn.modules.module import (
    _global_forward_hooks,
    _global_forward_pre_hooks,
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from .attention_deepseek_v41_vl import decode_rows
from .attention_state_deepseek_v41_vl import DeepseekV41DecodeStep, check_mask_shape, check_same_padding, left_padding_offsets
from .cache_deepseek_v41_vl import DeepseekV41Cache
from .cuda_graphs_deepseek_v41_vl import GraphedSegment, SideStream, graph_pool, in_line, side_stream
from .dspark_deepseek_v41_vl import (
    DeepseekV41DraftCache,
    draft_forward,
    draft_head_modules,
    gather_main_hidden,
    main_hidden_taps,
)
from .exceptions_deepseek_v41_vl import DeepseekV41ModelError
from .hyper_connection_deepseek_v41_vl import identity_pre_mix


def decode_model_step(
    model,
    cache: DeepseekV41Cache,
    widths: dict[int, int],
    input_ids: torch.Tensor,
    column: torch.Tensor,
    pads: torch.Tensor | None,
    publisher: torch.Tensor,
    history: torch.Tensor | None,
    main_hidden: bool = False,
    aside: Callable = in_line,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One decode step of the whole model (`DeepseekV41Transformer`), from device tensors only.

    Args:
        model: the `DeepseekV41Transformer`.
        cache: its filled cache (written in place: window rings, partial groups, compressed rows,
            index keys).
        widths: compress ratio -> compressed rows read (fixed for the sequence).
        input_ids: int64 ``[B, 1]``, the step's tokens (text: decode never emits the image token).
        column: int64 ``[1]``, the padded column of the step (the cache's length).
        pads: int64 ``[B]`` left padding of the rows, or None.
        publisher: int64 ``[B]``, each row's index-key publisher before the step (-1: none).
        history: int64 ``[B, max_ngram_size - 1]`` Engram history, or None without Engram layers.
        main_hidden: also return the draft head's `main_hidden` (`DeepseekV41Transformer.draft`).
        aside: how each layer runs what its next part does not read (`DeepseekV41DecodeStep.aside`):
            in line, or, for a CUDA graph (its warm-up and capture), the device's `SideStream`.

    Returns:
        ``(logits fp32 [B, 1, V], hidden bf16 [B, 1, D], publisher [B], history, main_hidden)`` after
        the step; main_hidden bf16 ``[B, 1, T*D]``, or None when not asked.

    Mirrors `inference/model.py: Transformer.forward` with ``start_pos > 0``.
    """
    positions = column.expand(input_ids.size(0)).clone() if pads is None else column - pads
    step = DeepseekV41DecodeStep(
        cache.attention, column, positions, publisher.clone(), widths, model.index_key_owners, pads,
        hidden_taps=main_hidden_taps(model.text_config) if main_hidden else None,
        aside=aside,
    )
    if model.engram_hash is not None:
        step.engram_hash_ids, history = model.engram_hash(input_ids, history=history)
    h = model.embed(input_ids)
    x = h.unsqueeze(2).repeat(1, 1, model.hc_mult, 1)
    pre_mix = identity_pre_mix(x, model.hc_mult)
    try:
        for layer in model.layers:
            x, pre_mix = layer.decode_step(x, pre_mix, step)
    finally:  # a layer that raised between a fork and its join leaves no side work unjoined
        if isinstance(step.aside, SideStream):
            step.aside.join_all()
    hidden = model.norm(model.hc.pre(x, pre_mix))
    taps = None if step.hidden_taps is None else gather_main_hidden(step.hidden_taps)
    return model.head.decode_logits(hidden[:, -1]).unsqueeze(1), hidden, step.publisher, history, taps


def check_step_inputs(model, input_ids, mm_token_type_ids, attention_mask, cache: DeepseekV41Cache, read_back: bool) -> None:
    """The checks of an engine step's inputs: the host-side ones (mask width, batch rows, room in
    the cache), and with `read_back` (a step called directly, not from `generate`'s loop) those
    a forward makes on the values: ids in the vocabulary and not the image token, text marks,
    the cache's padding.

    Raises:
        DeepseekV41ModelError, DeepseekV41AttentionError, DeepseekV41CacheError: as the forward.
    """
    cache.make_room(1)
    start = cache.get_seq_length()
    batch = input_ids.size(0)
    check_mask_shape(attention_mask, start, 1, batch)
    if cache.batch_size not in (-1, batch):
        raise DeepseekV41ModelError(f"the cache holds {cache.batch_size} batch rows, input_ids {batch}")
    if not read_back:
        return
    vocab = model.text_config.vocab_size
    if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
        raise DeepseekV41ModelError(
            f"input_ids must lie in [0, {vocab}) (vocab_size); got values from {int(input_ids.min())} to {int(input_ids.max())}"
        )
    model._image_positions(input_ids, mm_token_type_ids, None, None, None)
    if mm_token_type_ids is not None and bool((mm_token_type_ids != 0).any()):
        raise DeepseekV41ModelError("a decode step's token is text: mm_token_type_ids marks it as an image span")
    if attention_mask is not None:
        pads = left_padding_offsets(attention_mask, start, 1)
        check_same_padding(cache.attention.pad_offsets, pads, start, batch)


def _captured_step(context: tuple, *args):
    # the function a graph captures: `context` = (model, cache, widths, main_hidden), fixed for the
    # graph; run by `GraphedSegment` only (its warm-up, then the capture), under its replay lock,
    # with the side work on the device's side streams
    *fixed, main_hidden = context
    aside = side_stream(args[0].device) if args[0].is_cuda else in_line
    return decode_model_step(*fixed, *args, main_hidden=main_hidden, aside=aside)


def _captured_draft(context: tuple, *args):
    # the draft head's forward a graph captures: `context` = (model, rings), fixed for the graph
    model, rings = context
    return draft_forward(model.mtp, model.embed, model.head, model.text_config, *args, rings)


def _hooked(modules) -> bool:
    if _global_forward_hooks or _global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class _StructureVersion:
    """Advanced whenever any module registers a submodule, parameter or buffer (torch's global
    registration hooks, installed once): a replaced module or weight (an adapter injected, a head
    swapped) changes what a captured step would read and which modules a hook may watch."""

    value = 0
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return

        def advance(*_):
            cls.value += 1

        register_module_module_registration_hook(advance)
        register_module_parameter_registration_hook(advance)
        register_module_buffer_registration_hook(advance)
        cls.installed = True


# the runners whose steps the current thread's `generate` loop issues (checked at its entry), each
# with what its checks found in this call (`DeepseekV41DecodeRunner._once_per_call`)
_TRUSTED = threading.local()


def _offloaded(module) -> bool:
    """Whether accelerate swaps `module`'s weights in and out around each call (offload)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", [hook]) if hook is not None else []
    return any(getattr(h, "offload", False) for h in hooks)


class DeepseekV41DecodeRunner:
    """Runs the decode engine's steps of one model (:func:`decode_model_step`).

    Attributes:
        graphs: replay steps on CUDA from CUDA graphs (default True); False runs them eagerly
            (the same function, the same values bit for bit).
        captures: graphs captured so far (decode steps and draft-head forwards).
    """

    def __init__(self):
        self.graphs = True
        self.captures = 0
        self._watched: tuple[int, list] | None = None  # (structure version, modules)
        self._draft_watched: tuple[int, list] | None = None  # the same for the draft head
        _StructureVersion.install()

    @contextlib.contextmanager
    def trusting(self):
        """While in it, this thread's engine steps skip the checks that read values back from the
        GPU (`generate`'s loop: its tokens come from its own sampling, checked at its entry), and
        the scans of the model's modules that decide whether and how a step runs (hooks, devices,
        offload, the kernels' graph safety) run once, at the first step: a hook registered or a
        module moved while a `generate` call runs takes effect from the next call."""
        trusted = getattr(_TRUSTED, "runners", None)
        if trusted is None:
            trusted = _TRUSTED.runners = weakref.WeakKeyDictionary()
        was = self in trusted
        if not was:
            trusted[self] = {}
        try:
            yield
        finally:
            if not was:
                trusted.pop(self, None)

    @property
    def trusted(self) -> bool:
        """Whether this thread is inside :meth:`trusting`."""
        return self in getattr(_TRUSTED, "runners", ())

    def _once_per_call(self, key: tuple, scan: Callable[[], bool]) -> bool:
        """``scan()``, or inside :meth:`trusting` its first result for `key` in this call (keyed
        also on the model's structure: a module, parameter or buffer registered since scans again;
        the callers key on what else the scan reads, such as the numerics plan)."""
        found = getattr(_TRUSTED, "runners", {}).get(self)
        if found is None:
            return scan()
        key = (*key, _StructureVersion.value)
        if key not in found:
            found[key] = scan()
        return found[key]

    # -- which steps the engine takes --------------------------------------------------------
    def applies(self, model, cache, input_ids: torch.Tensor, output_hidden_states: bool = False) -> bool:
        """Whether the forward of `input_ids` on `cache` is a step of the engine: one token per
        row on a filled cache, fast numerics, no autograd, no forward hook on the model's modules
        (a hook expects the layer-by-layer forward), every layer on one device, no offload (those
        three scanned once per `generate` call, see :meth:`trusting`)."""
        if cache is None or input_ids.size(1) != 1 or cache.get_seq_length() == 0 or output_hidden_states:
            return False
        if model.numerics.exact or torch.is_grad_enabled():
            return False
        return self._once_per_call(("applies",), lambda: self._placed_for_steps(model))

    def _placed_for_steps(self, model) -> bool:
        # no forward hook on the model's modules, every layer on one device, no offload
        if self._watched is None or self._watched[0] != _StructureVersion.value:
            # every module but the routed experts (~1500 at release width): the step calls them
            # through the expert kernels, as the plain forward then does, so hooks on them fire
            # in neither
            experts = {id(m) for layer in model.layers for m in layer.ffn.experts.modules()}
            self._watched = (_StructureVersion.value, [m for m in model.modules() if id(m) not in experts])
        if _hooked(self._watched[1]):
            return False
        device = model.embed.weight.device
        if model.head.weight.device != device or model.norm.weight.device != device:
            return False
        if model.engram_hash is not None and model.engram_hash.token_map.device != device:
            return False
        return all(layer.weight_device == device and not _offloaded(layer) for layer in model.layers) \
            and not _offloaded(model)

    def _replays(self, model, batch: int, device: torch.device) -> bool:
        """Whether a step of `batch` rows on `device` replays from a CUDA graph: graphs on, CUDA,
        not inside a compile or another capture, every op of the step free of host
        synchronisation (the Triton sparse attention; the MoE's expert kernels at this batch) and
        every Engram table on `device` (those scanned once per `generate` call, see :meth:`trusting`)."""
        if not (self.graphs and device.type == "cuda"):
            return False
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        return self._once_per_call(("replays", batch, device, model.numerics), lambda: all(
            layer.attn.sparse_attention_graph_safe(device) and layer.ffn.runs_without_host_sync(batch, device)
            # Engram tables kept in host memory (`device_map` placing them on the CPU) are read
            # through host copies, which a graph cannot hold
            and (layer.engram is None or all(p.device == device for p in layer.engram.parameters()))
            for layer in model.layers
        ))

    def draft_replay(self, model, cache: DeepseekV41DraftCache, batch: int, start_pos: int):
        """How the draft head's forward of a decode step at `start_pos` runs (`draft_step`'s
        `replay`): a function replaying `dspark_deepseek_v41_vl.draft_forward` from a CUDA graph
        (captured once per batch size, numerics plan and weights, kept on `cache`), or None to
        run it eagerly. It replays on CUDA in fast numerics without autograd, once the ring holds
        a whole window (`start_pos + 1 >= W`: before that the rows read grow with the position),
        with the draft blocks, the embedding and the head on the rings' device, no hook on their
        modules, no offload, and every op free of host synchronisation at ``batch x bs`` rows (those
        scanned once per `generate` call, see :meth:`trusting`)."""
        device = cache.rings[0].device
        if not (self.graphs and device.type == "cuda") or model.numerics.exact or torch.is_grad_enabled():
            return None
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return None
        if start_pos + 1 < cache.rings[0].size(1):
            return None
        if any(ring.device != device for ring in cache.rings):
            return None
        rows = batch * model.text_config.dspark_block_size
        if not self._once_per_call(("draft", rows, device, model.numerics),
                                   lambda: self._draft_replays(model, rows, device)):
            return None
        segment = cache.graphs.get("draft")
        if segment is None:
            segment = cache.graphs["draft"] = GraphedSegment(_captured_draft, graph_pool(device))
        key = (model.numerics, model.decode_identity, model.weights_epoch, _StructureVersion.value)

        def run(token_ids, main_hidden, position, idxs):
            # main_hidden is often a one-position slice of a longer pending tensor: its strides
            # (part of the graph's input signature) would differ from call to call
            args = (token_ids, main_hidden.clone(memory_format=torch.contiguous_format), position, idxs)
            before = segment.captures
            out = segment(*args, key=key, context=(model, cache.rings))
            self.captures += segment.captures - before
            return out

        return run

    def _draft_replays(self, model, rows: int, device: torch.device) -> bool:
        # the draft head's embedding and head on `device`, neither offloaded, no hook on its
        # modules, every op free of host synchronisation at `rows` rows
        if model.embed.weight.device != device or model.head.weight.device != device:
            return False
        # an offloaded draft block was refused before (`_check_draft_head`); the embedding and
        # the head are the backbone's
        if _offloaded(model.embed) or _offloaded(model.head):
            return False
        if self._draft_watched is None or self._draft_watched[0] != _StructureVersion.value:
            # the draft head's modules but its routed experts after the first (`draft_head_modules`)
            self._draft_watched = (_StructureVersion.value, [*draft_head_modules(model.mtp), model.embed, model.head])
        if _hooked(self._draft_watched[1]):
            return False
        return all(block.attn.sparse_attention_graph_safe(device) and block.ffn.runs_without_host_sync(rows, device)
                   for block in model.mtp)

    # -- a step -------------------------------------------------------------------------------
    def widths(self, model, cache: DeepseekV41Cache) -> dict[int, int]:
        """Compressed rows the next step reads, per compress ratio: a static cache's capacity
        (the same at every step), or for a growing cache the power-of-two bucket of the rows in
        use, after making room for them in the buffers the step reads."""
        attention = cache.attention
        end = cache.get_seq_length() + 1
        widths = {}
        for ratio in model.compress_ratios:
            # every row a step writes: row position // ratio, the last one possibly of a partial group
            rows = attention.max_cache_len if attention.max_cache_len is not None else end
            widths[ratio] = -(-rows // ratio)
            if attention.max_cache_len is None:
                widths[ratio] = decode_rows(widths[ratio])
        for layer in model.layers:
            if not layer.attn.is_kv_source:
                continue
            own = attention.layer(layer.layer_idx)
            layer.attn.make_decode_rows(own)
            if attention.max_cache_len is None:
                own.compressed_kv.reserve(widths[layer.attn.ratio])
                if own.index_k is not None:  # read at any ratio's width, at most decode_rows(end)
                    own.index_k.reserve(decode_rows(end))
        return widths

    def step(
        self, model, input_ids: torch.Tensor, cache: DeepseekV41Cache, main_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One decode step of every row of `cache` (filled by a prefill), with no host
        synchronisation: the step's function replayed from a CUDA graph where :meth:`_replays`
        allows, else run eagerly; then the host bookkeeping. The inputs are trusted (checked
        at the prefill and at `generate`'s entry): ids in the vocabulary, one per row.

        Args:
            input_ids: int64 ``[B, 1]`` on the model's device.
            cache: the sequence's :class:`DeepseekV41Cache`.
            main_hidden: also return the draft head's `main_hidden` (a graph of its own).

        Returns:
            ``(logits fp32 [B, 1, V], last hidden state bf16 [B, 1, D], main_hidden bf16 [B, 1, T*D]
            or None)``.
        """
        attention = cache.attention
        batch, device = input_ids.size(0), input_ids.device
        start = cache.get_seq_length()
        widths = self.widths(model, cache)
        column = torch.full((1,), start, dtype=torch.int64, device=device)  # this call's own (threads)
        publisher = attention.publisher_rows(batch, device)
        args = (input_ids, column, attention.pad_offsets, publisher, cache.engram_history)
        if self._replays(model, batch, device):
            segment = attention.decode_graphs.get("step")
            if segment is None:
                segment = attention.decode_graphs["step"] = GraphedSegment(_captured_step, graph_pool(device))
            before = segment.captures
            key = (
                tuple(sorted(widths.items())), model.numerics, model.decode_identity, model.weights_epoch,
                _StructureVersion.value, attention.epoch.value, main_hidden, model.head.decode_version,
            )
            logits, hidden, publisher, history, taps = segment(*args, key=key, context=(model, cache, widths, main_hidden))
            self.captures += segment.captures - before
        else:
            logits, hidden, publisher, history, taps = decode_model_step(
                model, cache, widths, *args, main_hidden=main_hidden, aside=in_line
            )
        self._commit(model, cache, start, publisher)
        if history is not None:
            cache.engram_history = history
        cache.record_tokens(1, main_hidden=taps)
        return logits, hidden, taps

    def _commit(self, model, cache: DeepseekV41Cache, start: int, publisher: torch.Tensor) -> None:
        """The host side of a step at column `start`: rows held by each compressed buffer and the
        index-key publisher, computed from the positions the host knows (no device read)."""
        attention = cache.attention
        ends = [start + 1 - pad for pad in (attention.host_pads or [0])]  # each row's length after the step
        last_writer = None
        for layer in model.layers:
            attn = layer.attn
            if not attn.is_kv_source:
                continue
            own = attention.layer(layer.layer_idx)
            rows = max(end // attn.ratio for end in ends)
            for buffer in (own.compressed_kv, own.index_k):
                if buffer is not None:
                    buffer.length = max(buffer.length, rows)
            if attn.indexer is not None and attn.indexer.owns_k and any(end % attn.ratio == 0 for end in ends):
                last_writer = layer.layer_idx
        if attention.pad_offsets is None:
            if last_writer is not None:
                attention.index_k_publisher, attention.index_k_publisher_rows = last_writer, None
        else:
            attention.index_k_publisher_rows = publisher
            if last_writer is not None:
                attention.index_k_publisher = last_writer


__all__ = ["DeepseekV41DecodeRunner", "check_step_inputs", "decode_model_step"]
