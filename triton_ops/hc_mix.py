"""The mHC collapse and expand of DeepSeek-V4.1 in one Triton launch each (fast numerics).

Mirrors `inference/model.py: Block.hc_pre` and `Block.hc_post` (the torch ops are
`modeling/hyper_connection_deepseek_v41_vl.py: DeepseekV41HyperConnection.pre / post`,
REFERENCE.md section 4). In torch each is a chain of broadcast products, a reduction over the
copies and casts, and `post` materialises an fp32 ``[T, hc, hc, D]`` product: at a 16K-token
prefill that is ~5 GiB written and read again per call, 80 calls a forward. Here a program takes
one token and a block of columns and keeps everything in registers::

    pre:   y[d]    = bf16( sum_i mix[i] * float(x[i, d]) )
    post:  out[j, d] = bf16( post[j] * float(f[d]) + sum_i comb[i, j] * float(res[i, d]) )

with torch's order: each product rounded to fp32 on its own (no FMA contraction), the sum over
the copies taken from 0 in ascending i, the expand's product added last, one rounding to bf16.

Launch: grid ``(T, cdiv(D, BLOCK_D))`` for T tokens; no host synchronisation, only the output
allocation: CUDA-graph capturable once compiled.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs use the torch ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

from .kernel_backend import on_input_device, triton_available, triton_interpret_mode

if triton is not None:
    from .fake_quant import _bf16_to_fp32
    from .quant_linear import _to_bf16_rne

ENV_BACKEND = "DEEPSEEK_V41_HC_MIX_BACKEND"
MAX_HC_MULT = 16
_BLOCK_D = 512


class HcMixError(ValueError):
    """Bad arguments to :func:`hc_pre_triton` / :func:`hc_post_triton`: shapes, dtypes, devices."""


if triton is not None:

    @triton.jit
    def _hc_pre_kernel(x_ptr, mix_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for i in tl.static_range(HC):
            m = tl.load(mix_ptr + t * HC + i)
            acc += m * _bf16_to_fp32(tl.load(x_ptr + (t * HC + i) * D + cols, mask=ok, other=0.0))
        tl.store(out_ptr + t * D + cols, _to_bf16_rne(acc), mask=ok)

    @triton.jit
    def _hc_post_kernel(f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr,
                        BLOCK_HC: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        j = tl.arange(0, BLOCK_HC)
        j_ok = j < HC
        acc = tl.zeros((BLOCK_HC, BLOCK_D), dtype=tl.float32)
        for i in tl.static_range(HC):
            c = tl.load(comb_ptr + (t * HC + i) * HC + j, mask=j_ok, other=0.0)  # comb[i, :]
            r = _bf16_to_fp32(tl.load(res_ptr + (t * HC + i) * D + cols, mask=ok, other=0.0))
            acc += c[:, None] * r[None, :]
        p = tl.load(post_ptr + t * HC + j, mask=j_ok, other=0.0)
        f = _bf16_to_fp32(tl.load(f_ptr + t * D + cols, mask=ok, other=0.0))
        out = p[:, None] * f[None, :] + acc
        tl.store(out_ptr + (t * HC + j[:, None]) * D + cols[None, :], _to_bf16_rne(out), mask=j_ok[:, None] & ok[None, :])


def _check_runnable(*tensors: torch.Tensor) -> None:
    if not triton_available():
        raise HcMixError("the mHC mix kernels need the triton package, which is not installed")
    device = tensors[0].device
    if device.type != "cuda" and not triton_interpret_mode():
        raise HcMixError(f"the mHC mix kernels need CUDA tensors (got {device.type}) or TRITON_INTERPRET=1")
    for t in tensors[1:]:
        if t.device != device:
            raise HcMixError(f"all tensors must be on {device}, got one on {t.device}")


def _stream(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    if x.dim() != 4 or x.dtype != torch.bfloat16:
        raise HcMixError(f"{name} must be bf16 [B, S, hc, D], got {x.dtype} {tuple(x.shape)}")
    if not 1 <= x.size(2) <= MAX_HC_MULT:
        raise HcMixError(f"{name} has {x.size(2)} copies; the kernels take 1 to {MAX_HC_MULT}")
    return x.size(0) * x.size(1), x.size(2), x.size(3)


def _fp32(t: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise HcMixError(f"{name} must be fp32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t.contiguous()


@on_input_device
def hc_pre_triton(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Collapse the copies: ``y = sum_i mix[i] * x[i]`` in fp32, as bf16 (`Block.hc_pre`).

    Args:
        x: bf16 ``[B, S, hc, D]``. mix: fp32 ``[B, S, hc]``.

    Returns:
        bf16 ``[B, S, D]``.

    Raises:
        HcMixError: other shapes or dtypes, tensors on two devices, Triton missing, or CPU
            tensors outside Triton's interpreter.
    """
    tokens, hc, dim = _stream(x, "x")
    mix = _fp32(mix, tuple(x.shape[:3]), "mix")
    _check_runnable(x, mix)
    x = x.contiguous()
    out = torch.empty(*x.shape[:2], dim, dtype=torch.bfloat16, device=x.device)
    if tokens and dim:
        _hc_pre_kernel[(tokens, triton.cdiv(dim, _BLOCK_D))](
            x, mix, out, dim, HC=hc, BLOCK_D=_BLOCK_D, num_warps=4, enable_fp_fusion=False
        )
    return out


@on_input_device
def hc_post_triton(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand and mix: ``out[j] = post[j] * f + sum_i comb[i, j] * residual[i]`` in fp32, as bf16
    (`Block.hc_post`).

    Args:
        f: bf16 ``[B, S, D]`` (the sublayer's output). residual: bf16 ``[B, S, hc, D]``.
        post: fp32 ``[B, S, hc]``. comb: fp32 ``[B, S, hc, hc]`` (first index = source copy).

    Returns:
        bf16 ``[B, S, hc, D]``.

    Raises:
        HcMixError: other shapes or dtypes, tensors on two devices, Triton missing, or CPU
            tensors outside Triton's interpreter.
    """
    tokens, hc, dim = _stream(residual, "residual")
    if f.dtype != torch.bfloat16 or tuple(f.shape) != (*residual.shape[:2], dim):
        raise HcMixError(f"f must be bf16 {[*residual.shape[:2], dim]}, got {f.dtype} {list(f.shape)}")
    post = _fp32(post, tuple(residual.shape[:3]), "post")
    comb = _fp32(comb, (*residual.shape[:3], hc), "comb")
    _check_runnable(residual, f, post, comb)
    residual, f = residual.contiguous(), f.contiguous()
    out = torch.empty(residual.shape, dtype=torch.bfloat16, device=residual.device)
    if tokens and dim:
        _hc_post_kernel[(tokens, triton.cdiv(dim, _BLOCK_D))](
            f, residual, post, comb, out, dim, HC=hc, BLOCK_HC=triton.next_power_of_2(hc), BLOCK_D=_BLOCK_D,
            num_warps=4, enable_fp_fusion=False,
        )
    return out


__all__ = ["ENV_BACKEND", "MAX_HC_MULT", "HcMixError", "hc_post_triton", "hc_pre_triton"]
