"""Choosing between a Triton kernel and its torch fallback; shared by every op in `triton_ops`.

Each op takes ``backend``: ``"triton"``, ``"torch"``, or ``"auto"`` / ``None``. Auto reads the op's
environment variable first (so a user can force a backend without touching code), then picks
Triton for CUDA tensors and torch elsewhere. On the CPU a Triton kernel runs only inside Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests exercise the kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

try:  # triton is optional: CPU-only installs use the torch fallbacks
    import triton
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    """True when the `triton` package imports."""
    return triton is not None


def triton_interpret_mode() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older Triton without `knobs`
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_interpreted(kernel) -> bool:
    """Whether `kernel` (a ``triton.jit`` function) runs in Triton's CPU interpreter: decided when
    it was *defined*, by ``TRITON_INTERPRET`` at that time, whatever the variable says now."""
    return type(kernel).__name__ == "InterpretedFunction"


def unrunnable(device: torch.device, interpreted: bool, what: str) -> str | None:
    """Why a Triton kernel cannot run on tensors of `device`, or None: Triton missing, a device
    that is neither CUDA nor the CPU (meta, another accelerator), or the CPU while the kernel is
    not interpreted (`interpreted`: defined under the interpreter, `kernel_interpreted`) or the
    interpreter is off. `what` names the op."""
    if not triton_available():
        return f"{what} needs the triton package, which is not installed"
    if device.type not in ("cuda", "cpu"):
        return f"{what} runs on CUDA (or the CPU under Triton's interpreter), got {device.type}"
    if device.type != "cuda" and not (interpreted and triton_interpret_mode()):
        return (f"{what} needs CUDA tensors (got {device.type}) or Triton's interpreter "
                "(TRITON_INTERPRET=1 before this module is imported)")
    return None


def resolve_backend(
    backend: str | None, device: torch.device, *, env_var: str, error: type[Exception], what: str
) -> str:
    """The concrete backend (``"triton"`` or ``"torch"``) for tensors on `device`.

    Args:
        backend: ``"triton"``, ``"torch"``, ``"auto"`` or ``None`` (both: `env_var`, else auto).
        device: where the op's tensors live; auto means Triton on CUDA only.
        env_var: the op's environment override, read at each call.
        error: the op's exception class (a ValueError subclass).
        what: the op's name, for the message.

    Raises:
        error: an unknown backend name, from the argument or the environment variable.
    """
    if backend is None or backend == "auto":
        backend = os.environ.get(env_var, "auto") or "auto"
    backend = backend.lower()
    if backend not in BACKENDS:
        raise error(f"{what} backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend


def on_input_device(fn):
    """Decorator: run `fn` with the GPU of its first positional tensor argument as the current
    CUDA device (the decorated ops take their main tensor positionally, before any other).

    Triton launches a kernel on the current device's current stream, not on its tensors' device:
    for tensors on another GPU (a layer placed there by a device_map, called outside its own
    device context) the kernel would run on the wrong GPU's stream, unordered with the work that
    makes its inputs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        context = contextlib.nullcontext()
        if tensor is not None and tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
            context = torch.cuda.device(tensor.device)
        with context:
            return fn(*args, **kwargs)

    return wrapper
