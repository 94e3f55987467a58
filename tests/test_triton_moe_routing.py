"""The MoE router top-k (`triton_ops/moe_routing.py`): the Triton kernel, run by the Triton
interpreter on CPU, against the torch backend; and the torch backend against the reference's
`Gate.forward` op sequence (written out independently here).
"""

from __future__ import annotations


import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import deepseek_v41_vl.triton_ops.moe_routing as moe_routing  # noqa: E402


MoERoutingError = moe_routing.MoERoutingError
route_topk = moe_routing.route_topk


def _reference_gate(logits, bias, bias_vl, image_rows, top_k, route_scale, gate_temp=1.0):
    """`inference/model.py: Gate.forward` from the logits on, spelled out step by step."""
    scores = F.softplus(logits / gate_temp).sqrt()
    b = bias if image_rows is None else torch.where(image_rows.unsqueeze(-1), bias_vl, bias)
    ids = (scores + b).topk(top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if top_k > 1:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * route_scale, ids


def _inputs(n_tokens, n_experts, seed, image_fraction=0.5):
    g = torch.Generator().manual_seed(seed)
    # spread wide enough to exercise the softplus threshold (x > 20) and the tiny-exp tail
    logits = torch.randn(n_tokens, n_experts, generator=g) * 6.0
    logits[:, 0] = 25.0 * torch.rand(n_tokens, generator=g) - 30.0 * torch.rand(n_tokens, generator=g)
    bias = torch.randn(n_experts, generator=g) * 0.3
    bias_vl = torch.randn(n_experts, generator=g) * 0.3
    image_rows = torch.rand(n_tokens, generator=g) < image_fraction
    return logits, bias, bias_vl, image_rows


def _min_boundary_margin(logits, bias, bias_vl, image_rows, top_k):
    """Smallest gap between the k-th and (k+1)-th biased score; 0 means a tie at the boundary."""
    scores = F.softplus(logits).sqrt()
    b = torch.where(image_rows.unsqueeze(-1), bias_vl, bias)
    top = (scores + b).sort(dim=-1, descending=True).values
    gaps = top[:, : top_k + 1].diff(dim=-1).neg()
    return gaps.min().item()


SHAPES = [(t, e, k) for t in (1, 5, 64, 130) for e in (8, 384) for k in (2, 6)]


@pytest.mark.parametrize("n_tokens,n_experts,top_k", SHAPES)
def test_triton_matches_torch_backend(n_tokens, n_experts, top_k):
    logits, bias, bias_vl, image_rows = _inputs(n_tokens, n_experts, seed=1000 * n_tokens + n_experts + top_k)
    if n_tokens > 1:  # both kinds of rows in one batch
        image_rows[0], image_rows[1] = True, False
    # tie-free input: the margin is far above the few-ulp score differences of the kernel
    assert _min_boundary_margin(logits, bias, bias_vl, image_rows, top_k) > 1e-5

    w_ref, ids_ref = route_topk(logits, bias, bias_vl, image_rows, top_k, 1.5, backend="torch")
    w, ids = route_topk(logits, bias, bias_vl, image_rows, top_k, 1.5, backend="triton")

    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert w.shape == ids.shape == (n_tokens, top_k)
    # both return slots in descending biased-score order, so the ids agree slot by slot
    torch.testing.assert_close(ids, ids_ref, rtol=0, atol=0)
    torch.testing.assert_close(w, w_ref, rtol=4e-7, atol=0)
    torch.testing.assert_close(w.sum(-1), torch.full((n_tokens,), 1.5), rtol=1e-6, atol=0)


def test_image_rows_select_the_vl_bias():
    # bias and bias_vl push opposite experts to the top: the chosen set must follow the row's kind
    n_experts = 8
    logits = torch.zeros(6, n_experts)
    bias = torch.zeros(n_experts)
    bias_vl = torch.zeros(n_experts)
    bias[[1, 2]] = 5.0
    bias_vl[[6, 7]] = 5.0
    image_rows = torch.tensor([False, True, True, False, True, False])
    for backend in ("torch", "triton"):
        _, ids = route_topk(logits, bias, bias_vl, image_rows, 2, 1.5, backend=backend)
        chosen = ids.sort(dim=-1).values
        expect = torch.where(image_rows.unsqueeze(-1), torch.tensor([6, 7]), torch.tensor([1, 2]))
        assert torch.equal(chosen, expect), backend
        _, ids_text = route_topk(logits, bias, bias_vl, None, 2, 1.5, backend=backend)
        assert torch.equal(ids_text.sort(dim=-1).values, torch.tensor([[1, 2]] * 6)), backend


@pytest.mark.parametrize("n_tokens,n_experts,top_k", [(5, 8, 2), (130, 384, 6)])
def test_torch_backend_is_the_reference_gate(n_tokens, n_experts, top_k):
    logits, bias, bias_vl, image_rows = _inputs(n_tokens, n_experts, seed=7)
    w_ref, ids_ref = _reference_gate(logits, bias, bias_vl, image_rows, top_k, 1.5)
    w, ids = route_topk(logits, bias, bias_vl, image_rows, top_k, 1.5, backend="torch")
    assert torch.equal(ids, ids_ref)
    assert torch.equal(w, w_ref)  # bitwise


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gate_temp_top1_and_no_normalisation(backend):
    logits, bias, bias_vl, image_rows = _inputs(33, 384, seed=3)
    # gate_temp divides the logits before softplus
    w_ref, ids_ref = _reference_gate(logits, bias, bias_vl, image_rows, 6, 2.5, gate_temp=0.7)
    w, ids = route_topk(logits, bias, bias_vl, image_rows, 6, 2.5, gate_temp=0.7, backend=backend)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=4e-7, atol=0)
    # top-1 is never normalised: the weight is the raw score times route_scale
    w1, ids1 = route_topk(logits, bias, bias_vl, image_rows, 1, 1.5, backend=backend)
    scores = F.softplus(logits).sqrt()
    torch.testing.assert_close(w1, scores.gather(1, ids1) * 1.5, rtol=4e-7, atol=0)
    wn, idsn = route_topk(logits, bias, bias_vl, image_rows, 6, 1.5, backend=backend, norm_topk_prob=False)
    torch.testing.assert_close(wn, scores.gather(1, idsn) * 1.5, rtol=4e-7, atol=0)


def test_triton_tie_rule_lowest_index_and_weights():
    # every row has one exact tie straddling the top-k boundary (sel equal for two experts)
    n_tokens, n_experts, top_k = 9, 8, 2
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n_tokens, n_experts, generator=g)
    bias = torch.zeros(n_experts)
    bias_vl = torch.zeros(n_experts)
    image_rows = torch.arange(n_tokens) % 2 == 0
    for t in range(n_tokens):
        a, b = (t % 7) + 1, ((t + 3) % 7) + 1  # two distinct experts in 1..7
        lo, hi = min(a, b), max(a, b)
        logits[t, 0] = 9.0  # clear winner
        logits[t, lo] = logits[t, hi] = 5.0  # tied runners-up, one slot left for them
        for e in range(1, n_experts):
            if e not in (lo, hi):
                logits[t, e] = logits[t, e].clamp(max=1.0)
    w, ids = route_topk(logits, bias, bias_vl, image_rows, top_k, 1.5, backend="triton")
    scores = F.softplus(logits).sqrt()
    for t in range(n_tokens):
        tied = (logits[t] == 5.0).nonzero().flatten()
        assert ids[t, 0].item() == 0
        assert ids[t, 1].item() == tied.min().item()  # documented: lowest index among ties
    # weights belong to the experts actually chosen
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(w, chosen / (chosen.sum(-1, keepdim=True) + 1e-20) * 1.5, rtol=4e-7, atol=0)
    # the torch backend may break the tie either way, but must pick one of the tied experts
    w_t, ids_t = route_topk(logits, bias, bias_vl, image_rows, top_k, 1.5, backend="torch")
    for t in range(n_tokens):
        assert logits[t, ids_t[t, 1]].item() == 5.0
    torch.testing.assert_close(w_t, w, rtol=4e-7, atol=0)  # tied experts have equal scores


def test_auto_backend_on_cpu_is_torch():
    logits, bias, bias_vl, image_rows = _inputs(5, 8, seed=5)
    w, ids = route_topk(logits, bias, bias_vl, image_rows, 2, 1.5)
    w_ref, ids_ref = _reference_gate(logits, bias, bias_vl, image_rows, 2, 1.5)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_empty_batch():
    logits = torch.zeros(0, 8)
    for backend in ("torch", "triton"):
        w, ids = route_topk(logits, torch.zeros(8), None, None, 2, 1.5, backend=backend)
        assert w.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(router_logits=torch.zeros(4, 8, dtype=torch.bfloat16)), "float32"),
        (dict(router_logits=torch.zeros(2, 4, 8)), r"\[T, E\]"),
        (dict(bias=torch.zeros(7)), "bias must be"),
        (dict(bias_vl=torch.zeros(8, dtype=torch.float64)), "bias_vl must be"),
        (dict(image_rows=torch.zeros(4, dtype=torch.int64)), "image_rows must be bool"),
        (dict(image_rows=torch.zeros(5, dtype=torch.bool)), "image_rows must be bool"),
        (dict(bias_vl=None), "bias_vl is None"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=9), "top_k"),
        (dict(backend="cuda"), "backend"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(
        router_logits=torch.zeros(4, 8),
        bias=torch.zeros(8),
        bias_vl=torch.zeros(8),
        image_rows=torch.zeros(4, dtype=torch.bool),
        top_k=2,
        route_scale=1.5,
    )
    args.update(kwargs)
    with pytest.raises(MoERoutingError, match=match):
        route_topk(**args)
    assert issubclass(MoERoutingError, ValueError)
