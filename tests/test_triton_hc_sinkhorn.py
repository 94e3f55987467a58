"""The one-launch mHC split + Sinkhorn (`triton_ops/hc_sinkhorn.py`), run by Triton's CPU interpreter.

Two comparisons per input:

- bitwise, against the op sequence spelled out here with ``numpy.exp`` (the interpreter's exp) and
  explicit left-to-right sums: this pins the kernel's operation order, step for step;
- against the torch fallback `hc_split_sinkhorn` (the reference's ops) within ``REL_BOUND``. There
  exp is torch's (SLEEF) against numpy's: each within about one ulp of the true value, so about
  40 % of the exps differ by an ulp. Every quantity is positive (no cancellation) and Sinkhorn
  rescales rows and columns, which does not amplify a per-entry relative error; over 20 rounds
  the measured worst case is ~9e-7 (15 fp32 ulps, 2**-24 each) on comb, ~2.5e-7 on pre / post.
  REL_BOUND = 2e-6 (~34 ulps) leaves a 2x margin and is far below any modelling effect.

Plus the golden mHC boundary (the FFN ``pre`` handed to the next block) and the module dispatch.
"""

from __future__ import annotations

import json


import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl as hc_module  # noqa: E402
import deepseek_v41_vl.triton_ops.hc_sinkhorn as hc_sinkhorn  # noqa: E402
from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import (  # noqa: E402
    DeepseekV41HyperConnection,
    hc_split_sinkhorn,
)
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import (  # noqa: E402
    DeepseekV41Numerics,
    DeepseekV41NumericsError,
    apply_numerics,
)
from deepseek_v41_vl.triton_ops.hc_sinkhorn import (  # noqa: E402
    HcSinkhornError,
    hc_split_sinkhorn_triton,
    resolve_backend,
)
from golden_bits import LOCAL_REL_L2, assert_golden  # noqa: E402

REL_BOUND = 2e-6
EPS = 1e-6

# numpy warns when exp(-x) overflows to inf for very negative sigmoid inputs; 1 / (1 + inf) = 0
# is the intended (and torch's) result
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _np_exp(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(t.numpy()))


def _spelled_out(m, scale, base, hc, iters, eps):
    """`hc_split_sinkhorn`'s sequence with numpy's exp and every sum written left to right."""
    sigmoid = lambda x: 1 / (1 + _np_exp(-x))  # noqa: E731 - torch's sigmoid formula

    def row_sum(c):
        acc = c[..., 0]
        for t in range(1, hc):
            acc = acc + c[..., t]
        return acc.unsqueeze(-1)

    def col_sum(c):
        acc = c[..., 0, :]
        for t in range(1, hc):
            acc = acc + c[..., t, :]
        return acc.unsqueeze(-2)

    pre = sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    c = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    c = _np_exp(c - c.amax(dim=-1, keepdim=True))
    c = c / row_sum(c) + eps
    c = c / (col_sum(c) + eps)
    for _ in range(iters - 1):
        c = c / (row_sum(c) + eps)
        c = c / (col_sum(c) + eps)
    return pre, post, c


def _inputs(rows: int, hc: int, magnitude: float, seed: int):
    """Mixes like `hc_mixes` makes them (O(1) after the RMS factor) or `magnitude` times larger:
    with 30 the softmax saturates to one-hots plus eps and sigmoids reach 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    width = (2 + hc) * hc
    mixes = torch.randn(rows, width, generator=g) * magnitude
    scale = 0.5 + torch.rand(3, generator=g)
    base = torch.randn(width, generator=g) * 0.5
    return mixes, scale, base


CASES = [(hc, iters, rows) for hc in (4, 2) for iters in (20, 1) for rows in (1, 7, 300)] + [(3, 20, 7), (1, 20, 7)]


@pytest.mark.parametrize("magnitude", [2.0, 30.0])
@pytest.mark.parametrize("hc,iters,rows", CASES)
def test_kernel_matches_the_op_sequence_and_the_torch_fallback(hc, iters, rows, magnitude):
    mixes, scale, base = _inputs(rows, hc, magnitude, seed=1000 * rows + 10 * hc + iters)
    pre, post, comb = hc_split_sinkhorn_triton(mixes, scale, base, hc, iters, EPS)
    assert pre.shape == post.shape == (rows, hc) and comb.shape == (rows, hc, hc)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32

    for got, want in zip((pre, post, comb), _spelled_out(mixes, scale, base, hc, iters, EPS)):
        assert torch.equal(got, want)
    for got, want in zip((pre, post, comb), hc_split_sinkhorn(mixes, scale, base, hc, iters, EPS)):
        torch.testing.assert_close(got, want, rtol=REL_BOUND, atol=0)


def test_leading_dims_strided_rows_and_empty_input():
    hc, width = 4, 24
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(2, 3, width + 8, generator=g) * 3
    mixes = wide[..., 4 : 4 + width]  # rows strided by width + 8, as a slice of a wider projection
    scale, base = 0.5 + torch.rand(3, generator=g), torch.randn(width, generator=g)
    got = hc_split_sinkhorn_triton(mixes, scale, base, hc, 20, EPS)
    flat = hc_split_sinkhorn_triton(mixes.contiguous().view(6, width), scale, base, hc, 20, EPS)
    assert [t.shape for t in got] == [(2, 3, hc), (2, 3, hc), (2, 3, hc, hc)]
    for a, b in zip(got, flat):
        assert torch.equal(a.flatten(0, 1), b)
    # a last dimension that is not contiguous is copied first
    transposed = mixes.contiguous().view(6, width).t().contiguous().t()
    for a, b in zip(hc_split_sinkhorn_triton(transposed, scale, base, hc, 20, EPS), flat):
        assert torch.equal(a, b)
    empty = hc_split_sinkhorn_triton(torch.zeros(0, 5, width), scale, base, hc, 20, EPS)
    assert [t.shape for t in empty] == [(0, 5, hc), (0, 5, hc), (0, 5, hc, hc)]


def _golden_block_inputs(golden, variant):
    folder = golden / variant
    vl = load_file(folder / "vl.safetensors")
    ck = load_file(folder / "model.safetensors")
    index = json.loads((folder / "meta.json").read_text())["hidden_state_index"]
    return vl, ck, index


@pytest.mark.parametrize("variant", ["model_tiny_bf16", "model_tiny_fp8"])
def test_golden_ffn_pre_boundary(golden, monkeypatch, variant):
    """pre_mix_in.{i+1} (the reference's FFN `pre` of block i) from the kernel, within REL_BOUND.

    The FFN mixes' input is made with the exact (torch) path, which `test_hyper_connection` proves
    bit-identical to the reference; only the split + Sinkhorn under test runs in the kernel.
    """
    monkeypatch.setenv(hc_sinkhorn.ENV_BACKEND, "triton")
    vl, ck, index = _golden_block_inputs(golden, variant)
    exact = DeepseekV41HyperConnection(4, 20, EPS, 1e-20, numerics="exact")
    fast = DeepseekV41HyperConnection(4, 20, EPS, 1e-20, numerics="fast")
    layers = range(len(index) - 1) if variant == "model_tiny_bf16" else (0, len(index) - 2)
    for i in layers:
        x = vl[index[str(i)]["entering_block"]]
        p = {name: ck[f"layers.{i}.hc_{name}"] for name in ("attn_fn", "attn_scale", "attn_base")}
        p.update({name: ck[f"layers.{i}.hc_{name}"] for name in ("ffn_fn", "ffn_scale", "ffn_base")})
        _, post, comb = exact.mixes(x, p["attn_fn"], p["attn_scale"], p["attn_base"])
        x1 = exact.post(vl[f"prefill.attn_out.{i}"], x, post, comb)
        got = fast.mixes(x1, p["ffn_fn"], p["ffn_scale"], p["ffn_base"])
        want = exact.mixes(x1, p["ffn_fn"], p["ffn_scale"], p["ffn_base"])
        # the exact path is the reference (bit for bit on the fixture CPU, golden_bits.py) ...
        assert_golden(want[0], vl[f"prefill.pre_mix_in.{i + 1}"], f"block {i} ffn pre", rel_l2=LOCAL_REL_L2)
        # ... and the kernel is within its bound of it (pre, post and comb)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=REL_BOUND, atol=0)


def test_module_dispatch(monkeypatch):
    calls = []
    real = hc_module.hc_split_sinkhorn_triton
    monkeypatch.setattr(hc_module, "hc_split_sinkhorn_triton", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 3, 4, 8, generator=g).bfloat16()
    fn, scale, base = torch.randn(24, 32, generator=g), 0.5 + torch.rand(3, generator=g), torch.randn(24, generator=g)

    def run(numerics):
        return DeepseekV41HyperConnection(4, 20, EPS, 1e-20, numerics=numerics).mixes(x, fn, scale, base)

    monkeypatch.delenv(hc_sinkhorn.ENV_BACKEND, raising=False)
    want = run("exact")
    for numerics in ("exact", "fast"):  # auto on CPU tensors: torch
        assert all(torch.equal(a, b) for a, b in zip(run(numerics), want))
    assert calls == []
    monkeypatch.setenv(hc_sinkhorn.ENV_BACKEND, "triton")
    assert all(torch.equal(a, b) for a, b in zip(run("exact"), want))  # exact numerics never take the kernel
    assert calls == []
    got = run("fast")
    assert calls == [1]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=REL_BOUND, atol=0)
    # a module follows the plan it holds: handing it another plan switches it
    module = DeepseekV41HyperConnection(4, 20, EPS, 1e-20)
    module.mixes(x, fn, scale, base)
    assert calls == [1]
    apply_numerics(module, DeepseekV41Numerics.resolve("fast"))
    module.mixes(x, fn, scale, base)
    assert calls == [1, 1]
    apply_numerics(module, DeepseekV41Numerics.resolve("fast", hc_sinkhorn="torch"))
    module.mixes(x, fn, scale, base)
    assert calls == [1, 1]
    monkeypatch.setenv(hc_sinkhorn.ENV_BACKEND, "tilelang")
    with pytest.raises(DeepseekV41NumericsError, match="backend must be one of"):
        run("fast")
    with pytest.raises(DeepseekV41NumericsError, match="numerics must be one of"):
        DeepseekV41HyperConnection(4, 20, EPS, 1e-20, numerics="bitwise")
    monkeypatch.delenv(hc_sinkhorn.ENV_BACKEND)
    assert "numerics=fast" in repr(DeepseekV41HyperConnection(4, 20, EPS, 1e-20, numerics="fast"))


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv(hc_sinkhorn.ENV_BACKEND, raising=False)
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert resolve_backend(None, torch.device("cuda")) == "triton"
    monkeypatch.setenv(hc_sinkhorn.ENV_BACKEND, "torch")
    assert resolve_backend(None, torch.device("cuda")) == "torch"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"  # the argument wins


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(hc_sinkhorn, "triton_interpret_mode", lambda: False)
    mixes, scale, base = _inputs(2, 4, 1.0, seed=0)
    with pytest.raises(HcSinkhornError, match="needs CUDA tensors"):
        hc_split_sinkhorn_triton(mixes, scale, base, 4, 20, EPS)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda m, s, b, hc, it: (m[:, :20], s, b, hc, it), r"mixes must be \[\.\.\., \(2 \+ hc\) \* hc = 24\]"),
        (lambda m, s, b, hc, it: (m[0, 0], s, b, hc, it), "mixes must be"),
        (lambda m, s, b, hc, it: (m, s[:2], b, hc, it), r"scale must be \[3\]"),
        (lambda m, s, b, hc, it: (m, s, b[:20], hc, it), r"base must be \[24\]"),
        (lambda m, s, b, hc, it: (m, s, b, 3, it), r"= 15\] for hc_mult=3"),
        (lambda m, s, b, hc, it: (m.double(), s, b, hc, it), "mixes must be float32"),
        (lambda m, s, b, hc, it: (m, s.bfloat16(), b, hc, it), "scale must be float32"),
        (lambda m, s, b, hc, it: (m, s, b.half(), hc, it), "base must be float32"),
        (lambda m, s, b, hc, it: (m, s.to("meta"), b, hc, it), "one device"),
        (lambda m, s, b, hc, it: (m, s, b, 0, it), "hc_mult must be an int in"),
        (lambda m, s, b, hc, it: (m, s, b, 17, it), "hc_mult must be an int in"),
        (lambda m, s, b, hc, it: (m, s, b, 4.0, it), "hc_mult must be an int in"),
        (lambda m, s, b, hc, it: (m, s, b, hc, 0), "sinkhorn_iters must be an int >= 1"),
    ],
)
def test_bad_arguments_raise(change, match):
    mixes, scale, base = _inputs(3, 4, 1.0, seed=1)
    args = change(mixes, scale, base, 4, 20)
    with pytest.raises(HcSinkhornError, match=match):
        hc_split_sinkhorn_triton(*args, EPS)
    assert issubclass(HcSinkhornError, ValueError)
