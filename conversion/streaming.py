"""Tile-by-tile production and verification of converted tensors under a memory bound.

Each converted tensor is made in tiles whose working memory (source bytes + temporaries + output)
stays under ``max_slice_bytes``:

- ``copy`` / ``to_fp32``: contiguous element ranges of the flattened tensor;
- ``dequant_fp8`` / ``dequant_fp4``: 2-D tiles aligned to the 32-row / 32-column scale blocks
  (whole rows when 32 of them fit, otherwise column bands written row by row).

:func:`write_tensor` computes tiles with its own lean in-place arithmetic; :func:`verify_tensor`
re-reads the written bytes and compares them, bit for bit, with `state_dict_adapter_deepseek_v41_vl.apply_plan` (the
documented transform, built on the model's dequantizers) applied to the same source tiles.

Every source slice :func:`write_tensor` reads is checked for NaN / Inf codes (`nonfinite.py`) before
it is written, and a dequantized tile for values that overflow to Inf, so a corrupt checkpoint is
refused without a second pass over the data; :func:`check_tensor` is that check alone, for
``--link`` conversions, which write no tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..modeling.checkpoint_names_deepseek_v41_vl import DTYPE_SIZES, DeepseekV41ConversionError, TensorPlan
from ..modeling.state_dict_adapter_deepseek_v41_vl import SAFETENSORS_TO_TORCH, apply_plan
from ..triton_ops.formats import BLOCK
from .nonfinite import can_hold_nonfinite, check_finite, element, first_nonfinite
from .safetensors_io import SafetensorsReader, SafetensorsWriter

# Working bytes per OUTPUT element (source + temporaries + result), conservative.
_WRITE_COST = {"to_fp32": 2 + 4, "dequant_fp8": 1 + 4 + 4 + 2 + 1, "dequant_fp4": 1 + 8 + 4 + 4 + 2 + 1}
# Verification also holds the re-read output and runs the model's (less frugal) dequantizers.
_VERIFY_COST = {"copy": 2, "to_fp32": 2 + 4 + 4 + 1, "dequant_fp8": 1 + 4 + 4 + 4 + 2 + 2 + 2, "dequant_fp4": 1 + 16 + 16 + 8 + 4 + 4 + 2 + 2}
_MIN_BUDGET = 64 * 1024


@dataclass(frozen=True)
class Tile:
    """Rows [r0, r1) x output columns [c0, c1) of a 2-D tensor."""

    r0: int
    r1: int
    c0: int
    c1: int


def _floor_to(x: int, multiple: int) -> int:
    return max(multiple, x // multiple * multiple)


def tiles_2d(rows: int, cols: int, cost: int, budget: int) -> Iterator[Tile]:
    """Tiles covering ``[rows, cols]``, aligned to 32, each with ``rows*cols*cost <= budget`` where
    possible (never smaller than one 32x32 block)."""
    per_band = BLOCK * cols * cost
    if per_band <= budget:
        band = min(rows, _floor_to(budget // (cols * cost), BLOCK))
        for r0 in range(0, rows, band):
            yield Tile(r0, min(rows, r0 + band), 0, cols)
        return
    width = _floor_to(budget // (BLOCK * cost), BLOCK)
    for r0 in range(0, rows, BLOCK):
        for c0 in range(0, cols, width):
            yield Tile(r0, min(rows, r0 + BLOCK), c0, min(cols, c0 + width))


def _read_2d(reader: SafetensorsReader, name: str, tile_rows: tuple[int, int], byte_cols: tuple[int, int], row_bytes: int) -> bytearray:
    """Bytes of rows [r0, r1) and byte columns [b0, b1) of a row-major 2-D tensor, packed."""
    (r0, r1), (b0, b1) = tile_rows, byte_cols
    width = b1 - b0
    buffer = bytearray((r1 - r0) * width)
    if width == row_bytes:
        reader.read_into(name, r0 * row_bytes, buffer)
        return buffer
    view = memoryview(buffer)
    for i, r in enumerate(range(r0, r1)):
        reader.read_into(name, r * row_bytes + b0, view[i * width : (i + 1) * width])
    return buffer


def _tensor(buffer: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch view of `buffer` (no copy)."""
    if not buffer:
        return torch.empty(shape, dtype=SAFETENSORS_TO_TORCH[dtype])
    return torch.frombuffer(buffer, dtype=torch.uint8).view(SAFETENSORS_TO_TORCH[dtype]).view(shape)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


class SourceAccess:
    """Where each official tensor lives: `reader_for(name)` gives the open reader of its shard."""

    def __init__(self, readers: dict[str, SafetensorsReader]):
        self._readers = readers

    def reader_for(self, name: str) -> SafetensorsReader:
        return self._readers[name]

    def entry(self, name: str):
        return self._readers[name].header.entries[name]


def _scale_tile(source: SourceAccess, plan: TensorPlan, tile: Tile, col_block: int) -> torch.Tensor:
    """The scale rows/columns covering `tile` (fp8: 32x32 blocks; fp4: per row, 32 columns)."""
    entry = source.entry(plan.scale)
    srows, scols = entry.shape
    if plan.op == "dequant_fp8":
        rows = (tile.r0 // BLOCK, -(-tile.r1 // BLOCK))
    else:
        rows = (tile.r0, tile.r1)
    cols = (tile.c0 // col_block, -(-tile.c1 // col_block))
    buf = _read_2d(source.reader_for(plan.scale), plan.scale, rows, cols, scols)
    return _tensor(buf, entry.dtype, (rows[1] - rows[0], cols[1] - cols[0]))


def _source_tile(source: SourceAccess, plan: TensorPlan, tile: Tile) -> torch.Tensor:
    entry = source.entry(plan.source)
    rows, stored_cols = entry.shape
    if plan.op == "dequant_fp4":  # two codes per byte
        byte_cols, shape = (tile.c0 // 2, tile.c1 // 2), (tile.r1 - tile.r0, (tile.c1 - tile.c0) // 2)
    else:
        byte_cols, shape = (tile.c0, tile.c1), (tile.r1 - tile.r0, tile.c1 - tile.c0)
    buf = _read_2d(source.reader_for(plan.source), plan.source, (tile.r0, tile.r1), byte_cols, stored_cols)
    return _tensor(buf, entry.dtype, shape)


def _dequant_fp8_lean(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    if rows % BLOCK == 0 and cols % BLOCK == 0:  # whole blocks: broadcast the scale, no expansion
        blocks = w.float().view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        return blocks.mul_(s.float()[:, None, :, None]).view(rows, cols).to(torch.bfloat16)
    scale = s.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return w.float().mul_(scale).to(torch.bfloat16)


# byte -> (even value, odd value): the packed E2M1 pair, even element in the low nibble
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_FP4_PAIRS = torch.stack([_E2M1.repeat(16), _E2M1.repeat_interleave(16)], dim=1)


def _dequant_fp4_lean(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows = packed.shape[0]
    values = _FP4_PAIRS[packed.view(torch.uint8).long()].view(rows, -1)
    return values.mul_(s.float().repeat_interleave(BLOCK, 1)).to(torch.bfloat16)


def _write_2d(writer: SafetensorsWriter, name: str, tile: Tile, cols: int, out: torch.Tensor) -> None:
    data = _as_bytes(out)
    itemsize = out.element_size()
    if tile.c0 == 0 and tile.c1 == cols:
        writer.write_at(name, tile.r0 * cols * itemsize, data)
        return
    width = (tile.c1 - tile.c0) * itemsize
    for i, r in enumerate(range(tile.r0, tile.r1)):
        writer.write_at(name, (r * cols + tile.c0) * itemsize, data[i * width : (i + 1) * width])


def _elementwise_chunks(total_elements: int, cost: int, budget: int) -> Iterator[tuple[int, int]]:
    step = max(1, budget // cost)
    for start in range(0, total_elements, step):
        yield start, min(total_elements, start + step)


def _check_bytes(reader: SafetensorsReader, name: str, dtype: str, data: bytearray, first: int) -> None:
    """NaN / Inf check of `data`, elements ``first ...`` of the flattened tensor `name`."""
    if data and can_hold_nonfinite(dtype):
        check_finite(name, dtype, torch.frombuffer(data, dtype=torch.uint8), lambda i: element(first + i), str(reader.header.path))


def _tile_position(r0: int, c0: int, width: int) -> Callable[[int], str]:
    return lambda i: f"[{r0 + i // width}, {c0 + i % width}]"


def _check_tile(source: SourceAccess, name: str, data: torch.Tensor, r0: int, c0: int) -> None:
    """NaN / Inf check of a 2-D tile of the official tensor `name` whose first element is [r0, c0]."""
    dtype = source.entry(name).dtype
    if data.numel() and can_hold_nonfinite(dtype):
        position = _tile_position(r0, c0, data.shape[-1])
        check_finite(name, dtype, data, position, str(source.reader_for(name).header.path))


def write_tensor(plan: TensorPlan, source: SourceAccess, writer: SafetensorsWriter, budget: int, progress: Callable[[int], None]) -> None:
    """Produce `plan.target` in `writer` from the official tensor(s), tile by tile.

    Args:
        budget: working-memory bound in bytes (``max_slice_bytes``).
        progress: called with the number of output bytes of each finished tile.

    Raises:
        DeepseekV41ConversionError: a source element is NaN or Inf (`nonfinite.py`), or a
            dequantized value overflows to Inf; the message names the tensor and the element.
    """
    budget = max(budget, _MIN_BUDGET)
    entry = source.entry(plan.source)
    reader = source.reader_for(plan.source)
    if plan.op == "copy":
        size = DTYPE_SIZES[entry.dtype]
        for start, end in _elementwise_chunks(entry.nbytes // size, size, budget):
            data = reader.read(plan.source, start * size, (end - start) * size)
            _check_bytes(reader, plan.source, entry.dtype, data, start)
            writer.write_at(plan.target, start * size, data)
            progress((end - start) * size)
        return
    if plan.op == "to_fp32":
        size = DTYPE_SIZES[entry.dtype]
        n = entry.nbytes // size
        for start, end in _elementwise_chunks(n, _WRITE_COST["to_fp32"], budget):
            data = reader.read(plan.source, start * size, (end - start) * size)
            _check_bytes(reader, plan.source, entry.dtype, data, start)
            chunk = _tensor(data, entry.dtype, (end - start,))
            writer.write_at(plan.target, start * 4, _as_bytes(chunk.float()))
            progress((end - start) * 4)
        return
    rows, cols = plan.shape
    for tile in tiles_2d(rows, cols, _WRITE_COST[plan.op], budget):
        w = _source_tile(source, plan, tile)
        _check_tile(source, plan.source, w, tile.r0, tile.c0 // 2 if plan.op == "dequant_fp4" else tile.c0)
        s = _scale_tile(source, plan, tile, BLOCK)
        _check_tile(source, plan.scale, s, tile.r0 // BLOCK if plan.op == "dequant_fp8" else tile.r0, tile.c0 // BLOCK)
        out = _dequant_fp8_lean(w, s) if plan.op == "dequant_fp8" else _dequant_fp4_lean(w, s)
        overflow = first_nonfinite(out, "BF16")
        if overflow is not None:
            at = _tile_position(tile.r0, tile.c0, tile.c1 - tile.c0)(overflow)
            raise DeepseekV41ConversionError(
                f"dequantizing {plan.source!r} with its scale {plan.scale!r} gives Inf at {at} (a scale too large for "
                "its block): the checkpoint is corrupt; nothing was converted"
            )
        _write_2d(writer, plan.target, tile, cols, out)
        progress(out.numel() * 2)
        del w, s, out


def check_tensor(name: str, source: SourceAccess, budget: int, progress: Callable[[int], None]) -> None:
    """Read the official tensor `name` once, in slices of at most `budget` bytes, and refuse it
    when an element is NaN or Inf (what :func:`write_tensor` checks on the way, for conversions
    that write no tensor).

    Raises:
        DeepseekV41ConversionError: names the tensor, its file and the element.
    """
    budget = max(budget, _MIN_BUDGET)
    entry = source.entry(name)
    if not can_hold_nonfinite(entry.dtype):
        progress(entry.nbytes)
        return
    reader = source.reader_for(name)
    size = DTYPE_SIZES[entry.dtype]
    for start, end in _elementwise_chunks(entry.nbytes // size, size, budget):
        _check_bytes(reader, name, entry.dtype, reader.read(name, start * size, (end - start) * size), start)
        progress((end - start) * size)


def verify_tensor(plan: TensorPlan, source: SourceAccess, written: SafetensorsReader, budget: int, progress: Callable[[int], None]) -> None:
    """Re-read `plan.target` from the written file and compare it bitwise with
    `state_dict_adapter_deepseek_v41_vl.apply_plan` of the source, tile by tile.

    Raises:
        DeepseekV41ConversionError: header mismatch or the first differing tile.
    """
    budget = max(budget, _MIN_BUDGET)
    out_entry = written.header.entries.get(plan.target)
    if out_entry is None or out_entry.dtype != plan.dtype or out_entry.shape != plan.shape:
        raise DeepseekV41ConversionError(f"verify: {plan.target} is missing or has the wrong dtype/shape in {written.header.path}")
    entry = source.entry(plan.source)
    reader = source.reader_for(plan.source)

    def mismatch(where: str) -> DeepseekV41ConversionError:
        return DeepseekV41ConversionError(f"verify: {plan.target} differs from the {plan.op} of {plan.source} at {where}")

    if plan.op in ("copy", "to_fp32"):
        size = DTYPE_SIZES[entry.dtype]
        out_size = DTYPE_SIZES[plan.dtype]
        n = entry.nbytes // size
        for start, end in _elementwise_chunks(n, _VERIFY_COST[plan.op] * max(size, out_size), budget):
            src = _tensor(reader.read(plan.source, start * size, (end - start) * size), entry.dtype, (end - start,))
            expected = apply_plan(plan, src).contiguous().view(torch.uint8)
            got = _tensor(written.read(plan.target, start * out_size, (end - start) * out_size), "U8", ((end - start) * out_size,))
            if not torch.equal(expected, got):
                raise mismatch(f"elements [{start}, {end})")
            progress((end - start) * out_size)
        return
    rows, cols = plan.shape
    for tile in tiles_2d(rows, cols, _VERIFY_COST[plan.op], budget):
        w = _source_tile(source, plan, tile)
        s = _scale_tile(source, plan, tile, BLOCK)
        expected = apply_plan(plan, w, s)
        got = _tensor(_read_2d(written, plan.target, (tile.r0, tile.r1), (tile.c0 * 2, tile.c1 * 2), cols * 2), "BF16", tuple(expected.shape))
        if not torch.equal(expected.view(torch.int16), got.view(torch.int16)):
            raise mismatch(f"rows [{tile.r0}, {tile.r1}) x columns [{tile.c0}, {tile.c1})")
        progress(expected.numel() * 2)
        del w, s, expected, got


__all__ = ["SourceAccess", "Tile", "check_tensor", "tiles_2d", "verify_tensor", "write_tensor"]
