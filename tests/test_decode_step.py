"""The decode engine (`decode_step_deepseek_v41_vl.py`): the whole model's one-token step, run
eagerly on the CPU (its CUDA-graph replay is tested in tests/test_gpu.py).

- Against the layer-by-layer forward (which a forward hook selects): the same row counts,
  publisher and positions in the cache, the same greedy tokens and close logits (the step lists
  the top-k picks unsorted and ranks them over the sequence's fixed width: the same terms added
  in another order), for a static and a growing cache, one row and a left-padded batch.
- A left-padded row decodes as it does alone.
- A static cache keeps its storage (its epoch) from the first step to the last and into the next
  `generate` of the same length: a captured step stays valid.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import decode_window_idxs, decode_window_idxs_at
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import (
    DeepseekV41AttentionError,
    DeepseekV41CacheError,
    DeepseekV41ModelError,
)

from golden_models import golden_model, run_inputs
from helpers import rel_l2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANT = "model_tiny_fp8"
STEPS = 9  # odd and even positions: the ratio-2 groups end on alternate steps


@pytest.fixture(scope="module")
def fast(golden):
    model = golden_model(golden, VARIANT, "fast")
    _, inputs = run_inputs(golden, VARIANT, "text")
    return model, inputs["input_ids"]


class _LayerByLayer:
    """A forward hook on the final norm: the forward then takes every step layer by layer."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.handle = self.model.norm.register_forward_hook(lambda *_: None)

    def __exit__(self, *exc):
        self.handle.remove()


def _decode(model, prompt, tokens, engine: bool, max_cache_len=None, mask=None):
    """Prefill `prompt`, then feed `tokens` ``[B, n]`` one column per step; returns the stacked
    step logits and the cache."""
    cache = DeepseekV41Cache(model.config, max_cache_len=max_cache_len)
    logits = []
    with torch.no_grad():
        model(prompt, cache=cache, attention_mask=mask)
        for i in range(tokens.size(1)):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if engine:
                logits.append(model(tokens[:, i : i + 1], cache=cache, attention_mask=mask).logits)
            else:
                with _LayerByLayer(model):
                    logits.append(model(tokens[:, i : i + 1], cache=cache, attention_mask=mask).logits)
    return torch.cat(logits, dim=1), cache


def _greedy(model, prompt, steps, mask=None):
    """Greedy tokens, the image token suppressed (as `generate` does)."""
    cache = DeepseekV41Cache(model.config)
    out = []

    def pick(logits):
        return logits.index_fill(-1, torch.tensor([model.config.image_token_id]), -torch.inf).argmax(-1)

    with torch.no_grad(), _LayerByLayer(model):
        token = pick(model(prompt, cache=cache, attention_mask=mask).logits[:, -1:])
        for _ in range(steps):
            out.append(token)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            token = pick(model(token, cache=cache, attention_mask=mask).logits)
    return torch.cat(out, dim=1)


def _bookkeeping(cache):
    attention = cache.attention
    rows = {
        (i, kind): getattr(state, kind).length
        for i, state in attention.layers.items()
        for kind in ("compressed_kv", "index_k")
        if getattr(state, kind) is not None
    }
    # each row's publisher (the forward keeps one for all rows when they agree)
    per_row = attention.index_k_publisher_rows
    batch = cache.batch_size
    publishers = [attention.index_k_publisher] * batch if per_row is None else per_row.tolist()
    return rows, publishers, cache.get_seq_length()


@pytest.mark.parametrize("max_cache_len", [None, 64], ids=["growing", "static"])
@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "left-padded"])
def test_engine_steps_follow_the_layer_by_layer_forward(fast, max_cache_len, padded):
    model, ids = fast
    prompt, mask = ids[:1, :21], None
    if padded:
        prompt = torch.cat([prompt, torch.cat([torch.zeros(1, 4, dtype=ids.dtype), prompt[:, 4:]], 1)])
        mask = torch.ones_like(prompt)
        mask[1, :4] = 0
    tokens = _greedy(model, prompt, STEPS, mask)
    plain, plain_cache = _decode(model, prompt, tokens, engine=False, mask=mask)
    captures_before = model.decode_runner.captures
    engine, engine_cache = _decode(model, prompt, tokens, engine=True, max_cache_len=max_cache_len, mask=mask)
    assert model.decode_runner.captures == captures_before  # the CPU runs the step eagerly
    assert _bookkeeping(engine_cache) == _bookkeeping(plain_cache)
    assert rel_l2(engine, plain) < 1e-2
    assert torch.equal(engine.argmax(-1), plain.argmax(-1))
    # the rows the caches hold (every row of a row's own positions) agree closely
    for i, state in plain_cache.attention.layers.items():
        other = engine_cache.attention.layer(i)
        assert rel_l2(other.window_kv.float(), state.window_kv.float()) < 1e-2, i
        if state.compressed_kv is not None:
            n = state.compressed_kv.length
            assert rel_l2(other.compressed_kv.rows(n).float(), state.compressed_kv.rows(n).float()) < 2e-2, i


@pytest.mark.parametrize("length", [1, 2, 3])
def test_engine_steps_after_a_prompt_shorter_than_a_group(fast, length):
    """The first compressed rows of a ratio-2 source are made by decode steps."""
    model, ids = fast
    prompt = ids[:1, :length]
    tokens = _greedy(model, prompt, STEPS)
    plain, plain_cache = _decode(model, prompt, tokens, engine=False)
    engine, engine_cache = _decode(model, prompt, tokens, engine=True, max_cache_len=length + STEPS)
    assert _bookkeeping(engine_cache) == _bookkeeping(plain_cache)
    for i, state in plain_cache.attention.layers.items():
        for kind in ("compressed_kv", "index_k"):
            want, got = getattr(state, kind), getattr(engine_cache.attention.layer(i), kind)
            if want is not None:
                assert got.storage().dtype == want.storage().dtype, (i, kind)
    assert torch.equal(engine.argmax(-1), plain.argmax(-1)) and rel_l2(engine, plain) < 1e-2


def test_a_left_padded_row_decodes_as_it_does_alone(fast):
    model, ids = fast
    short, long = ids[:1, :13], ids[:1, :21]
    prompt = torch.cat([torch.cat([torch.zeros(1, 8, dtype=ids.dtype), short], 1), long])
    mask = torch.ones_like(prompt)
    mask[0, :8] = 0
    tokens = _greedy(model, prompt, STEPS, mask)
    batch, _ = _decode(model, prompt, tokens, engine=True, max_cache_len=40, mask=mask)
    for row, alone_prompt in enumerate((short, long)):
        alone, _ = _decode(model, alone_prompt, tokens[row : row + 1], engine=True, max_cache_len=40)
        assert rel_l2(batch[row : row + 1], alone) < 1e-2, row
        assert torch.equal(batch[row : row + 1].argmax(-1), alone.argmax(-1)), row


def test_a_static_cache_keeps_its_storage_through_the_steps_and_the_next_generate(fast, tiny_model):
    model, ids = fast
    cache = DeepseekV41Cache(model.config, max_cache_len=40)
    with torch.no_grad():
        token = model(ids[:1, :21], cache=cache).logits.argmax(-1)
        token = model(token, cache=cache).logits.argmax(-1)  # the first step may allocate its own state
        epoch = cache.attention.epoch.value
        for _ in range(STEPS):
            token = model(token, cache=cache).logits.argmax(-1)
    assert cache.attention.epoch.value == epoch
    # generate keeps its static cache on the model: the next call of the same length reuses it
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    tiny_model.set_numerics("fast")
    try:
        first = tiny_model.generate(prompt, do_sample=False, max_new_tokens=6)
        kept = tiny_model._kept_cache
        epoch = kept.attention.epoch.value
        second = tiny_model.generate(prompt, do_sample=False, max_new_tokens=6)
        dynamic = tiny_model.generate(prompt, do_sample=False, max_new_tokens=6, cache_implementation="dynamic")
    finally:
        tiny_model.set_numerics("exact")
    assert tiny_model._kept_cache is kept and kept.attention.epoch.value == epoch
    assert torch.equal(first, second) and kept.max_cache_len == prompt.size(1) + 6 - 1
    assert torch.equal(dynamic, first)


def test_a_static_cache_grows_when_a_forward_needs_more_room(fast):
    model, ids = fast
    cache = DeepseekV41Cache(model.config, max_cache_len=22)
    grown = DeepseekV41Cache(model.config)
    with torch.no_grad():
        for c in (cache, grown):
            model(ids[:1, :21], cache=c)
        a = model(ids[:1, 21:30], cache=cache).logits  # 9 tokens past 22 positions
        b = model(ids[:1, 21:30], cache=grown).logits
    assert cache.max_cache_len == 44 and torch.equal(a, b)
    assert cache.attention.layer(1).compressed_kv.capacity == 22


def test_a_step_called_directly_is_checked_as_a_forward(fast):
    model, ids = fast
    cache = DeepseekV41Cache(model.config, max_cache_len=40)
    with torch.no_grad():
        model(ids[:1, :21], cache=cache)
        with pytest.raises(DeepseekV41ModelError, match="must lie in"):
            model(torch.tensor([[model.text_config.vocab_size]]), cache=cache)
        with pytest.raises(DeepseekV41ModelError, match="outside an image span"):
            model(torch.tensor([[model.config.image_token_id]]), cache=cache)
        with pytest.raises(DeepseekV41AttentionError, match=r"\[batch, past \+ seq\] = \[1, 22\]"):
            model(ids[:1, 21:22], cache=cache, attention_mask=torch.ones(1, 21, dtype=torch.long))
        with pytest.raises(DeepseekV41ModelError, match="the cache holds 1 batch rows"):
            model(ids[:2, 21:22], cache=cache)
    assert cache.get_seq_length() == 21  # nothing was written


def test_a_trusted_call_scans_the_modules_once(fast, monkeypatch):
    # hooks, devices, offload: scanned at the first step of a call (`trusting`), not at every step;
    # a hook registered during a call takes the layer-by-layer forward from the next call on
    model, ids = fast
    runner = model.decode_runner
    scans, steps = [], []
    placed, step = runner._placed_for_steps, runner.step
    monkeypatch.setattr(runner, "_placed_for_steps", lambda m: scans.append(1) or placed(m))
    monkeypatch.setattr(runner, "step", lambda *a, **k: steps.append(1) or step(*a, **k))
    cache = DeepseekV41Cache(model.config, max_cache_len=64)
    handle = None
    try:
        with torch.no_grad():
            token = model(ids[:1, :21], cache=cache).logits[:, -1:].argmax(-1)
            with runner.trusting():
                for _ in range(3):
                    token = model(token, cache=cache).logits.argmax(-1)
                handle = model.norm.register_forward_hook(lambda *_: None)
                token = model(token, cache=cache).logits.argmax(-1)
            assert (len(scans), len(steps)) == (1, 4)
            token = model(token, cache=cache).logits.argmax(-1)  # outside a call: scanned, hooked
            with runner.trusting():
                token = model(token, cache=cache).logits.argmax(-1)
            assert (len(scans), len(steps)) == (3, 4)
            handle.remove()
            with runner.trusting(), runner.trusting():  # nested: still one scan
                for _ in range(2):
                    token = model(token, cache=cache).logits.argmax(-1)
            assert (len(scans), len(steps)) == (4, 6)
    finally:
        if handle is not None:
            handle.remove()


def test_generate_scans_the_modules_at_its_first_step_only(tiny_model, monkeypatch):
    runner = tiny_model.model.decode_runner
    scans, steps = [], []
    placed, step = runner._placed_for_steps, runner.step
    monkeypatch.setattr(runner, "_placed_for_steps", lambda m: scans.append(1) or placed(m))
    monkeypatch.setattr(runner, "step", lambda *a, **k: steps.append(1) or step(*a, **k))
    prompt = torch.randint(0, 400, (1, 20), generator=torch.Generator().manual_seed(20))
    with _fast(tiny_model):
        tiny_model.generate(prompt, do_sample=False, max_new_tokens=6)
        assert (len(scans), len(steps)) == (1, 5)
        tiny_model.generate(prompt, do_sample=False, max_new_tokens=3)  # the next call scans again
        assert (len(scans), len(steps)) == (2, 7)


def test_a_scan_runs_again_within_a_call_for_a_new_module_or_plan(fast, monkeypatch):
    from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import apply_numerics

    model, _ = fast
    runner = model.decode_runner
    scans = []

    def scan():
        scans.append(1)
        return True

    with runner.trusting():
        assert runner._once_per_call(("probe",), scan) and runner._once_per_call(("probe",), scan)
        assert len(scans) == 1
        torch.nn.Module().register_buffer("probe", torch.zeros(1))  # any registration
        runner._once_per_call(("probe",), scan)
        assert len(scans) == 2
    runner._once_per_call(("probe",), scan)
    runner._once_per_call(("probe",), scan)
    assert len(scans) == 4  # outside a call: every time
    # the replay decision (the layers' kernels) is keyed on the plan too
    checks = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for layer in model.layers:
        monkeypatch.setattr(layer.attn, "sparse_attention_graph_safe", lambda device: checks.append(1) or True)
        monkeypatch.setattr(layer.ffn, "runs_without_host_sync", lambda batch, device: True)
    cuda, plan = torch.device("cuda"), model.numerics
    try:
        with runner.trusting():
            runner._replays(model, 1, cuda)
            first = len(checks)
            runner._replays(model, 1, cuda)
            assert first >= 1 and len(checks) == first
            apply_numerics(model, plan.replace(rope="torch"))
            runner._replays(model, 1, cuda)
            assert len(checks) == 2 * first
    finally:
        apply_numerics(model, plan)


@pytest.mark.parametrize("window", [1, 8, 128])
def test_window_index_list_from_a_device_position_equals_the_host_one(window):
    for start_pos in (1, 2, window - 1, window, window + 1, 3 * window + 5, 4097):
        if start_pos < 1:
            continue
        want = decode_window_idxs(window, 2, start_pos)
        got = decode_window_idxs_at(window, 2, torch.tensor([start_pos]))
        assert got.dtype == want.dtype and torch.equal(got, want), (window, start_pos)


def test_a_growing_cache_decodes_across_its_width_buckets(fast, monkeypatch):
    """A step writes the row of a partial group too: the width it reads covers it when the rows in
    use reach a power of two (here every bucket is crossed: the smallest bucket is 1 row)."""
    import deepseek_v41_vl.modeling.attention_deepseek_v41_vl as attention

    monkeypatch.setattr(attention, "DECODE_MIN_ROWS", 1)
    model, ids = fast
    prompt = ids[:1, :16]  # 8 complete groups of the ratio-2 layers, then a partial one
    tokens = _greedy(model, prompt, STEPS)
    plain, plain_cache = _decode(model, prompt, tokens, engine=False)
    engine, engine_cache = _decode(model, prompt, tokens, engine=True)
    assert _bookkeeping(engine_cache) == _bookkeeping(plain_cache)
    assert torch.equal(engine.argmax(-1), plain.argmax(-1)) and rel_l2(engine, plain) < 1e-2


def test_growing_a_static_cache_keeps_its_rows(fast):
    model, ids = fast
    cache = DeepseekV41Cache(model.config, max_cache_len=21)
    with torch.no_grad():
        model(ids[:1, :21], cache=cache)
    rows = {i: s.compressed_kv.rows(s.compressed_kv.length).clone() for i, s in cache.attention.layers.items()
            if s.compressed_kv is not None}
    for length in (22, 23, 60):  # ratio-2 rows: the same capacity, then more
        with torch.no_grad():  # (as `generate` grows a cache it is given)
            cache.grow_to(length)
        assert cache.max_cache_len == length
        for i, kept in rows.items():
            assert torch.equal(cache.attention.layer(i).compressed_kv.rows(kept.size(1)), kept), (length, i)


def test_a_batch_selection_moves_the_host_padding_with_the_rows(fast):
    model, ids = fast
    prompt = torch.cat([ids[:1, :21], torch.cat([torch.zeros(1, 4, dtype=ids.dtype), ids[:1, 4:21]], 1)])
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        model(prompt, cache=cache, attention_mask=mask)
        cache.batch_select_indices(torch.tensor([1, 1]))
        assert cache.attention.host_pads == [4, 4] and cache.attention.pad_offsets.tolist() == [4, 4]
        token = torch.tensor([[7], [7]])
        with _LayerByLayer(model):
            plain = model(token, cache=cache).logits
    alone = DeepseekV41Cache(model.config)
    with torch.no_grad(), _LayerByLayer(model):
        model(prompt[1:], cache=alone, attention_mask=mask[1:])
        want = model(token[:1], cache=alone).logits
    for row in (0, 1):  # (fast numerics: a batch of 2 rows is not added up as one row alone)
        assert rel_l2(plain[row], want[0]) < 1e-2 and torch.equal(plain[row].argmax(-1), want[0].argmax(-1))


def test_a_cache_reordered_under_inference_mode_continues_outside_it(fast):
    model, ids = fast
    cache = DeepseekV41Cache(model.config)
    with torch.inference_mode():
        model(ids[:2, :21], cache=cache)
        cache.batch_select_indices(torch.tensor([0]))  # a smaller batch: new tensors
    with torch.no_grad():
        logits = model(torch.tensor([[7]]), cache=cache).logits
    assert logits.shape[:2] == (1, 1)


def test_generate_hands_over_the_cache_it_returns(fast, tiny_model):
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    first = tiny_model.generate(prompt, do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
    held = first.past_key_values
    assert tiny_model.__dict__.get("_kept_cache") is not held
    length = held.get_seq_length()
    second = tiny_model.generate(prompt + 1, do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
    assert second.past_key_values is not held and held.get_seq_length() == length
    with pytest.raises(DeepseekV41ModelError, match="'static' \\(the default\\) or 'dynamic'"):
        tiny_model.generate(prompt, max_new_tokens=2, cache_implementation="offloaded")
    # a continuation whose first forward is the caller's single token: checked at the entry
    whole = torch.cat([first.sequences[:, :-1], torch.tensor([[tiny_model.config.text_config.vocab_size]])], 1)
    with pytest.raises(DeepseekV41ModelError, match="must lie in"):
        tiny_model.generate(whole, cache=held, max_new_tokens=2)


@contextlib.contextmanager
def _fast(model):
    model.set_numerics("fast")
    try:
        yield model
    finally:
        model.set_numerics("exact")


def test_static_and_growing_caches_generate_the_same_tokens(tiny_model):
    """Past index_topk compressed positions the picks are ranked over the cache's width: ties go
    to the lower position, so a static cache (its capacity) and a growing one (a bucket) keep the
    same picks, and the greedy tokens agree."""
    prompt = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(40))
    with _fast(tiny_model):
        static = tiny_model.generate(prompt, do_sample=False, max_new_tokens=30)
        longer = tiny_model.generate(prompt, do_sample=False, max_new_tokens=30, max_cache_len=100)
        dynamic = tiny_model.generate(prompt, do_sample=False, max_new_tokens=30, cache_implementation="dynamic")
    assert torch.equal(static, dynamic) and torch.equal(static, longer)
    for bad in ("x", -5, 0, True):
        with pytest.raises(DeepseekV41CacheError, match="max_cache_len must be None or an int >= 1"):
            tiny_model.generate(prompt, max_new_tokens=1, max_cache_len=bad)


def test_threads_generating_at_once_get_their_own_tokens(tiny_model):
    prompts = [torch.randint(0, 400, (1, 6 + i), generator=torch.Generator().manual_seed(50 + i)) for i in range(3)]
    with _fast(tiny_model):
        alone = [tiny_model.generate(p, do_sample=False, max_new_tokens=6) for p in prompts]
        together = [None] * len(prompts)

        def run(i):
            together[i] = tiny_model.generate(prompts[i], do_sample=False, max_new_tokens=6)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_a_step_ranks_ties_by_position_whatever_the_width(fast):
    """Equal index scores at the top-k boundary (the relu makes many exactly 0) go to the lower
    positions, so the picks do not depend on the width the step ranks."""
    model, _ = fast
    indexer = next(
        layer.attn.indexer for layer in model.layers
        if layer.attn.indexer is not None and not layer.attn.indexer.is_candidate_source and not layer.attn.indexer.uses_candidates
    )
    gen = torch.Generator().manual_seed(3)
    q = torch.rand(1, 1, indexer.n_heads, indexer.head_dim, generator=gen).to(torch.bfloat16)
    weights = torch.ones(1, 1, indexer.n_heads)
    visible, k = 20, indexer.index_topk
    picks = []
    for width in (visible, 24, 64, 300, 1000):
        keys = torch.randn(1, width, indexer.head_dim, generator=gen).to(torch.bfloat16)  # past `visible`: masked
        keys[:, :visible] = 0  # every visible score 0: all tied ...
        keys[:, :3] = q[0, 0, 0]  # ... but three
        idxs, _ = indexer.decode_select(q, weights, keys, torch.tensor([visible]).view(1, 1, 1), 0)
        picks.append(sorted(idxs.flatten().tolist()))
    assert all(p == list(range(k)) for p in picks), picks


def test_the_work_a_step_runs_aside_is_read_only_after_its_join(fast, monkeypatch):
    # the step hands each layer's two mixes (with their Sinkhorn) and the attention's keys to
    # `aside`, which in a CUDA graph runs them on side streams beside the attention's queries, the
    # attention and the FFN. Run here only at their join, they give the same bits: nothing
    # between the fork and the join reads their results or changes what they read.
    import types

    from deepseek_v41_vl.modeling import decode_step_deepseek_v41_vl as engine

    model, ids = fast
    prompt = ids[:1, :21]
    tokens = _greedy(model, prompt, 4)
    in_line, _ = _decode(model, prompt, tokens, engine=True)
    names = []

    def later(fn, *args):
        names.append(getattr(fn, "__name__", type(fn).__name__))
        return types.SimpleNamespace(join=lambda: fn(*args))

    monkeypatch.setattr(engine, "in_line", later)
    deferred, _ = _decode(model, prompt, tokens, engine=True)
    # per layer and step: the block input's mixes, the attention's keys, then the attention
    # output's mixes (all of them aside: `post_mixes` takes its fused launch in line only)
    assert names == ["mixes", "_decode_keys", "mixes"] * (len(model.layers) * tokens.size(1))
    assert torch.equal(deferred, in_line)


def test_the_heads_decode_logits_off_cuda_are_its_forward():
    """`DeepseekV41Head.decode_logits` reads a bf16 copy of the weight on CUDA only (tests/test_gpu.py);
    elsewhere it is `forward`, bit for bit, holding no copy. A held copy is dropped when the head
    is moved or cast and is not pickled."""
    import pickle

    from deepseek_v41_vl.modeling.layers_deepseek_v41_vl import DeepseekV41Head

    head = DeepseekV41Head(50, 16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16).bfloat16().float())
    x = torch.randn(3, 1, 16).bfloat16()
    with torch.no_grad():
        assert torch.equal(head.decode_logits(x), head(x))
    assert "_decode_copy" not in head.__dict__
    head.__dict__["_decode_copy"] = (head.decode_version, head.weight.detach().bfloat16())
    assert "_decode_copy" not in pickle.loads(pickle.dumps(head)).__dict__
    version = head.decode_version
    head.to(torch.float32)  # onto itself: the same storage, but the copy is gone
    assert "_decode_copy" not in head.__dict__ and head.decode_version != version
    version = head.decode_version
    with torch.no_grad():
        head.weight.mul_(2)
    assert head.decode_version != version
    version = head.decode_version
    head.drop_decode_copy()  # after a write through `.data`, which bumps no version
    assert head.decode_version != version
    with torch.inference_mode():
        frozen = DeepseekV41Head(50, 16)
    assert frozen.decode_version[3] is None  # an inference tensor keeps no version: never copied
