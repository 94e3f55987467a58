"""Attention stack: RoPE, index helpers, sparse attention, and teacher-forced parity with the reference.

The golden tests feed every layer the reference's own attention input,
attn_norm(hc_pre(block_in_i, pre_mix_in_i)), run the layers 0..7 in order through one
`DeepseekV41AttentionState` (so KV / index sharing is exercised), and compare bit for bit on the
fixture CPU (`golden_bits.assert_golden`; elsewhere within its per-block bounds, reported xfailed).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import deepseek_v41_vl.modeling.numerics_deepseek_v41_vl as numerics_module
from deepseek_v41_vl.modeling.attention_deepseek_v41_vl import DeepseekV41Attention
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import (
    DeepseekV41AttentionState,
    window_topk_idxs,
)
from deepseek_v41_vl.modeling.layers_deepseek_v41_vl import DeepseekV41RMSNorm
from deepseek_v41_vl.modeling.indexer_deepseek_v41_vl import select_candidate_blocks
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config, DeepseekV41TextConfig
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear, dequantize_fp8_weight
from deepseek_v41_vl.triton_ops.sparse_attention import sparse_attention as sparse_attention_op
from golden_bits import LOCAL_MISMATCH, LOCAL_REL_L2, assert_golden
from helpers import rel_l2
from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import (
    DeepseekV41RopeError,
    DeepseekV41RotaryEmbedding,
    apply_rotary,
    rope_inv_frequencies,
)

# ----------------------------------------------------------------------------------------- RoPE


def test_yarn_frequencies_against_float64():
    rd, base, factor = 64, 160000.0, 16
    got = rope_inv_frequencies(rd, base, factor, 32, 1, 65536)
    plain = [base ** (-2 * i / rd) for i in range(rd // 2)]

    def corr(r):
        return rd * math.log(65536 / (r * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), rd - 1)
    assert (low, high) == (15, 25)  # REFERENCE.md section 7
    for i, f in enumerate(plain):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = f / factor * ramp + f * (1 - ramp)
        assert abs(got[i].item() - want) <= 1e-6 * want
    assert got[:16].tolist() == rope_inv_frequencies(rd, base)[:16].tolist()  # untouched below low


def test_rotary_layer_variants_follow_compress_ratio():
    cfg = DeepseekV41TextConfig()
    window, compressed = DeepseekV41RotaryEmbedding.for_layer(cfg, 0), DeepseekV41RotaryEmbedding.for_layer(cfg, 2)
    assert window.base == 10000.0 and window.yarn["original_max_position_embeddings"] == 0
    assert compressed.base == 160000.0 and compressed.yarn["factor"] == 16.0
    assert torch.equal(window.inv_freq, rope_inv_frequencies(64, 10000.0))


def test_apply_rotary_interleaved_last_dims_and_inverse():
    rope = DeepseekV41RotaryEmbedding(8, 10000.0)
    pos = torch.tensor([0, 3, 7])
    freqs = rope(pos)
    assert freqs.dtype == torch.complex64 and freqs.shape == (3, 4)
    x = torch.zeros(1, 3, 2, 12, dtype=torch.float32)
    x[..., :4] = 5.0  # the non-rotated leading dims
    x[..., 4::2] = 1.0  # every pair (1, 0)
    y = apply_rotary(x, freqs)
    assert torch.equal(y[..., :4], x[..., :4])
    assert torch.equal(y[:, 0], x[:, 0])  # position 0 is the identity
    inv = rope_inv_frequencies(8, 10000.0).double()
    for t, p in enumerate(pos.tolist()):
        for i in range(4):
            ang = p * inv[i].item()
            assert abs(y[0, t, 0, 4 + 2 * i].item() - math.cos(ang)) < 1e-6
            assert abs(y[0, t, 0, 5 + 2 * i].item() - math.sin(ang)) < 1e-6
    back = apply_rotary(y, freqs, inverse=True)
    assert torch.allclose(back, x, atol=1e-6)
    xb = torch.randn(2, 3, 12).to(torch.bfloat16)
    assert apply_rotary(xb, freqs).dtype == torch.bfloat16
    with pytest.raises(DeepseekV41RopeError):
        apply_rotary(torch.zeros(1, 2, 12), freqs)  # table for 3 positions
    with pytest.raises(DeepseekV41RopeError):
        rope(torch.tensor([0.5]))


# ----------------------------------------------------------------------------------- helpers


def test_window_topk_idxs_prefill_and_decode():
    pre = window_topk_idxs(3, 2, 5, 0)
    assert pre.dtype == torch.int32 and pre.shape == (2, 5, 3)
    assert pre[0].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert window_topk_idxs(4, 1, 2, 0)[0].tolist() == [[0, -1], [0, 1]]
    # decode at position 5 with W=3: slot = pos % 3, oldest first (positions 3, 4, 5 = slots 0, 1, 2)
    assert window_topk_idxs(3, 1, 1, 5)[0].tolist() == [[0, 1, 2]]
    assert window_topk_idxs(3, 1, 1, 4)[0].tolist() == [[2, 0, 1]]
    assert window_topk_idxs(4, 1, 1, 2)[0].tolist() == [[-1, 0, 1, 2]]  # ring still filling


def test_select_candidate_blocks():
    inf = float("inf")
    scores = torch.tensor(
        [
            [5.0, 1.0, 2.0, 3.0, 0.5, -inf, -inf],  # blocks of 2: max 5, 3, 0.5, -inf
            [0.1, 0.2, 9.0, 1.0, -inf, -inf, -inf],
        ]
    )
    lens = torch.tensor([[5], [2]])  # newest visible block: (5-1)//2 = 2, (2-1)//2 = 0
    keep = select_candidate_blocks(scores, lens, 2, 2)
    assert keep.tolist() == [
        [True, True, False, False, True, True, False],  # block 0 (best) + pinned block 2 (both rows)
        [True, True, True, True, False, False, False],  # pinned block 0 + block 1
    ]
    few = select_candidate_blocks(torch.tensor([[1.0, -inf, -inf, -inf]]), torch.tensor([[1]]), 2, 2)
    assert few.tolist() == [[True, True, False, False]]  # the -inf pick is dropped


def _naive_attention(q, kv, sink, idxs, scale):
    b, m, h, d = q.shape
    out = torch.zeros(b, m, h, d, dtype=torch.float64)
    for bi in range(b):
        for t in range(m):
            rows = [j for j in idxs[bi, t].tolist() if j >= 0]
            if not rows:
                continue
            k = kv[bi, rows].double()
            logits = q[bi, t].double() @ k.T * scale  # [h, n]
            mx = torch.maximum(logits.amax(-1), sink.double())
            e = torch.exp(logits - mx[:, None])
            out[bi, t] = (e @ k) / (e.sum(-1) + torch.exp(sink.double() - mx))[:, None]
    return out


def test_sparse_attention_against_float64():
    gen = torch.Generator().manual_seed(0)
    b, m, h, d, n = 2, 3, 4, 32, 150
    q = torch.randn(b, m, h, d, generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, n, d, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen)
    idxs = torch.randint(0, n, (b, m, 130), generator=gen, dtype=torch.int32)  # 3 blocks of <= 64
    idxs[0, 1, ::3] = -1
    idxs[1, 2] = -1  # no valid index: output 0
    out = sparse_attention_op(q, kv, idxs, sink, d**-0.5, backend="torch")
    assert out.dtype == torch.bfloat16 and out.shape == (b, m, h, d)
    want = _naive_attention(q, kv, sink, idxs, d**-0.5)
    assert torch.equal(out[1, 2], torch.zeros(h, d, dtype=torch.bfloat16))
    assert torch.allclose(out.double(), want, atol=2e-2, rtol=2e-2)
    # the sink only adds to the denominator: a huge sink drives the output to 0
    assert sparse_attention_op(q, kv, idxs, torch.full((h,), 80.0), d**-0.5, backend="torch").abs().max() < 1e-6


def test_sparse_attention_rounds_probabilities_per_64_block():
    """K = V rows [logit, value]; q = [1, 0] and scale 1 make the logits exact.

    Within one block the probabilities are rounded to bf16 relative to that block's max before PV;
    across blocks the earlier block is rescaled in fp32. Values are chosen so that the rounded
    products cancel exactly.
    """
    e = torch.tensor(math.exp(-1.0), dtype=torch.float32)
    bf16_e = e.to(torch.bfloat16).float().item()  # 0.3671875
    q = torch.zeros(1, 2, 1, 32, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    kv = torch.zeros(1, 66, 32, dtype=torch.bfloat16)
    kv[0, :64, 1] = 1.0  # 64 rows with logit 0 and value 1
    kv[0, 64, 0], kv[0, 64, 1] = 1.0, -64 * bf16_e  # logit 1; cancels the 64 rounded probabilities
    kv[0, 65, 0], kv[0, 65, 1] = 1.0, -bf16_e  # logit 1; cancels one rounded probability
    idxs = torch.full((1, 2, 65), -1, dtype=torch.int32)
    idxs[0, 0] = torch.arange(65)  # rows 0..63 in block 1, row 64 in block 2
    idxs[0, 1, 0], idxs[0, 1, 1] = 0, 65  # both in block 1
    out = sparse_attention_op(q, kv, idxs, torch.tensor([-100.0]), 1.0, backend="torch")
    # same block: bf16(e^-1) * 1 - bf16(e^-1) = 0 exactly
    assert out[0, 1, 0, 1].item() == 0.0
    # two blocks: block 1 had probabilities exactly 1, rescaled by fp32 e^-1 afterwards
    want = (64 * e.item() - 64 * bf16_e) / (64 * e.item() + 1)
    assert out[0, 0, 0, 1].item() == pytest.approx(want, rel=1e-2)


def test_rmsnorm_fp32_compute():
    norm = DeepseekV41RMSNorm(4, 1e-20)
    norm.weight.data = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.bfloat16)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    rms = math.sqrt((1 + 4 + 9 + 16) / 4)
    want = torch.tensor([[1 / rms, 4 / rms, 1.5 / rms, 4 / rms]]).to(torch.bfloat16)
    assert torch.equal(norm(x), want)


# ------------------------------------------------------------------------- golden parity


def _golden_layers(golden, variant: str, numerics: str):
    config = DeepseekV41Config.from_reference_args(golden / variant / "config.json", numerics=numerics).text_config
    ck = load_file(golden / variant / "model.safetensors")
    want = "fp8" if ck["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn else "bf16"
    assert config.weight_dtype == want  # the storage comes from the config alone
    layers = []
    for i in range(config.num_hidden_layers):
        attn = DeepseekV41Attention(config, i)
        state = {}
        # golden README section 6, "Converting to module dtypes"
        for name, param in attn.state_dict().items():
            tensor = ck[f"layers.{i}.attn.{name}"]
            if name == "wo_a.weight" and tensor.dtype == torch.float8_e4m3fn:
                tensor = dequantize_fp8_weight(tensor, ck[f"layers.{i}.attn.wo_a.scale"])
            elif param.dtype == torch.float32 and tensor.dtype == torch.bfloat16:
                tensor = tensor.float()  # ratio-2 compressor wkv / wgate
            state[name] = tensor
        attn.load_state_dict(state)
        norm = DeepseekV41RMSNorm(config.hidden_size, config.rms_norm_eps)
        norm.load_state_dict({"weight": ck[f"layers.{i}.attn_norm.weight"]})
        layers.append((norm, attn))
    return config, layers


def _attention_input(gold, i: int, norm: DeepseekV41RMSNorm) -> torch.Tensor:
    block_in = gold[f"prefill.block_in.{i}"] if f"prefill.block_in.{i}" in gold else gold[f"prefill.block_out.{i - 1}"]
    mix = gold[f"prefill.pre_mix_in.{i}"]
    collapsed = torch.sum(mix.unsqueeze(-1) * block_in.float(), dim=2).to(block_in.dtype)  # hc_pre
    return norm(collapsed)


def _run_teacher_forced(golden, variant, run, numerics):
    config, layers = _golden_layers(golden, variant, numerics)
    gold = load_file(golden / variant / f"{run}.safetensors")
    state = DeepseekV41AttentionState(record_index_scores=True)
    outs = {}
    for i, (norm, attn) in enumerate(layers):
        outs[i] = attn(_attention_input(gold, i, norm), state)
    return config, gold, state, outs


@pytest.mark.parametrize("variant", ["model_tiny_fp8", "model_tiny_bf16"])
@pytest.mark.parametrize("run", ["vl", "text"])
def test_teacher_forced_prefill_is_bit_exact(golden, variant, run):
    with torch.no_grad():
        config, gold, state, outs = _run_teacher_forced(golden, variant, run, "exact")
    compared = []
    for i in range(config.num_hidden_layers):
        if f"prefill.attn_out.{i}" in gold:
            assert_golden(outs[i], gold[f"prefill.attn_out.{i}"], f"attn_out.{i}", rel_l2=LOCAL_REL_L2)
            compared.append(f"attn_out.{i}")
        if f"prefill.indexer.{i}.topk_idxs" in gold:
            assert_golden(state.topk_idxs[i], gold[f"prefill.indexer.{i}.topk_idxs"], f"indexer.{i}.topk_idxs", mismatch=LOCAL_MISMATCH)
            assert_golden(state.index_scores[i], gold[f"prefill.indexer.{i}.scores"], f"indexer.{i}.scores", rel_l2=LOCAL_REL_L2)
            compared.append(f"indexer.{i}")
    for src in config.kv_source_layer_ids:
        layer_cache = state.cache.layer(src)
        kv, k = layer_cache.compressed_kv, layer_cache.index_k
        assert_golden(kv.rows(kv.length), gold[f"prefill.compress_kv_cache.{src}"], f"compress_kv_cache.{src}", rel_l2=LOCAL_REL_L2)
        assert_golden(k.rows(k.length), gold[f"prefill.index_k_cache.{src}"], f"index_k_cache.{src}", rel_l2=LOCAL_REL_L2)
    cand = config.candidate_source_layer_id
    assert_golden(state.candidates, gold[f"prefill.indexer.{cand}.candidates"], "candidates", mismatch=LOCAL_MISMATCH)
    # every index source and, for the VL run, every layer's output was compared
    assert len([c for c in compared if c.startswith("indexer")]) == len(config.index_source_layer_ids)
    assert len([c for c in compared if c.startswith("attn_out")]) == (config.num_hidden_layers if run == "vl" else 0)


def test_teacher_forced_prefill_fast_numerics_is_close(golden, monkeypatch):
    # a tiny element budget forces the query-chunked paths of the fast mode
    monkeypatch.setattr(numerics_module, "FAST_MAX_ELEMENTS", 50_000)
    config, gold, state, outs = _run_teacher_forced(golden, "model_tiny_fp8", "vl", "fast")
    for i in range(config.num_hidden_layers):
        want = gold[f"prefill.attn_out.{i}"].float()
        rel = rel_l2(outs[i], want)
        assert rel < 0.05, (i, rel)
    for i in config.index_source_layer_ids:
        agree = (state.topk_idxs[i] == gold[f"prefill.indexer.{i}.topk_idxs"]).float().mean()
        assert agree > 0.9, (i, agree.item())


# ------------------------------------------------------------------------------ decode path


def _tiny_config(ratios, kv_sources, index_sources, candidate_source, index_topk=64, candidate_blocks=64):
    return DeepseekV41TextConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=len(ratios),
        num_nextn_predict_layers=0,
        num_attention_heads=2,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=8,
        compress_ratios=ratios,
        kv_source_layer_ids=kv_sources,
        index_source_layer_ids=index_sources,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=index_topk,
        candidate_source_layer_id=candidate_source,
        candidate_topk_blocks=candidate_blocks,
        candidate_block_size=2,
        engram_layer_ids=[],
        engram_num_embeddings=[],
        dspark_noise_token_id=0,
        numerics="exact",
        weight_dtype="bf16",
        expert_weight_dtype="bf16",
        compress_rope_scaling={"factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 32},
    )


def _random_layers(config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(config.num_hidden_layers):
        attn = DeepseekV41Attention(config, i)
        for module in attn.modules():
            if isinstance(module, DeepseekV41Linear):
                w = torch.randn(module.out_features, module.in_features, generator=gen) * module.in_features**-0.5
                module.weight.data = w.to(module.weight.dtype)
            elif isinstance(module, DeepseekV41RMSNorm):
                module.weight.data = (1 + 0.1 * torch.randn(module.weight.shape, generator=gen)).to(torch.bfloat16)
        attn.attn_sink.data = torch.randn(config.num_attention_heads, generator=gen)
        layers.append(attn)
    return layers


@pytest.mark.parametrize(
    "ratios,kv_sources,index_sources,candidate_source",
    [([0, 2, 2, 2], [1], [1, 3], -1), ([1, 1, 1], [0], [0, 2], 0)],
)
def test_decode_steps_match_prefill(ratios, kv_sources, index_sources, candidate_source):
    """Prefill S tokens, then one-token steps, equals a prefill of all tokens at those positions.

    index_topk / candidate blocks exceed the compressed length so that every visible position is
    selected (no tie-breaking); the remaining differences are the summation order of the window
    rows (ring order in decode), a few fp32 ulps.
    """
    config = _tiny_config(ratios, kv_sources, index_sources, candidate_source)
    layers = _random_layers(config)
    b, s, steps = 2, 11, 8  # odd prefill: the ratio-2 compressor parks a partial group; window 8 wraps
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(b, s + steps, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in layers]
    full_state = DeepseekV41AttentionState()
    full = [attn(x, full_state) for attn, x in zip(layers, xs)]

    state = DeepseekV41AttentionState()
    for attn, x in zip(layers, xs):
        attn(x[:, :s], state)
    cache = state.cache
    for t in range(s, s + steps):
        step = DeepseekV41AttentionState(start_pos=t, cache=cache)
        for i, (attn, x) in enumerate(zip(layers, xs)):
            out = attn(x[:, t : t + 1], step)
            want = full[i][:, t].float()
            rel = rel_l2(out[:, 0], want)
            assert rel < 1e-2, (t, i, rel)
    for src in kv_sources:
        r = ratios[src]
        got = cache.layer(src).compressed_kv
        want = full_state.cache.layer(src).compressed_kv
        assert got.length == want.length == (s + steps) // r
        assert (got.rows(got.length).float() - want.rows(want.length).float()).abs().max() < 0.1


def test_decode_ratio2_indexer_reads_last_published_keys():
    """Reference detail (`Indexer.forward`, `shared_attn.index_k`): a ratio-2 owner publishes index
    keys only when its group completes; otherwise its indexer reads the keys published last, which
    are the ratio-1 source's from the previous forward."""
    config = _tiny_config([0, 2, 1], [1, 2], [1, 2], -1, index_topk=4)
    layers = _random_layers(config)
    x = torch.randn(1, 7, config.hidden_size).to(torch.bfloat16)
    state = DeepseekV41AttentionState()
    for attn in layers:
        attn(x[:, :6], state)
    assert state.cache.index_k_publisher == 2
    state.cache.layer(2).index_k.rows(6).zero_()  # make the ratio-1 keys recognisable
    step = DeepseekV41AttentionState(start_pos=6, cache=state.cache, record_index_scores=True)
    layers[0](x[:, 6:], step)
    layers[1](x[:, 6:], step)  # position 6 does not complete a ratio-2 group
    assert torch.equal(step.index_scores[1], torch.zeros(1, 1, 3, dtype=torch.bfloat16))


def test_attention_errors():
    config = _tiny_config([0, 2, 2], [1], [1], -1)
    layers = _random_layers(config)
    x = torch.randn(1, 4, config.hidden_size).to(torch.bfloat16)
    with pytest.raises(DeepseekV41AttentionError):
        layers[0](x, DeepseekV41AttentionState(start_pos=3))  # a chunk after position 0
    with pytest.raises(DeepseekV41AttentionError):
        layers[0](x[:, :1], DeepseekV41AttentionState(start_pos=3))  # decode without a prefill
    with pytest.raises(DeepseekV41AttentionError):
        layers[2](x, DeepseekV41AttentionState())  # consumer before its source
