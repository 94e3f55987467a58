"""Refusing NaN and Inf weights: which stored codes are not finite numbers, per safetensors dtype.

A checkpoint with a NaN weight loads and runs, and every logit comes out NaN. The converter looks
at every stored element as it streams it (and, for ``--link``, in one reading pass):

- ``F64`` / ``F32`` / ``F16`` / ``BF16``: all exponent bits set (Inf or NaN);
- ``F8_E4M3`` (e4m3fn, no Inf): the NaN codes ``0x7F`` and ``0xFF``;
- ``F8_E5M2``: all exponent bits set (Inf or NaN);
- ``F8_E8M0`` (power-of-two scales): ``0xFF`` is NaN, and ``0xF7``-``0xFE`` (2^120 and up) make
  the dequantized weight overflow (448 x 2^120 > 2^128);
- integer types, and packed fp4 (``I8``: E2M1 has no NaN or Inf code): every code is finite.

The rule is the loader's (`load_checks_deepseek_v41_vl.NONFINITE_CODES`, which ``from_pretrained``
applies to a loaded model), so the converter and the loader refuse the same codes. The test works
on the bits, in pieces of :data:`PIECE` elements, so its temporaries stay a few
MiB whatever the size of the tensor or the slice handed in.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..modeling.checkpoint_names_deepseek_v41_vl import DTYPE_SIZES, DeepseekV41ConversionError
from ..modeling.load_checks_deepseek_v41_vl import NONFINITE_CODES, nonfinite_mask

PIECE = 1 << 20  # elements tested at a time

# safetensors dtype -> the torch dtype whose non-finite codes it stores (the rule itself is the
# loader's NONFINITE_CODES)
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_WHAT = {"F8_E4M3": "the e4m3 NaN code", "F8_E8M0": "an e8m0 scale of 0xF7 or more (0xFF is NaN, the others 2^120 and up: the weights overflow)"}


def can_hold_nonfinite(dtype: str) -> bool:
    """Whether a stored `dtype` has NaN or Inf codes at all."""
    return dtype in _TORCH_DTYPES


def first_nonfinite(data: torch.Tensor, dtype: str) -> int | None:
    """The index of the first element of `data` (the raw bytes of whole elements of `dtype`, any
    shape, C order) that is NaN or Inf, or None when all are finite.

    Raises:
        DeepseekV41ConversionError: `data`'s byte count is not a whole number of elements.
    """
    if dtype not in _TORCH_DTYPES:
        return None
    flat = data.reshape(-1).view(torch.uint8)
    size = DTYPE_SIZES[dtype]
    if flat.numel() % size:
        raise DeepseekV41ConversionError(f"internal error: {flat.numel()} bytes are not whole {dtype} elements")
    codes = flat.view(NONFINITE_CODES[_TORCH_DTYPES[dtype]][0])  # one integer a element
    for start in range(0, codes.numel(), PIECE):
        bad = nonfinite_mask(codes[start : start + PIECE], _TORCH_DTYPES[dtype])
        if bad.any():
            return start + int(bad.nonzero()[0, 0])
    return None


def element(index: int) -> str:
    """The default position text of :func:`check_finite`: the flat element index."""
    return f"element {index}"


def check_finite(name: str, dtype: str, data: torch.Tensor, position: Callable[[int], str] = element, where: str | None = None) -> None:
    """Refuse `data` (raw bytes of some elements of tensor `name`) when one of them is NaN or Inf.

    Args:
        position: index in `data` -> where that element lies in the tensor (for the message).
        where: the file holding the tensor (for the message).

    Raises:
        DeepseekV41ConversionError: names the tensor, the element and its code.
    """
    index = first_nonfinite(data, dtype)
    if index is None:
        return
    size = DTYPE_SIZES[dtype]
    code = bytes(data.reshape(-1).view(torch.uint8)[index * size : (index + 1) * size].tolist())[::-1].hex()
    what = _WHAT.get(dtype, "NaN or Inf")
    place = f" in {where}" if where else ""
    raise DeepseekV41ConversionError(
        f"tensor {name!r}{place} holds {what} (0x{code}, {dtype}) at {position(index)}: the checkpoint is corrupt "
        "(a model converted from it would compute NaN logits); nothing was converted"
    )


__all__ = ["PIECE", "can_hold_nonfinite", "check_finite", "element", "first_nonfinite"]
