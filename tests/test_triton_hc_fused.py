"""The mHC mixes in two launches (`triton_ops/hc_mix.py: hc_mixes_sinkhorn_triton`), run by Triton's
CPU interpreter: bit for bit the projection (`hc_mixes_triton`, two launches) followed by the split
+ Sinkhorn (`hc_split_sinkhorn_triton`, one launch), which it replaces at decode; which calls of
`DeepseekV41HyperConnection.mixes` take it; bad arguments.
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl as hyper
from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection
from deepseek_v41_vl.triton_ops import hc_mix, hc_sinkhorn
from deepseek_v41_vl.triton_ops.hc_mix import HcMixError, hc_mixes_sinkhorn_triton, hc_mixes_triton
from deepseek_v41_vl.triton_ops.hc_sinkhorn import HcSinkhornError, hc_split_sinkhorn_triton
from deepseek_v41_vl.triton_ops.kernel_backend import kernel_interpreted

NORM_EPS, HC_EPS = 1e-6, 1e-6


def _inputs(batch: int, seq: int, hc: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, seq, hc, dim, generator=g) * torch.logspace(-1, 1, dim)).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=g) * (hc * dim) ** -0.5
    scale = 0.5 + torch.rand(3, generator=g)
    base = torch.randn((2 + hc) * hc, generator=g)
    return x, fn, scale, base


def _unfused(x, fn, scale, base, iters):
    m = hc_mixes_triton(x, fn, NORM_EPS)
    return hc_split_sinkhorn_triton(m, scale, base, x.size(2), iters, HC_EPS)


def _assert_equal(got, want):
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32 and a.is_contiguous()
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "batch,seq,hc,dim,iters",
    [
        (1, 1, 4, 256, 20),  # one decode row, split over 8 programs, the release's 20 rounds
        (1, 3, 4, 96, 3),  # three rows, a ragged last K step
        (3, 1, 4, 40, 1),  # the first round only (softmax + column pass)
        (2, 3, 3, 64, 7),  # hc 3: padded copies (BLOCK_HC 4)
        (1, hc_mix.MIXES_MAX_ROWS, 4, 8, 2),  # the most rows the module sends here: 16 row blocks, no split
    ],
)
def test_fused_is_bit_identical_to_the_two_calls(batch, seq, hc, dim, iters):
    x, fn, scale, base = _inputs(batch, seq, hc, dim, seed=batch * seq + dim + iters)
    _assert_equal(hc_mixes_sinkhorn_triton(x, fn, NORM_EPS, scale, base, iters, HC_EPS),
                  _unfused(x, fn, scale, base, iters))


def test_strided_inputs_and_no_rows():
    x, fn, scale, base = _inputs(1, 2, 4, 64, seed=3)
    wide = torch.cat([x, x], dim=-1)[..., :64]  # not contiguous
    _assert_equal(hc_mixes_sinkhorn_triton(wide, fn, NORM_EPS, scale, base, 4, HC_EPS),
                  _unfused(x, fn, scale, base, 4))
    pre, post, comb = hc_mixes_sinkhorn_triton(x[:, :0], fn, NORM_EPS, scale, base, 4, HC_EPS)
    assert pre.shape == post.shape == (1, 0, 4) and comb.shape == (1, 0, 4, 4)


def test_kernels_are_decorated_per_interpreter_mode():
    # the interpreter's kernels call the interpreter's helpers (a kernel resolves helpers in its scope)
    kernel = hc_sinkhorn._jit("_hc_mixes_sinkhorn_kernel")
    assert kernel_interpreted(kernel) and kernel is hc_sinkhorn._jit("_hc_mixes_sinkhorn_kernel")
    scope = kernel.fn.__globals__
    assert scope is not vars(hc_sinkhorn)
    for name in ("_mixes_finish", "_split_sinkhorn", "_hc_sinkhorn_kernel"):
        assert kernel_interpreted(scope[name]) and scope[name] is hc_sinkhorn._jit(name)
    assert kernel_interpreted(hc_mix._mixes_finish) and kernel_interpreted(hc_mix._hc_mixes_finish_kernel)


def _spy(monkeypatch):
    calls = []
    for name in ("hc_mixes_sinkhorn_triton", "hc_mixes_triton", "hc_split_sinkhorn_triton"):
        real = getattr(hyper, name)
        monkeypatch.setattr(hyper, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    return calls


@pytest.mark.parametrize(
    "mix_backend,sinkhorn_backend,want",
    [
        ("triton", "triton", ["hc_mixes_sinkhorn_triton"]),
        ("triton", "torch", ["hc_mixes_triton"]),
        ("torch", "triton", ["hc_split_sinkhorn_triton"]),
        ("torch", "torch", []),
    ],
)
def test_module_takes_the_fused_path_with_both_triton_backends(monkeypatch, mix_backend, sinkhorn_backend, want):
    calls = _spy(monkeypatch)
    monkeypatch.setenv(hc_mix.ENV_BACKEND, mix_backend)  # triton on the CPU: the interpreter
    monkeypatch.setenv(hc_sinkhorn.ENV_BACKEND, sinkhorn_backend)
    x, fn, scale, base = _inputs(1, 2, 4, 32, seed=5)
    fast = DeepseekV41HyperConnection(4, 5, HC_EPS, NORM_EPS, numerics="fast")
    got = fast.mixes(x, fn, scale, base)
    assert calls == want
    if want == ["hc_mixes_sinkhorn_triton"]:
        _assert_equal(got, _unfused(x, fn, scale, base, 5))
    calls.clear()
    DeepseekV41HyperConnection(4, 5, HC_EPS, NORM_EPS, numerics="exact").mixes(x, fn, scale, base)
    assert calls == []  # exact numerics: the torch ops whatever the backends


def test_module_keeps_the_other_paths_when_the_projection_kernel_does_not_apply(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setenv(hc_mix.ENV_BACKEND, "triton")
    monkeypatch.setenv(hc_sinkhorn.ENV_BACKEND, "triton")
    fast = DeepseekV41HyperConnection(4, 2, HC_EPS, NORM_EPS, numerics="fast")
    # more rows than a decode step: the torch projection, then the Sinkhorn kernel
    x, fn, scale, base = _inputs(1, hc_mix.MIXES_MAX_ROWS + 1, 4, 8, seed=6)
    fast.mixes(x, fn, scale, base)
    assert calls == ["hc_split_sinkhorn_triton"]
    # fp32 streams, or autograd recording: the same
    x, fn, scale, base = _inputs(1, 1, 4, 8, seed=7)
    fast.mixes(x.float(), fn, scale, base)
    fast.mixes(x, fn.clone().requires_grad_(), scale, base)
    assert calls == ["hc_split_sinkhorn_triton"] * 3


def test_bad_arguments_raise(monkeypatch):
    x, fn, scale, base = _inputs(1, 1, 4, 16, seed=8)

    def call(x=x, fn=fn, scale=scale, base=base, iters=3):
        return hc_mixes_sinkhorn_triton(x, fn, NORM_EPS, scale, base, iters, HC_EPS)

    with pytest.raises(HcMixError, match=r"x must be bf16 \[B, S, hc, D\]"):
        call(x=x.float())
    with pytest.raises(HcMixError, match="copies"):
        call(x=torch.zeros(1, 1, 17, 4, dtype=torch.bfloat16))
    with pytest.raises(HcMixError, match="fn must be fp32"):
        call(fn=fn[:, 1:])
    with pytest.raises(HcMixError, match="fn must be fp32"):
        call(fn=fn.double())
    with pytest.raises(HcMixError, match="no columns"):
        call(x=torch.zeros(1, 1, 4, 0, dtype=torch.bfloat16), fn=torch.zeros(24, 0))
    with pytest.raises(HcSinkhornError, match=r"scale must be \[3\]"):
        call(scale=scale[:2])
    with pytest.raises(HcSinkhornError, match=r"base must be \[24\] for hc_mult=4"):
        call(base=base[:15])
    with pytest.raises(HcSinkhornError, match="base must be float32"):
        call(base=base.half())
    with pytest.raises(HcSinkhornError, match="sinkhorn_iters must be an int >= 1"):
        call(iters=0)
    with pytest.raises(HcSinkhornError, match="sinkhorn_iters must be an int >= 1"):
        call(iters=2.0)
    with pytest.raises(HcSinkhornError, match="one device"):
        call(scale=scale.to("meta"))
    monkeypatch.setattr(hc_mix, "triton_interpret_mode", lambda: False)
    with pytest.raises(HcMixError, match="need CUDA tensors"):
        call()
