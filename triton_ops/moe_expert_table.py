"""The routed experts' weight table: where each expert's w1 / w3 / w2 weights and e8m0 scales
live, recorded once as byte (bf16: element) offsets from one base tensor, for the Triton kernels that
read experts in place (`moe_experts.py` for decode rows, `moe_prefill.py` for prefill).

:func:`build_expert_table` checks the storage (one format for all experts, shapes, contiguity,
device, element alignment) and builds the int64 ``[E, 6]`` offsets on the experts' device;
:class:`ExpertTableCache` keeps a table until the experts' device, storage or first / last addresses
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .formats import BLOCK as QUANT_GROUP  # activation fake-quant group and e8m0 weight-scale group along K

__all__ = ["QUANT_GROUP", "ExpertTableCache", "ExpertWeightTable", "MoEExpertsError", "build_expert_table",
           "expert_table_key"]

_FORMATS = {"bf16": 0, "fp4": 1, "fp8": 2}
# weight offsets that are multiples of this many elements (>= 16 bytes) let the kernel promise
# 16-byte alignment to Triton (vectorized, asynchronous weight loads)
_ALIGN_ELEMENTS = 16


class MoEExpertsError(ValueError):
    """Bad arguments to the MoE expert kernels: shapes, dtypes, devices, storage or backend."""


@dataclass
class ExpertWeightTable:
    """Where every expert's weights live, for the kernels. Built by :func:`build_expert_table`.

    Attributes:
        key: :func:`expert_table_key` of the experts it was built from.
        fmt: ``"fp4"``, ``"fp8"`` or ``"bf16"``.
        hidden_size, intermediate_size: ``D`` and ``I``.
        n_experts: ``E``.
        swiglu_limit: the experts' clamp (0 = none).
        weight_base: expert 0's w1 weight (uint8 view for fp4 / fp8, bf16 otherwise).
        scale_base: expert 0's w1 scale as uint8, or None for bf16.
        offsets: int64 ``[E, 6]`` on the experts' device: offsets of (w1, w3, w2) weights from
            `weight_base` and of (s1, s3, s2) scales from `scale_base`, in elements of the base.
        aligned: every weight offset is a multiple of 16 elements (the kernels then tell Triton
            so; true for separately allocated tensors).
    """

    key: tuple
    fmt: str
    hidden_size: int
    intermediate_size: int
    n_experts: int
    swiglu_limit: float
    weight_base: torch.Tensor
    scale_base: torch.Tensor | None
    offsets: torch.Tensor
    aligned: bool


def _linears(expert):
    return expert.w1, expert.w3, expert.w2


def expert_table_key(experts: Sequence) -> tuple:
    """Cheap identity of a list of experts' storage: device, dtype, count, and the addresses of the
    first and last expert's weights and scales. O(1) in the number of experts (a full check would
    cost ~2k ``data_ptr`` calls per layer per step); replacing a *middle* expert's tensors without
    touching the first or last one needs :meth:`ExpertTableCache.clear`."""
    first, last = experts[0], experts[len(experts) - 1]
    ptrs = []
    for expert in (first, last):
        for lin in _linears(expert):
            ptrs.append(lin.weight.data_ptr())
            ptrs.append(None if lin.scale is None else lin.scale.data_ptr())
    return (first.w1.weight.device, first.w1.weight_dtype, len(experts), tuple(ptrs))


def _check_tensor(t: torch.Tensor, shape: tuple, what: str, device: torch.device) -> None:
    if tuple(t.shape) != shape:
        raise MoEExpertsError(f"{what}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise MoEExpertsError(f"{what} is not contiguous (the kernels index rows by a fixed stride)")
    if t.device != device:
        raise MoEExpertsError(f"{what} is on {t.device}, expert 0 on {device}")


def build_expert_table(experts: Sequence) -> ExpertWeightTable:
    """Record the storage of `experts` for :func:`moe_experts_triton`.

    Args:
        experts: a sequence of ``E`` SwiGLU experts as `DeepseekV41Expert` (attributes ``w1``,
            ``w2``, ``w3``: `DeepseekV41Linear` with ``weight``, ``scale``, ``weight_dtype``,
            ``in_features``, ``out_features``; and ``swiglu_limit``), all with one storage format
            (``"fp4"``, ``"fp8"`` or ``"bf16"``), one shape and one device.

    Returns:
        An :class:`ExpertWeightTable`; its ``offsets`` tensor is copied to the device (a
        host-to-device copy: build it before capturing a CUDA graph).

    Raises:
        MoEExpertsError: no experts, an unsupported or mixed storage format, mismatched shapes,
            devices or swiglu limits, non-contiguous tensors, offsets not a whole number of base
            elements, or a call while the current CUDA stream is being captured.
    """
    if len(experts) == 0:
        raise MoEExpertsError("no experts")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise MoEExpertsError(
            "the expert table cannot be built during CUDA graph capture (it copies to the device): "
            "run one call eagerly first"
        )
    first = experts[0]
    fmt = first.w1.weight_dtype
    if fmt not in _FORMATS:
        raise MoEExpertsError(f"expert storage {fmt!r} is not supported by the kernels (one of {sorted(_FORMATS)})")
    d, i = first.w1.in_features, first.w1.out_features
    if d % QUANT_GROUP or i % QUANT_GROUP:
        raise MoEExpertsError(f"hidden size {d} and expert width {i} must be multiples of {QUANT_GROUP}")
    device = first.w1.weight.device
    limit = float(first.swiglu_limit)
    # logical [out, in] of w1, w3, w2
    shapes = ((i, d), (i, d), (d, i))
    weight_base = first.w1.weight
    scale_base = first.w1.scale
    elem = weight_base.element_size()
    offsets = []
    aligned = True
    for e, expert in enumerate(experts):
        if float(expert.swiglu_limit) != limit:
            raise MoEExpertsError(f"expert {e} has swiglu_limit {expert.swiglu_limit}, expert 0 {limit}")
        row_w, row_s = [], []
        for name, lin, (n, k) in zip(("w1", "w3", "w2"), _linears(expert), shapes):
            what = f"experts[{e}].{name}"
            if lin.weight_dtype != fmt:
                raise MoEExpertsError(f"{what} stores {lin.weight_dtype!r}, expert 0 {fmt!r}")
            if (lin.out_features, lin.in_features) != (n, k):
                raise MoEExpertsError(f"{what} is [{lin.out_features}, {lin.in_features}], expected [{n}, {k}]")
            w_shape = (n, k // 2) if fmt == "fp4" else (n, k)
            _check_tensor(lin.weight, w_shape, f"{what}.weight", device)
            diff = lin.weight.data_ptr() - weight_base.data_ptr()
            if diff % elem:
                raise MoEExpertsError(f"{what}.weight is not element-aligned with experts[0].w1.weight")
            aligned &= (diff // elem) % _ALIGN_ELEMENTS == 0
            row_w.append(diff // elem)
            if fmt == "bf16":
                row_s.append(0)
                continue
            s_shape = (n, k // QUANT_GROUP) if fmt == "fp4" else (-(-n // QUANT_GROUP), -(-k // QUANT_GROUP))
            _check_tensor(lin.scale, s_shape, f"{what}.scale", device)
            row_s.append(lin.scale.data_ptr() - scale_base.data_ptr())
        offsets.append(row_w + row_s)
    table = torch.tensor(offsets, dtype=torch.int64).to(device)
    return ExpertWeightTable(
        key=expert_table_key(experts),
        fmt=fmt,
        hidden_size=d,
        intermediate_size=i,
        n_experts=len(experts),
        swiglu_limit=limit,
        weight_base=weight_base.detach().view(torch.uint8) if fmt != "bf16" else weight_base.detach(),
        scale_base=None if scale_base is None else scale_base.detach().view(torch.uint8),
        offsets=table,
        aligned=bool(aligned),
    )


class ExpertTableCache:
    """One :class:`ExpertWeightTable`, rebuilt when :func:`expert_table_key` of the experts changes
    (``.to()``, a new device, replaced first / last expert parameters). Keep one per MoE module."""

    def __init__(self):
        self._table: ExpertWeightTable | None = None

    def get(self, experts: Sequence) -> ExpertWeightTable:
        """The table for `experts`, built on first use or after a storage change.

        Raises:
            MoEExpertsError: as :func:`build_expert_table`.
        """
        key = expert_table_key(experts)
        if self._table is None or self._table.key != key:
            self._table = build_expert_table(experts)
        return self._table

    def clear(self) -> None:
        """Forget the table (call after replacing a middle expert's tensors in place)."""
        self._table = None
