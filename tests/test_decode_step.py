"""The one-token decode step (`DeepseekV41DecoderLayer.decode_step`) against `block`'s forward.

On CUDA a decode step is replayed from CUDA graphs, whole (fast numerics, no padding) or split in
three parts (head and tail replayed, the attention's middle eager). Both are device-independent
functions, so on the CPU they run eagerly here:

- the three-part split gives the forward's outputs and leaves the same cache behind, bit for bit,
  for every layer kind (window-only, ratio-2 source, ratio-1 candidate source, ratio-1 reuse), in
  both numerics, with and without left padding;
- the whole step (fixed shapes: caches written in place at device positions, compressed rows read
  in a bucketed width) keeps the same top-k sets up to ties of equal scores, and then the same
  outputs and caches, bit for bit, including the first steps after prompts shorter than a
  compressor group and a step whose buffers grow past a bucket.

The graph replay itself is tested in tests/test_gpu.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch

from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41AttentionError
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer

from conftest import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYER_IDS = (0, 2, 20, 21)  # window-only, ratio-2 source, ratio-1 candidate source, ratio-1 reuse


def _bench():
    spec = importlib.util.spec_from_file_location("bench", REPO_ROOT / "benchmarks" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _layers(numerics: str):
    released = json.loads((REPO_ROOT / "configs" / "deepseek_v41_flash.json").read_text())
    # the released layer schedule and storage dtypes at tiny widths (the benchmark's --quick shape)
    released["text_config"].update(dict(
        hidden_size=128, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=8,
        index_n_heads=2, index_head_dim=32, index_topk=4, candidate_topk_blocks=3, candidate_block_size=2,
        numerics=numerics,
    ))
    text = DeepseekV41Config.from_dict(released).text_config
    init = _bench()._init_layer
    gen = torch.Generator().manual_seed(11)
    layers = []
    for layer_id in LAYER_IDS:
        layer = DeepseekV41DecoderLayer(text, layer_id).eval()
        init(layer, gen)
        layers.append(layer)
    return text, layers


def _inputs(text, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block inputs: bf16 hidden states ``[B, L, hc, D]`` and a softmaxed pre-mix ``[B, L, hc]``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, text.hc_mult, text.hidden_size, generator=gen).to(torch.bfloat16)
    return x, torch.softmax(torch.randn(batch, length, text.hc_mult, generator=gen), -1)


def _cache_tensors(cache) -> dict:
    out = {}
    for layer_id, lc in cache.layers.items():
        for name in ("window_kv", "compressor_kv", "compressor_score"):
            t = getattr(lc, name)
            if t is not None:
                out[f"{layer_id}.{name}"] = t
        for name in ("compressed_kv", "index_k"):
            buf = getattr(lc, name)
            if buf is not None:
                out[f"{layer_id}.{name}"] = buf.rows(buf.length)
    return out


@pytest.fixture
def plain_forward():
    """Make `block` take the plain forward for one-token steps too: a forward hook on a submodule
    (as `capture_intermediates` registers) keeps a layer off the fused step."""
    handles = []

    def apply(layers):
        handles.extend(layer.attn_norm.register_forward_hook(lambda *_: None) for layer in layers)
        return layers

    yield apply
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "left-padded"])
@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_piecewise_decode_step_equals_the_plain_forward(numerics, padded, plain_forward):
    text, layers = _layers(numerics)
    plain_forward(layers)
    prefill, steps = 13, 6  # odd prefill: the ratio-2 groups complete on alternate steps
    batch = 2 if padded else 1
    pads = torch.tensor([0, 3]) if padded else None  # row 1 starts 3 columns later
    x, pre = _inputs(text, batch, prefill + steps, seed=5)
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0, pad_offsets=pads)
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        split_cache = copy.deepcopy(state.cache)
        for t in range(prefill, prefill + steps):
            whole = DeepseekV41AttentionState(start_pos=t, cache=state.cache, pad_offsets=pads)
            split = DeepseekV41AttentionState(start_pos=t, cache=split_cache, pad_offsets=pads)
            h_whole = h_split = x[:, t : t + 1]
            m_whole = m_split = pre[:, t : t + 1]
            for layer in layers:
                h_whole, m_whole = layer.block(h_whole, m_whole, whole)
                h_split, m_split = layer.decode_step_piecewise(h_split, m_split, split)
                assert torch.equal(h_whole, h_split), (t, layer.layer_idx)
                assert torch.equal(m_whole, m_split), (t, layer.layer_idx)
            assert whole.topk_idxs.keys() == split.topk_idxs.keys()
            for k in whole.topk_idxs:
                assert torch.equal(whole.topk_idxs[k], split.topk_idxs[k])
    a, b = _cache_tensors(state.cache), _cache_tensors(split_cache)
    assert a.keys() == b.keys() and len(a) >= 6
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_decode_attend_refuses_a_prefill():
    text, layers = _layers("fast")
    layer = layers[0]
    x = torch.randn(1, 3, text.hidden_size).to(torch.bfloat16)
    freqs = layer.attn.rotary(torch.arange(3))
    with torch.no_grad(), pytest.raises(DeepseekV41AttentionError, match="one token after a prefill"):
        qr, kv, q, *extras = layer.attn.decode_project(x, freqs)
        layer.attn.decode_attend(x, qr, kv, q, freqs, DeepseekV41AttentionState(start_pos=0), *extras)


def _replayed(fn):
    """`fn` with a CUDA graph's output semantics: every call returns the same tensors (per input
    signature), rewritten in place, as `GraphedSegment` does for the head."""
    outputs = {}

    def call(*args):
        fresh = fn(*args)
        key = tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)
        if key not in outputs:
            outputs[key] = tuple(None if o is None else o.clone() for o in fresh)
        for static, o in zip(outputs[key], fresh):
            if static is not None:
                static.copy_(o)
        return outputs[key]

    return call


@pytest.mark.parametrize("prefill", [1, 2, 5])
def test_head_outputs_rewritten_by_the_next_step_do_not_leak_into_the_cache(prefill):
    # a prompt shorter than a compressor group: the first latent of the ratio-2 source is stored
    # by a decode step, from the head's outputs, which a graph rewrites at the next replay
    text, layers = _layers("fast")
    steps = 6
    x, pre = _inputs(text, 1, prefill + steps, seed=7)
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        replay_cache = copy.deepcopy(state.cache)
        for layer in layers:
            layer.decode_head = _replayed(layer.decode_head)
        try:
            for t in range(prefill, prefill + steps):
                whole = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
                replay = DeepseekV41AttentionState(start_pos=t, cache=replay_cache)
                h_whole = h_replay = x[:, t : t + 1]
                m_whole = m_replay = pre[:, t : t + 1]
                for layer in layers:
                    h_whole, m_whole = layer.block(h_whole, m_whole, whole)
                    h_replay, m_replay = layer.decode_step(h_replay, m_replay, replay)
                    assert torch.equal(h_whole, h_replay), (t, layer.layer_idx)
        finally:
            for layer in layers:
                del layer.decode_head
    a, b = _cache_tensors(state.cache), _cache_tensors(replay_cache)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_decode_step_and_its_switch_refuse_bad_input():
    from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

    text, layers = _layers("fast")
    layer = layers[0]
    x = torch.randn(1, 3, text.hc_mult, text.hidden_size).to(torch.bfloat16)
    pre = torch.full((1, 3, text.hc_mult), 0.25)
    with torch.no_grad():
        with pytest.raises(DeepseekV41ModelError, match="one token per row"):
            layer.decode_step(x, pre, DeepseekV41AttentionState(start_pos=5))
        with pytest.raises(DeepseekV41ModelError, match="follows a prefill"):
            layer.decode_step(x[:, :1], pre[:, :1], DeepseekV41AttentionState(start_pos=0))
        with pytest.raises(DeepseekV41ModelError, match="needs CUDA"):
            layer.decode_step(x[:, :1], pre[:, :1], DeepseekV41AttentionState(start_pos=5), graphs=True)
    for bad in ("False", None, 0, torch.tensor(True)):
        with pytest.raises(DeepseekV41ModelError, match="True or False"):
            layer.decode_cuda_graphs = bad
    layer.decode_cuda_graphs = False
    assert layer.decode_cuda_graphs is False


@pytest.mark.parametrize("prefill", [1, 13, 250], ids=["shorter-than-a-group", "odd", "crosses-a-bucket"])
def test_whole_decode_step_matches_the_piecewise_split(prefill):
    text, layers = _layers("fast")
    steps = 10
    x, pre = _inputs(text, 1, prefill + steps, seed=3)
    keys = {layer.layer_idx: [] for layer in layers}
    whole_steps = tie_steps = 0
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        whole_cache = copy.deepcopy(state.cache)
        for t in range(prefill, prefill + steps):
            split = DeepseekV41AttentionState(start_pos=t, cache=state.cache, record_index_scores=True)
            whole = DeepseekV41AttentionState(start_pos=t, cache=whole_cache)
            h, m = x[:, t : t + 1], pre[:, t : t + 1]
            for layer in layers:
                plan = layer.attn.decode_plan(whole, 1)
                if plan is not None:
                    keys[layer.layer_idx].append(plan.key)
                    whole_steps += 1
                h_split, m_split = layer.decode_step_piecewise(h, m, split)
                h_whole, m_whole = layer.decode_step(h, m, whole)
                same_sets = True
                if layer.attn.is_index_source and layer.attn.ratio:
                    lid = layer.layer_idx
                    scores = split.index_scores[lid][0, 0].float()
                    got = whole.topk_idxs[lid][0, 0]
                    want = split.topk_idxs[lid][0, 0]
                    got, want = got[got >= 0] - layer.attn.window, want[want >= 0] - layer.attn.window
                    # the kept scores agree; the picks may differ only among equal scores
                    assert torch.equal(scores[got].sort().values, scores[want].sort().values), (t, lid)
                    same_sets = torch.equal(got.sort().values, want.sort().values)
                    if not same_sets:
                        tie_steps += 1
                        whole.topk_idxs[lid] = split.topk_idxs[lid]  # go on from the same picks
                if same_sets and all(
                    torch.equal(whole.topk_idxs[k].sort(-1).values[..., -split.topk_idxs[k].size(-1):], split.topk_idxs[k].sort(-1).values)
                    for k in split.topk_idxs
                ):
                    assert torch.equal(h_whole, h_split), (t, layer.layer_idx)
                    assert torch.equal(m_whole, m_split), (t, layer.layer_idx)
                h, m = h_split, m_split
    assert whole_steps >= (steps - 2) * len(layers)
    assert tie_steps <= steps
    a, b = _cache_tensors(state.cache), _cache_tensors(whole_cache)
    assert a.keys() == b.keys() and len(a) >= 6
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # a graph per cache layout: after the first whole step a layer's key changes only with its
    # buffers (a bucket crossed) or, for a ratio-2 source, with the steps that end a group
    for layer in layers:
        distinct = len(set(keys[layer.layer_idx][1:]))
        allowed = 2 if layer.attn.ratio == 2 else 1
        assert distinct <= allowed + (prefill == 250) * allowed, (layer.layer_idx, distinct)


@pytest.mark.parametrize("window", [1, 8, 128])
def test_window_index_list_from_a_device_position_equals_the_host_one(window):
    from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import (
        decode_window_idxs,
        decode_window_idxs_at,
    )

    for start_pos in (1, 2, window - 1, window, window + 1, 3 * window + 5, 4097):
        if start_pos < 1:
            continue
        want = decode_window_idxs(window, 2, start_pos)
        got = decode_window_idxs_at(window, 2, torch.tensor([start_pos]))
        assert got.dtype == want.dtype and torch.equal(got, want), (window, start_pos)
