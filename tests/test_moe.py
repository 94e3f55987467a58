"""MoE of DeepSeek-V4.1 (`modeling_deepseek_v41_vl/moe_deepseek_v41_vl.py`) against the golden tiny
models, teacher-forced block by block.

The golden run does not store the FFN input, so it is rebuilt from stored tensors with the mHC
math (REFERENCE.md section 4), for every block i of the VL prefill:

    x        = tensor entering block i (meta.json -> hidden_state_index)
    a_*      = hc_mixes(x, hc_attn_*)
    x1       = hc_post(attn_out.i, x, a_post, a_comb)
    f_*      = hc_mixes(x1, hc_ffn_*)
    ffn_in   = ffn_norm(hc_pre(x1, a_pre))
    block_out.i == hc_post(MoE(ffn_in, image_rows), x1, f_post, f_comb)

and the router is checked against `prefill.gate.i.{indices, weights, biased_scores}`.
"""

from __future__ import annotations

import copy
import json


import pytest  # noqa: E402
import torch  # noqa: E402

from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection  # noqa: E402
from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import (  # noqa: E402
    DeepseekV41Expert,
    DeepseekV41MoE,
    DeepseekV41MoEError,
)
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41Transformer  # noqa: E402
from deepseek_v41_vl.triton_ops.moe_routing import MoERoutingError  # noqa: E402

from golden_bits import LOCAL_MISMATCH, LOCAL_REL_L2, assert_golden  # noqa: E402
from golden_models import VARIANTS, golden_checkpoint, golden_config, golden_run  # noqa: E402


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`inference/model.py: RMSNorm.forward`: fp32 statistics, bf16 weight times fp32, cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


class _Golden:
    """One golden variant: config, checkpoint, VL run tensors, and the rebuilt FFN inputs."""

    def __init__(self, root, variant: str):
        self.config = golden_config(root, variant)
        self.text_config = self.config.text_config
        self.variant = variant
        self.weights = golden_checkpoint(root, variant)
        self.vl = golden_run(root, variant, "vl")
        meta = json.loads((root / variant / "meta.json").read_text())
        self.hidden_state_index = meta["hidden_state_index"]
        self.differs_with_text_bias = meta["image_rows_whose_experts_would_differ_with_text_bias"]
        self.image_rows = self.vl["token_types"] >= 0  # the whole span: START/NEWLINE/END included
        tc = self.text_config
        self.hc = DeepseekV41HyperConnection(tc.hc_mult, tc.hc_sinkhorn_iters, tc.hc_eps, tc.rms_norm_eps)
        self._ffn = {}

    def moe(self, layer: int, numerics: str = "exact") -> DeepseekV41MoE:
        self.text_config.numerics = numerics
        try:
            module = DeepseekV41MoE(self.text_config, layer)
        finally:
            self.text_config.numerics = "fast"
        prefix = f"layers.{layer}.ffn."
        state = {k[len(prefix) :]: v for k, v in self.weights.items() if k.startswith(prefix)}
        module.load_state_dict(state, strict=True)
        return module.eval()

    def ffn_side(self, layer: int):
        """(ffn_in [B, S, D], x1, f_post, f_comb) of block `layer`, rebuilt from the golden run."""
        if layer not in self._ffn:
            w = self.weights
            p = f"layers.{layer}."
            x = self.vl[self.hidden_state_index[str(layer)]["entering_block"]]
            a_pre, a_post, a_comb = self.hc.mixes(x, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"], w[p + "hc_attn_base"])
            x1 = self.hc.post(self.vl[f"prefill.attn_out.{layer}"], x, a_post, a_comb)
            _, f_post, f_comb = self.hc.mixes(x1, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"], w[p + "hc_ffn_base"])
            ffn_in = _rms_norm(self.hc.pre(x1, a_pre), w[p + "ffn_norm.weight"], self.text_config.rms_norm_eps)
            self._ffn[layer] = (ffn_in, x1, f_post, f_comb)
        return self._ffn[layer]


@pytest.fixture(scope="module", params=VARIANTS)
def gold(request, golden):
    return _Golden(golden, request.param)


N_LAYERS = 8


def test_weight_dtypes_follow_the_checkpoint(gold):
    # fp8 checkpoint: routed experts fp4, shared expert fp8; bf16 checkpoint: all bf16
    routed, shared = {"model_tiny_bf16": ("bf16", "bf16"), "model_tiny_fp8": ("fp4", "fp8")}[gold.variant]
    moe = gold.moe(0)
    torch_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp4": torch.float4_e2m1fn_x2}
    assert moe.experts[3].w2.weight.dtype == torch_dtype[routed]
    assert moe.shared_experts.w1.weight.dtype == torch_dtype[shared]
    assert moe.gate.weight.dtype == torch.bfloat16 and moe.gate.bias_vl.dtype == torch.float32


@pytest.mark.parametrize(("weight_dtype", "expert_weight_dtype"), [("fp8", "bf16"), ("fp8", "fp4"), ("bf16", "fp8")])
def test_storage_dtypes_come_from_the_text_config_only(gold, weight_dtype, expert_weight_dtype):
    # regression: a model with fp8 linears and bf16 experts once built fp8 routed experts (the
    # MoE re-read a quantization dict the model rebuilt, instead of `expert_weight_dtype`)
    config = copy.deepcopy(gold.config)
    config.text_config.weight_dtype, config.text_config.expert_weight_dtype = weight_dtype, expert_weight_dtype
    with torch.device("meta"):
        model = DeepseekV41Transformer(config)
    torch_dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp4": torch.float4_e2m1fn_x2}
    for layer in model.layers:
        assert {e.w1.weight.dtype for e in layer.ffn.experts} == {torch_dtype[expert_weight_dtype]}
        assert layer.ffn.shared_experts.w1.weight.dtype == torch_dtype[weight_dtype]
        assert layer.attn.wq_a.weight.dtype == torch_dtype[weight_dtype]


@torch.inference_mode()
@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_gate_is_bit_exact(gold, layer):
    ffn_in, *_ = gold.ffn_side(layer)
    moe = gold.moe(layer)
    x = ffn_in.reshape(-1, ffn_in.size(-1))
    rows = gold.image_rows.reshape(-1)
    weights, indices = moe.gate(x, rows)
    g = f"prefill.gate.{layer}."
    # the input is rebuilt through mHC from golden tensors: off the fixture CPU, last bits differ
    assert_golden(indices, gold.vl[g + "indices"], f"layer {layer} gate indices", mismatch=LOCAL_MISMATCH)
    assert_golden(weights, gold.vl[g + "weights"], f"layer {layer} gate weights", rel_l2=LOCAL_REL_L2)
    biased = moe.gate.scores(x) + torch.where(rows.unsqueeze(-1), moe.gate.bias_vl, moe.gate.bias)
    assert_golden(biased, gold.vl[g + "biased_scores"], f"layer {layer} biased scores", rel_l2=LOCAL_REL_L2)


@torch.inference_mode()
@pytest.mark.parametrize("layer", [0, 3, 7])
def test_text_bias_changes_image_rows(gold, layer):
    # with image_rows=None the text bias applies everywhere: the golden counts how many image rows
    # then pick other experts, and text rows must not change at all
    ffn_in, *_ = gold.ffn_side(layer)
    moe = gold.moe(layer)
    x = ffn_in.reshape(-1, ffn_in.size(-1))
    rows = gold.image_rows.reshape(-1)
    _, ids_text = moe.gate(x, None)
    _, ids_vl = moe.gate(x, rows)
    changed = (ids_text.sort(-1).values != ids_vl.sort(-1).values).any(-1)
    assert not changed[~rows].any()
    assert int(changed[rows].sum()) == gold.differs_with_text_bias[str(layer)]


@torch.inference_mode()
@pytest.mark.parametrize("layer", range(N_LAYERS))
def test_moe_block_out_is_bit_exact(gold, layer):
    ffn_in, x1, f_post, f_comb = gold.ffn_side(layer)
    moe = gold.moe(layer, numerics="exact")
    out = moe(ffn_in, gold.image_rows)
    assert out.dtype == torch.bfloat16 and out.shape == ffn_in.shape
    block_out = gold.hc.post(out, x1, f_post, f_comb)
    assert_golden(block_out, gold.vl[f"prefill.block_out.{layer}"], f"layer {layer} block_out", rel_l2=LOCAL_REL_L2)


@torch.inference_mode()
@pytest.mark.parametrize("layer", [0, 4, 7])
def test_moe_fast_numerics(gold, layer):
    ffn_in, x1, f_post, f_comb = gold.ffn_side(layer)
    exact = gold.moe(layer, numerics="exact")(ffn_in, gold.image_rows)
    fast = gold.moe(layer, numerics="fast")(ffn_in, gold.image_rows)
    if gold.variant == "model_tiny_bf16":
        # bf16 weights: same GEMMs on the same row slices, same per-row add order
        assert torch.equal(fast, exact)
    else:
        # dequantized bf16 matmul instead of the per-32-block fp32 GEMM: ~1 bf16 ulp per linear
        torch.testing.assert_close(fast.float(), exact.float(), rtol=0.02, atol=2e-3)
        # against the exact block output (the golden one bit for bit on the fixture CPU,
        # test_moe_block_out_is_bit_exact), so that this bound does not depend on the CPU
        block_out = gold.hc.post(fast, x1, f_post, f_comb)
        torch.testing.assert_close(
            block_out.float(), gold.hc.post(exact, x1, f_post, f_comb).float(), rtol=0.02, atol=2e-3
        )


@torch.inference_mode()
def test_grouped_combine_equals_expert_loop(golden):
    # random inputs through the fp8/fp4 experts: the expert-sorted path and the reference loop
    # add the same values per row in the same order
    gold = _Golden(golden, "model_tiny_fp8")
    moe = gold.moe(2, numerics="exact")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, gold.text_config.hidden_size, generator=gen).bfloat16()
    weights, indices = moe.gate(x, torch.rand(37, generator=gen) < 0.5)
    assert torch.equal(moe._routed_grouped(x, weights, indices), moe._routed_exact(x, weights, indices))


@torch.inference_mode()
@pytest.mark.parametrize("slice_rows", [None, 1, 5], ids=["one-pass", "slices-of-1", "slices-of-5"])
def test_routed_sum_runs_in_ascending_expert_order(golden, monkeypatch, slice_rows):
    # top-2 sums are order-free (0 + a + b == 0 + b + a), so the golden cannot see the order; with
    # top-6 it matters. Reference order: experts ascending, each expert's rows in (token, slot)
    # order, added into an fp32 zero accumulator.
    gold = _Golden(golden, "model_tiny_bf16")
    cfg = gold.text_config
    saved = cfg.n_routed_experts, cfg.num_experts_per_tok
    cfg.n_routed_experts, cfg.num_experts_per_tok = 16, 6
    try:
        moe = DeepseekV41MoE(cfg, 0, None)
    finally:
        cfg.n_routed_experts, cfg.num_experts_per_tok = saved
    gen = torch.Generator().manual_seed(3)
    for name, param in moe.named_parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * (0.1 if "w2" in name else 1.0))
    x = torch.randn(29, cfg.hidden_size, generator=gen).bfloat16()
    weights, indices = moe.gate(x)
    per_expert = {}
    for e in range(16):
        rows, slots = torch.where(indices == e)
        if len(rows):
            per_expert[e] = dict(zip(rows.tolist(), moe.experts[e](x[rows], weights[rows, slots, None]).float()))

    def summed(order):
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in order:
            for row, y in per_expert.get(e, {}).items():
                out[row] = out[row] + y
        return out

    ascending = summed(range(16))
    assert not torch.equal(ascending, summed(reversed(range(16))))  # the order is observable here
    if slice_rows is not None:
        # the grouped path adds the expert outputs in slices of rows (bounded fp32 copies)
        from deepseek_v41_vl.modeling import moe_deepseek_v41_vl as moe_module

        monkeypatch.setattr(moe_module, "INDEX_ADD_SLICE_BYTES", slice_rows * 4 * cfg.hidden_size)
    assert torch.equal(moe._routed_exact(x, weights, indices), ascending)
    assert torch.equal(moe._routed_grouped(x, weights, indices), ascending)


def _bf16_expert(hidden, inter, limit):
    expert = DeepseekV41Expert(hidden, inter, "bf16", limit, "exact")
    gen = torch.Generator().manual_seed(1)
    for lin in (expert.w1, expert.w2, expert.w3):
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=gen) * 2.0)
    return expert


@torch.inference_mode()
def test_expert_clamps_and_weight_inside():
    expert = _bf16_expert(64, 32, 10.0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.rand(5, 1, generator=gen)
    g = torch.nn.functional.linear(x, expert.w1.weight).float()
    u = torch.nn.functional.linear(x, expert.w3.weight).float()
    assert (g > 10).any() and (g < -10).any() and (u.abs() > 10).any()  # the clamps bite here
    h = torch.nn.functional.silu(g.clamp(max=10.0)) * u.clamp(-10.0, 10.0)
    expect = torch.nn.functional.linear((w * h).bfloat16(), expert.w2.weight)
    assert torch.equal(expert(x, w), expect)
    # no clamp with limit 0, and the shared expert path has no weight
    expert.swiglu_limit = 0.0
    plain = torch.nn.functional.linear((torch.nn.functional.silu(g) * u).bfloat16(), expert.w2.weight)
    assert torch.equal(expert(x), plain)


def test_bad_inputs_raise(golden):
    gold = _Golden(golden, "model_tiny_bf16")
    moe = gold.moe(0)
    x = torch.zeros(1, 4, gold.text_config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(DeepseekV41MoEError, match="image_rows"):
        moe(x, torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(DeepseekV41MoEError, match="image_rows"):
        moe(x, torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(DeepseekV41MoEError, match="hidden_states"):
        moe(x.reshape(4, -1))
    with pytest.raises(DeepseekV41MoEError, match="gate input"):
        moe.gate(x)
    with pytest.raises(MoERoutingError, match="image_rows"):
        moe.gate(x[0], torch.zeros(3, dtype=torch.bool))
    cfg = gold.text_config
    cfg.n_shared_experts = 2
    try:
        with pytest.raises(DeepseekV41MoEError, match="n_shared_experts"):
            DeepseekV41MoE(cfg)
    finally:
        cfg.n_shared_experts = 1
    cfg.scoring_func = "softmax"
    try:
        with pytest.raises(DeepseekV41MoEError, match="scoring_func"):
            DeepseekV41MoE(cfg)
    finally:
        cfg.scoring_func = "sqrtsoftplus"
