"""The Engram gate in one Triton launch (fast numerics).

After its lookup and its ``wkv`` projection, an Engram layer (`modeling/engram_deepseek_v41_vl.py:
DeepseekV41Engram`) adds the shared value to each hc copy of the stream, scaled by a gate of how
well that copy matches its key::

    h = float(hidden[..., c, :]),  key = float(kv[..., c * D : (c + 1) * D]),  w = float(q_c) * float(k_c)
    rstd = rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps)
    logit = sum(h * w * key) * rstd * D^-0.5
    gate = sigmoid(sign(logit) * sqrt(max(|logit|, floor)))        (0 where the token is masked)
    out[..., c, :] = bf16(h + gate * float(value)),  value = kv[..., hc * D :]

In torch (:func:`engram_gate_torch`, the reference's op order, what exact numerics and the CPU
run) that is about twenty launches over ``[B, S, hc, D]`` fp32 tensors. This kernel runs one
program per (token, copy): the three sums in one pass over the row, the gate, then the output
in a second pass. Its sums add in another order than torch's, its square roots are the GPU's
IEEE-rounded ones and the compiled ``h + gate * value`` may be one fused multiply-add, so a gate
may differ in the last fp32 bits and an output by one bf16 ulp now and then, or, where ``h`` and
``gate * value`` nearly cancel, by about 1e-7 of ``|value|``: only fast numerics use it. A masked
token's copies come out as their input, exactly; a NaN logit gives a NaN gate, as in torch.

bf16 in and out on the bits (the interpreter's casts truncate). No host synchronisation and only
the output allocation: CUDA-graph capturable once compiled. Mirrors `inference/model.py: Engram`
(REFERENCE.md section 5, "Lookup and gate").
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import kernel_interpreted, on_input_device, unrunnable

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .quant_linear import _to_bf16_rne

ENV_BACKEND = "DEEPSEEK_V41_ENGRAM_GATE_BACKEND"
_BLOCK = 1024  # columns per step of a row's loop


class EngramGateError(ValueError):
    """Bad arguments to :func:`engram_gate_triton`: dtypes, shapes, devices."""


def engram_gate_torch(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    token_mask: torch.Tensor | None,
    eps: float,
    floor: float,
) -> torch.Tensor:
    """The gate in the reference's torch ops (the arguments of :func:`engram_gate_triton`; any
    float dtypes, autograd included): ``[B, S, hc, D]`` in the dtype of `hidden_states`."""
    hc, dim = hidden_states.shape[-2:]
    key, value = kv.split([hc * dim, dim], dim=-1)
    key = key.float().unflatten(-1, (hc, dim))
    weight = q_weight.float() * k_weight.float()
    h = hidden_states.float()
    # RMS-normalized per (token, copy) over hidden_size, not jointly over the copies; the
    # operation order is the reference's, so the fp32 result is bit-identical.
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    logit = (h * weight * key).sum(-1) * rstd * dim**-0.5
    # signed square root before the sigmoid, as the training kernel does
    gate = torch.sigmoid(torch.copysign(logit.abs().clamp_min(floor).sqrt(), logit))
    if token_mask is not None:
        gate = gate.masked_fill(~token_mask.bool().unsqueeze(-1), 0)
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(hidden_states.dtype)


if triton is not None:

    @triton.jit
    def _engram_gate_kernel(
        h_ptr, kv_ptr, q_ptr, k_ptr, mask_ptr, out_ptr, D, HC, eps, scale, floor,
        HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)  # token * HC + copy
        token = pid // HC
        copy = pid % HC
        h_row = h_ptr + pid * D
        key_row = kv_ptr + token * (HC + 1) * D + copy * D
        value_row = kv_ptr + token * (HC + 1) * D + HC * D
        hh = tl.zeros([BLOCK], dtype=tl.float32)
        kk = tl.zeros([BLOCK], dtype=tl.float32)
        hwk = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < D
            h = _bf16_to_fp32(tl.load(h_row + cols, mask=ok, other=0.0))
            key = _bf16_to_fp32(tl.load(key_row + cols, mask=ok, other=0.0))
            w = _bf16_to_fp32(tl.load(q_ptr + copy * D + cols, mask=ok, other=0.0)) * _bf16_to_fp32(
                tl.load(k_ptr + copy * D + cols, mask=ok, other=0.0)
            )
            hh += h * h
            kk += key * key
            hwk += h * w * key
        rstd_h = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(hh, axis=0) / D + eps))
        rstd_k = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(kk, axis=0) / D + eps))
        logit = tl.sum(hwk, axis=0) * (rstd_h * rstd_k) * scale
        root = tl.sqrt_rn(tl.maximum(tl.abs(logit), floor))
        signed = tl.where(logit.to(tl.int32, bitcast=True) < 0, -root, root)  # copysign: -0 too
        gate = tl.div_rn(1.0, 1.0 + tl.exp(-signed))
        gate = tl.where(logit != logit, logit, gate)  # NaN stays NaN (the GPU's maximum drops it)
        if HAS_MASK:
            gate = tl.where(tl.load(mask_ptr + token) != 0, gate, 0.0)
        out_row = out_ptr + pid * D
        for start in range(0, D, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < D
            h = _bf16_to_fp32(tl.load(h_row + cols, mask=ok, other=0.0))
            value = _bf16_to_fp32(tl.load(value_row + cols, mask=ok, other=0.0))
            tl.store(out_row + cols, _to_bf16_rne(h + gate * value), mask=ok)


def _kernel_is_interpreted() -> bool:
    # triton.jit picks the interpreter when the kernel is *defined* (TRITON_INTERPRET at import)
    return triton is not None and kernel_interpreted(_engram_gate_kernel)


def _problem(hidden_states, kv, q_weight, k_weight, token_mask) -> str | None:
    # what keeps `engram_gate_triton` from taking these arguments (None: nothing)
    tensors = (hidden_states, kv, q_weight, k_weight)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "hidden_states, kv, q_weight and k_weight must be tensors"
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return "hidden_states, kv, q_weight and k_weight must be bf16, got " + ", ".join(str(t.dtype) for t in tensors)
    if hidden_states.dim() != 4:
        return f"hidden_states must be [B, S, hc, D], got {tuple(hidden_states.shape)}"
    batch, seq, hc, dim = hidden_states.shape
    if kv.shape != (batch, seq, (hc + 1) * dim):
        return f"kv must be [{batch}, {seq}, {(hc + 1) * dim}] (hc keys and the value), got {tuple(kv.shape)}"
    if q_weight.shape != (hc, dim) or k_weight.shape != (hc, dim):
        return f"q_weight and k_weight must be [{hc}, {dim}], got {tuple(q_weight.shape)} and {tuple(k_weight.shape)}"
    if token_mask is not None and (token_mask.dtype != torch.bool or token_mask.shape != (batch, seq)):
        return f"token_mask must be bool [{batch}, {seq}], got {token_mask.dtype} {tuple(token_mask.shape)}"
    devices = {t.device for t in (*tensors, *(() if token_mask is None else (token_mask,)))}
    if len(devices) > 1:
        return f"the tensors are on several devices: {sorted(map(str, devices))}"
    return unrunnable(hidden_states.device, _kernel_is_interpreted(), "engram_gate_triton")


def kernel_runs(hidden_states, kv, q_weight, k_weight, token_mask=None) -> bool:
    """Whether :func:`engram_gate_triton` takes these arguments (else it raises, naming why): the
    caller asks first and otherwise runs :func:`engram_gate_torch`."""
    return _problem(hidden_states, kv, q_weight, k_weight, token_mask) is None


@on_input_device
def engram_gate_triton(
    hidden_states: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    token_mask: torch.Tensor | None,
    eps: float,
    floor: float,
) -> torch.Tensor:
    """Add the gated Engram value to every hc copy, in one launch.

    Args:
        hidden_states: bf16 ``[B, S, hc, D]``, the stream entering the block.
        kv: bf16 ``[B, S, (hc + 1) * D]``, the ``wkv`` output: hc keys, then the shared value.
        q_weight, k_weight: bf16 ``[hc, D]``, used as their product.
        token_mask: bool ``[B, S]``, False where the gate is 0 (image positions), or None.
        eps: the RMS norms' epsilon; floor: the ``|logit|`` floor before the signed square root.

    Returns:
        bf16 ``[B, S, hc, D]``.

    Raises:
        EngramGateError: other dtypes or shapes, tensors on several devices, Triton missing, or
            CPU tensors outside Triton's interpreter.
    """
    problem = _problem(hidden_states, kv, q_weight, k_weight, token_mask)
    if problem is not None:
        raise EngramGateError(problem)
    batch, seq, hc, dim = hidden_states.shape
    hidden, kv = hidden_states.contiguous(), kv.contiguous()
    out = torch.empty_like(hidden)
    rows = batch * seq * hc
    if rows == 0:
        return out
    mask = hidden if token_mask is None else token_mask.contiguous().view(torch.uint8)  # unread without a mask
    _engram_gate_kernel[(rows,)](
        hidden, kv, q_weight.contiguous(), k_weight.contiguous(), mask, out, dim, hc, float(eps), dim**-0.5, float(floor),
        HAS_MASK=token_mask is not None, BLOCK=min(_BLOCK, triton.next_power_of_2(dim)), num_warps=4,
    )
    return out


__all__ = ["ENV_BACKEND", "EngramGateError", "engram_gate_torch", "engram_gate_triton", "kernel_runs"]
