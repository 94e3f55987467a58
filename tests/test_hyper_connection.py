"""mHC (hyper-connections): golden bit-exactness of the mixes and the expand/mix, plus the algebra.

The golden VL run stores, per block i, the block input, the attention output (before `hc_post`)
and the next block's `pre_mix_in`, which is this block's FFN `pre` computed from
`hc_post(attn_out)`. So `mixes -> post -> mixes` is checked bit for bit against the reference
without running attention or the MoE.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import (
    DeepseekV41HyperConnection,
    DeepseekV41HyperConnectionError,
    hc_split_sinkhorn,
    identity_pre_mix,
)
from golden_bits import LOCAL_REL_L2, assert_golden

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-20


def _hc() -> DeepseekV41HyperConnection:
    return DeepseekV41HyperConnection(HC, ITERS, HC_EPS, NORM_EPS)


@pytest.mark.parametrize("variant", ["model_tiny_bf16", "model_tiny_fp8"])
def test_ffn_pre_from_attention_output_is_bit_exact(golden, variant):
    """pre_mix_in.{i+1} == ffn-mixes(hc_post(attn_out.i, block_in.i, attn-mixes(block_in.i)))."""
    folder = golden / variant
    vl = load_file(folder / "vl.safetensors")
    ck = load_file(folder / "model.safetensors")
    index = json.loads((folder / "meta.json").read_text())["hidden_state_index"]
    hc = _hc()
    n_layers = len(index)
    for i in range(n_layers - 1):
        x = vl[index[str(i)]["entering_block"]]

        def p(name: str) -> torch.Tensor:
            return ck[f"layers.{i}.hc_{name}"]

        _, post, comb = hc.mixes(x, p("attn_fn"), p("attn_scale"), p("attn_base"))
        x1 = hc.post(vl[f"prefill.attn_out.{i}"], x, post, comb)
        assert x1.dtype == torch.bfloat16 and x1.shape == x.shape
        f_pre, _, _ = hc.mixes(x1, p("ffn_fn"), p("ffn_scale"), p("ffn_base"))
        # teacher-forced, one block: off the fixture CPU only last-bit GEMM differences
        assert_golden(f_pre, vl[f"prefill.pre_mix_in.{i + 1}"], f"{variant}: block {i} ffn pre", rel_l2=LOCAL_REL_L2)


def test_sinkhorn_output_ranges_and_double_stochasticity():
    torch.manual_seed(0)
    mixes = torch.randn(3, 5, (2 + HC) * HC)
    scale = torch.tensor([0.7, 1.3, 2.0])
    base = torch.randn((2 + HC) * HC)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, HC, ITERS, HC_EPS)
    assert pre.shape == (3, 5, HC) and post.shape == (3, 5, HC) and comb.shape == (3, 5, HC, HC)
    assert ((pre > HC_EPS) & (pre <= 1 + HC_EPS)).all()
    assert ((post >= 0) & (post <= 2)).all()
    # the last step normalizes columns, so columns sum to 1 up to eps; rows converge to 1
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, 5, HC), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(3, 5, HC), atol=5e-2, rtol=0)
    _, _, comb_1 = hc_split_sinkhorn(mixes, scale, base, HC, 1, HC_EPS)
    assert (comb.sum(-1) - 1).abs().max() < (comb_1.sum(-1) - 1).abs().max()
    # pre and post read their own slices: pre from [0:hc], post from [hc:2hc]
    expect_pre = torch.sigmoid(mixes[..., :HC] * scale[0] + base[:HC]) + HC_EPS
    assert torch.equal(pre, expect_pre)
    expect_post = 2 * torch.sigmoid(mixes[..., HC : 2 * HC] * scale[1] + base[HC : 2 * HC])
    assert torch.equal(post, expect_post)


def test_sinkhorn_single_iteration_is_softmax_then_column_normalization():
    torch.manual_seed(1)
    mixes = torch.randn(2, (2 + HC) * HC)
    scale, base = torch.ones(3), torch.zeros((2 + HC) * HC)
    _, _, comb = hc_split_sinkhorn(mixes, scale, base, HC, 1, HC_EPS)
    c = torch.softmax(mixes[:, 2 * HC :].view(2, HC, HC).double(), dim=-1) + HC_EPS
    c = c / (c.sum(-2, keepdim=True) + HC_EPS)
    torch.testing.assert_close(comb.double(), c, atol=1e-6, rtol=0)


def test_post_mixes_over_the_source_copy_index():
    """out[j] = post[j] * f + sum_i comb[i][j] * residual[i] (comb is not symmetric here)."""
    torch.manual_seed(2)
    b, s, d = 2, 3, 8
    f = torch.randn(b, s, d).bfloat16()
    residual = torch.randn(b, s, HC, d).bfloat16()
    post = torch.rand(b, s, HC)
    comb = torch.rand(b, s, HC, HC)
    out = _hc().post(f, residual, post, comb)
    assert out.dtype == torch.bfloat16
    expect = torch.empty(b, s, HC, d, dtype=torch.float64)
    for j in range(HC):
        acc = post[..., j, None].double() * f.double()
        for i in range(HC):
            acc = acc + comb[..., i, j, None].double() * residual[:, :, i].double()
        expect[:, :, j] = acc
    torch.testing.assert_close(out.double(), expect.bfloat16().double(), atol=0.02, rtol=0.01)
    transposed = _hc().post(f, residual, post, comb.transpose(-1, -2))
    assert not torch.equal(out, transposed)


@pytest.mark.parametrize("rows_per_slice", [1, 3, 36, 37])
def test_post_in_slices_of_positions_equals_one_pass(monkeypatch, rows_per_slice):
    """Long inputs run `post` in slices of positions (the fp32 [B, S, N, N, D] product would take
    5 GiB at 16K tokens): the same values, bit for bit."""
    from deepseek_v41_vl.modeling import hyper_connection_deepseek_v41_vl as hc_module

    gen = torch.Generator().manual_seed(5)
    b, s, d = 2, 37, 24
    f = torch.randn(b, s, d, generator=gen).bfloat16()
    residual = torch.randn(b, s, HC, d, generator=gen).bfloat16()
    post, comb = torch.rand(b, s, HC, generator=gen), torch.rand(b, s, HC, HC, generator=gen)
    whole = _hc().post(f, residual, post, comb)
    monkeypatch.setattr(hc_module, "POST_SLICE_BYTES", rows_per_slice * b * HC * HC * d * 4)
    calls = []
    original = hc_module._post
    monkeypatch.setattr(hc_module, "_post", lambda *a: calls.append(a[1].size(1)) or original(*a))
    sliced = _hc().post(f, residual, post, comb)
    assert calls == [min(rows_per_slice, s - i) for i in range(0, s, rows_per_slice)]
    assert sliced.dtype == whole.dtype and torch.equal(sliced, whole)


def test_identity_pre_mix_collapses_to_copy_zero():
    torch.manual_seed(3)
    x = torch.randn(2, 5, HC, 16).bfloat16()
    mix = identity_pre_mix(x, HC)
    assert mix.dtype == torch.float32 and mix.shape == (2, 5, HC)
    assert torch.equal(_hc().pre(x, mix), x[:, :, 0])


def test_mixes_rms_is_over_all_copies_and_applied_after_projection():
    torch.manual_seed(4)
    d = 16
    x = torch.randn(1, 3, HC, d).bfloat16()
    fn = torch.randn((2 + HC) * HC, HC * d)
    scale, base = torch.rand(3), torch.randn((2 + HC) * HC)
    hc = _hc()
    pre, post, comb = hc.mixes(x, fn, scale, base)
    # scaling the whole token by 4 (exact in bf16) leaves the normalized mixes unchanged
    pre4, post4, comb4 = hc.mixes(x * 4, fn, scale, base)
    torch.testing.assert_close(pre4, pre, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb4, comb, atol=1e-6, rtol=1e-6)
    # scaling one copy only changes them: the statistic is joint over the copies
    y = x.clone()
    y[:, :, 1] *= 4
    pre_y, _, _ = hc.mixes(y, fn, scale, base)
    assert not torch.allclose(pre_y, pre)


def test_bad_shapes_raise():
    hc = _hc()
    with pytest.raises(DeepseekV41HyperConnectionError, match="hc_mult=4"):
        hc.pre(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3))
    with pytest.raises(DeepseekV41HyperConnectionError, match="fn has shape"):
        hc.mixes(torch.zeros(1, 2, HC, 8), torch.zeros(24, 16), torch.zeros(3), torch.zeros(24))
    with pytest.raises(DeepseekV41HyperConnectionError, match="residual"):
        hc.post(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, HC), torch.zeros(1, 2, HC, HC))
