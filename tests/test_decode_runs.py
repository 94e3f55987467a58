"""`decode_layers`: a one-token step through consecutive layers, each run of layers on one device
as one function (on CUDA one graph), against calling the layers one by one.

A run plans every layer first (host bookkeeping committed as it goes, so later plans see it),
then executes the layers in order, handing top-k indices and candidate blocks from layer to layer
inside the run. On the CPU the run executes eagerly (``graphs=False``): the same function a graph
captures. It must give the per-layer outputs, hand-downs and caches bit for bit, including the
first steps after a one-token prompt (layers not ready yet break the run) and a step whose
buffers grow past a bucket. The graph replay itself is tested in tests/test_gpu.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from deepseek_v41_vl.modeling import cuda_graphs_deepseek_v41_vl as cuda_graphs
from deepseek_v41_vl.modeling import modeling_deepseek_v41_vl as modeling
from deepseek_v41_vl.modeling.decoder_layer_deepseek_v41_vl import DeepseekV41DecoderLayer
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import decode_layers

from golden_models import golden_model, run_inputs
from test_decode_step import _cache_tensors, _inputs, _layers

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def runs_seen(monkeypatch):
    """The layer ids of every run `decode_layers` executes."""
    seen = []
    original = cuda_graphs._replay_run

    def spy(entries, *args, **kwargs):
        seen.append(tuple(layer.layer_idx for layer, _ in entries))
        return original(entries, *args, **kwargs)

    monkeypatch.setattr(cuda_graphs, "_replay_run", spy)
    return seen


def _assert_same_state(a: DeepseekV41AttentionState, b: DeepseekV41AttentionState) -> None:
    assert a.topk_idxs.keys() == b.topk_idxs.keys()
    for k in a.topk_idxs:
        assert torch.equal(a.topk_idxs[k], b.topk_idxs[k]), k
    assert (a.candidate_blocks is None) == (b.candidate_blocks is None)
    if a.candidate_blocks is not None:
        assert torch.equal(a.candidate_blocks, b.candidate_blocks)


@pytest.mark.parametrize("prefill", [1, 13, 250], ids=["one-token-prompt", "odd", "crosses-a-bucket"])
def test_a_run_equals_the_layers_one_by_one(prefill, runs_seen):
    text, layers = _layers("fast")
    steps = 8
    x, pre = _inputs(text, 1, prefill + steps, seed=7)
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        run_cache = copy.deepcopy(state.cache)
        for t in range(prefill, prefill + steps):
            alone = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
            run = DeepseekV41AttentionState(start_pos=t, cache=run_cache)
            h, m = x[:, t : t + 1], pre[:, t : t + 1]
            for layer in layers:
                h, m = layer.block(h, m, alone)
            h_run, m_run = decode_layers(layers, x[:, t : t + 1], pre[:, t : t + 1], run, graphs=False)
            assert torch.equal(h_run, h) and torch.equal(m_run, m), t
            _assert_same_state(run, alone)
            assert not any(v is cuda_graphs._PENDING for v in run.topk_idxs.values())
    a, b = _cache_tensors(state.cache), _cache_tensors(run_cache)
    assert a.keys() == b.keys() and len(a) >= 6
    for k in a:
        assert torch.equal(a[k], b[k]), k
    whole = tuple(layer.layer_idx for layer in layers)
    assert runs_seen.count(whole) >= steps - 2, runs_seen
    if prefill == 1:
        # the first step: the compressed layers are not ready, the window-only layer runs alone
        assert runs_seen[0] == (0,), runs_seen


def _one_step_both_ways(layers, x, pre, prefill: int, call):
    """Prefill `prefill` tokens, then the next token twice from copies of that cache: the layers
    one by one through `call(layer, h, m, state)`, and `decode_layers` (eager). Returns
    ``((h, m, state) one by one, (h, m, state) of the run)``."""
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        run_cache = copy.deepcopy(state.cache)
        alone = DeepseekV41AttentionState(start_pos=prefill, cache=state.cache)
        h, m = x[:, prefill : prefill + 1], pre[:, prefill : prefill + 1]
        for layer in layers:
            h, m = call(layer, h, m, alone)
        run = DeepseekV41AttentionState(start_pos=prefill, cache=run_cache)
        h_run, m_run = decode_layers(layers, x[:, prefill : prefill + 1], pre[:, prefill : prefill + 1], run, graphs=False)
    return (h, m, alone), (h_run, m_run, run)


def test_a_hooked_layer_splits_the_run(runs_seen):
    text, layers = _layers("fast")
    x, pre = _inputs(text, 1, 14, seed=9)
    calls = []
    handle = layers[1].attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        (h, m, alone), (h_run, m_run, run) = _one_step_both_ways(
            layers, x, pre, 13, lambda layer, h, m, state: layer.block(h, m, state)
        )
    finally:
        handle.remove()
    assert calls == [1, 1, 1]  # the hooked attention ran as a module: prefill, one by one, decode_layers
    assert runs_seen == [(0,), (20, 21)]
    assert torch.equal(h_run, h) and torch.equal(m_run, m)
    _assert_same_state(run, alone)


def test_hooks_on_a_layer_itself_keep_it_out_of_runs(runs_seen):
    """A run does not call its layers as modules: a layer with hooks of its own (here one that
    rewrites its input) steps alone, through its hooks, as in the layer-by-layer loop."""
    text, layers = _layers("fast")
    x, pre = _inputs(text, 1, 14, seed=4)
    calls = []
    handles = [
        layers[1].register_forward_pre_hook(lambda m, args: (args[0] * 0.5, *args[1:])),
        layers[1].register_forward_hook(lambda *a: calls.append("post")),
    ]
    try:
        (h, m, alone), (h_run, m_run, run) = _one_step_both_ways(
            layers, x, pre, 13, lambda layer, h, m, state: layer(h, m, state)
        )
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["post", "post"]
    assert runs_seen == [(0,), (20, 21)]
    assert torch.equal(h_run, h) and torch.equal(m_run, m)
    _assert_same_state(run, alone)


def test_a_failed_run_puts_back_its_bookkeeping(monkeypatch):
    """An error inside a run (an out-of-memory at its capture, say) leaves the cache's row counts,
    index-key publisher and the state's hand-downs as they were before the run, so the step can be
    taken again and gives what a clean step gives."""
    text, layers = _layers("fast")
    prefill = 13
    x, pre = _inputs(text, 1, prefill + 1, seed=6)
    with torch.no_grad():
        state = DeepseekV41AttentionState(start_pos=0)
        for layer in layers:
            layer.block(x[:, :prefill], pre[:, :prefill], state)
        clean_cache = copy.deepcopy(state.cache)
        lengths = {i: (c.compressed_kv and c.compressed_kv.length, c.index_k and c.index_k.length) for i, c in state.cache.layers.items()}
        publisher = state.cache.index_k_publisher
        original = DeepseekV41DecoderLayer.decode_whole

        def failing(self, *args):
            if self.layer_idx == 21:
                raise RuntimeError("out of memory (simulated)")
            return original(self, *args)

        step = DeepseekV41AttentionState(start_pos=prefill, cache=state.cache)
        with monkeypatch.context() as m:
            m.setattr(DeepseekV41DecoderLayer, "decode_whole", failing)
            with pytest.raises(RuntimeError, match="simulated"):
                decode_layers(layers, x[:, prefill:], pre[:, prefill:], step, graphs=False)
        after = {i: (c.compressed_kv and c.compressed_kv.length, c.index_k and c.index_k.length) for i, c in state.cache.layers.items()}
        assert after == lengths and state.cache.index_k_publisher == publisher
        assert step.topk_idxs == {} and step.candidate_blocks is None
        retry = DeepseekV41AttentionState(start_pos=prefill, cache=state.cache)
        h_run, m_run = decode_layers(layers, x[:, prefill:], pre[:, prefill:], retry, graphs=False)
        clean = DeepseekV41AttentionState(start_pos=prefill, cache=clean_cache)
        h, m = x[:, prefill:], pre[:, prefill:]
        for layer in layers:
            h, m = layer.block(h, m, clean)
    assert torch.equal(h_run, h) and torch.equal(m_run, m)
    _assert_same_state(retry, clean)
    a, b = _cache_tensors(state.cache), _cache_tensors(clean_cache)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_runs_are_off_by_default_and_the_switch_takes_bools_only(golden):
    model = golden_model(golden, "model_tiny_fp8", "fast")
    assert model.decode_layer_runs is False
    with pytest.raises(DeepseekV41ModelError, match="decode_layer_runs must be True or False"):
        model.decode_layer_runs = 1
    assert model.decode_layer_runs is False


def test_decode_layers_refuses_a_prefill_and_several_tokens():
    text, layers = _layers("fast")
    x, pre = _inputs(text, 1, 2, seed=1)
    with pytest.raises(DeepseekV41ModelError, match="one token per row"):
        decode_layers(layers, x, pre, DeepseekV41AttentionState(start_pos=4))
    with pytest.raises(DeepseekV41ModelError, match="start_pos is 0"):
        decode_layers(layers, x[:, :1], pre[:, :1], DeepseekV41AttentionState(start_pos=0))


def test_the_model_decodes_through_runs_like_layer_by_layer(golden, monkeypatch, runs_seen):
    """A golden tiny model (Engram layers included) decoding greedily: with its layers' steps
    grouped in runs, the same logits bit for bit as with each layer alone."""
    model = golden_model(golden, "model_tiny_fp8", "fast")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "text")
    prompt = {"input_ids": inputs["input_ids"][:1]}
    text = model.config.text_config
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        token = model(**prompt, cache=cache).logits.argmax(-1)
    run_cache = copy.deepcopy(cache)
    eager_runs = functools.partial(decode_layers, graphs=False)
    with torch.no_grad():
        for step in range(6):
            alone = model(token, cache=cache).logits
            with monkeypatch.context() as m:
                m.setattr(modeling, "decode_layers", eager_runs)  # the model module's name for it
                m.setattr(model, "decode_layer_runs", True)
                run = model(token, cache=run_cache).logits
            assert torch.equal(run, alone), step
            token = alone.argmax(-1)
    # Engram layers step alone and split the runs
    assert runs_seen, "no run was executed"
    for ids in runs_seen:
        assert not set(ids) & set(text.engram_layer_ids), ids
    assert max(len(ids) for ids in runs_seen) >= 2
