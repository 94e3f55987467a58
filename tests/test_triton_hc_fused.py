"""The mHC kernels fused with their neighbours, run by Triton's CPU interpreter, each against the
launches it replaces, bit for bit:

- the mixes in two launches (`triton_ops/hc_mix.py: hc_mixes_sinkhorn_triton`): the projection
  (`hc_mixes_triton`, two launches) followed by the split + Sinkhorn (`hc_split_sinkhorn_triton`,
  one launch), which it replaces at decode; which calls of `DeepseekV41HyperConnection.mixes` take
  it; bad arguments;
- the collapse + norm in one launch (`triton_ops/hc_fused.py: hc_pre_rms_norm_triton`) against
  `hc_pre_triton` then `rms_norm_triton`, and the expand + the next mixes' projection
  (`hc_post_mixes_triton`) against `hc_post_triton` then the mixes' kernels; which calls of
  `DeepseekV41HyperConnection.pre_norm / post_mixes` take them; and a decoder layer in fast
  numerics, whose outputs are bit for bit those of the unfused calls.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

import deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl as hyper
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig
from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import in_line
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer
from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection
from deepseek_v41_vl.modeling.layers_deepseek_v41_vl import DeepseekV41RMSNorm
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics
from deepseek_v41_vl.triton_ops import hc_mix, hc_sinkhorn, rms_norm
from deepseek_v41_vl.triton_ops.hc_fused import hc_post_mixes_triton, hc_pre_rms_norm_triton
from deepseek_v41_vl.triton_ops.hc_mix import HcMixError, hc_mixes_sinkhorn_triton, hc_mixes_triton
from deepseek_v41_vl.triton_ops.hc_sinkhorn import HcSinkhornError, hc_split_sinkhorn_triton
from deepseek_v41_vl.triton_ops.kernel_backend import kernel_interpreted

from conftest import REPO_ROOT

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


# --- collapse + norm, expand + projection (`triton_ops/hc_fused.py`) ---------------------------


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    # equal bit patterns (NaN included), shapes and dtypes
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[got.dtype]
    assert torch.equal(got.view(ints), want.view(ints))


def _stream_inputs(batch: int, seq: int, hc: int, dim: int, seed: int):
    # rows of ordinary, tiny (subnormal products) and huge (overflowing squares) magnitudes
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hc, dim, generator=g) * torch.logspace(-2, 2, dim)
    scales = torch.tensor([1.0, 1e-36, 1e30, 3e-3, 1e18])
    x = x * scales[torch.arange(batch * seq) % len(scales)].view(batch, seq, 1, 1)
    x[..., 0, :3] = 0.0
    f = (torch.randn(batch, seq, dim, generator=g) * 4).to(torch.bfloat16)
    mix = torch.rand(batch, seq, hc, generator=g) + 1e-3
    post = 2 * torch.rand(batch, seq, hc, generator=g)
    comb = torch.rand(batch, seq, hc, hc, generator=g)
    return x.to(torch.bfloat16), f, mix, post, comb / comb.sum(-1, keepdim=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the huge rows, in numpy
@pytest.mark.parametrize(
    "batch,seq,hc,dim,w_dtype",
    [
        (1, 1, 4, 256, torch.bfloat16),  # one decode row
        (1, 5, 4, 300, torch.bfloat16),  # five rows, a padded block (512 columns, 300 used)
        (5, 1, 4, 384, torch.float32),  # five decode rows, an fp32 weight
        (2, 2, 3, 96, torch.bfloat16),  # hc 3
    ],
)
def test_pre_rms_norm_is_bit_identical_to_the_two_kernels(batch, seq, hc, dim, w_dtype):
    x, _, mix, _, _ = _stream_inputs(batch, seq, hc, dim, seed=dim + seq)
    weight = (1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(dim))).to(w_dtype)
    for eps in (1e-6, 1e-20):
        want = rms_norm.rms_norm_triton(hc_mix.hc_pre_triton(x, mix), weight, eps)
        _same_bits(hc_pre_rms_norm_triton(x, mix, weight, eps), want)
    strided = torch.cat([x, x], dim=-1)[..., :dim]
    want = rms_norm.rms_norm_triton(hc_mix.hc_pre_triton(x, mix), weight, 1e-6)
    _same_bits(hc_pre_rms_norm_triton(strided, mix, weight, 1e-6), want)
    assert hc_pre_rms_norm_triton(x[:, :0], mix[:, :0], weight, 1e-6).shape == (batch, 0, dim)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the huge rows, in numpy
@pytest.mark.parametrize(
    "batch,seq,hc,dim,iters",
    [
        (1, 1, 4, 256, 20),  # one decode row; D a multiple of the 128-column K step
        (1, 5, 4, 300, 3),  # five rows; K steps that straddle two copies, a ragged last step
        (5, 1, 4, 128, 2),  # five decode rows
        (2, 3, 3, 64, 1),  # hc 3, half-copy steps
        (2, 17, 4, 8, 2),  # 34 rows: three row blocks, the last ragged
    ],
)
def test_post_mixes_is_bit_identical_to_the_separate_kernels(batch, seq, hc, dim, iters):
    x, f, _, post, comb = _stream_inputs(batch, seq, hc, dim, seed=3 * dim + seq)
    _, fn, scale, base = _inputs(1, 1, hc, dim, seed=dim)
    want_x1 = hc_mix.hc_post_triton(f, x, post, comb)
    x1, mixes = hc_post_mixes_triton(f, x, post, comb, fn, NORM_EPS, (scale, base, iters, HC_EPS))
    _same_bits(x1, want_x1)
    want = hc_mixes_sinkhorn_triton(want_x1, fn, NORM_EPS, scale, base, iters, HC_EPS)
    for got, ref in zip(mixes, want, strict=True):
        _same_bits(got, ref)
    x1, m = hc_post_mixes_triton(f, x, post, comb, fn, NORM_EPS)  # the projection alone
    _same_bits(x1, want_x1)
    _same_bits(m, hc_mixes_triton(want_x1, fn, NORM_EPS))


class _Later:
    """An `aside` that runs nothing until join(): what a side stream may do at worst."""

    def __init__(self):
        self.names = []

    def __call__(self, fn, *args):
        self.names.append(fn.__name__)
        return types.SimpleNamespace(join=lambda: fn(*args))


def test_post_mixes_runs_only_its_second_launch_aside():
    x, f, _, post, comb = _stream_inputs(1, 1, 4, 256, seed=5)
    _, fn, scale, base = _inputs(1, 1, 4, 256, seed=6)
    sinkhorn = (scale, base, 20, HC_EPS)
    want_x1, want = hc_post_mixes_triton(f, x, post, comb, fn, NORM_EPS, sinkhorn)
    later = _Later()
    x1, handle = hc_post_mixes_triton(f, x, post, comb, fn, NORM_EPS, sinkhorn, aside=later)
    assert later.names == ["_finish"]  # the expand (x1) ran in line, the finish + Sinkhorn did not
    _same_bits(x1, want_x1)
    for got, ref in zip(handle.join(), want, strict=True):
        _same_bits(got, ref)
    _, handle = hc_post_mixes_triton(f[:, :0], x[:, :0], post[:, :0], comb[:, :0], fn, NORM_EPS, sinkhorn, aside=later)
    assert later.names[-1] == "_empty_mixes" and handle.join()[2].shape == (1, 0, 4, 4)


def test_post_mixes_takes_strided_inputs_and_no_rows():
    x, f, _, post, comb = _stream_inputs(1, 2, 4, 64, seed=11)
    _, fn, scale, base = _inputs(1, 1, 4, 64, seed=12)
    wide = torch.cat([x, x], dim=-1)[..., :64]
    x1, mixes = hc_post_mixes_triton(f, wide, post, comb, fn, NORM_EPS, (scale, base, 4, HC_EPS))
    want_x1 = hc_mix.hc_post_triton(f, x, post, comb)
    _same_bits(x1, want_x1)
    _same_bits(mixes[2], hc_mixes_sinkhorn_triton(want_x1, fn, NORM_EPS, scale, base, 4, HC_EPS)[2])
    x1, (pre, post0, comb0) = hc_post_mixes_triton(f[:, :0], x[:, :0], post[:, :0], comb[:, :0], fn, NORM_EPS,
                                                    (scale, base, 4, HC_EPS))
    assert x1.shape == (1, 0, 4, 64) and pre.shape == post0.shape == (1, 0, 4) and comb0.shape == (1, 0, 4, 4)


def test_fused_bad_arguments_raise():
    x, f, mix, post, comb = _stream_inputs(1, 1, 4, 16, seed=13)
    _, fn, scale, base = _inputs(1, 1, 4, 16, seed=14)
    weight = torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(HcMixError, match="must be \\[D\\] for rows of D = 16 "):
        hc_pre_rms_norm_triton(x, mix, weight[:8], 1e-6)
    with pytest.raises(HcMixError, match="bf16 or fp32 weight"):
        hc_pre_rms_norm_triton(x, mix, weight.half(), 1e-6)
    with pytest.raises(HcMixError, match="mix must be fp32"):
        hc_pre_rms_norm_triton(x, mix[..., :3], weight, 1e-6)
    with pytest.raises(HcMixError, match="past the kernel"):
        big = torch.zeros(1, 1, 1, rms_norm.MAX_COLS + 1, dtype=torch.bfloat16)
        hc_pre_rms_norm_triton(big, torch.ones(1, 1, 1), torch.ones(rms_norm.MAX_COLS + 1), 1e-6)
    with pytest.raises(HcMixError, match="f must be bf16"):
        hc_post_mixes_triton(f[..., :8], x, post, comb, fn, NORM_EPS)
    with pytest.raises(HcMixError, match="fn must be fp32"):
        hc_post_mixes_triton(f, x, post, comb, fn[:, 1:], NORM_EPS)
    with pytest.raises(HcMixError, match="token rows are past"):
        rows = hc_mix.MIXES_MAX_ROWS + 1
        hc_post_mixes_triton(f.expand(1, rows, 16), x.expand(1, rows, 4, 16), post.expand(1, rows, 4),
                             comb.expand(1, rows, 4, 4), fn, NORM_EPS)
    with pytest.raises(HcSinkhornError, match="sinkhorn_iters"):
        hc_post_mixes_triton(f, x, post, comb, fn, NORM_EPS, (scale, base, 0, HC_EPS))


def _spy_fused(monkeypatch):
    calls = []
    for name in ("hc_pre_rms_norm_triton", "hc_post_mixes_triton", "hc_pre_triton", "hc_post_triton"):
        real = getattr(hyper, name)
        monkeypatch.setattr(hyper, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def _plan(**backends: str) -> DeepseekV41Numerics:
    ops = dict(rms_norm="triton", hc_mix="triton", hc_sinkhorn="triton")
    ops.update(backends)
    return DeepseekV41Numerics.resolve("fast", **ops)


def test_pre_norm_takes_one_launch_where_both_kernels_would_run(monkeypatch):
    calls = _spy_fused(monkeypatch)
    x, _, mix, _, _ = _stream_inputs(1, 2, 4, 64, seed=15)
    norm = DeepseekV41RMSNorm(64, 1e-6, _plan())
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(64, generator=torch.Generator().manual_seed(0)))
    hc = DeepseekV41HyperConnection(4, 3, HC_EPS, NORM_EPS, numerics=_plan())
    want = rms_norm.rms_norm_triton(hc_mix.hc_pre_triton(x, mix), norm.weight.detach(), 1e-6)
    calls.clear()
    with torch.no_grad():
        _same_bits(hc.pre_norm(x, mix, norm), want)
        assert calls == ["hc_pre_rms_norm_triton"]
        # either kernel not taken, or a hook watching the norm: the two calls
        for hc_backends, norm_backends in (({"hc_mix": "torch"}, {}), ({}, {"rms_norm": "torch"})):
            calls.clear()
            norm.numerics = _plan(**norm_backends)
            DeepseekV41HyperConnection(4, 3, HC_EPS, NORM_EPS, numerics=_plan(**hc_backends)).pre_norm(x, mix, norm)
            assert "hc_pre_rms_norm_triton" not in calls
        norm.numerics = _plan()
        seen = []
        handle = norm.register_forward_hook(lambda m, a, out: seen.append(out))
        calls.clear()
        _same_bits(hc.pre_norm(x, mix, norm), want)
        handle.remove()
        assert calls == ["hc_pre_triton"] and len(seen) == 1
    calls.clear()
    hc.pre_norm(x, mix, norm)  # autograd would record the norm's weight: its torch ops
    assert calls == ["hc_pre_triton"]


@pytest.mark.parametrize("sinkhorn_backend", ["triton", "torch"])
def test_post_mixes_takes_the_fused_launch_where_both_kernels_would_run(monkeypatch, sinkhorn_backend):
    calls = _spy_fused(monkeypatch)
    x, f, _, post, comb = _stream_inputs(1, 2, 4, 64, seed=16)
    _, fn, scale, base = _inputs(1, 1, 4, 64, seed=17)
    hc = DeepseekV41HyperConnection(4, 3, HC_EPS, NORM_EPS, numerics=_plan(hc_sinkhorn=sinkhorn_backend))
    want_x1 = hc.post(f, x, post, comb)
    want = hc.mixes(want_x1, fn, scale, base)
    calls.clear()
    x1, mixes = hc.post_mixes(f, x, post, comb, fn, scale, base)
    assert calls == ["hc_post_mixes_triton"]
    _same_bits(x1, want_x1)
    for got, ref in zip(mixes.join(), want, strict=True):
        _same_bits(got, ref)
    # another `aside` (a decode step's side stream): the expand alone here, all of the projection aside
    calls.clear()
    ran = []

    def aside(fn, *args):
        ran.append(fn)
        return in_line(fn, *args)

    x1, mixes = hc.post_mixes(f, x, post, comb, fn, scale, base, aside=aside)
    assert calls == ["hc_post_triton"] and ran == [hc.mixes]
    _same_bits(x1, want_x1)
    for got, ref in zip(mixes.join(), want, strict=True):
        _same_bits(got, ref)
    calls.clear()
    rows = hc_mix.MIXES_MAX_ROWS + 1  # past the projection kernels: the two calls
    hc.post_mixes(f[:, :1].expand(1, rows, 64), x[:, :1].expand(1, rows, 4, 64), post[:, :1].expand(1, rows, 4),
                  comb[:, :1].expand(1, rows, 4, 4), fn, scale, base)
    assert calls == ["hc_post_triton"]


def _tiny_layer(numerics: DeepseekV41Numerics) -> DeepseekV41DecoderLayer:
    text = DeepseekV41TextConfig(**json.loads((REPO_ROOT / "configs" / "tiny_vl.json").read_text())["text_config"])
    layer = DeepseekV41DecoderLayer(text, 0, numerics).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.size(-1) ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return layer


@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 3)])
def test_decoder_layer_makes_the_fused_calls_with_the_same_outputs(monkeypatch, batch, seq):
    other_ops = {op: "torch" for op, _ in DeepseekV41Numerics.resolve("fast").kernels}
    layer = _tiny_layer(_plan(**{**other_ops, "rms_norm": "triton", "hc_mix": "triton", "hc_sinkhorn": "triton"}))
    g = torch.Generator().manual_seed(batch * seq)
    x = torch.randn(batch, seq, 4, 256, generator=g).to(torch.bfloat16)
    pre_mix = torch.rand(batch, seq, 4, generator=g)

    def run():
        with torch.no_grad():
            return layer.block(x, pre_mix, DeepseekV41AttentionState(start_pos=0))

    calls = _spy_fused(monkeypatch)
    fused = run()
    assert calls == ["hc_pre_rms_norm_triton", "hc_post_mixes_triton", "hc_pre_rms_norm_triton", "hc_post_triton"]
    # the unfused calls: the collapse and the norm, the expand and the mixes, each on its own
    monkeypatch.setattr(DeepseekV41HyperConnection, "pre_norm", lambda self, x, mix, norm: norm(self.pre(x, mix)))
    monkeypatch.setattr(
        DeepseekV41HyperConnection, "post_mixes",
        lambda self, f, r, p, c, fn, s, b, aside=in_line: (lambda x1: (x1, aside(self.mixes, x1, fn, s, b)))(self.post(f, r, p, c)),
    )
    calls.clear()
    unfused = run()
    assert calls == ["hc_pre_triton", "hc_post_triton", "hc_pre_triton", "hc_post_triton"]
    for got, want in zip(fused, unfused, strict=True):
        _same_bits(got, want)
