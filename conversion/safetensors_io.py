"""Bounded-memory reading and writing of safetensors files.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (``{name: {dtype,
shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}``, offsets relative to the data
buffer that follows), then the raw tensor bytes (C order, little-endian).

The converter must stream tensors far larger than its memory bound (an Engram table is ~91.5 GiB),
so this module never maps a file and never reads or writes a whole tensor: :class:`SafetensorsReader`
reads byte ranges with ``os.preadv`` into caller-sized buffers, :class:`SafetensorsWriter` lays the
header out first (every size is known in advance) and then takes byte ranges at any offset with
``os.pwrite``. (Reading through ``safe_open``'s memory map would make every touched page of a
shard resident, so the process's memory would grow with the tensor.)
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..modeling.checkpoint_names_deepseek_v41_vl import DTYPE_SIZES, DeepseekV41ConversionError, tensor_nbytes

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library refuses larger headers too
_ALIGN = 8  # the data buffer starts 8-byte aligned (header padded with spaces)


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype string, shape, absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


@dataclass
class Header:
    """The parsed header of a safetensors file."""

    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str] | None
    data_start: int


def _is_count(value) -> bool:
    """A non-negative JSON integer (not a bool, a float or a string)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_entry(path: Path, name: str, spec) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one header entry, every field type-checked.

    Raises:
        DeepseekV41ConversionError: a missing field, or one of the wrong type or value.
    """
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise DeepseekV41ConversionError(f"{path}: corrupt header entry for {name!r} (needs dtype, shape and data_offsets): {spec!r}")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise DeepseekV41ConversionError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise DeepseekV41ConversionError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]:
        raise DeepseekV41ConversionError(
            f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with integers 0 <= begin <= end"
        )
    return dtype, tuple(shape), (offsets[0], offsets[1])


def parse_json(path: Path, raw: bytes | str, what: str = "unreadable JSON"):
    """`raw` (the text of the file `path`) parsed as JSON: the one place conversion parses a file's JSON.

    Raises:
        DeepseekV41ConversionError: ``<path>: <what> (<reason>)``: invalid UTF-8 or JSON, or nesting
            too deep for the parser (Python's `RecursionError`).
    """
    try:
        return json.loads(raw)
    except RecursionError:
        raise DeepseekV41ConversionError(f"{path}: {what} (nested too deeply to parse)") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise DeepseekV41ConversionError(f"{path}: {what} ({exc})") from None


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the header of `path` (reads only the header bytes).

    Raises:
        DeepseekV41ConversionError: not a safetensors file, a corrupt or truncated header, an
            unknown dtype, a field of the wrong type (a dtype that is not a string, a shape or
            data_offsets that are not integers), a byte range that disagrees with dtype x shape,
            overlaps or lies past the end of the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise DeepseekV41ConversionError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise DeepseekV41ConversionError(f"{path}: not a safetensors file (header length {n}, file size {size})")
        header = parse_json(path, f.read(n), "corrupt safetensors header")
    if not isinstance(header, dict):
        raise DeepseekV41ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not isinstance(metadata, dict):
        raise DeepseekV41ConversionError(f"{path}: corrupt safetensors header (__metadata__ is {type(metadata).__name__}, not an object)")
    entries: dict[str, Entry] = {}
    for name, spec in header.items():
        dtype, shape, (begin, end) = _parse_entry(path, name, spec)
        expected = tensor_nbytes(shape, dtype)
        if end - begin != expected:
            raise DeepseekV41ConversionError(
                f"{path}: tensor {name!r} {dtype}{list(shape)} needs {expected} bytes, the header gives [{begin}, {end})"
            )
        if data_start + end > size:
            raise DeepseekV41ConversionError(f"{path}: tensor {name!r} lies past the end of the file (truncated?)")
        entries[name] = Entry(dtype, shape, data_start + begin, expected)
    spans = sorted((e.start, e.start + e.nbytes, name) for name, e in entries.items() if e.nbytes)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise DeepseekV41ConversionError(f"{path}: tensors {a!r} and {b!r} overlap")
    return Header(path, entries, metadata, data_start)


class SafetensorsReader:
    """Reads byte ranges of the tensors of one file into caller-provided buffers (no mmap).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, header: Header):
        self.header = header
        self._fd = os.open(header.path, os.O_RDONLY)

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read_into(self, name: str, offset: int, buffer: bytearray | memoryview) -> None:
        """Fill `buffer` with the bytes of tensor `name` from byte `offset` (within the tensor).

        Raises:
            DeepseekV41ConversionError: the range leaves the tensor, or the file is shorter than
                its header says.
        """
        entry = self.header.entries[name]
        view = memoryview(buffer).cast("B")
        if offset < 0 or offset + len(view) > entry.nbytes:
            raise DeepseekV41ConversionError(
                f"{self.header.path}: read of [{offset}, {offset + len(view)}) outside tensor {name!r} ({entry.nbytes} bytes)"
            )
        done, position = 0, entry.start + offset
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], position + done)
            if got <= 0:
                raise DeepseekV41ConversionError(f"{self.header.path}: unexpected end of file while reading {name!r}")
            done += got

    def read(self, name: str, offset: int, nbytes: int) -> bytearray:
        """A new ``bytearray`` of `nbytes` bytes of tensor `name` from `offset`."""
        buffer = bytearray(nbytes)
        self.read_into(name, offset, buffer)
        return buffer


def layout(tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, dict[str, Entry]]:
    """Header bytes and entries (absolute offsets) for tensors written in the given order.

    Args:
        tensors: ``(name, dtype, shape)`` in file order.
        metadata: the ``__metadata__`` string map (``{"format": "pt"}`` for transformers).
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset, rel = 0, {}
    for name, dtype, shape in tensors:
        nbytes = tensor_nbytes(shape, dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        rel[name] = (dtype, tuple(shape), offset, nbytes)
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % _ALIGN)
    data_start = 8 + len(blob)
    entries = {name: Entry(d, s, data_start + o, n) for name, (d, s, o, n) in rel.items()}
    return struct.pack("<Q", len(blob)) + blob, entries


class SafetensorsWriter:
    """Writes one safetensors file whose tensor list is known up front.

    The header is written at once and the file is sized to its final length; tensor bytes then
    arrive as ranges at any offset (:meth:`write_at`), so a tensor can be produced tile by tile.
    A failed write (a full disk, an I/O error) raises `DeepseekV41ConversionError` naming the file.
    """

    def __init__(self, path: str | os.PathLike, tensors: list[tuple[str, str, tuple[int, ...]]], metadata=None):
        self.path = Path(path)
        blob, self.entries = layout(tensors, metadata)
        total = len(blob) + sum(e.nbytes for e in self.entries.values())
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._pwrite(blob, 0)
            os.ftruncate(self._fd, total)
        except OSError as exc:
            self._abandon()
            raise self._failure(exc) from None
        self.size = total

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._abandon()

    def _failure(self, exc: OSError) -> DeepseekV41ConversionError:
        return DeepseekV41ConversionError(f"{self.path}: cannot write ({exc.strerror or exc})")

    def _abandon(self) -> None:
        """Close without flushing (the file is being given up)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass

    def _pwrite(self, view, position: int) -> None:
        view = memoryview(view).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], position + done)

    def close(self) -> None:
        """Flush to disk and close.

        Raises:
            DeepseekV41ConversionError: the flush failed (a full disk shows here at the latest).
        """
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.fsync(fd)
            except OSError as exc:
                try:
                    os.close(fd)
                except OSError:
                    pass
                raise self._failure(exc) from None
            try:
                os.close(fd)
            except OSError as exc:
                raise self._failure(exc) from None

    def write_at(self, name: str, offset: int, data) -> None:
        """Write the bytes-like `data` into tensor `name` at byte `offset` (within the tensor).

        Raises:
            DeepseekV41ConversionError: the range leaves the tensor; the write failed (a full
                disk, an I/O error): the message names the file and the reason.
        """
        entry = self.entries[name]
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > entry.nbytes:
            raise DeepseekV41ConversionError(f"{self.path}: write of [{offset}, {offset + len(view)}) outside tensor {name!r}")
        try:
            self._pwrite(view, entry.start + offset)
        except OSError as exc:
            raise self._failure(exc) from None


__all__ = ["Entry", "Header", "SafetensorsReader", "SafetensorsWriter", "layout", "parse_json", "read_header"]
