"""The mHC collapse / expand kernels (`triton_ops/hc_mix.py`), run by Triton's CPU interpreter,
against the torch ops of `DeepseekV41HyperConnection.pre / post` (the reference's `hc_pre` /
`hc_post`): the same fp32 products, the copies summed from 0 in ascending order, one rounding to
bf16, so at most one bf16 ulp apart where torch sums in another order (in practice equal). Also:
which numerics and modes take them, and bad arguments.
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.triton_ops.hc_mix as hc_mix
from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == torch.bfloat16
    same_sign = (ours.view(torch.int16) < 0) == (ref.view(torch.int16) < 0)
    assert bool((same_sign | (ours == ref)).all())
    assert int(_ulps(ours, ref)[same_sign].max()) <= 1
    assert (ours == ref).float().mean().item() >= 0.99


def _inputs(batch: int, seq: int, hc: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, seq, hc, dim, generator=g) * torch.logspace(-2, 2, dim)).to(torch.bfloat16)
    f = (torch.randn(batch, seq, dim, generator=g) * 3).to(torch.bfloat16)
    mix = torch.rand(batch, seq, hc, generator=g) + 1e-3
    post = 2 * torch.rand(batch, seq, hc, generator=g)
    comb = torch.rand(batch, seq, hc, hc, generator=g)
    comb = comb / comb.sum(-1, keepdim=True)
    return x, f, mix, post, comb


def test_a_rows_mixes_do_not_depend_on_the_rows_beside_it():
    """The projection's column splits follow the width alone: 33 rows (three row blocks) give each
    row the bits it gets alone, and so do the tiles the fused expand + projection takes (a
    verification forward of k tokens equals k one-token steps; a conversation's next turn, one
    prefill of it). The width has 50 K steps, more than the 128 // 3 splits a three-block call
    would have been given when the splits followed the rows."""
    x, *_ = _inputs(1, 33, 4, 800, seed=3)
    fn = torch.randn(24, 3200, generator=torch.Generator().manual_seed(4)) * 3200 ** -0.5
    grids = {hc_mix._mixes_grid(tokens, 3200)[1:] for tokens in (1, 16, 33, 200, hc_mix.MIXES_MAX_ROWS)}
    assert len(grids) == 1
    together = hc_mix.hc_mixes_triton(x, fn, 1e-6)
    for row in (0, 17, 32):
        assert torch.equal(hc_mix.hc_mixes_triton(x[:, row : row + 1], fn, 1e-6), together[:, row : row + 1])


@pytest.mark.parametrize("batch,seq,hc,dim", [(1, 1, 4, 5120), (2, 3, 4, 700), (1, 2, 3, 64), (1, 1, 1, 32)])
def test_kernels_agree_with_the_torch_ops(batch, seq, hc, dim):
    x, f, mix, post, comb = _inputs(batch, seq, hc, dim, seed=dim)
    module = DeepseekV41HyperConnection(hc, 20, 1e-6, 1e-6, numerics="exact")
    _assert_close(hc_mix.hc_pre_triton(x, mix), module.pre(x, mix))
    _assert_close(hc_mix.hc_post_triton(f, x, post, comb), module.post(f, x, post, comb))


@pytest.mark.parametrize("batch,seq,hc,dim", [(1, 1, 4, 5120), (2, 17, 4, 96), (1, 3, 3, 40)])
def test_projection_agrees_with_the_torch_ops(batch, seq, hc, dim):
    # one decode row at release width (split over 80 programs), 34 rows (three row blocks, one
    # split), an odd width (a ragged last K step); fp32 sums in another order: a few fp32 ulps
    x, *_ = _inputs(batch, seq, hc, dim, seed=dim + seq)
    g = torch.Generator().manual_seed(7)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=g) * (hc * dim) ** -0.5
    ours = hc_mix.hc_mixes_triton(x, fn, 1e-6)
    flat = x.flatten(2).float()
    ref = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert ((ours - ref).abs() <= 1e-5 * ref.abs().max()).all()


def test_fast_numerics_take_the_kernels_without_autograd(monkeypatch):
    import deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl as hyper

    calls = []
    monkeypatch.setattr(hyper, "hc_pre_triton", lambda *a: calls.append("pre") or hc_mix.hc_pre_triton(*a))
    monkeypatch.setattr(hyper, "hc_post_triton", lambda *a: calls.append("post") or hc_mix.hc_post_triton(*a))
    monkeypatch.setattr(hyper, "hc_mixes_triton", lambda *a: calls.append("mixes") or hc_mix.hc_mixes_triton(*a))
    monkeypatch.setenv(hc_mix.ENV_BACKEND, "triton")  # on the CPU: the interpreter
    x, f, mix, post, comb = _inputs(1, 2, 4, 64, seed=1)
    exact = DeepseekV41HyperConnection(4, 20, 1e-6, 1e-6, numerics="exact")
    fast = DeepseekV41HyperConnection(4, 20, 1e-6, 1e-6, numerics="fast")
    exact.pre(x, mix), exact.post(f, x, post, comb)
    assert calls == []
    _assert_close(fast.pre(x, mix), exact.pre(x, mix))
    _assert_close(fast.post(f, x, post, comb), exact.post(f, x, post, comb))
    assert calls == ["pre", "post"]
    # autograd recording (fine-tuning): the torch ops, so gradients reach f and the mixes
    f_grad, post_grad = f.float().requires_grad_(), post.clone().requires_grad_()
    fast.post(f_grad.bfloat16(), x, post_grad, comb).float().sum().backward()
    assert calls == ["pre", "post"] and post_grad.grad is not None and f_grad.grad is not None
    fast.pre(x.float(), mix)  # fp32 streams: the torch ops
    assert calls == ["pre", "post"]
    g = torch.Generator().manual_seed(2)
    fn, scale, base = torch.randn(24, 4 * 64, generator=g) * 0.06, torch.rand(3, generator=g), torch.randn(24, generator=g)
    for ours, ref in zip(fast.mixes(x, fn, scale, base), exact.mixes(x, fn, scale, base)):
        assert ((ours - ref).abs() <= 1e-5 * ref.abs().max()).all()
    assert calls == ["pre", "post", "mixes"]


def test_bad_arguments_are_refused():
    x, f, mix, post, comb = _inputs(1, 2, 4, 64)
    with pytest.raises(hc_mix.HcMixError, match="bf16 \\[B, S, hc, D\\]"):
        hc_mix.hc_pre_triton(x.float(), mix)
    with pytest.raises(hc_mix.HcMixError, match="mix must be fp32"):
        hc_mix.hc_pre_triton(x, mix[..., :3])
    with pytest.raises(hc_mix.HcMixError, match="f must be bf16"):
        hc_mix.hc_post_triton(f[:, :1], x, post, comb)
    with pytest.raises(hc_mix.HcMixError, match="comb must be fp32"):
        hc_mix.hc_post_triton(f, x, post, comb.double())
    with pytest.raises(hc_mix.HcMixError, match="fn must be fp32"):
        hc_mix.hc_mixes_triton(x, torch.zeros(24, 255), 1e-6)
    with pytest.raises(hc_mix.HcMixError, match="no columns"):
        hc_mix.hc_mixes_triton(torch.zeros(1, 1, 4, 0, dtype=torch.bfloat16), torch.zeros(24, 0), 1e-6)
    empty = torch.zeros(0, 3, 4, 64, dtype=torch.bfloat16)
    exact = DeepseekV41HyperConnection(4, 20, 1e-6, 1e-6, numerics="exact")
    assert exact.post(torch.zeros(0, 3, 64, dtype=torch.bfloat16), empty, torch.zeros(0, 3, 4),
                      torch.zeros(0, 3, 4, 4)).shape == empty.shape  # no division by an empty slice
    with pytest.raises(hc_mix.HcMixError, match="copies"):
        hc_mix.hc_pre_triton(torch.zeros(1, 1, 17, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 17))
