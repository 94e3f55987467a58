"""Fast numerics' query-chunked attention paths (indexer with both top-k levels, compressor, query
path) against the unchunked computation, and the candidate blocks handed down as ids.

A tiny random stack holds every role: window-only, ratio-2 kv/index source, ratio-1 candidate
source, an index source filtering by its candidates, and a reuse layer. index_topk 4 and 3
candidate blocks of 2 make both top-k levels bite at 24 tokens; the blocks hold more positions
than index_topk, as in the real config, so a top-k never has to fill up with -inf scores that
are visible (which the reference would keep as indices, picked arbitrarily among ties).
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.modeling.numerics_deepseek_v41_vl as numerics_module
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState
from deepseek_v41_vl.modeling.indexer_deepseek_v41_vl import (
    candidate_block_ids,
    candidate_mask_from_blocks,
    select_candidate_blocks,
)

from helpers import rel_l2
from test_attention import _random_layers, _tiny_config

SEQ = 24


def _run(numerics: str, seq: int = SEQ):
    config = _tiny_config([0, 2, 1, 1, 1], [1, 2], [1, 2, 3], 2, index_topk=4, candidate_blocks=3)
    config.numerics = numerics
    layers = _random_layers(config)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, seq, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in layers]
    state = DeepseekV41AttentionState(record_index_scores=True)
    outs = [layer(x, state) for layer, x in zip(layers, xs)]
    return config, layers, xs, state, outs


def _assert_tie_choices_only(got, want, scores, offset):
    """Rows whose index lists differ picked the same multiset of finite scores: they differ only in
    tie choices. (Picks among -inf scores are the reference's arbitrary choice: an invisible
    position becomes -1, a visible one outside the candidate blocks stays; chunks see only the
    visible positions.)"""
    differing = (got != want).any(-1).nonzero().tolist()
    for b, t in differing:
        picked = []
        for ids in (got, want):
            values = scores[b, t, [j - offset for j in ids[b, t].tolist() if j >= 0]].float()
            picked.append(sorted(values[values.isfinite()].tolist()))
        assert picked[0] == picked[1], (b, t)
    return len(differing)


def test_candidate_block_ids_are_the_reference_mask():
    inf = float("inf")
    scores = torch.tensor([[5.0, 1.0, 2.0, 3.0, 0.5, -inf, -inf], [0.1, 0.2, 9.0, 1.0, -inf, -inf, -inf]])
    lens = torch.tensor([[5], [2]])
    ids = candidate_block_ids(scores, lens, 2, 2)
    assert sorted(ids[0].tolist()) == [0, 2] and sorted(ids[1].tolist()) == [0, 1]
    mask = candidate_mask_from_blocks(ids, 7, 2)
    assert torch.equal(mask, select_candidate_blocks(scores, lens, 2, 2))
    few = torch.tensor([[1.0, -inf, -inf, -inf]])
    assert candidate_block_ids(few, torch.tensor([[1]]), 2, 2).tolist() == [[0, -1]]  # the -inf pick is dropped
    # a narrower width (positions a query chunk can see) cuts the mask; ids beyond it select nothing
    assert candidate_mask_from_blocks(ids, 3, 2).tolist() == [[True, True, False], [True, True, True]]
    assert candidate_mask_from_blocks(torch.tensor([[7, -1]]), 4, 2).tolist() == [[False] * 4]


def test_fast_unchunked_equals_exact_and_keeps_block_ids():
    _, _, _, exact, exact_outs = _run("exact")
    config, _, _, fast, fast_outs = _run("fast")
    assert fast.candidates is None and exact.candidate_blocks is None
    n_kept = min(config.candidate_topk_blocks, -(-SEQ // config.candidate_block_size))
    assert fast.candidate_blocks.shape == (2, SEQ, n_kept) and fast.candidate_blocks.dtype == torch.int16
    assert torch.equal(candidate_mask_from_blocks(fast.candidate_blocks, SEQ, config.candidate_block_size), exact.candidates)
    assert exact.candidates.sum(-1).max() < SEQ  # the candidate filter does bite
    for i in exact.topk_idxs:
        assert torch.equal(fast.topk_idxs[i], exact.topk_idxs[i])
    for got, want in zip(fast_outs, exact_outs):
        assert torch.equal(got, want)


def test_chunked_fast_paths_match_unchunked(monkeypatch):
    config, _, _, whole, whole_outs = _run("fast")
    # a tiny budget: indexer chunks of 3 queries, compressor chunks of one group, q path 2 rows
    monkeypatch.setattr(numerics_module, "FAST_MAX_ELEMENTS", 600)
    _, _, _, chunked, chunked_outs = _run("fast")
    for src in config.kv_source_layer_ids:
        a, b = whole.cache.layer(src), chunked.cache.layer(src)
        assert torch.equal(a.compressed_kv.rows(a.compressed_kv.length), b.compressed_kv.rows(b.compressed_kv.length))
        assert torch.equal(a.index_k.rows(a.index_k.length), b.index_k.rows(b.index_k.length))
    assert torch.equal(whole.cache.layer(1).compressor_kv, chunked.cache.layer(1).compressor_kv)
    # the candidate source's kept blocks: the same set
    block = config.candidate_block_size
    assert torch.equal(
        candidate_mask_from_blocks(chunked.candidate_blocks, SEQ, block),
        candidate_mask_from_blocks(whole.candidate_blocks, SEQ, block),
    )
    for i in config.index_source_layer_ids:
        # chunks score only their visible positions; the recorded scores are padded back to -inf
        assert torch.equal(chunked.index_scores[i], whole.index_scores[i])
        _assert_tie_choices_only(chunked.topk_idxs[i], whole.topk_idxs[i], whole.index_scores[i], SEQ)
    # an output row depends on its index list only: rows with equal lists are bitwise equal (the
    # chunked query path and attention change no value)
    for layer_id, (got, want) in enumerate(zip(chunked_outs, whole_outs)):
        source = config.index_source_of(layer_id)
        if source is None:
            assert torch.equal(got, want)
            continue
        same_rows = (chunked.topk_idxs[source] == whole.topk_idxs[source]).all(-1)
        assert same_rows.float().mean() > 0.9
        assert torch.equal(got[same_rows], want[same_rows]), layer_id


@pytest.mark.parametrize("budget", [1 << 26, 600])
def test_fast_decode_steps_match_fast_prefill(monkeypatch, budget):
    """Prefill then one-token steps (candidate blocks handed down per step) against one prefill."""
    monkeypatch.setattr(numerics_module, "FAST_MAX_ELEMENTS", budget)
    config = _tiny_config([0, 2, 1, 1, 1], [1, 2], [1, 2, 3], 2, index_topk=64, candidate_blocks=64)
    config.numerics = "fast"
    layers = _random_layers(config)
    gen = torch.Generator().manual_seed(4)
    s, steps = 11, 5
    xs = [torch.randn(1, s + steps, config.hidden_size, generator=gen).to(torch.bfloat16) for _ in layers]
    full_state = DeepseekV41AttentionState()
    full = [layer(x, full_state) for layer, x in zip(layers, xs)]
    state = DeepseekV41AttentionState()
    for layer, x in zip(layers, xs):
        layer(x[:, :s], state)
    for t in range(s, s + steps):
        step = DeepseekV41AttentionState(start_pos=t, cache=state.cache)
        for i, (layer, x) in enumerate(zip(layers, xs)):
            out = layer(x[:, t : t + 1], step)
            want = full[i][:, t].float()
            assert rel_l2(out[:, 0], want) < 1e-2, (t, i)
        assert step.candidate_blocks is not None and step.candidate_blocks.shape[:2] == (1, 1)
