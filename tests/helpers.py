"""Small helpers several test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import struct
import zlib

import torch
from torch import nn

from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, apply_numerics


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm()).item()


def with_backends(module: nn.Module, **backends: str) -> nn.Module:
    """Hand `module` (and its submodules) its plan with the given kernel backends changed (op name
    -> "auto" / "triton" / "torch"), the public way to switch a built module."""
    plan = next(m.numerics for m in module.modules() if isinstance(getattr(m, "numerics", None), DeepseekV41Numerics))
    apply_numerics(module, plan.replace(**backends))
    return module


def png_header_only(width: int, height: int) -> bytes:
    """A PNG with a valid IHDR claiming width x height RGB pixels, and no pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# a two-turn conversation, one image in each turn (tests of a conversation on one cache)
TURN1 = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>A cat.<｜end▁of▁sentence｜>"
TURN2 = "<｜User｜><｜deepseek_image｜>And this one?<｜Assistant｜></think>"


def conversation_turns(processor, photos: list) -> tuple:
    """(first turn, second turn, whole conversation) of TURN1 / TURN2 with `photos[0]` and
    `photos[1]`, through `processor` as "pt" tensors; the whole one's ids are the two turns'."""
    first = processor(images=[photos[0]], text=TURN1, return_tensors="pt")
    second = processor(images=[photos[1]], text=TURN2, add_special_tokens=False, return_tensors="pt")
    whole = processor(images=photos[:2], text=TURN1 + TURN2, return_tensors="pt")
    assert torch.equal(whole["input_ids"], torch.cat([first["input_ids"], second["input_ids"]], dim=1))
    return first, second, whole


def cache_state(cache) -> list[tuple[str, object]]:
    """Everything a later forward reads (and the stale slots it does not), as (name, value)."""
    att = cache.attention
    state = [
        ("length", cache.get_seq_length()), ("attention.seen_tokens", att.seen_tokens),
        ("publisher", att.index_k_publisher), ("publisher_rows", att.index_k_publisher_rows),
        ("pad_offsets", att.pad_offsets), ("prefill_length", att.prefill_length),
        ("engram_history", cache.engram_history), ("image_counts", cache.image_counts),
    ]
    for layer_id, s in sorted(att.layers.items()):
        state += [(f"{layer_id}.window_kv", s.window_kv), (f"{layer_id}.compressor_kv", s.compressor_kv),
                  (f"{layer_id}.compressor_score", s.compressor_score)]
        for name in ("compressed_kv", "index_k"):
            buffer = getattr(s, name)
            state.append((f"{layer_id}.{name}", None if buffer is None else (buffer.length, buffer.rows(buffer.length))))
    return state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def differences(got, want) -> list[str]:
    """The names of `cache_state` entries in which caches (or snapshots) `got` and `want` differ."""
    got = got if isinstance(got, list) else cache_state(got)
    want = want if isinstance(want, list) else cache_state(want)
    return [name for (name, a), (_, b) in zip(got, want) if not _same(a, b)]


def snapshot(cache) -> list[tuple[str, object]]:
    """`cache_state` with every tensor copied: the state as it is now."""
    def copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        return tuple(copy(v) for v in value) if isinstance(value, tuple) else value

    return [(name, copy(value)) for name, value in cache_state(cache)]
