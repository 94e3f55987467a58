"""The numerics plan: one frozen object that says how every op of the model computes.

Two modes (`configuration_deepseek_v41_vl.NUMERICS_MODES`, the one definition of the allowed values):

- ``"exact"``: the reference's op sequence and shapes; on the CPU every boundary is bitwise the
  reference's. Only kernels that are bitwise equal to their torch ops (:data:`BITWISE_OPS`) may
  run.
- ``"fast"``: the same formulas with fused kernels, dequantized bf16 GEMMs and query chunks that
  bound the memory of long prefills.

Each op with a Triton kernel has one backend choice (``"auto"``, ``"triton"`` or ``"torch"``),
read ONCE from its environment variable (:data:`KERNEL_ENV`) when the plan is made, or given as
an override. "auto" means Triton for CUDA tensors, torch elsewhere. The kernels' other choices
(:data:`KERNEL_OPTION_ENV`: how the routed-expert kernel multiplies quantized weights) are read the
same way, once, into the plan (:meth:`DeepseekV41Numerics.option`).

The model makes one plan at build time and every module that needs it holds that same object
(attribute ``numerics``). `DeepseekV41Transformer.set_numerics` (or assigning
``config.numerics`` / ``config.text_config.numerics``, picked up at the next forward) makes a new
plan and hands it to every module (:func:`apply_numerics`), so a change after loading takes
effect everywhere at once. This mirrors the reference's one numerics decision
(`inference/model.py: linear()`), taken here per op instead of per call.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..triton_ops.dequant import ENV_BACKEND as DEQUANT_ENV
from ..triton_ops.engram_gate import ENV_BACKEND as ENGRAM_GATE_ENV
from ..triton_ops.engram_hash import ENV_BACKEND as ENGRAM_HASH_ENV
from ..triton_ops.fake_quant import ENV_BACKEND as FAKE_QUANT_ENV
from ..triton_ops.hc_mix import ENV_BACKEND as HC_MIX_ENV
from ..triton_ops.hc_sinkhorn import ENV_BACKEND as HC_SINKHORN_ENV
from ..triton_ops.index_topk import ENV_BACKEND as INDEX_TOPK_ENV
from ..triton_ops.kernel_backend import BACKENDS, triton_available
from ..triton_ops.moe_experts import DEFAULT_MMA as MOE_EXPERTS_DEFAULT_MMA
from ..triton_ops.moe_experts import ENV_BACKEND as MOE_EXPERTS_ENV
from ..triton_ops.moe_experts import ENV_MMA as MOE_EXPERTS_MMA_ENV
from ..triton_ops.moe_experts import MMA_CHOICES as MOE_EXPERTS_MMA_CHOICES
from ..triton_ops.moe_prefill import ENV_BACKEND as MOE_PREFILL_ENV
from ..triton_ops.quant_linear import ENV_BACKEND as QUANT_LINEAR_ENV
from ..triton_ops.rms_norm import ENV_BACKEND as RMS_NORM_ENV
from ..triton_ops.rope import ENV_BACKEND as ROPE_ENV
from ..triton_ops.sparse_attention import ENV_BACKEND as SPARSE_ATTENTION_ENV
from ..triton_ops.swiglu import ENV_BACKEND as SWIGLU_ENV
from ..triton_ops.vision_rope import ENV_BACKEND as VISION_ROPE_ENV
from .configuration_deepseek_v41_vl import NUMERICS_MODES, check_numerics_mode

# op -> the environment variable that forces its backend (None: no variable, "auto" unless overridden)
KERNEL_ENV: dict[str, str | None] = {
    "rms_norm": RMS_NORM_ENV,
    "sparse_attention": SPARSE_ATTENTION_ENV,
    "hc_sinkhorn": HC_SINKHORN_ENV,
    "hc_mix": HC_MIX_ENV,
    "quant_linear": QUANT_LINEAR_ENV,
    "dequant": DEQUANT_ENV,
    "fake_quant": FAKE_QUANT_ENV,
    "moe_routing": None,
    "moe_experts": MOE_EXPERTS_ENV,
    "moe_prefill": MOE_PREFILL_ENV,
    "vision_rope": VISION_ROPE_ENV,
    "swiglu": SWIGLU_ENV,
    "rope": ROPE_ENV,
    "index_topk": INDEX_TOPK_ENV,
    "engram_gate": ENGRAM_GATE_ENV,
    "engram_hash": ENGRAM_HASH_ENV,
}
# kernel option -> (its environment variable, the allowed values, the default); read once per plan
KERNEL_OPTION_ENV: dict[str, tuple[str, tuple[str, ...], str]] = {
    # "scaled" (tl.dot_scaled) or "manual": how the routed-expert kernel multiplies quantized weights
    "moe_experts_mma": (MOE_EXPERTS_MMA_ENV, MOE_EXPERTS_MMA_CHOICES, MOE_EXPERTS_DEFAULT_MMA),
}
# kernels whose outputs equal their torch fallbacks bit for bit: exact numerics may run them
BITWISE_OPS = frozenset({"dequant", "fake_quant", "vision_rope", "engram_hash"})

# Fast numerics bound the largest intermediates by splitting the queries into chunks; exact keeps
# the reference's single-call shapes (CPU GEMM rounding may depend on them).
FAST_MAX_ELEMENTS = 1 << 26
# On a GPU a larger budget (0.5 GiB of bf16 per intermediate) keeps each chunk's kernels long
# enough that launch overhead stays small against their run time.
FAST_MAX_ELEMENTS_CUDA = 1 << 28


class DeepseekV41NumericsError(ValueError):
    """An unknown numerics mode, op or backend name."""


@dataclass(frozen=True)
class DeepseekV41Numerics:
    """How the model computes: the mode and one backend per kernel op. Frozen and hashable (it is
    part of the key of captured CUDA graphs).

    Attributes:
        mode: ``"fast"`` or ``"exact"``.
        kernels: ``((op, choice), ...)`` for every op of :data:`KERNEL_ENV`, choice ``"auto"``,
            ``"triton"`` or ``"torch"``.
        options: ``((name, value), ...)`` for every option of :data:`KERNEL_OPTION_ENV` (a name
            left out reads as its default).

    Make one with :meth:`resolve`.
    """

    mode: str
    kernels: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def resolve(cls, mode: str = "fast", **backends: str) -> "DeepseekV41Numerics":
        """The plan for `mode`, each op's backend from `backends` (op name -> choice) or else its
        environment variable, read now; likewise each kernel option (option name -> value, or
        its variable, or its default).

        Raises:
            DeepseekV41NumericsError: an unknown mode, op, option, backend name or option value
                (from an argument or an environment variable, which is named).
        """
        check_numerics_mode(mode, DeepseekV41NumericsError)
        unknown = sorted(set(backends) - set(KERNEL_ENV) - set(KERNEL_OPTION_ENV))
        if unknown:
            raise DeepseekV41NumericsError(
                f"unknown kernel ops {unknown}; the ops are {sorted(KERNEL_ENV)}, the options {sorted(KERNEL_OPTION_ENV)}"
            )
        options = []
        for name, (env_var, allowed, default) in KERNEL_OPTION_ENV.items():
            if name in backends:
                value, source = backends[name], f"{name}="
            else:
                value, source = os.environ.get(env_var) or default, f"${env_var}="
            value = str(value).lower()
            if value not in allowed:
                raise DeepseekV41NumericsError(f"{source}{value!r}: {name} must be one of {allowed}")
            options.append((name, value))
        kernels = []
        for op, env_var in KERNEL_ENV.items():
            if op in backends:
                choice, source = backends[op], f"{op}="
            else:
                choice, source = (os.environ.get(env_var) if env_var else None) or "auto", f"${env_var}="
            choice = str(choice).lower()
            if choice not in BACKENDS:
                raise DeepseekV41NumericsError(f"{source}{choice!r}: a backend must be one of {BACKENDS}")
            kernels.append((op, choice))
        return cls(mode, tuple(kernels), tuple(options))

    def replace(self, mode: str | None = None, **backends: str) -> "DeepseekV41Numerics":
        """This plan with another mode and / or some ops' backends (or kernel options) changed;
        the others keep theirs (the environment is not read again).

        Raises:
            DeepseekV41NumericsError: an unknown mode, op, option, backend name or option value.
        """
        kept = {op: choice for op, choice in self.kernels + self.options if op not in backends}
        plan = DeepseekV41Numerics.resolve(self.mode if mode is None else mode, **kept, **backends)
        return plan

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    def choice(self, op: str) -> str:
        """The op's configured choice (``"auto"``, ``"triton"`` or ``"torch"``).

        Raises:
            DeepseekV41NumericsError: `op` is not one of :data:`KERNEL_ENV`.
        """
        for name, choice in self.kernels:
            if name == op:
                return choice
        raise DeepseekV41NumericsError(f"unknown kernel op {op!r}; the ops are {sorted(KERNEL_ENV)}")

    def option(self, name: str) -> str:
        """The value of kernel option `name` (:data:`KERNEL_OPTION_ENV`), e.g. ``"moe_experts_mma"``.

        Raises:
            DeepseekV41NumericsError: `name` is not one of :data:`KERNEL_OPTION_ENV`.
        """
        if name not in KERNEL_OPTION_ENV:
            raise DeepseekV41NumericsError(f"unknown kernel option {name!r}; the options are {sorted(KERNEL_OPTION_ENV)}")
        return dict(self.options).get(name, KERNEL_OPTION_ENV[name][2])

    def backend(self, op: str, device: torch.device) -> str:
        """``"triton"`` or ``"torch"``: what `op` runs for tensors on `device`. Exact numerics
        run torch except for the bitwise-equal kernels. Memoised: modules ask at every call."""
        return _backend(self, op, device.type if isinstance(device, torch.device) else torch.device(device).type)

    def query_chunk(self, per_query_elements: int, device: torch.device | None = None) -> int | None:
        """Queries per chunk so that a chunk's largest intermediate stays within the budget; None =
        all at once (exact numerics)."""
        if self.exact:
            return None
        budget = FAST_MAX_ELEMENTS_CUDA if device is not None and device.type == "cuda" else FAST_MAX_ELEMENTS
        return max(1, budget // max(per_query_elements, 1))


@functools.lru_cache(maxsize=None)
def _backend(plan: DeepseekV41Numerics, op: str, device_type: str) -> str:
    choice = plan.choice(op)
    if plan.exact and op not in BITWISE_OPS:
        return "torch"
    if choice == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    return choice


def as_numerics(value: "DeepseekV41Numerics | str") -> DeepseekV41Numerics:
    """`value` itself, or the plan of a mode name (backends from the environment).

    Raises:
        DeepseekV41NumericsError: neither a plan nor a mode name.
    """
    if isinstance(value, DeepseekV41Numerics):
        return value
    if isinstance(value, str):
        return DeepseekV41Numerics.resolve(value)
    raise DeepseekV41NumericsError(f"numerics must be one of {NUMERICS_MODES} or a DeepseekV41Numerics, got {value!r}")


def plan_for(config, numerics: "DeepseekV41Numerics | str | None" = None) -> DeepseekV41Numerics:
    """The plan a module built from `config` holds: `numerics` (a plan or a mode name) when
    given, else the plan of ``config.numerics`` (backends from the environment).

    Raises:
        DeepseekV41NumericsError: an unknown mode.
    """
    return as_numerics(config.numerics if numerics is None else numerics)


def apply_numerics(module: nn.Module, plan: DeepseekV41Numerics) -> None:
    """Hand `plan` to `module` and every submodule that holds a plan (attribute ``numerics``)."""
    for sub in module.modules():
        if isinstance(sub.__dict__.get("numerics"), DeepseekV41Numerics):
            sub.numerics = plan


__all__ = [
    "BITWISE_OPS",
    "DeepseekV41Numerics",
    "DeepseekV41NumericsError",
    "KERNEL_ENV",
    "KERNEL_OPTION_ENV",
    "NUMERICS_MODES",
    "apply_numerics",
    "as_numerics",
    "plan_for",
]
