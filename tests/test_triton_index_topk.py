"""The indexer's decode-step top-k in one launch (`triton_ops/index_topk.py`), run by Triton's CPU
interpreter: the same kept positions as the torch ops (ties at the k-th score to the lower
position, -0 tied with +0, rows seeing fewer than k), listed in ascending position; its errors;
and the decode step of the golden tiny model taking it in every index source.
"""

from __future__ import annotations

import pytest
import torch

import deepseek_v41_vl.triton_ops.index_topk as index_topk
from deepseek_v41_vl.triton_ops.index_topk import IndexTopkError, index_topk_torch, index_topk_triton

NONE = torch.iinfo(torch.int32).max


def _ascending(picks: torch.Tensor) -> torch.Tensor:
    # the positions in ascending order, the -1 entries (kept, not visible) last
    return torch.sort(torch.where(picks < 0, NONE, picks), dim=-1).values


def _scores(batch: int, width: int, seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, 1, width, generator=g) * 4
    if ties:  # whole numbers and zeros of both signs, as the relu and the bf16 sums make them
        s = torch.where(torch.rand(batch, 1, width, generator=g) < 0.4, 0.0, s.round())
        s = torch.where(torch.rand(batch, 1, width, generator=g) < 0.2, -0.0, s)
    return s.bfloat16()


@pytest.mark.parametrize(
    ("batch", "width", "k", "ties"),
    [(1, 16, 16, False), (3, 100, 40, True), (2, 513, 512, True), (4, 1000, 512, True), (1, 7, 3, False),
     (2, 2100, 512, True)],
)
def test_kept_positions_equal_the_torch_ops_in_ascending_order(batch, width, k, ties):
    s = _scores(batch, width, seed=width, ties=ties)
    g = torch.Generator().manual_seed(k)
    visible = torch.randint(0, width + 1, (batch, 1, 1), generator=g)
    visible[0] = width  # a row that sees every position
    got = index_topk_triton(s, visible, k, 128)
    want = index_topk_torch(s, visible, k, 128)
    assert got.dtype == torch.int32 and got.shape == (batch, 1, k)
    assert torch.equal(_ascending(got), _ascending(want))
    assert torch.equal(torch.where(got < 0, NONE, got), _ascending(got))  # listed in ascending position


def test_a_shared_visible_count_strided_rows_and_infinite_scores():
    s = _scores(3, 64, seed=1, ties=True)
    s[1, 0, :10] = -torch.inf
    s[2, 0, 5] = torch.inf
    wide = torch.zeros(3, 1, 80, dtype=torch.bfloat16)
    wide[..., :64] = s
    strided = wide[..., :64]  # batch rows 80 apart
    visible = torch.tensor([50])
    got = index_topk_triton(strided, visible, 20, 0)
    assert torch.equal(_ascending(got), _ascending(index_topk_torch(s, visible, 20, 0)))


@pytest.mark.parametrize("layout", ["strided", "expanded", "flat"])
def test_visible_counts_in_any_layout(layout):
    s = _scores(3, 40, seed=4, ties=True)
    counts = torch.tensor([40, 7, 0]) if layout != "expanded" else torch.tensor([9]).expand(3)
    if layout == "strided":
        visible = torch.stack([counts, torch.full_like(counts, 99)], 1)[:, 0].view(3, 1, 1)  # rows 2 apart
        assert visible.reshape(-1).stride(0) == 2
    elif layout == "expanded":
        visible = counts.view(3, 1, 1)
    else:
        visible = counts
    got = index_topk_triton(s, visible, 10, 3)
    assert torch.equal(_ascending(got), _ascending(index_topk_torch(s, visible, 10, 3)))
    per_row = index_topk_torch(s, counts.view(3, 1, 1), 10, 3)
    assert torch.equal(_ascending(index_topk_torch(s, visible, 10, 3)), _ascending(per_row))


def test_a_row_that_sees_nothing_keeps_only_unseen_positions():
    s = _scores(2, 32, seed=3, ties=False)
    got = index_topk_triton(s, torch.tensor([[[0]], [[32]]]), 8, 4)
    assert got[0].tolist() == [[-1] * 8]
    assert torch.equal(_ascending(got[1:]), _ascending(index_topk_torch(s[1:], torch.tensor([32]), 8, 4)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "scores": a["scores"].float()}, "bf16"),
        (lambda a: {**a, "scores": a["scores"][:, 0]}, r"\[B, 1, W\]"),
        (lambda a: {**a, "scores": torch.zeros(1, 1, index_topk.MAX_WIDTH + 1, dtype=torch.bfloat16)}, "outside"),
        (lambda a: {**a, "k": 0}, "k must be"),
        (lambda a: {**a, "k": 33}, "k must be"),
        (lambda a: {**a, "k": True}, "k must be"),
        (lambda a: {**a, "visible": a["visible"].int()}, "int64"),
        (lambda a: {**a, "visible": torch.zeros(3, dtype=torch.long)}, "one int64 count per row"),
        (lambda a: {**a, "scores": [1.0]}, "must be tensors"),
        (lambda a: {**a, "offset": -1}, "offset must be"),
        (lambda a: {**a, "offset": 2**31 - 32}, "offset must be"),
        (lambda a: {**a, "offset": 1.5}, "offset must be"),
        (lambda a: {**a, "offset": None}, "offset must be"),
        (lambda a: {**a, "scores": a["scores"].to("meta"), "visible": a["visible"].to("meta")}, "runs on CUDA"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, message):
    args = change({"scores": _scores(2, 32, seed=0, ties=False), "visible": torch.tensor([5, 9]), "k": 8, "offset": 0})
    assert not index_topk.kernel_runs(args["scores"], args["visible"], args["k"], args["offset"])
    with pytest.raises(IndexTopkError, match=message):
        index_topk_triton(args["scores"], args["visible"], args["k"], args["offset"])


def test_the_decode_step_ranks_every_index_source_with_the_kernel(golden, monkeypatch):
    """Decode steps of the golden fp8 tiny model, its plan running the top-k kernel: one launch
    per index source and step, the same greedy tokens as the torch ops and close logits (the same
    positions attended, listed in another order)."""
    from golden_models import golden_model, run_inputs

    import deepseek_v41_vl.modeling.indexer_deepseek_v41_vl as indexer
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
    from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import apply_numerics
    from helpers import rel_l2, with_backends

    model = golden_model(golden, "model_tiny_fp8", "fast")
    _, inputs = run_inputs(golden, "model_tiny_fp8", "text")
    prompt = inputs["input_ids"][:1]
    calls = []
    kernel = indexer.index_topk_triton
    monkeypatch.setattr(indexer, "index_topk_triton", lambda *a: calls.append(1) or kernel(*a))
    sources = sum(layer.attn.is_index_source for layer in model.layers)
    plan, runs = model.numerics, {}
    try:
        for backend in ("torch", "triton"):
            with_backends(model, index_topk=backend)
            cache = DeepseekV41Cache(model.config, max_cache_len=prompt.size(1) + 8)
            logits, tokens = [], []
            with torch.no_grad():
                token = model(prompt, cache=cache).logits[:, -1:].argmax(-1)
                calls.clear()
                for _ in range(6):
                    logits.append(model(token, cache=cache).logits)
                    token = logits[-1].argmax(-1)
                    tokens.append(token)
            runs[backend] = (torch.cat(logits, 1), torch.cat(tokens, 1), len(calls))
    finally:
        apply_numerics(model, plan)
    assert sources > 0 and runs["triton"][2] == 6 * sources and runs["torch"][2] == 0
    assert torch.equal(runs["triton"][1], runs["torch"][1])
    assert rel_l2(runs["triton"][0], runs["torch"][0]) < 1e-2
