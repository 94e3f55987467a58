"""GPU parity: the Triton kernels compiled for the device, the tiny golden models and the real-width
vision tower on CUDA. Every test is marked ``cuda`` and skipped where CUDA is unavailable.

Run alone, in its own process (the CPU Triton tests switch on Triton's interpreter at import, and
a kernel defined under the interpreter stays interpreted)::

    python -m pytest -m cuda tests/test_gpu.py

What is checked (bounds from the golden README, "Tolerances"):

- ``apply_vision_rope``: the compiled kernel equals the torch fallback bit for bit on random
  shapes, strided views and three dtypes (the kernel keeps every fp32 rounding of the fallback).
- ``route_topk``: the compiled kernel against the torch fallback at 1 .. 65536 rows and up to 384
  experts: identical experts, slot by slot, on every row whose top-(k+1) biased scores are apart by
  more than 1e-5 (GPU ``exp``/``log`` differ by ulps, so exact ties may break either way); weights
  within 1e-5 relative.
- the tiny golden models (bf16 and fp8 storage, numerics fast and exact), each block teacher-forced
  with the golden block input and pre-mix: block output rel L2 < 0.05, attention output rel L2 < 0.1,
  the same expert set on >= 90% of rows; and the full prefill: logits rel L2 < 0.1, argmax equal on
  >= 90% of positions (the README expects 0.03-0.05 and ~93% without bit-exactness), aligner
  rows rel L2 < 0.02; 12 cached decode steps fed the golden tokens: logits rel L2 < 0.15 at every
  step, argmax equal on >= 80% of them.
- the vision tower at real width (32 x 1024 + aligner, random weights): bf16 on the GPU against
  fp32 on the CPU, aligner rows with cosine similarity > 0.999 and rel L2 < 0.02; and its attention
  runs on a fused SDPA kernel (flash / memory-efficient), not the math fallback.

With ``DEEPSEEK_V41_GPU_METRICS=<file>`` the measured errors are written there as JSON.
No test asserts a time.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

try:  # the GPU machine has Triton; CPU-only installs skip this file
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]

import deepseek_v41_vl.triton_ops.moe_routing as moe_routing  # noqa: E402
from deepseek_v41_vl.triton_ops import dequant as _dequant  # noqa: E402
import deepseek_v41_vl.triton_ops.vision_rope as vision_rope  # noqa: E402
from deepseek_v41_vl.modeling.attention_state_deepseek_v41_vl import DeepseekV41AttentionState  # noqa: E402
from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache  # noqa: E402
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41VisionConfig  # noqa: E402
from deepseek_v41_vl.modeling.debug_deepseek_v41_vl import capture_intermediates  # noqa: E402
from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import (
    DeepseekV41VisionAttention,
    packs_images,
    vision_rope_tables,
)

from golden_models import RUNS, VARIANTS, VisionTower, golden_model, golden_run, prefill_inputs  # noqa: E402
from helpers import conversation_turns, rel_l2, with_backends  # noqa: E402

CUDA = torch.device("cuda")
NUMERICS = ("fast", "exact")

_METRICS: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_metrics():
    yield
    path = os.environ.get("DEEPSEEK_V41_GPU_METRICS")
    if path and _METRICS:
        Path(path).write_text(json.dumps(_METRICS, indent=1, sort_keys=True))


def _require_compiled_triton():
    if vision_rope.triton_interpret_mode() or moe_routing._kernel_is_interpreted():
        pytest.fail("Triton runs in its interpreter here: run tests/test_gpu.py in its own pytest process, without TRITON_INTERPRET")


# --------------------------------------------------------------------------------------------
# Triton kernels, compiled, against their torch fallbacks
# --------------------------------------------------------------------------------------------

ROPE_CASES = [
    # (n_h, n_w, heads, head_dim, dtype, strided q/k views of one fused qkv)
    (1, 1, 16, 64, torch.bfloat16, True),
    (93, 93, 16, 64, torch.bfloat16, True),  # the maximum-budget image at real width
    (37, 11, 16, 64, torch.bfloat16, False),
    (13, 29, 3, 40, torch.float16, True),
    (7, 300, 5, 12, torch.float32, True),
    (64, 64, 2, 128, torch.bfloat16, True),
]


@pytest.mark.parametrize("n_h,n_w,heads,head_dim,dtype,strided", ROPE_CASES)
def test_vision_rope_kernel_equals_fallback(n_h, n_w, heads, head_dim, dtype, strided):
    _require_compiled_triton()
    g = torch.Generator(device=CUDA).manual_seed(n_h * 1000 + n_w + head_dim)
    n, width = n_h * n_w, heads * head_dim
    cos, sin = vision_rope_tables(n_h, n_w, head_dim // 2, 10000.0, CUDA)
    if strided:
        # values over many binades, as the fused projection gives them
        scale = torch.logspace(-6, 3, 3 * width, device=CUDA)[torch.randperm(3 * width, device=CUDA, generator=g)]
        qkv = (torch.randn(n, 3 * width, device=CUDA, generator=g) * scale).to(dtype)
        q, k, _ = (t.view(n, heads, head_dim) for t in qkv.chunk(3, dim=-1))
    else:
        q, k = (torch.randn(n, heads, head_dim, device=CUDA, generator=g).to(dtype) for _ in range(2))
    ref = vision_rope.apply_vision_rope(q, k, cos, sin, backend="torch")
    out = vision_rope.apply_vision_rope(q, k, cos, sin, backend="triton")
    for ours, want in zip(out, ref):
        assert ours.dtype == dtype and ours.shape == (n, heads, head_dim) and ours.is_contiguous()
        assert torch.equal(ours, want), f"max abs diff {(ours.double() - want.double()).abs().max().item():.3g}"


ROUTING_CASES = [(1, 384, 6), (63, 384, 6), (64, 8, 2), (4096, 384, 6), (65536, 384, 6), (1000, 256, 8), (333, 64, 1)]


def _tie_free_rows(logits, bias, bias_vl, image_rows, top_k, gap=1e-5) -> torch.Tensor:
    scores = F.softplus(logits).sqrt()
    row_bias = bias if image_rows is None else torch.where(image_rows[:, None], bias_vl, bias)
    top = (scores + row_bias).topk(min(top_k + 1, logits.size(1)), dim=-1).values
    return (-top.diff(dim=-1) > gap).all(-1)


@pytest.mark.parametrize("with_image_rows", [True, False])
@pytest.mark.parametrize("n_tokens,n_experts,top_k", ROUTING_CASES)
def test_route_topk_kernel_matches_fallback(n_tokens, n_experts, top_k, with_image_rows):
    _require_compiled_triton()
    g = torch.Generator(device=CUDA).manual_seed(n_tokens + 7 * n_experts + top_k)
    logits = torch.randn(n_tokens, n_experts, device=CUDA, generator=g) * 4.0
    logits[:, 0] = 60.0 * torch.rand(n_tokens, device=CUDA, generator=g) - 35.0  # both softplus branches
    bias = torch.randn(n_experts, device=CUDA, generator=g) * 0.3
    bias_vl = torch.randn(n_experts, device=CUDA, generator=g) * 0.3
    image_rows = (torch.rand(n_tokens, device=CUDA, generator=g) < 0.5) if with_image_rows else None
    args = (logits, bias, bias_vl if with_image_rows else None, image_rows, top_k, 1.5)
    w_ref, ids_ref = moe_routing.route_topk(*args, backend="torch")
    w, ids = moe_routing.route_topk(*args, backend="triton")
    assert w.shape == ids.shape == (n_tokens, top_k) and ids.dtype == torch.int64 and w.dtype == torch.float32
    clear = _tie_free_rows(logits, bias, bias_vl, image_rows, top_k)
    assert clear.float().mean().item() > 0.98, "too many near-tied rows for the comparison to mean anything"
    assert torch.equal(ids[clear], ids_ref[clear])
    torch.testing.assert_close(w[clear], w_ref[clear], rtol=1e-5, atol=1e-7)
    # every row, tied or not: a valid set of distinct experts
    assert bool(((ids >= 0) & (ids < n_experts)).all())
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all())
    if top_k > 1:  # normalised; a single expert keeps its raw score (times route_scale)
        torch.testing.assert_close(w.sum(-1), torch.full((n_tokens,), 1.5, device=CUDA), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------------------------
# The tiny golden models on the GPU
# --------------------------------------------------------------------------------------------


def _same_set_fraction(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.reshape(-1, ours.size(-1)), ref.reshape(-1, ref.size(-1))
    return (ours.sort(-1).values == ref.to(ours.device).sort(-1).values).all(-1).float().mean().item()


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_blocks_teacher_forced_on_gpu(golden, variant, run, numerics):
    model = golden_model(golden, variant, numerics, CUDA)
    tensors = golden_run(golden, variant, run, CUDA)
    index = json.loads((golden / variant / "meta.json").read_text())["hidden_state_index"]
    image_mask = (tensors["token_types"] >= 0) if run == "vl" else None
    state = DeepseekV41AttentionState(start_pos=0)
    rows = []
    with torch.no_grad(), capture_intermediates(model) as captured:
        for i, layer in enumerate(model.layers):
            x = tensors[index[str(i)]["entering_block"]]
            out, _ = layer.block(x, tensors[f"prefill.pre_mix_in.{i}"], state, image_mask)
            assert out.device.type == CUDA.type and out.dtype == torch.bfloat16
            row = {"block": i, "block_out_rel_l2": rel_l2(out, tensors[f"prefill.block_out.{i}"])}
            if f"prefill.attn_out.{i}" in tensors:
                row["attn_out_rel_l2"] = rel_l2(captured[f"attn_out.{i}"], tensors[f"prefill.attn_out.{i}"])
            row["gate_same_set"] = _same_set_fraction(captured[f"gate.{i}.indices"], tensors[f"prefill.gate.{i}.indices"])
            if f"prefill.indexer.{i}.topk_idxs" in tensors and f"indexer.{i}.topk_idxs" in captured:
                row["indexer_same_set"] = _same_set_fraction(
                    captured[f"indexer.{i}.topk_idxs"], tensors[f"prefill.indexer.{i}.topk_idxs"]
                )
            rows.append(row)
    _METRICS[f"teacher_forced/{variant}/{run}/{numerics}"] = rows
    assert len(rows) == len(model.layers)
    for row in rows:
        assert row["block_out_rel_l2"] < 0.05, row
        assert row.get("attn_out_rel_l2", 0.0) < 0.1, row
        assert row["gate_same_set"] >= 0.9, row


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_prefill_logits_on_gpu(golden, variant, run):
    model = golden_model(golden, variant, "fast", CUDA)
    tensors = golden_run(golden, variant, run, CUDA)
    with torch.no_grad(), capture_intermediates(model) as captured:
        logits = model(**prefill_inputs(golden, variant, run, tensors, CUDA), logits_to_keep=0).logits
    ref = tensors["prefill.logits"]
    metrics = {
        "logits_rel_l2": rel_l2(logits, ref),
        "argmax_agree": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }
    for name in sorted(k.removeprefix("prefill.") for k in tensors if k.endswith(".aligner_out")):
        metrics[f"{name}_rel_l2"] = rel_l2(captured[name], tensors[f"prefill.{name}"])
    _METRICS[f"prefill/{variant}/{run}"] = metrics
    assert logits.device.type == CUDA.type and logits.shape == ref.shape
    assert metrics["logits_rel_l2"] < 0.1, metrics
    assert metrics["argmax_agree"] >= 0.9, metrics
    for name, value in metrics.items():
        if name.endswith("aligner_out_rel_l2"):
            assert value < 0.02, metrics  # the README's bound for vision outputs


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_decode_on_gpu(golden, variant, run):
    """Prefill into a cache, then 12 one-token steps fed the golden tokens (teacher forcing, so
    one flipped argmax does not derail the rest)."""
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    model = golden_model(golden, variant, "fast", CUDA)
    tensors = golden_run(golden, variant, run, CUDA)
    cache = DeepseekV41Cache(model.config)
    steps = tensors["decode.logits"].size(0)
    errors, agree = [], []
    with torch.no_grad():
        model(**prefill_inputs(golden, variant, run, tensors, CUDA), cache=cache)
        token = tensors["prefill.next_token"]
        for step in range(steps):
            logits = model(token.view(-1, 1), cache=cache).logits[:, -1]
            ref = tensors["decode.logits"][step]
            errors.append(rel_l2(logits, ref))
            agree.append((logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
            token = tensors["decode.token"][step]
    _METRICS[f"decode/{variant}/{run}"] = {"logits_rel_l2": errors, "argmax_agree": agree}
    assert cache.get_seq_length() == tensors["input_ids"].size(1) + steps
    assert max(errors) < 0.15, errors
    assert sum(agree) / steps >= 0.8, agree


@pytest.mark.parametrize("run", RUNS)
def test_draft_head_on_gpu_follows_the_reference(golden, run):
    """The DSpark draft head in fast numerics on the GPU against the reference's `forward_spec`
    (golden `model_tiny_dspark`), teacher-forced (each step fed the golden token, each draft seeded
    with the golden next token): the first draft's logits within rel L2 0.15 and most drafts the same. The
    steps' `main_hidden` comes from the graph-replayed engine step (a graph of its own), bit for
    bit the eager step's, and so do the drafts: the draft head's forward is replayed from its own
    graph once the ring holds a whole window (every step here), bit for bit its eager run."""
    model = golden_model(golden, "model_tiny_dspark", "fast", CUDA)
    want = golden_run(golden, "model_tiny_dspark", run, CUDA)
    inputs = prefill_inputs(golden, "model_tiny_fp8", run, golden_run(golden, "model_tiny_fp8", run, CUDA), CUDA)
    runner, results = model.decode_runner, {}
    for graphs in (False, True):
        runner.graphs = graphs
        before = runner.captures
        cache = DeepseekV41Cache(model.config)
        hidden, drafts = [], []
        with torch.no_grad():
            out = model(**inputs, cache=cache, output_main_hidden=True)
            rings = model.draft_cache(inputs["input_ids"].size(0))
            model.draft(want["prefill.next_token"], out.main_hidden, 0, rings)
            start = inputs["input_ids"].size(1)
            for s in range(8):
                out = model(want[f"step.{s}.input_token"].view(-1, 1), cache=cache, output_main_hidden=True)
                hidden.append(out.main_hidden)
                drafts.append(model.draft(want[f"step.{s}.next_token"], out.main_hidden, start + s, rings))
        results[graphs] = hidden, drafts, runner.captures - before
    runner.graphs = True
    assert results[False][2] == 0 and results[True][2] == 2  # the step's graph and the draft head's
    assert torch.equal(torch.cat(results[True][0], 1), torch.cat(results[False][0], 1))
    errors, agree = [], []
    for s, (graphed, eager) in enumerate(zip(results[True][1], results[False][1])):
        assert all(torch.equal(a, b) for a, b in zip(graphed, eager)), s
        ids, logits, _ = graphed
        # the first draft's logits (the later ones follow the drafts before them through the
        # Markov bias, so one flipped near-tie moves them all)
        errors.append(rel_l2(logits[:, 0], want[f"step.{s}.draft_logits"][:, 0]))
        agree.append((ids == want[f"step.{s}.draft_ids"]).float().mean().item())
    _METRICS[f"dspark/{run}"] = {"draft_logits_rel_l2": errors, "draft_ids_agree": agree}
    assert max(errors) < 0.15, errors
    assert sum(agree) / len(agree) >= 0.8, agree


def test_dspark_generation_on_gpu_gives_plain_greedy_tokens(golden, converted_tiny_dspark, monkeypatch):
    """[dspark] `generate(use_mtp=True)` in fast numerics, graph-replayed steps: the verification
    runs the engine's one-token steps and the cache is cropped back to the accepted ones, so greedy
    gives plain greedy's tokens, with the draft head's own drafts and with drafts forced from the
    plain run (accepted in full, in part, not at all). The steps are the same graph replays on the
    same state, so the tokens are expected equal; a difference is recorded with plain greedy's
    logit margin at the first one (a near-tie or not)."""
    from transformers import AutoModelForImageTextToText

    from deepseek_v41_vl.modeling.dspark_generation_deepseek_v41_vl import DeepseekV41DSparkCandidateGenerator

    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_dspark, numerics="fast", device_map=0)
    inputs, _ = hf_vl_inputs(golden, converted_tiny_dspark)
    n, new = inputs["input_ids"].size(1), 24
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=new, output_scores=True, return_dict_in_generate=True)
    runs = {"own drafts": model.generate(**inputs, do_sample=False, max_new_tokens=new, use_mtp=True,
                                         assistant_confidence_threshold=0.0)}
    schedule = itertools.cycle([(3, None), (4, 2), (2, 0), (5, None), (3, 1)])  # (drafts, the one spoiled)
    original, matches = DeepseekV41DSparkCandidateGenerator.get_candidates, []

    def forced(self, input_ids, *args, is_first_iteration=False, **kwargs):
        ids, logits = original(self, input_ids, *args, is_first_iteration=is_first_iteration, **kwargs)
        if is_first_iteration:
            return ids, logits
        count, spoiled = next(schedule)
        drafts = plain.sequences[0, input_ids.size(1) : input_ids.size(1) + count].clone()
        if spoiled is not None and spoiled < drafts.numel():
            drafts[spoiled] = 3 if drafts[spoiled] != 3 else 4
        return torch.cat([input_ids, drafts[None]], dim=1), None

    monkeypatch.setattr(DeepseekV41DSparkCandidateGenerator, "get_candidates", forced)
    monkeypatch.setattr(DeepseekV41DSparkCandidateGenerator, "update_candidate_strategy",
                        lambda self, ids, scores, m: matches.append(int(m)))
    runs["forced drafts"] = model.generate(**inputs, do_sample=False, max_new_tokens=new, use_mtp=True)
    assert {3, 4} & set(matches) and 0 in matches, matches
    want = plain.sequences[0, n:]
    for name, out in runs.items():
        got = out[0, n:]
        differ = (got != want).nonzero().flatten().tolist()
        margin = float(plain.scores[differ[0]][0].topk(2).values.diff().abs()) if differ else None
        _METRICS[f"dspark_generate/{name}"] = {"first_difference": differ[:1], "margin_there": margin}
        assert not differ, (name, differ[0], margin)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
def test_side_stream_work_reads_its_arguments_as_they_were_at_the_fork(captured):
    """Work handed to a `SideStream` runs beside the current stream and still reads its
    arguments as they were when it was handed over: the main stream drops its reference and
    reuses the memory at once (eagerly: while the side stream is still asleep), and the join
    orders the main stream after the work."""
    from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import SideStream

    side = SideStream(CUDA)

    def slow_copy(t):
        torch.cuda._sleep(50_000_000)  # tens of ms: the main stream's work below is enqueued first
        return t * 2

    def step(src):
        a = src + 1  # made on the main stream, read only on the side stream
        handle = side(slow_copy, a)
        del a
        b = torch.full_like(src, -7.0)  # the main stream's next tensor of that size
        return handle.join() + 0 * b, b

    src = torch.arange(1 << 20, device=CUDA, dtype=torch.float32)
    if captured:
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(src)  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out, b = step(src)
        graph.replay()
    else:
        out, b = step(src)
    torch.cuda.synchronize()
    assert torch.equal(out, (src + 1) * 2) and bool((b == -7.0).all())


def test_side_stream_join_waits_for_its_own_work_only():
    """Two works handed over one after the other run on two lanes: joining the second does not
    wait for the first (still asleep), and `join_all` then waits for both."""
    from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import SideStream

    side = SideStream(torch.device(CUDA))
    src = torch.ones(4, device=CUDA)

    def slow(t):
        torch.cuda._sleep(200_000_000)  # ~0.1 s
        return t + 1

    first, second = side(slow, src), side(lambda t: t + 2, src)
    assert torch.equal(second.join(), torch.full_like(src, 3.0))  # a read on the current stream, after its join
    torch.cuda.current_stream().synchronize()
    assert not first._done.query()  # the first work is still running
    side.join_all()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(first.value, torch.full_like(src, 2.0))


@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "left-padded"])
@pytest.mark.parametrize("static", [True, False], ids=["static-cache", "growing-cache"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_cuda_graphs_equal_eager_steps(golden, variant, static, padded, monkeypatch):
    """The whole model's decode step replayed from one CUDA graph gives, bit for bit, the logits
    and the cache of the same step run eagerly (16 greedy steps after the VL prompt, or a
    left-padded two-row batch of it); the graph is captured once per cache storage and width
    (a growing cache: again when its buffers cross a bucket). The graph runs work beside the step
    on side streams, the eager step in line; replayed with that work in line too, or with every
    side work made to start late (a sleep first: a read before its join would see stale values),
    the step gives the same bits."""
    from deepseek_v41_vl.modeling import decode_step_deepseek_v41_vl as engine
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache
    from deepseek_v41_vl.modeling.cuda_graphs_deepseek_v41_vl import SideStream, in_line

    class LateSide(SideStream):
        def __call__(self, fn, *args):
            def late(*a):
                torch.cuda._sleep(1_000_000)  # ~0.5 ms: the main stream runs well ahead meanwhile
                return fn(*a)

            return super().__call__(late, *args)

    model = golden_model(golden, variant, "fast", CUDA)
    tensors = golden_run(golden, variant, "vl", CUDA)
    inputs = prefill_inputs(golden, variant, "vl", tensors, CUDA)
    mask = None
    if padded:  # the golden text prompt, and a row of it with its first 5 tokens as padding
        text = golden_run(golden, variant, "text", CUDA)
        ids = prefill_inputs(golden, variant, "text", text, CUDA)["input_ids"][:1]
        inputs = {"input_ids": torch.cat([ids, torch.cat([torch.zeros_like(ids[:, :5]), ids[:, 5:]], 1)])}
        mask = torch.ones_like(inputs["input_ids"])
        mask[1, :5] = 0
    runner = model.decode_runner
    results = {}
    late = LateSide(torch.device(CUDA))
    for name, graphs, aside in (("eager", False, None), ("graph", True, None),
                                ("graph, in line", True, lambda device: in_line), ("graph, late side", True, lambda device: late)):
        runner.graphs = graphs
        if aside is not None:
            monkeypatch.setattr(engine, "side_stream", aside)
        before = runner.captures
        cache = DeepseekV41Cache(model.config, max_cache_len=(inputs["input_ids"].size(1) + 16) if static else None)
        logits = []
        step_mask = mask
        with torch.no_grad():
            token = model(**inputs, cache=cache, attention_mask=step_mask).logits[:, -1:].argmax(-1)
            for _ in range(16):
                if step_mask is not None:
                    step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
                step = model(token, cache=cache, attention_mask=step_mask).logits[:, -1]
                logits.append(step)
                token = step.argmax(-1, keepdim=True)
        results[name] = (torch.stack(logits), cache, runner.captures - before)
    runner.graphs = True
    eager, graphed = results["eager"][0], results["graph"][0]
    _METRICS[f"decode_graphs/{variant}/{'static' if static else 'growing'}/{'padded' if padded else 'one-row'}"] = {
        "bitwise": torch.equal(eager, graphed), "rel_l2": rel_l2(graphed, eager), "captures": results["graph"][2],
    }
    assert results["eager"][2] == 0 and 1 <= results["graph"][2] <= (1 if static else 2)
    assert all(results[name][2] >= 1 for name in ("graph, in line", "graph, late side"))  # captured anew
    for name, (got, cache, _) in results.items():
        assert torch.equal(got, eager), name
        for i, state in results["eager"][1].attention.layers.items():
            other = cache.attention.layer(i)
            assert torch.equal(other.window_kv, state.window_kv), (name, i)
            if state.compressed_kv is not None:
                n = state.compressed_kv.length
                assert other.compressed_kv.length == n and torch.equal(other.compressed_kv.rows(n), state.compressed_kv.rows(n)), (name, i)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_decode_runner_never_synchronises_with_the_host(golden, variant):
    """16 steps driven through the model's decode runner (not `generate`, whose own loop reads a
    flag on the host) under `torch.cuda.set_sync_debug_mode("error")`: no step waits for the GPU."""
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    model = golden_model(golden, variant, "fast", CUDA)
    tensors = golden_run(golden, variant, "vl", CUDA)
    cache = DeepseekV41Cache(model.config, max_cache_len=tensors["input_ids"].size(1) + 17)
    with torch.no_grad():
        token = model(**prefill_inputs(golden, variant, "vl", tensors, CUDA), cache=cache).logits[:, -1:].argmax(-1)
        model.decode_runner.step(model, token, cache)  # capture (Triton compiles, autotunes) outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(16):
                logits, _, _ = model.decode_runner.step(model, token, cache)
                token = logits[:, -1].argmax(-1, keepdim=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert cache.get_seq_length() == tensors["input_ids"].size(1) + 17


# --------------------------------------------------------------------------------------------
# The vision tower at real width
# --------------------------------------------------------------------------------------------


def real_vision_tower(seed: int = 0) -> VisionTower:
    """fp32 tower of the released shape (32 x 1024, 16 heads, aligner to 5120), default init."""
    torch.manual_seed(seed)
    config = DeepseekV41VisionConfig()
    assert (config.num_hidden_layers, config.hidden_size, config.out_hidden_size) == (32, 1024, 5120)
    return VisionTower(config).eval()


def to_bf16_weights(tower: VisionTower) -> VisionTower:
    """bf16 linear weights and biases, fp32 RMSNorm weights: the reference's dtypes."""
    for module in tower.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    return tower


def test_vision_tower_real_width_gpu_bf16_matches_cpu_fp32():
    tower = real_vision_tower()
    grids = [(20, 28), (9, 7), (1, 4)]  # padding to multiples of 3 on both sides, a 1-row image
    g = torch.Generator().manual_seed(5)
    n = sum(h * w for h, w in grids)
    pixels = (torch.rand(n, 3 * 14 * 14, generator=g) * 2 - 1).to(torch.bfloat16)
    grid_thw = torch.tensor([[1, h, w] for h, w in grids])
    # both run from the same bf16-representable weights, so the difference is the GPU's bf16 math
    to_bf16_weights(tower)
    reference = real_vision_tower()
    reference.load_state_dict({k: v.float() for k, v in tower.state_dict().items()})
    with torch.no_grad():
        want = reference(pixels.float(), grid_thw)
        ours = to_bf16_weights(tower.to(CUDA))(pixels.to(CUDA), grid_thw.to(CUDA))
    assert ours.dtype == torch.bfloat16 and ours.shape == want.shape == (7 * 10 + 3 * 3 + 1 * 2, 5120)
    cosine = F.cosine_similarity(ours.double().cpu(), want.double(), dim=-1)
    _METRICS["vision_real_width"] = {
        "min_row_cosine": cosine.min().item(),
        "rel_l2": rel_l2(ours, want),
        "max_abs": (ours.double().cpu() - want.double()).abs().max().item(),
        "ref_abs_max": want.abs().max().item(),
    }
    assert cosine.min().item() > 0.999, _METRICS["vision_real_width"]
    assert _METRICS["vision_real_width"]["rel_l2"] < 0.02, _METRICS["vision_real_width"]


def test_packed_images_on_cuda_are_their_one_image_calls():
    """Fast numerics on CUDA pack a call's images (`packs_images`): each image's aligner rows are
    its one-image call's up to the GEMMs' rounding over more rows, and an image changed leaves
    the others' rows as they were."""
    tower = to_bf16_weights(real_vision_tower()).to(CUDA)
    grids = [(20, 28), (9, 7), (1, 4)]
    g = torch.Generator().manual_seed(6)
    pixels = [(torch.rand(h * w, 3 * 14 * 14, generator=g) * 2 - 1).to(torch.bfloat16).to(CUDA) for h, w in grids]
    with torch.no_grad():
        packed = tower(torch.cat(pixels), [[1, h, w] for h, w in grids])
        alone = torch.cat([tower(p, [[1, h, w]]) for p, (h, w) in zip(pixels, grids)])
        moved = tower(torch.cat([pixels[0], pixels[1].flip(0), pixels[2]]), [[1, h, w] for h, w in grids])
    assert packs_images(tower.vision, CUDA, 3) and packs_images(tower.aligner, CUDA, 3)
    assert packed.shape == alone.shape
    first, second = 7 * 10, 7 * 10 + 3 * 3
    cosine = F.cosine_similarity(packed.double(), alone.double(), dim=-1)
    _METRICS["vision_packed"] = {"rel_l2": rel_l2(packed, alone), "min_row_cosine": cosine.min().item()}
    assert cosine.min().item() > 0.999 and _METRICS["vision_packed"]["rel_l2"] < 0.02, _METRICS["vision_packed"]
    assert not torch.equal(moved[first:second], packed[first:second])
    # another image's rows move by the GEMMs' rounding at most, never by its attention
    assert rel_l2(moved[:first], packed[:first]) < 1e-3 and rel_l2(moved[second:], packed[second:]) < 1e-3


def test_vision_attention_runs_on_a_fused_sdpa_kernel():
    """The ViT attention must reach flash / memory-efficient SDPA in bf16: the math fallback
    materializes [heads, N, N] scores (16 x 8649^2 for a maximum-budget image, per block)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = DeepseekV41VisionConfig()
    torch.manual_seed(0)
    with torch.device(CUDA):
        attn = DeepseekV41VisionAttention(config).to(torch.bfloat16).eval()
    n_h, n_w = 31, 29
    x = torch.randn(n_h * n_w, config.hidden_size, device=CUDA).to(torch.bfloat16)
    cos, sin = vision_rope_tables(n_h, n_w, config.head_dim // 2, float(config.rope_theta), CUDA)
    with torch.no_grad():
        with sdpa_kernel([SDPBackend.MATH]):
            want = attn(x, cos, sin)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            try:
                ours = attn(x, cos, sin)
            except RuntimeError as exc:
                pytest.fail(f"vision attention cannot use a fused SDPA kernel: {exc}")
    assert ours.dtype == torch.bfloat16
    assert rel_l2(ours, want) < 0.02


# --------------------------------------------------------------------------------------------
# The transformers classes on CUDA: Engram tables resident on the CPU, the golden run
# --------------------------------------------------------------------------------------------

ENGRAM_TABLES = ("model.layers.1.engram.embed", "model.layers.5.engram.embed")  # engram_layer_ids [1, 5]
_HF: dict[str, object] = {}


def hf_vl_inputs(golden: Path, folder: Path):
    """The golden VL prompt and images through the processor, on the GPU, and the golden tokens."""
    from transformers import AutoProcessor

    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["vl_run"]
    processor = AutoProcessor.from_pretrained(folder)
    images = [str(golden / im["file"]) for im in meta["images"]]
    inputs = processor(images=images, text=meta["prompt"], return_tensors="pt").to(CUDA)
    return inputs, meta["generated_tokens"]


def hf_all_gpu_run(golden: Path, folder: Path) -> dict:
    """The whole model on GPU 0 (numerics fast): its prefill logits and greedy tokens, computed once."""
    from transformers import AutoModelForImageTextToText

    if "all_gpu" not in _HF:
        model = AutoModelForImageTextToText.from_pretrained(folder, numerics="fast", device_map=0)
        inputs, _ = hf_vl_inputs(golden, folder)
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits
        tokens = model.generate(**inputs, do_sample=False, max_new_tokens=13)[:, inputs["input_ids"].shape[1] :]
        _HF["all_gpu"] = {"model": model, "logits": logits, "tokens": tokens.tolist()}
    return _HF["all_gpu"]


def test_generate_after_a_decode_loop_under_inference_mode(golden, converted_tiny_fp8):
    """A manual decode loop under `torch.inference_mode()` captures a decode step; `generate`
    (under no_grad) then captures and replays its own: the graphs' input buffers and the cache's
    state are ordinary tensors (an inference tensor refuses "Inplace update to inference tensor
    outside InferenceMode")."""
    from transformers import AutoModelForImageTextToText

    reference = hf_all_gpu_run(golden, converted_tiny_fp8)["model"]
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, numerics="fast", device_map=0)
    inputs, _ = hf_vl_inputs(golden, converted_tiny_fp8)
    prompt = {"input_ids": inputs["input_ids"][:, :1], "attention_mask": inputs["attention_mask"][:, :1]}
    cache = DeepseekV41Cache(model.config)
    with torch.inference_mode():
        token = model(**prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(4):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert model.model.decode_runner.captures > 0  # a step was captured under inference mode
    tokens = model.generate(**prompt, do_sample=False, max_new_tokens=8)
    assert tokens.tolist() == reference.generate(**prompt, do_sample=False, max_new_tokens=8).tolist()


def test_a_second_generate_replays_the_graphs_of_the_first(golden, converted_tiny_fp8):
    """`generate` keeps its static cache on the model; a second call of the same length resets
    and reuses it, so the decode step captured for its storage replays: no capture, the same
    tokens."""
    model = hf_all_gpu_run(golden, converted_tiny_fp8)["model"]
    inputs, _ = hf_vl_inputs(golden, converted_tiny_fp8)
    runner = model.model.decode_runner
    first = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    before = runner.captures
    assert before > 0
    second = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    assert runner.captures == before
    assert second.tolist() == first.tolist()


def test_a_conversation_on_one_cache_continues_like_one_prefill_on_gpu(golden, converted_tiny_fp8, photos):
    """[conversation] in fast numerics on the GPU: a second turn with its own image, on the cache
    of the first (and again with its span cut across two chunks), within the chunked-prefill
    bounds of one prefill of the whole conversation; then crop back to the first turn and redo it."""
    from transformers import AutoProcessor

    from golden_bits import LOGITS_REL_L2
    from test_chunked_prefill import ARGMAX_AGREEMENT

    model = hf_all_gpu_run(golden, converted_tiny_fp8)["model"]
    processor = AutoProcessor.from_pretrained(converted_tiny_fp8)
    first, second, whole = (inputs.to(CUDA) for inputs in conversation_turns(processor, photos))
    n = first["input_ids"].size(1)
    keys = ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    with torch.no_grad():
        want = model(**whole, use_cache=False, logits_to_keep=0).logits[:, n:]
        cache = DeepseekV41Cache(model.config, max_crop=256)
        model(**first, past_key_values=cache, logits_to_keep=0)
        got = model(**{k: second[k] for k in keys}, past_key_values=cache, logits_to_keep=0).logits
        cache.crop(n)
        again = model(**{k: second[k] for k in keys}, past_key_values=cache, logits_to_keep=0).logits
        rows = model.model.get_image_span_embeddings(second["pixel_values"], second["image_grid_thw"])
        marks = second["mm_token_type_ids"]
        cut = int(marks[0].nonzero().flatten()[rows.size(0) // 2])
        chunked = DeepseekV41Cache(model.config)
        model(**first, past_key_values=chunked, logits_to_keep=0)
        k = int(marks[:, :cut].sum())
        parts = [model.model(second["input_ids"][:, a:b], cache=chunked, logits_to_keep=0, mm_token_type_ids=marks[:, a:b],
                             image_span_embeds=r).logits
                 for (a, b), r in (((0, cut), rows[:k]), ((cut, marks.size(1)), rows[k:]))]
    for name, logits in (("one forward", got), ("two chunks", torch.cat(parts, dim=1))):
        _METRICS[f"conversation/{name}"] = {"rel_l2": rel_l2(logits, want)}
        assert rel_l2(logits, want) < LOGITS_REL_L2, name
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= ARGMAX_AGREEMENT, name
    assert torch.equal(again, got)  # crop then continue: the same forward again


def _engram_split_map(model, form: str) -> dict:
    tables = dict.fromkeys(ENGRAM_TABLES, "cpu")
    if form == "root":
        return {"": 0, **tables}
    # every top-level module and decoder layer an entry of its own, the tables below their layers
    entries = {}
    for name, child in model.model.named_children():
        if name == "layers":
            entries.update({f"model.layers.{i}": 0 for i in range(len(child))})
        else:
            entries[f"model.{name}"] = 0
    entries.update({f"model.{name}": 0 for name, _ in model.model.named_parameters(recurse=False)})
    return {**entries, **tables}


@pytest.mark.parametrize("form", ["root", "per_layer", "engram_device"])
def test_engram_tables_resident_on_cpu_give_the_all_gpu_logits_and_tokens(golden, converted_tiny_fp8, form):
    """`model.layers.{i}.engram.embed: "cpu"` beside a model on GPU 0: the tables stay real CPU
    tensors without accelerate hooks, the hash ids go to them and only the looked-up rows come back,
    and the logits and greedy tokens equal the all-GPU load's (the CPU dequantization is exact)."""
    from transformers import AutoModelForImageTextToText

    reference = hf_all_gpu_run(golden, converted_tiny_fp8)
    if form == "engram_device":
        kwargs = {"device_map": "auto", "engram_device": "cpu"}
    else:
        kwargs = {"device_map": _engram_split_map(reference["model"], form)}
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, numerics="fast", **kwargs)
    if form != "engram_device":
        assert model.hf_device_map == kwargs["device_map"]
    assert {model.hf_device_map[name] for name in ENGRAM_TABLES} == {"cpu"}
    tables = [model.get_submodule(name) for name in ENGRAM_TABLES]
    pointers = [p.data_ptr() for table in tables for p in table.parameters()]
    for table in tables:
        assert not hasattr(table, "_hf_hook")
        assert all(p.device.type == "cpu" and not p.is_meta for p in table.parameters())
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[0] not in ENGRAM_TABLES:
            # one GPU: everything on it; "auto" on several GPUs may spread the layers
            assert param.device == torch.device("cuda", 0) or (form == "engram_device" and param.is_cuda), name
    for i in (1, 5):  # a layer hook, if any, only moves inputs
        assert not getattr(getattr(model.model.layers[i], "_hf_hook", None), "offload", False)

    crossings = []

    def crossing(module, args, out):
        crossings.append((args[0].device.type, module.weight.device.type, out.device.type))

    handles = [table.register_forward_hook(crossing) for table in tables]
    inputs, _ = hf_vl_inputs(golden, converted_tiny_fp8)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    for handle in handles:
        handle.remove()
    assert crossings == [("cuda", "cpu", "cuda")] * 2
    assert [p.data_ptr() for table in tables for p in table.parameters()] == pointers  # never moved
    assert all(p.device.type == "cpu" for table in tables for p in table.parameters())
    _METRICS[f"engram_resident/{form}"] = {"logits_bitwise": torch.equal(logits, reference["logits"])}
    assert torch.equal(logits, reference["logits"])
    tokens = model.generate(**inputs, do_sample=False, max_new_tokens=13)[:, inputs["input_ids"].shape[1] :]
    assert tokens.tolist() == reference["tokens"]


def test_beam_search_replays_the_decode_graphs_and_equals_eager_steps(golden, converted_tiny_fp8):
    """Beam search reorders the cache rows at every step; the reorder keeps the buffers' storage,
    so the whole-step graphs are replayed, not captured again per step, and the beams equal those
    of the same search with graphs off. Then a second `generate` (the VL prompt, batch 1) gives
    the tokens of its eager run too (graphs of the first call's layouts left behind)."""
    model = hf_all_gpu_run(golden, converted_tiny_fp8)["model"]
    inputs, _ = hf_vl_inputs(golden, converted_tiny_fp8)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(converted_tiny_fp8)
    text = processor(text="A short prompt, then a longer one about cats and dogs. " * 3, return_tensors="pt").to(CUDA)
    runner = model.model.decode_runner
    results = {}
    try:
        for graphs in (False, True):
            runner.graphs = graphs
            before = runner.captures
            with torch.no_grad():
                beams = model.generate(**text, do_sample=False, num_beams=3, num_return_sequences=3, max_new_tokens=10)
                captures = runner.captures - before
                short = model.generate(**inputs, do_sample=False, max_new_tokens=12)
            results[graphs] = (beams.tolist(), short.tolist(), captures)
    finally:
        runner.graphs = True
    _METRICS["beam_search_graphs"] = {"captures": results[True][2]}
    assert results[True][0] == results[False][0]
    assert results[True][1] == results[False][1]
    # 9 decode steps reordering the rows in place: one capture (the expanded batch), not one per step
    assert results[True][2] == 1, results[True][2]


def test_hf_wrapper_on_gpu_matches_the_golden_run(golden, converted_tiny_fp8):
    """`AutoModelForImageTextToText` + processor on CUDA (numerics fast) against the golden VL run,
    within this file's bounds: prefill logits rel L2 < 0.1 and argmax equal on >= 90% of positions;
    the cached decode fed the golden tokens, logits rel L2 < 0.15 at every step and argmax equal on
    >= 80% of them; and `generate` (greedy, 13 tokens) follows the golden tokens as long as its logits
    do: each step's logits, while the tokens so far agree, are within the decode bound of the golden
    step's, and every step's token is that step's argmax."""
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    model = hf_all_gpu_run(golden, converted_tiny_fp8)["model"]
    tensors = golden_run(golden, "model_tiny_fp8", "vl", CUDA)
    inputs, golden_tokens = hf_vl_inputs(golden, converted_tiny_fp8)
    assert torch.equal(inputs["input_ids"], tensors["input_ids"])
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    ref = tensors["prefill.logits"]
    prefill = {
        "logits_rel_l2": rel_l2(logits, ref),
        "argmax_agree": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }

    # teacher-forced decode through the wrapper's forward and cache
    cache = DeepseekV41Cache(model.config)
    errors, agree = [], []
    with torch.no_grad():
        model(**inputs, cache=cache, logits_to_keep=1)
        token = tensors["prefill.next_token"].view(-1, 1)
        for step in range(tensors["decode.logits"].size(0)):
            step_logits = model(input_ids=token, cache=cache).logits[:, -1]
            step_ref = tensors["decode.logits"][step]
            errors.append(rel_l2(step_logits, step_ref))
            agree.append((step_logits.argmax(-1) == step_ref.argmax(-1)).float().mean().item())
            token = tensors["decode.token"][step].view(-1, 1)

    out = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=13,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    step_refs = [ref[:, -1]] + [tensors["decode.logits"][s] for s in range(len(golden_tokens[0]) - 1)]
    # greedy: each token is its step's argmax (of the processed scores, where the image id is suppressed)
    assert tokens == [int(scores[0].argmax()) for scores in out.scores]
    followed, generate_errors = 0, []
    for step, (ours, want) in enumerate(zip(out.logits, step_refs)):
        if tokens[:step] != golden_tokens[0][:step]:
            break
        generate_errors.append(rel_l2(ours, want))
        followed = step + 1
    _METRICS["hf_wrapper_golden"] = {
        "prefill": prefill, "decode_rel_l2": errors, "decode_argmax_agree": agree,
        "generated": tokens, "golden": golden_tokens[0], "generate_steps_compared": followed,
        "generate_rel_l2": generate_errors,
    }
    assert prefill["logits_rel_l2"] < 0.1 and prefill["argmax_agree"] >= 0.9, prefill
    assert max(errors) < 0.15 and sum(agree) / len(agree) >= 0.8, (errors, agree)
    assert len(tokens) == 13 and followed >= 1
    assert max(generate_errors) < 0.15, generate_errors


# --------------------------------------------------------------------------------------------
# Decode kernels compiled for the GPU: quantized GEMV
# --------------------------------------------------------------------------------------------

QUANT_LINEAR_CASES = [  # (kind, rows, N, K): real decode shapes and edge tiles
    ("fp8", 1, 512, 5120), ("fp8", 4, 1280, 5120), ("fp8", 1, 5120, 8192), ("fp8", 3, 40, 96),
    ("fp4", 1, 2304, 5120), ("fp4", 6, 5120, 2304), ("fp4", 1, 104, 64),
]


def _quant_weight(kind: str, n: int, k: int, gen: torch.Generator, one_per_row: bool = False):
    """Random valid storage (fp8 e4m3 values or fp4 bytes, e8m0 scales around 2^-7); with
    `one_per_row` every output row has a single non-zero weight, so the product is exact and the
    kernel must equal the fallback bit for bit."""
    if kind == "fp8":
        w = torch.randn(n, k, generator=gen, device=CUDA).clamp(-8, 8)
        if one_per_row:
            w = w * F.one_hot(torch.randint(0, k, (n,), generator=gen, device=CUDA), k)
        weight = w.to(torch.float8_e4m3fn)
        scale_shape = (-(-n // 32), -(-k // 32))
    else:
        codes = torch.randint(0, 16, (n, k), generator=gen, device=CUDA, dtype=torch.uint8)
        if one_per_row:
            codes = codes * F.one_hot(torch.randint(0, k, (n,), generator=gen, device=CUDA), k).to(torch.uint8)
        weight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.float4_e2m1fn_x2)
        scale_shape = (n, k // 32)
    scale = torch.randint(118, 126, scale_shape, generator=gen, device=CUDA, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return weight, scale


def test_quant_linear_split_launches_on_two_streams_at_once():
    """Split-K launches (the last program of a tile sums the ranges, counted per stream) issued on
    two streams at once, each also from a CUDA graph: every output equals the same launch run
    alone (no tile counter shared between concurrent launches)."""
    from deepseek_v41_vl.triton_ops.quant_linear import default_config, quantized_linear_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(11)
    weight, scale = _quant_weight("fp8", 1280, 5120, gen, False)
    assert default_config(1, 1280, 5120, "fp8", torch.device(CUDA)).split_k > 1
    xs = [(torch.randn(1, 5120, generator=gen, device=CUDA) * 3).to(torch.bfloat16) for _ in range(8)]
    alone = [quantized_linear_triton(x, weight, scale, "fp8") for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    graphs = []
    for stream in streams:  # one graph per stream, captured on it, replayed there
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            quantized_linear_triton(xs[0], weight, scale, "fp8")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = [quantized_linear_triton(x, weight, scale, "fp8") for x in xs]
        graphs.append((graph, outs))
    torch.cuda.synchronize()
    for _ in range(20):
        eager = []
        for stream, (graph, _) in zip(streams, graphs):
            with torch.cuda.stream(stream):
                graph.replay()
                eager.append([quantized_linear_triton(x, weight, scale, "fp8") for x in xs])
        torch.cuda.synchronize()
        for (_, outs), rows in zip(graphs, eager):
            assert all(torch.equal(a, b) for a, b in zip(outs, alone))
            assert all(torch.equal(a, b) for a, b in zip(rows, alone))


@pytest.mark.parametrize("one_per_row", [True, False])
@pytest.mark.parametrize("kind,rows,n,k", QUANT_LINEAR_CASES)
def test_quant_linear_kernel_matches_fallback(kind, rows, n, k, one_per_row):
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear
    from deepseek_v41_vl.triton_ops.quant_linear import quantized_linear_triton

    gen = torch.Generator(device=CUDA).manual_seed(n + k + rows)
    linear = DeepseekV41Linear(k, n, kind, numerics="fast").to(CUDA)
    weight, scale = _quant_weight(kind, n, k, gen, one_per_row)
    linear.weight.data, linear.scale.data = weight, scale
    x = (torch.randn(rows, k, generator=gen, device=CUDA) * 3).to(torch.bfloat16)
    x[:, :32] = 0  # an all-zero group: the 1e-4 amax floor
    ours = quantized_linear_triton(x, weight, scale, kind)
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import fake_quant_fp8

    ref = F.linear(fake_quant_fp8(x), linear.dequantized_weight(torch.bfloat16))
    if one_per_row:
        assert torch.equal(ours, ref)
        return
    # the same products summed in another order: within 1 bf16 ulp plus the fp32 reordering bound
    exact = fake_quant_fp8(x).double() @ linear.dequantized_weight(torch.float32).double().T
    bound = exact.abs().float().clamp_min(2**-126) * 2**-7 + 2 * k * 2**-24 * (
        fake_quant_fp8(x).float().abs() @ linear.dequantized_weight(torch.float32).abs().T
    )
    assert ((ours.float() - exact.float()).abs() <= bound).all()
    assert ((ref.float() - exact.float()).abs() <= bound).all()
    # routed through the module: the kernel for decode rows
    assert torch.equal(linear(x), ours)


if triton is not None:

    @triton.jit
    def _fp4_ptx_decode_probe(w_ptr, s_ptr, out_ptr, COLS: tl.constexpr):
        # one row of packed bytes through the routed-expert kernel's decode, values stored interleaved
        row = tl.program_id(0)
        j = tl.arange(0, COLS // 2)
        packed = tl.load(w_ptr + row * (COLS // 2) + j)
        scale = _dequant.e8m0_to_bf16(tl.load(s_ptr + row * (COLS // 32) + j // 16).to(tl.int32))
        lo, hi = _dequant.fp4_pairs_to_bf16_ptx(packed, scale)
        tl.store(out_ptr + row * COLS + 2 * j, lo)
        tl.store(out_ptr + row * COLS + 2 * j + 1, hi)


    @triton.jit
    def _e4m3_scaled_ptx_decode_probe(w_ptr, s_ptr, out_ptr, N: tl.constexpr):
        # one row of e4m3 bytes, its scale byte per 32 columns, through the quantized linear's decode
        row = tl.program_id(0)
        j = tl.arange(0, N)
        scale = _dequant.e8m0_to_bf16(tl.load(s_ptr + row * (N // 32) + j // 32).to(tl.int32))
        tl.store(out_ptr + row * N + j, _dequant.e4m3_scaled_to_bf16_ptx(tl.load(w_ptr + row * N + j), scale))


def test_e4m3_scaled_ptx_decode_equals_dequantize_fp8_weight_for_every_byte_and_scale():
    """`dequant.e4m3_scaled_to_bf16_ptx` (the quantized linear's fp8 weight decode on the GPU) on all
    256 e4m3 bytes under all 256 e8m0 scales (subnormal products, overflow to inf, the NaN scale
    included): bit for bit `dequantize_fp8_weight`, except the two NaN bytes (unspecified)."""
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp8_weight

    # row block r (32 rows) has the scale byte r; every row holds the 256 bytes, 8 scale columns
    raw = torch.arange(256, dtype=torch.uint8, device=CUDA).repeat(256 * 32, 1)
    scale = torch.arange(256, dtype=torch.uint8, device=CUDA)[:, None].repeat(1, 8)
    out = torch.empty(256 * 32, 256, dtype=torch.bfloat16, device=CUDA)
    row_scales = scale.repeat_interleave(32, dim=0).contiguous()
    _e4m3_scaled_ptx_decode_probe[(256 * 32,)](raw, row_scales, out, N=256)
    ref = dequantize_fp8_weight(raw.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))
    nan_byte = ((raw & 0x7F) == 0x7F)
    nan = ref.isnan() & ~nan_byte
    assert int(nan.sum()) == 32 * 254  # the NaN scale (byte 255) row block
    assert torch.equal(out.isnan()[~nan_byte], ref.isnan()[~nan_byte])
    keep = ~nan_byte & ~ref.isnan()
    assert torch.equal(out.view(torch.int16)[keep], ref.view(torch.int16)[keep])


def test_fp4_ptx_decode_equals_dequantize_fp4_weight_for_every_byte_and_scale():
    """`dequant.fp4_pairs_to_bf16_ptx` (the routed-expert kernel's fp4 decode on the GPU) on all 256
    packed bytes under all 256 e8m0 scales (subnormal 2^-127, overflow to inf, NaN included): bit
    for bit `dequantize_fp4_weight`, NaN wherever it gives NaN."""
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp4_weight

    cols = 512  # 256 packed bytes per row, 16 scale groups
    weight = torch.arange(256, dtype=torch.uint8, device=CUDA).repeat(256, 1)  # [256 scales, 256 bytes]
    weight = weight.view(torch.float4_e2m1fn_x2)
    scale = torch.arange(256, dtype=torch.uint8, device=CUDA)[:, None].repeat(1, cols // 32).view(torch.float8_e8m0fnu)
    out = torch.empty(256, cols, dtype=torch.bfloat16, device=CUDA)
    _fp4_ptx_decode_probe[(256,)](weight.view(torch.uint8), scale.view(torch.uint8), out, COLS=cols)
    ref = dequantize_fp4_weight(weight, scale)
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def _random_released_moe(kind: str, gen: torch.Generator, numerics: str | None = None, scale_bytes: tuple | None = None):
    """Layer 3's MoE of the released config at a mid width (hidden 512, experts 256 wide), on the
    GPU, experts stored as `kind`, weights drawn from `gen`: fp4 codes uniform, e8m0 scale bytes
    uniform in ``[scale_bytes[0], scale_bytes[1])`` (None: all 121, i.e. 2^-6, drawing nothing);
    `numerics` None keeps the config's."""
    import json as _json

    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config as _Config
    from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41MoE

    released = _json.loads((Path(__file__).resolve().parent.parent / "configs" / "deepseek_v41_flash.json").read_text())
    released["text_config"].update(hidden_size=512, moe_intermediate_size=256)
    text = _Config.from_dict(released).text_config
    text.expert_weight_dtype = kind
    if numerics is not None:
        text.numerics = numerics
    with torch.device(CUDA):
        moe = DeepseekV41MoE(text, 3).eval()
    for name, p in moe.named_parameters():
        if p.dtype == torch.float4_e2m1fn_x2:
            p.data.view(torch.uint8).copy_(torch.randint(0, 256, p.shape, generator=gen, device=CUDA, dtype=torch.uint8))
        elif p.dtype == torch.float8_e8m0fnu and scale_bytes is None:
            p.data.view(torch.uint8).fill_(127 - 6)
        elif p.dtype == torch.float8_e8m0fnu:
            p.data.view(torch.uint8).copy_(torch.randint(*scale_bytes, p.shape, generator=gen, device=CUDA, dtype=torch.uint8))
        elif p.dtype == torch.float8_e4m3fn:
            p.data.copy_((torch.randn(p.shape, generator=gen, device=CUDA) * 4).to(p.dtype))
        else:
            p.data.copy_((torch.randn(p.shape, generator=gen, device=CUDA) * p.shape[-1] ** -0.5).to(p.dtype))
    return moe


@pytest.mark.parametrize("kind", ["fp4", "bf16"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_moe_expert_kernels_match_the_grouped_path(kind, tokens, monkeypatch):
    """The routed-expert kernels (decode rows) against the per-expert grouped path, compiled, at a
    mid width with the released expert count and top-k; and the weight dequantization kernels bit
    for bit against the torch functions on the same experts."""
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp4_weight

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    moe = _random_released_moe(kind, gen)
    x = torch.randn(1, tokens, 512, generator=gen, device=CUDA).to(torch.bfloat16)
    with torch.no_grad():
        ref = with_backends(moe, moe_experts="torch")(x)
        with_backends(moe, moe_experts="auto")
        assert moe.runs_without_host_sync(tokens, CUDA)
        ours = moe(x)
    _METRICS[f"moe_experts/{kind}/{tokens}"] = {"rel_l2": rel_l2(ours, ref), "bitwise_fraction": (ours == ref).float().mean().item()}
    assert rel_l2(ours, ref) < 2e-3
    assert (ours == ref).float().mean().item() >= 0.9
    if kind == "fp4":
        w1 = moe.experts[0].w1
        assert torch.equal(w1.dequantized_weight(backend="triton"), dequantize_fp4_weight(w1.weight, w1.scale))
        shared = moe.shared_experts.w2
        if shared.weight_dtype == "fp8":
            assert torch.equal(shared.dequantized_weight(backend="triton"), shared.dequantized_weight(backend="torch"))


@pytest.mark.parametrize("fma", [False, True])
@pytest.mark.parametrize("tokens", [1, 64])
def test_moe_expert_decode_variants_agree(tokens, fma, monkeypatch):
    """Every variant of the compiled fp4 expert launches ("manual" MMA, or the CUDA-core launches
    with `fma`): the PTX and the portable weight decode give the same bits at any split count (they
    decode to equal values in the same layout), and split-K (module docstring: fp32 partial sums
    added in another order) stays as close to the per-expert torch loop as no split. Scale bytes
    vary over 2^-8 .. 2^-5."""
    from deepseek_v41_vl.triton_ops import moe_experts as _moe_experts

    _require_compiled_triton()
    finishes, combined = [], []
    finish, combine = _moe_experts._gate_up_finish_kernel, _moe_experts._combine

    class _FinishSpy:
        def __getitem__(self, grid):
            finishes.append(grid)
            return finish[grid]

    monkeypatch.setattr(_moe_experts, "_gate_up_finish_kernel", _FinishSpy())
    monkeypatch.setattr(_moe_experts, "_combine", lambda *a: combined.append(a[5]) or combine(*a))
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    moe = _random_released_moe("fp4", gen, scale_bytes=(119, 123))
    x = torch.randn(tokens, 512, generator=gen, device=CUDA).to(torch.bfloat16)
    with torch.no_grad():
        weights, indices = moe.gate(x)
        table = moe.expert_tables.get(moe.experts)
        ref = with_backends(moe, moe_prefill="torch")._routed_grouped(x, weights, indices)
        outs = {}
        for ptx in (True, False):
            for splits in ((1, 1), (4, 2)):
                tiles = {"gate_up": (32, 128, 4, 1), "down": (16, 128, 4, 1)} if fma else {}  # K blocks of 128
                config = {"ptx_decode": ptx, "splits": {"gate_up": splits[0], "down": splits[1]}, "fma": fma, **tiles}
                outs[ptx, splits] = _moe_experts.moe_experts_triton(x, weights, indices, table, mma="manual", config=config)
    # the splits reached the launches: K = 512 / 256 in blocks of 128 take 4 / 2 splits
    assert len(finishes) == 2 and combined == [1, 2, 1, 2]
    for splits in ((1, 1), (4, 2)):
        assert torch.equal(outs[True, splits], outs[False, splits]), f"PTX vs portable decode at splits {splits}"
    for splits in ((1, 1), (4, 2)):
        out = outs[True, splits]
        _METRICS[f"moe_experts/variants/{tokens}/{'fma' if fma else 'dot'}/splits{splits[0]}x{splits[1]}"] = {
            "rel_l2": rel_l2(out, ref), "bitwise_fraction": (out == ref).float().mean().item()}
        assert rel_l2(out, ref) < 2e-3
        assert (out == ref).float().mean().item() >= 0.9


@pytest.mark.parametrize("kind", ["fp4", "fp8", "bf16"])
def test_moe_prefill_path_matches_the_per_expert_loop(kind, monkeypatch):
    """The MoE prefill path (`triton_ops/moe_prefill.py`: batched expert dequantization +
    ``torch._grouped_mm``) against the per-expert module loop of `_routed_grouped`, compiled, at a
    mid width (D=512, I=256) with the released 384 experts and top-6, 300 tokens (1800 rows: not
    the decode kernels). The GEMMs sum the same exact products in another order, so: rel L2 < 2e-3
    and >= 90% of the output elements bitwise equal; the batched dequantization bit for bit."""
    import deepseek_v41_vl.triton_ops.moe_prefill as moe_prefill
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp4_weight, dequantize_fp8_weight

    _require_compiled_triton()
    tokens = 300
    gen = torch.Generator(device=CUDA).manual_seed(7)
    moe = _random_released_moe(kind, gen, numerics="fast", scale_bytes=(119, 123))
    assert moe.n_routed_experts == 384 and moe.gate.top_k == 6
    x = torch.randn(1, tokens, 512, generator=gen, device=CUDA).to(torch.bfloat16)
    calls = []
    real = moe_prefill.moe_routed_prefill
    monkeypatch.setattr(
        "deepseek_v41_vl.modeling.moe_deepseek_v41_vl.moe_routed_prefill", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    with torch.no_grad():
        ref = with_backends(moe, moe_prefill="torch")(x)
        assert calls == []
        ours = with_backends(moe, moe_prefill="auto")(x)
        assert calls == [1]
    bitwise = (ours == ref).float().mean().item()
    _METRICS[f"moe_prefill/{kind}/{tokens}"] = {"rel_l2": rel_l2(ours, ref), "bitwise_fraction": bitwise}
    assert torch.isfinite(ours).all()
    assert rel_l2(ours, ref) < 2e-3
    assert bitwise >= 0.9
    # the batched dequantization: a chunk not starting at expert 0, bit for bit
    table = moe.expert_tables.get(moe.experts)
    ids = torch.arange(384, dtype=torch.int32, device=CUDA)
    w13 = moe_prefill.dequantize_experts(table, "w13", ids, 370, 14)
    w2 = moe_prefill.dequantize_experts(table, "w2", ids, 370, 14)
    for g in (0, 13):
        expert = moe.experts[370 + g]
        for got, lin in ((w13[g, :256], expert.w1), (w13[g, 256:], expert.w3), (w2[g], expert.w2)):
            if kind == "fp4":
                want = dequantize_fp4_weight(lin.weight, lin.scale)
            elif kind == "fp8":
                want = dequantize_fp8_weight(lin.weight, lin.scale)
            else:
                want = lin.weight
            assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# Activation fake-quant kernels (`triton_ops/fake_quant.py`), compiled, against the torch ops
# --------------------------------------------------------------------------------------------

FAKE_QUANT_SHAPES = [(1, 1, 32, 128), (1, 1, 512), (3, 5, 64), (7, 4096)]


@pytest.mark.parametrize("shape", FAKE_QUANT_SHAPES)
@pytest.mark.parametrize("fmt", ["fp8", "fp4/e4m3", "fp4/ue8m0"])
def test_fake_quant_kernels_bitwise_equal_torch(fmt, shape):
    """Bit for bit (int16 patterns, so -0 counts) on random data across magnitudes, zero groups,
    huge values and every finite bf16 value; the torch ops run on the GPU too (IEEE division)."""
    import deepseek_v41_vl.modeling.quantization_deepseek_v41_vl as quant
    from deepseek_v41_vl.triton_ops.fake_quant import fake_quant_fp4_triton, fake_quant_fp8_triton

    _require_compiled_triton()
    if fmt == "fp8":
        kernel, reference = fake_quant_fp8_triton, lambda x: quant._fake_quant_fp8_torch(x, 32, "ue8m0")
    else:
        group, scale_fmt = (16, "e4m3") if fmt == "fp4/e4m3" else (32, "ue8m0")
        kernel = lambda x: fake_quant_fp4_triton(x, group, scale_fmt)  # noqa: E731
        reference = lambda x: quant._fake_quant_fp4_torch(x, group, scale_fmt)  # noqa: E731
    gen = torch.Generator(device=CUDA).manual_seed(sum(shape))
    k = shape[-1]
    mags = torch.logspace(-40, 36, k // 32, device=CUDA).repeat_interleave(32)  # bf16 subnormals to 1e36
    x = (torch.randn(shape, generator=gen, device=CUDA) * mags).to(torch.bfloat16)
    x.view(-1, k)[0, :32] = 0.0
    x.view(-1, k)[-1, ::16] = -3.0e38
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=CUDA).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())].reshape(-1, 64)
    strided = torch.stack([-x, x], dim=-1)[..., 1]  # x's values, last-dimension stride 2
    assert not strided.is_contiguous()
    for inp in (x, strided, every):
        ours, ref = kernel(inp), reference(inp)
        assert ours.shape == inp.shape and ours.dtype == torch.bfloat16
        assert torch.equal(ours.contiguous().view(torch.int16), ref.contiguous().view(torch.int16))
    # the public functions dispatch to the kernel on CUDA
    public = quant.fake_quant_fp8(x) if fmt == "fp8" else quant.fake_quant_fp4(x, group, scale_fmt)
    assert torch.equal(public.view(torch.int16), kernel(x).view(torch.int16))


@pytest.mark.parametrize(
    "shape, weight_dtype",
    [((1, 1, 5120), torch.bfloat16), ((1, 1280), torch.bfloat16), ((3, 512), torch.bfloat16),
     ((4096, 5120), torch.bfloat16), ((2, 128), torch.bfloat16), ((8649, 1024), torch.float32)],
)
def test_rms_norm_kernel_agrees_with_the_torch_ops(shape, weight_dtype):
    """The fused RMSNorm (`triton_ops/rms_norm.py`), compiled, against the torch ops on the GPU:
    at most one bf16 ulp apart, mostly equal. The fp32 weight is the vision tower's (its norms
    at the largest image: 8649 rows of 1024)."""
    from deepseek_v41_vl.modeling.layers_deepseek_v41_vl import DeepseekV41RMSNorm
    from deepseek_v41_vl.triton_ops.rms_norm import rms_norm_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen, device=CUDA) * torch.logspace(-3, 3, shape[-1], device=CUDA)).to(torch.bfloat16)
    norm = DeepseekV41RMSNorm(shape[-1], 1e-6, numerics="exact").to(CUDA)
    with torch.no_grad():
        norm.weight.data = (torch.rand(shape[-1], generator=gen, device=CUDA) + 0.5).to(weight_dtype)
        ours, ref = rms_norm_triton(x, norm.weight, 1e-6), norm(x)
    ulps = (ours.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    _METRICS[f"rms_norm/{shape}/{weight_dtype}"] = {"max_ulps": int(ulps.max()), "equal": (ulps == 0).float().mean().item()}
    assert int(ulps.max()) <= 1 and (ulps == 0).float().mean().item() >= 0.99


@pytest.mark.parametrize("rows", [1, 64])
def test_hc_mixes_sinkhorn_fused_equals_the_two_kernels(rows):
    """The mixes' second launch with the split + Sinkhorn in it (`hc_mix.hc_mixes_sinkhorn_triton`),
    compiled, against the projection then `hc_split_sinkhorn_triton`: bit for bit (the same jit
    helpers; the fused one reads back the row it stored, after a barrier)."""
    from deepseek_v41_vl.triton_ops.hc_mix import hc_mixes_sinkhorn_triton, hc_mixes_triton
    from deepseek_v41_vl.triton_ops.hc_sinkhorn import hc_split_sinkhorn_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(rows)
    x = (torch.randn(rows, 1, 4, 5120, generator=gen, device=CUDA) * 4).to(torch.bfloat16)
    fn = torch.randn(24, 4 * 5120, generator=gen, device=CUDA) * 0.01
    scale, base = torch.rand(3, generator=gen, device=CUDA), torch.randn(24, generator=gen, device=CUDA) * 0.1
    fused = hc_mixes_sinkhorn_triton(x, fn, 1e-6, scale, base, 20, 1e-6)
    apart = hc_split_sinkhorn_triton(hc_mixes_triton(x, fn, 1e-6), scale, base, 4, 20, 1e-6)
    for ours, ref in zip(fused, apart):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize("inverse", [False, True])
def test_text_rope_kernel_agrees_with_the_torch_ops(inverse):
    """The text RoPE (`triton_ops/rope.py`), compiled, against `apply_rotary`'s torch ops at the
    query's release shape (64 heads x 512, 64 rotated dims), in place and not: the same fp32
    complex product (torch's may contract to an FMA on the GPU): at most one bf16 ulp apart."""
    from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding, apply_rotary
    from deepseek_v41_vl.triton_ops.rope import apply_rotary_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(5 + inverse)
    x = (torch.randn(2, 3, 64, 512, generator=gen, device=CUDA) * 3).to(torch.bfloat16)
    freqs = DeepseekV41RotaryEmbedding(64, 10000.0, None)(torch.tensor([[7, 8, 9], [300, 301, 302]], device=CUDA))
    ref = apply_rotary(x, freqs, inverse=inverse)
    ours = apply_rotary_triton(x, freqs, inverse=inverse)
    ulps = (ours.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    _METRICS[f"rope/inverse={inverse}"] = {"max_ulps": int(ulps.max()), "equal": (ulps == 0).float().mean().item()}
    assert int(ulps.max()) <= 1
    same = x.clone()
    assert apply_rotary_triton(same, freqs, inverse=inverse, inplace=True) is same and torch.equal(same, ours)


@pytest.mark.parametrize("width", [113, 512, 4096, 16384])
def test_index_topk_kernel_keeps_the_torch_ops_positions(width):
    """The indexer's decode-step top-k in one launch (`triton_ops/index_topk.py`), compiled: the
    positions the torch ops keep (k = 512, ties at the k-th score to the lower position, -0 tied
    with +0, rows seeing fewer than k), listed in ascending position; graph-capturable."""
    from deepseek_v41_vl.triton_ops.index_topk import index_topk_torch, index_topk_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(width)
    s = (torch.randn(4, 1, width, generator=gen, device=CUDA) * 4).round()
    s = torch.where(torch.rand(4, 1, width, generator=gen, device=CUDA) < 0.3, -0.0, s).to(torch.bfloat16)
    visible = torch.tensor([width, width // 2, 300, 0], device=CUDA).view(4, 1, 1)
    k = min(512, width)
    none = torch.iinfo(torch.int32).max

    def ascending(v):
        return torch.sort(torch.where(v < 0, none, v), dim=-1).values

    got = index_topk_triton(s, visible, k, 128)
    assert torch.equal(ascending(got), ascending(index_topk_torch(s, visible, k, 128)))
    assert torch.equal(torch.where(got < 0, none, got), ascending(got))
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = index_topk_triton(s, visible, k, 128)
    graph.replay()
    assert torch.equal(out, got)


@pytest.mark.parametrize(("tokens", "hc", "dim", "masked"), [(1, 4, 5120, False), (4096, 4, 5120, True), (3, 2, 1100, True)])
def test_engram_gate_kernel_close_to_the_torch_ops(tokens, hc, dim, masked):
    """The Engram gate in one launch (`triton_ops/engram_gate.py`), compiled, at the release's
    width (4 copies x 5120) and an odd one: within a bf16 ulp of the torch ops (or ~1e-7 of the
    value where the sum nearly cancels), masked tokens passed through exactly; graph-capturable."""
    from deepseek_v41_vl.triton_ops.engram_gate import engram_gate_torch, engram_gate_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    hidden = torch.randn(1, tokens, hc, dim, generator=gen, device=CUDA).to(torch.bfloat16)
    kv = torch.randn(1, tokens, (hc + 1) * dim, generator=gen, device=CUDA).to(torch.bfloat16)
    q, k = ((torch.rand(hc, dim, generator=gen, device=CUDA) + 0.5).to(torch.bfloat16) for _ in range(2))
    mask = (torch.rand(1, tokens, generator=gen, device=CUDA) < 0.7) if masked else None
    got = engram_gate_triton(hidden, kv, q, k, mask, 1e-6, 1e-6)
    want = engram_gate_torch(hidden, kv, q, k, mask, 1e-6, 1e-6)
    assert rel_l2(got, want) < 2e-3
    value = kv[..., hc * dim :].float().abs().unsqueeze(-2)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 2**-17 * value).all()
    if masked:
        assert torch.equal(got[~mask], hidden[~mask])
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = engram_gate_triton(hidden, kv, q, k, mask, 1e-6, 1e-6)
    graph.replay()
    assert torch.equal(out, got)


@pytest.mark.parametrize(("batch", "length", "pad"), [(4, 1, 3), (1, 1, 1), (4, 3000, 0)])
def test_engram_hash_kernel_equals_the_torch_ops(batch, length, pad):
    """The Engram n-gram hash in one launch (`triton_ops/engram_hash.py`), compiled, with the
    release's layout: bit for bit the torch ops; graph-capturable."""
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
    from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import DeepseekV41EngramLayout
    from deepseek_v41_vl.triton_ops.engram_hash import DEAD, ngram_hash_torch, ngram_hash_triton

    _require_compiled_triton()
    root = Path(__file__).resolve().parents[1]
    config = DeepseekV41Config(**json.loads((root / "configs" / "deepseek_v41_flash.json").read_text()))
    layout = DeepseekV41EngramLayout.from_config(config.text_config)
    constants = [torch.tensor(t, device=CUDA) for t in (layout.multipliers(), layout.primes, layout.offsets())]
    gen = torch.Generator(device=CUDA).manual_seed(length)
    ids = torch.randint(0, layout.compressed_vocab_size, (batch, length), generator=gen, device=CUDA)
    ids = torch.where(torch.rand(batch, length, generator=gen, device=CUDA) < 0.1, DEAD, ids)
    history = torch.randint(0, layout.compressed_vocab_size, (batch, layout.history_len), generator=gen, device=CUDA)
    history[0, 0] = DEAD
    got = ngram_hash_triton(ids, history, pad, *constants)
    assert torch.equal(got, ngram_hash_torch(ids, history, pad, *constants))
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = ngram_hash_triton(ids, history, pad, *constants)
    graph.replay()
    assert torch.equal(out, got)


@pytest.mark.parametrize("batch", [1, 256])
def test_window_kv_row_fused_equals_the_four_launches(batch):
    """The decode step's window-KV row in one launch (`triton_ops/window_kv.py`), compiled, at the
    release's row (512 dims, 64 rotated) against the norm, RoPE and fake-quant kernels and the ring
    write: bit for bit (the same jit bodies, the row handed between them through the slot after
    barriers; the RoPE products rounded apart as the RoPE kernel's), over rows whose values span
    many binades (every rounding exercised) and several slots; the other slots untouched."""
    from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding
    from deepseek_v41_vl.triton_ops.fake_quant import fake_quant_fp8_triton
    from deepseek_v41_vl.triton_ops.rms_norm import rms_norm_triton
    from deepseek_v41_vl.triton_ops.rope import apply_rotary_triton
    from deepseek_v41_vl.triton_ops.window_kv import window_kv_row_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(batch)
    spread = torch.logspace(-6, 6, 512, device=CUDA)[torch.randperm(512, generator=gen, device=CUDA)]
    kv = (torch.randn(batch, 1, 512, generator=gen, device=CUDA) * spread).to(torch.bfloat16)
    weight = (torch.rand(512, generator=gen, device=CUDA) * 2).to(torch.bfloat16)
    positions = torch.randint(0, 70000, (batch, 1), generator=gen, device=CUDA)
    freqs = DeepseekV41RotaryEmbedding(64, 10000.0, None)(positions)
    ring = torch.randn(batch, 128, 512, generator=gen, device=CUDA).to(torch.bfloat16)
    rows = fake_quant_fp8_triton(apply_rotary_triton(rms_norm_triton(kv, weight, 1e-20), freqs))
    for at in (0, 77, 127):
        slot = torch.tensor([at], device=CUDA)
        want = ring.clone()
        want.index_copy_(1, slot, rows)
        got = ring.clone()
        window_kv_row_triton(kv, weight, 1e-20, freqs, got, slot)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for outside in (-1, 128):  # a slot outside the ring: nothing written
        got = ring.clone()
        window_kv_row_triton(kv, weight, 1e-20, freqs, got, torch.tensor([outside], device=CUDA))
        assert torch.equal(got.view(torch.int16), ring.view(torch.int16))


@pytest.mark.parametrize("batch, seq", [(1, 1), (4, 1), (1, 2048)])
def test_hc_mix_kernels_agree_with_the_torch_ops(batch, seq):
    """The mHC collapse / expand (`triton_ops/hc_mix.py`), compiled, against the torch ops of
    `DeepseekV41HyperConnection.pre / post` on the GPU at release width: the same fp32 products
    (no FMA contraction), the copies summed in ascending order; at most one bf16 ulp apart."""
    from deepseek_v41_vl.modeling.hyper_connection_deepseek_v41_vl import DeepseekV41HyperConnection
    from deepseek_v41_vl.triton_ops.hc_mix import hc_post_triton, hc_pre_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(seq)
    x = (torch.randn(batch, seq, 4, 5120, generator=gen, device=CUDA) * 4).to(torch.bfloat16)
    f = torch.randn(batch, seq, 5120, generator=gen, device=CUDA).to(torch.bfloat16)
    mix = torch.rand(batch, seq, 4, generator=gen, device=CUDA)
    post = 2 * torch.rand(batch, seq, 4, generator=gen, device=CUDA)
    comb = torch.rand(batch, seq, 4, 4, generator=gen, device=CUDA)
    torch_ops = DeepseekV41HyperConnection(4, 20, 1e-6, 1e-6, numerics="exact")
    for name, ours, ref in (("pre", hc_pre_triton(x, mix), torch_ops.pre(x, mix)),
                            ("post", hc_post_triton(f, x, post, comb), torch_ops.post(f, x, post, comb))):
        ulps = (ours.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        _METRICS[f"hc_mix/{name}/{batch}x{seq}"] = {"max_ulps": int(ulps.max()), "equal": (ulps == 0).float().mean().item()}
        assert int(ulps.max()) <= 1, _METRICS[f"hc_mix/{name}/{batch}x{seq}"]
    # the projection: exact fp32 FMA sums (no TF32) in another order than cuBLAS's fp32 GEMM
    from deepseek_v41_vl.triton_ops.hc_mix import hc_mixes_triton

    fn = torch.randn(24, 4 * 5120, generator=gen, device=CUDA) * (4 * 5120) ** -0.5
    flat = x.flatten(2).float()
    ref = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    ours = hc_mixes_triton(x, fn, 1e-6)
    _METRICS[f"hc_mix/mixes/{batch}x{seq}"] = {"max_rel": ((ours - ref).abs().max() / ref.abs().max()).item()}
    assert ((ours - ref).abs() <= 1e-5 * ref.abs().max()).all(), _METRICS[f"hc_mix/mixes/{batch}x{seq}"]


@pytest.mark.parametrize("shape", [(8649, 2 * 2816), (3, 2 * 2816), (5, 2 * 40)])
def test_swiglu_kernel_equals_the_torch_ops(shape):
    """The vision MLP's fused SwiGLU (`triton_ops/swiglu.py`), compiled, against ``F.silu(gate) *
    up`` on the GPU: the same fp32 arithmetic (CUDA's expf, an IEEE division) and roundings, so
    bit for bit; (8649, 5632) is w1's output at the largest image."""
    from deepseek_v41_vl.triton_ops.swiglu import swiglu_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(sum(shape))
    h = (torch.randn(shape, generator=gen, device=CUDA) * torch.logspace(-4, 1.5, shape[-1], device=CUDA)).to(torch.bfloat16)
    gate, up = h.chunk(2, dim=-1)
    ours, ref = swiglu_triton(h), F.silu(gate) * up
    ulps = (ours.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    _METRICS[f"swiglu/{shape}"] = {"max_ulps": int(ulps.max()), "equal": (ulps == 0).float().mean().item()}
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16)), _METRICS[f"swiglu/{shape}"]


def test_router_logits_in_fast_numerics_are_the_fp32_gemm_reordered():
    """`DeepseekV41Gate.router_logits` in fast numerics on CUDA (one bf16 GEMM with fp32 output)
    against the exact path's fp32 GEMM at release width: the same exact products, summed in
    another order (within a few fp32 ulps of the row's scale), and the same experts picked."""
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig
    from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41Gate

    config = DeepseekV41TextConfig(hidden_size=5120, n_routed_experts=384, num_experts_per_tok=6)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    fast = DeepseekV41Gate(config, 0, numerics="fast").to(CUDA)
    exact = DeepseekV41Gate(config, 0, numerics="exact").to(CUDA)
    with torch.no_grad():
        for gate in (fast, exact):
            gate.weight.copy_((torch.randn(384, 5120, generator=gen, device=CUDA) * 0.02).to(torch.bfloat16))
            gen.manual_seed(0)
        x = torch.randn(4, 5120, generator=gen, device=CUDA).to(torch.bfloat16)
        ours, ref = fast.router_logits(x), exact.router_logits(x)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert ((ours - ref).abs() <= 1e-5 * ref.abs().amax(dim=-1, keepdim=True)).all()


def test_head_decode_logits_read_an_exact_bf16_copy_and_follow_the_weight():
    """`DeepseekV41Head.decode_logits` on CUDA at release width: with bf16-valued fp32 weights, the
    fp32 GEMM's products summed in another order (a few fp32 ulps of the row's scale) from a bf16
    copy; after an in-place change to values bf16 cannot hold, `forward` itself, bit for bit (no
    copy), and the version a captured step keys on has changed."""
    from deepseek_v41_vl.modeling.layers_deepseek_v41_vl import DeepseekV41Head

    gen = torch.Generator(device=CUDA).manual_seed(0)
    head = DeepseekV41Head(129280, 5120).to(CUDA)
    with torch.no_grad():
        head.weight.copy_((torch.randn(129280, 5120, generator=gen, device=CUDA) * 0.02).to(torch.bfloat16))
        x = torch.randn(2, 1, 5120, generator=gen, device=CUDA).to(torch.bfloat16)
        ref = head(x)
        ours = head.decode_logits(x)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert ((ours - ref).abs() <= 1e-5 * ref.abs().amax(dim=-1, keepdim=True)).all()
        assert head.__dict__["_decode_copy"][1].dtype == torch.bfloat16
        version = head.decode_version
        head.weight[-1, -1] += 1e-6  # no longer a bf16 value (in the last of the checked row chunks)
        assert head.decode_version != version
        assert torch.equal(head.decode_logits(x), head(x))
        assert head.__dict__["_decode_copy"][1] is None


@pytest.mark.parametrize("weighted", [False, True])
def test_expert_swiglu_kernel_equals_the_expert_ops(weighted):
    """The language model's expert SwiGLU (`swiglu.expert_swiglu_triton`), compiled, against
    `DeepseekV41Expert.forward`'s torch ops between its linears (clamps, fp32 silu and products,
    one rounding): bit for bit on the GPU."""
    from deepseek_v41_vl.triton_ops.swiglu import expert_swiglu_triton

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(3 + weighted)
    gate = (torch.randn(6, 2304, generator=gen, device=CUDA) * 8).to(torch.bfloat16)
    up = (torch.randn(6, 2304, generator=gen, device=CUDA) * 8).to(torch.bfloat16)
    w = torch.rand(6, 1, generator=gen, device=CUDA) if weighted else None
    g, u = gate.float(), up.float().clamp(min=-10.0, max=10.0)
    h = F.silu(g.clamp(max=10.0)) * u
    ref = (h if w is None else w * h).to(torch.bfloat16)
    ours = expert_swiglu_triton(gate, up, 10.0, w)
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))


def test_fake_quant_kernels_replay_in_a_cuda_graph():
    """Captured once (after a compiling warm-up), replayed on new input: no host synchronisation."""
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import fake_quant_fp4, fake_quant_fp8

    _require_compiled_triton()
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(1, 1, 512, generator=gen, device=CUDA).to(torch.bfloat16)

    def step(t):
        return fake_quant_fp8(t), fake_quant_fp4(t, 16, "e4m3"), fake_quant_fp4(t, 32, "ue8m0")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(x)
    x.copy_((torch.randn(1, 1, 512, generator=gen, device=CUDA) * 100).to(torch.bfloat16))
    graph.replay()
    for got, want in zip(outs, step(x)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_triton_ops_launch_on_the_gpu_of_their_tensors():
    """Triton launches on the current device's stream: every op makes its tensors' GPU current
    (the model's final norm on GPU 1 is called while GPU 0 is current, under an "auto" map)."""
    from deepseek_v41_vl.triton_ops.kernel_backend import on_input_device
    from deepseek_v41_vl.triton_ops.rms_norm import rms_norm_triton

    seen = []
    probe = on_input_device(lambda t: seen.append(torch.cuda.current_device()))
    with torch.cuda.device(0):
        probe(torch.zeros(1, device="cuda:1"))
        probe(torch.zeros(1, device="cuda:0"))
        x = torch.randn(64, 5120, device="cuda:1").bfloat16()
        w = torch.rand(5120, device="cuda:1").bfloat16()
        got = rms_norm_triton(x, w, 1e-6)
    assert seen == [1, 0]
    with torch.cuda.device(1):
        want = rms_norm_triton(x, w, 1e-6)
    assert got.device == torch.device("cuda", 1) and torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_layers_split_over_two_gpus_decode_from_graphs_like_one_gpu(golden, converted_tiny_fp8):
    """A device_map over GPUs 0 and 1 (decoder layers whole, half on each): generation (layer by
    layer, no captured step) gives the one-GPU greedy tokens with the one-GPU prefill logits (the
    same kernels on the same GPU model)."""
    from transformers import AutoModelForImageTextToText

    reference = hf_all_gpu_run(golden, converted_tiny_fp8)
    n_layers = len(reference["model"].model.layers)
    core = reference["model"].model
    device_map = {f"model.{name}": 0 for name, _ in core.named_children() if name != "layers"}
    device_map.update({f"model.{name}": 0 for name, _ in core.named_parameters(recurse=False)})
    device_map.update({f"model.{name}": 0 for name, _ in core.named_buffers(recurse=False)})
    device_map.update({f"model.layers.{i}": int(i >= n_layers // 2) for i in range(n_layers)})
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, numerics="fast", device_map=device_map)
    assert {p.device.index for p in model.model.layers[n_layers - 1].parameters()} == {1}
    inputs, _ = hf_vl_inputs(golden, converted_tiny_fp8)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    tokens = model.generate(**inputs, do_sample=False, max_new_tokens=13)[:, inputs["input_ids"].shape[1] :]
    # a model over two devices decodes layer by layer (the engine's step runs on one device)
    assert model.model.decode_runner.captures == 0
    _METRICS["two_gpus"] = {"logits_rel_l2": rel_l2(logits.to(CUDA), reference["logits"]), "tokens_equal": tokens.tolist() == reference["tokens"]}
    assert rel_l2(logits.to(CUDA), reference["logits"]) < 1e-3
    assert tokens.tolist() == reference["tokens"]


def test_decode_graphs_are_captured_again_after_every_graph_was_dropped(golden):
    """Dropping every decode graph (a new cache each round) and decoding again captures new ones
    into the same per-device pool: no failure inside torch (a pool whose last graph was freed
    cannot take captures), and the same logits as the first round, bit for bit."""
    import gc

    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    model = golden_model(golden, "model_tiny_fp8", "fast", CUDA)
    tensors = golden_run(golden, "model_tiny_fp8", "text", CUDA)
    rounds = []
    for _ in range(2):
        gc.collect()
        before = model.decode_runner.captures
        cache = DeepseekV41Cache(model.config, max_cache_len=tensors["input_ids"].size(1) + 5)
        logits = []
        with torch.no_grad():
            step = model(tensors["input_ids"][:1], cache=cache).logits[:, -1]
            for _ in range(4):
                step = model(step.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
                logits.append(step)
        assert model.decode_runner.captures == before + 1
        rounds.append(torch.stack(logits))
        del cache
    assert torch.equal(rounds[0], rounds[1])


def test_decode_cuda_graphs_from_a_one_token_prompt_equal_eager_steps(golden):
    """A one-token prompt: the ratio-2 source's first compressed row is made by a graph-replayed
    decode step. 12 greedy steps, graphs vs eager: same logits, same compressed KV and index keys."""
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    model = golden_model(golden, "model_tiny_fp8", "fast", CUDA)
    tensors = golden_run(golden, "model_tiny_fp8", "text", CUDA)
    results = {}
    for graphs in (False, True):
        model.decode_runner.graphs = graphs
        cache = DeepseekV41Cache(model.config)
        logits = []
        with torch.no_grad():
            token = tensors["input_ids"][:, :1]
            step = model(token, cache=cache).logits[:, -1]
            for _ in range(12):
                token = step.argmax(-1, keepdim=True)
                step = model(token, cache=cache).logits[:, -1]
                logits.append(step)
        results[graphs] = (torch.stack(logits), cache)
    model.decode_runner.graphs = True
    assert torch.equal(results[True][0], results[False][0])
    for layer_id, state in results[False][1].attention.layers.items():
        other = results[True][1].attention.layers[layer_id]
        for name in ("compressed_kv", "index_k"):
            ours, ref = getattr(other, name), getattr(state, name)
            if ref is not None:
                assert torch.equal(ours.rows(ours.length), ref.rows(ref.length)), (layer_id, name)


@pytest.mark.parametrize("dim", [5120, 300, 1024])
@pytest.mark.parametrize("batch, seq", [(1, 1), (8, 1), (1, 8)])
def test_hc_fused_kernels_equal_the_separate_kernels(batch, seq, dim):
    """The fused mHC kernels (`triton_ops/hc_fused.py`), compiled, bit for bit the launches they
    replace, hc 4: collapse + norm against `hc_pre_triton` then `rms_norm_triton` (bf16 and fp32
    weights), expand + projection against `hc_post_triton` then `hc_mixes_sinkhorn_triton` /
    `hc_mixes_triton`; rows of ordinary, tiny and huge magnitudes. D 5120 is the release width
    (K steps inside one copy, the 8-warp norm); D 300 has K steps across two copies and a masked
    norm block; D 1024 the 4-warp norm. Then both captured in a CUDA graph and replayed: the same
    bits."""
    from deepseek_v41_vl.triton_ops.hc_fused import hc_post_mixes_triton, hc_pre_rms_norm_triton
    from deepseek_v41_vl.triton_ops.hc_mix import hc_mixes_sinkhorn_triton, hc_mixes_triton, hc_post_triton, hc_pre_triton
    from deepseek_v41_vl.triton_ops.rms_norm import rms_norm_triton

    _require_compiled_triton()

    def same(a, b):
        ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))

    gen = torch.Generator(device=CUDA).manual_seed(batch * 10 + seq + dim)
    hc, rows = 4, batch * seq
    scales = torch.tensor([1.0, 1e-36, 1e30, 3e-3, 1e18, 1.0, 0.5, 2.0], device=CUDA)[torch.arange(rows, device=CUDA) % 8]
    x = (torch.randn(batch, seq, hc, dim, generator=gen, device=CUDA) * 4 * scales.view(batch, seq, 1, 1)).to(torch.bfloat16)
    f = torch.randn(batch, seq, dim, generator=gen, device=CUDA).to(torch.bfloat16)
    mix = torch.rand(batch, seq, hc, generator=gen, device=CUDA) + 1e-3
    post = 2 * torch.rand(batch, seq, hc, generator=gen, device=CUDA)
    comb = torch.rand(batch, seq, hc, hc, generator=gen, device=CUDA)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen, device=CUDA) * (hc * dim) ** -0.5
    scale = 0.5 + torch.rand(3, generator=gen, device=CUDA)
    base = torch.randn((2 + hc) * hc, generator=gen, device=CUDA)
    for w_dtype in (torch.bfloat16, torch.float32):
        weight = (1 + 0.2 * torch.randn(dim, generator=gen, device=CUDA)).to(w_dtype)
        assert same(hc_pre_rms_norm_triton(x, mix, weight, 1e-6), rms_norm_triton(hc_pre_triton(x, mix), weight, 1e-6))
    want_x1 = hc_post_triton(f, x, post, comb)
    want = hc_mixes_sinkhorn_triton(want_x1, fn, 1e-6, scale, base, 20, 1e-6)
    x1, mixes = hc_post_mixes_triton(f, x, post, comb, fn, 1e-6, (scale, base, 20, 1e-6))
    assert same(x1, want_x1) and all(same(a, b) for a, b in zip(mixes, want))
    x1, m = hc_post_mixes_triton(f, x, post, comb, fn, 1e-6)
    assert same(x1, want_x1) and same(m, hc_mixes_triton(want_x1, fn, 1e-6))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_norm = hc_pre_rms_norm_triton(x, mix, weight, 1e-6)
        g_x1, g_mixes = hc_post_mixes_triton(f, x, post, comb, fn, 1e-6, (scale, base, 20, 1e-6))
    graph.replay()
    torch.cuda.synchronize()
    assert same(g_norm, rms_norm_triton(hc_pre_triton(x, mix), weight, 1e-6))
    assert same(g_x1, want_x1) and all(same(a, b) for a, b in zip(g_mixes, want))


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("rows", [1, 64])
def test_linear_partial_on_gpu_is_the_forward_before_its_rounding(kind, rows):
    """`DeepseekV41Linear.partial` (a tensor-parallel rank's share of a row-parallel linear) on
    the GPU: the kernel's fp32 output (1 row) and the bf16 GEMM with an fp32 output (64 rows, the
    fallback) round to the forward's bf16 output up to the fp32 summation order."""
    from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear, fp32_sums

    gen = torch.Generator(device=CUDA).manual_seed(5 + rows)
    linear = DeepseekV41Linear(2048, 1280, kind, numerics="fast").to(CUDA)
    linear.weight.data, linear.scale.data = _quant_weight(kind, 1280, 2048, gen, False)
    x = (torch.randn(rows, 2048, generator=gen, device=CUDA) * 3).to(torch.bfloat16)
    sums, out = linear.partial(x), linear(x)
    assert sums.dtype == torch.float32 and out.dtype == torch.bfloat16
    ulp = torch.exp2(torch.floor(torch.log2(out.float().abs().clamp_min(2.0**-126))) - 7)
    assert ((sums.to(torch.bfloat16).float() - out.float()).abs() <= ulp).all()
    assert (sums != sums.to(torch.bfloat16).float()).any()
    a = (torch.randn(3, 64, generator=gen, device=CUDA)).to(torch.bfloat16)
    w = (torch.randn(16, 64, generator=gen, device=CUDA)).to(torch.bfloat16)
    assert torch.allclose(fp32_sums(a, w).double(), a.double() @ w.double().t(), rtol=1e-6, atol=1e-5)
