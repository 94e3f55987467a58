"""Tensor and expert parallelism (`parallel_deepseek_v41_vl.py`) on the CPU over gloo: the golden
tiny model (4 heads in 2 output groups, 8 experts) under ``torchrun --nproc-per-node 2`` and a tiny
model whose heads, groups, experts and shared expert split four ways (with a draft head) under
``--nproc-per-node 4``, each against one process (`tests/parallel_worker.py` runs both); what one
rank loads, read as slices; and the settings refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41TextConfig
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.parallel_deepseek_v41_vl import (
    DeepseekV41ParallelError,
    DeepseekV41Shard,
    load_shards,
    parallel_request,
    shard_model,
)

WORKER = Path(__file__).with_name("parallel_worker.py")
# a rank's share is added to the others' in fp32 and rounded once, as one process rounds its one
# sum: the logits differ only by the order of fp32 additions, which the tiny random models can
# amplify (on the fixture CPU the text runs are bit-equal and the VL prefill is 2.5e-4 off). Much
# tighter than an error in the shards would give: another rank's attention sinks give 2e-2.
LOGITS_REL_L2 = 2e-3
ARGMAX_AGREEMENT = 0.98


def _run_worker(folder: Path, out: Path, ranks: int, *extra: str) -> list[dict]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([*launch, str(WORKER), str(folder), str(out), *extra], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(max(ranks, 1))]


def _expert_bytes(held: dict[str, int]) -> dict[str, int]:
    """Routed-expert bytes per layer (names with the expert index dropped)."""
    total: dict[str, int] = {}
    for name, size in held.items():
        match = re.match(r"(.*\.ffn\.experts)\.\d+\.", name)
        if match:
            total[match.group(1)] = total.get(match.group(1), 0) + size
    return total


def _sharded(name: str, shared_split: bool) -> bool:
    if ".shared_experts." in name and not shared_split:
        return False  # its width does not split into 32-blocks per rank: replicated
    plan = DeepseekV41TextConfig.base_model_tp_plan
    module = name.removeprefix("model.").rsplit(".", 1)[0]
    return any(re.fullmatch(re.escape(p).replace(r"\*", r"\d+"), m) for p in plan for m in (module, name.removeprefix("model.")))


def _check_holdings(one: dict[str, int], ranks: list[dict[str, int]], shared_split: bool) -> None:
    """Every rank holds 1/N of each sharded weight and of each layer's routed experts, and all
    of every other tensor."""
    n = len(ranks)
    for held in ranks:
        for name, size in one.items():
            if ".ffn.experts." in name:
                continue
            if ".engram.embed." in name:  # rows in shares of ceil(rows / N), summing to the table
                assert sum(r[name] for r in ranks) == size, name
                continue
            assert held[name] == (size // n if _sharded(name, shared_split) else size), name
        assert _expert_bytes(held) == {k: v // n for k, v in _expert_bytes(one).items()}
        assert sum(held.values()) < sum(one.values())


def _check_against_one_process(one: dict, ranks: list[dict], shared_split: bool) -> None:
    for key in one:
        if key in ("bytes", "shapes"):
            continue
        for seen in ranks[1:]:
            assert torch.equal(seen[key], ranks[0][key]), f"{key}: ranks differ"
        if key == "sampled":  # seeded alike across the ranks, not like the one process
            continue
        got, want = ranks[0][key], one[key]
        if want.is_floating_point():
            rel = ((got - want).norm() / want.norm()).item()
            agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            assert rel < LOGITS_REL_L2 and agree >= ARGMAX_AGREEMENT, f"{key}: rel L2 {rel:.4f}, argmax {agree:.3f}"
        else:
            assert torch.equal(got, want), f"{key}: {got.tolist()} != {want.tolist()}"
    _check_holdings(one["bytes"], [seen["bytes"] for seen in ranks], shared_split)
    for name, shape in one["shapes"].items():  # Engram rows: rank r holds rows r*ceil(R/N) ..
        if ".engram.embed." in name:
            share = -(-shape[0] // len(ranks))
            want = [min((r + 1) * share, shape[0]) - min(r * share, shape[0]) for r in range(len(ranks))]
            assert [seen["shapes"][name][0] for seen in ranks] == want, name


def test_golden_tiny_model_on_two_ranks_follows_one_process(converted_tiny_fp8, golden, photos, tmp_path):
    """The golden VL prefill (two images), the text prefill (two rows) and a text prompt: logits
    within the bounds; 2 greedy tokens, and 2 of a later turn with a new image on the first
    turn's cache, equal; each rank holds half of every sharded weight."""
    extra = ["--golden", str(golden), "--photos", *photos]
    one = _run_worker(converted_tiny_fp8, tmp_path / "one", 0, *extra)[0]
    ranks = _run_worker(converted_tiny_fp8, tmp_path / "two", 2, *extra)
    assert {"prefill/vl", "prefill/text", "greedy", "turn"} <= set(one)
    _check_against_one_process(one, ranks, shared_split=False)  # a 32-wide fp8 shared expert


@pytest.fixture(scope="module")
def four_way_tiny(tmp_path_factory) -> Path:
    """A tiny random model (converted) whose 8 heads in 4 groups, 8 experts (4 in the draft
    block) and 128-wide shared expert split over 4 ranks, with a DSpark draft head."""
    from deepseek_v41_vl.conversion.convert import convert_checkpoint
    from deepseek_v41_vl.conversion.make_tiny import tiny_reference_args, write_official_checkpoint

    root = tmp_path_factory.mktemp("four_way")
    args = tiny_reference_args("fp8", mtp=True) | {"n_heads": 8, "o_groups": 4, "moe_inter_dim": 128}
    write_official_checkpoint(root / "official", args)
    convert_checkpoint(root / "official", root / "converted", progress=False)
    return root / "converted"


def test_four_ranks_with_a_sharded_shared_expert_and_drafts(four_way_tiny, tmp_path):
    """4 ranks: logits within the bounds, greedy tokens equal, `generate(use_mtp=True)` equal to
    plain greedy; the shared expert and the draft block's attention are sharded too."""
    one = _run_worker(four_way_tiny, tmp_path / "one", 0, "--mtp")[0]
    ranks = _run_worker(four_way_tiny, tmp_path / "four", 4, "--mtp")
    assert torch.equal(ranks[0]["draft"], ranks[0]["plain"])
    _check_against_one_process(one, ranks, shared_split=True)
    assert ranks[0]["bytes"]["model.layers.1.ffn.shared_experts.w2.weight"] * 4 == one["bytes"]["model.layers.1.ffn.shared_experts.w2.weight"]
    assert ranks[0]["bytes"]["model.mtp.0.attn.wq_b.weight"] * 4 == one["bytes"]["model.mtp.0.attn.wq_b.weight"]


def test_one_rank_reads_its_slices(converted_tiny_fp8, monkeypatch):
    """Rank 1 of 2, loaded in this process (no collective runs while loading): each sharded tensor
    is read as a slice along its split dim and equals that slice of the whole tensor; the
    routed experts are the second half, renumbered from 0."""
    from transformers import AutoConfig
    from deepseek_v41_vl.modeling import parallel_deepseek_v41_vl as parallel
    from deepseek_v41_vl.modeling.model_classes_deepseek_v41_vl import empty_model, model_class_for
    from safetensors.torch import load_file

    whole = load_file(converted_tiny_fp8 / "model.safetensors")
    config = AutoConfig.from_pretrained(converted_tiny_fp8, trust_remote_code=True)
    model = empty_model(config, model_class_for(config))
    reads = {}
    original = parallel.read_split

    def spy(source, dim, shard):
        part = original(source, dim, shard)
        reads[part.data_ptr()] = dim
        return part

    monkeypatch.setattr(parallel, "read_split", spy)
    load_shards(model, converted_tiny_fp8, DeepseekV41Shard(rank=1, size=2), torch.device("cpu"))
    assert len(reads) == len(whole) - sum(".ffn.experts." in n for n in whole) // 2
    state = model.state_dict()
    wq_b = whole["model.layers.1.attn.wq_b.weight"]
    assert torch.equal(state["model.layers.1.attn.wq_b.weight"].view(torch.uint8), wq_b[wq_b.size(0) // 2 :].view(torch.uint8))
    wo_b = whole["model.layers.1.attn.wo_b.scale"]
    assert torch.equal(state["model.layers.1.attn.wo_b.scale"].view(torch.uint8), wo_b[:, wo_b.size(1) // 2 :].view(torch.uint8))
    assert torch.equal(state["model.layers.1.attn.attn_sink"], whole["model.layers.1.attn.attn_sink"][2:])
    assert torch.equal(state["model.head.weight"], whole["model.head.weight"][256:].float())
    experts = model.model.layers[1].ffn.experts
    assert len(experts) == 4
    assert torch.equal(state["model.layers.1.ffn.experts.0.w2.scale"].view(torch.uint8),
                       whole["model.layers.1.ffn.experts.4.w2.scale"].view(torch.uint8))
    attn = model.model.layers[1].attn
    assert (attn.n_heads, attn.n_groups) == (2, 1)


def test_sizes_that_do_not_split_are_refused(converted_tiny_fp8):
    from transformers import AutoConfig
    from deepseek_v41_vl.modeling.model_classes_deepseek_v41_vl import empty_model, model_class_for

    config = AutoConfig.from_pretrained(converted_tiny_fp8, trust_remote_code=True)
    with pytest.raises(DeepseekV41ParallelError, match="o_groups \\(2\\) does not split over 4 ranks"):
        shard_model(empty_model(config, model_class_for(config)).model, DeepseekV41Shard(rank=0, size=4))
    with pytest.raises(DeepseekV41ParallelError, match="o_groups \\(2\\) does not split over 3 ranks"):
        shard_model(empty_model(config, model_class_for(config)).model, DeepseekV41Shard(rank=0, size=3))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp_plan": {"layers.*.attn.wq_b": "rowwise"}}, "its own plan only"),
        ({"distributed_config": {"tp_size": 2, "fsdp_size": 2}}, "fsdp_size=2 is not supported"),
        ({"distributed_config": {"tp_size": 2, "pp_size": 2}}, "pp_size=2 is not supported"),
        ({"distributed_config": {"tp_size": 2, "ep_plan": {"x": "ep"}}}, "its own plan only"),
        ({"tp_plan": "auto", "device_map": "cpu"}, "mutually exclusive"),
        ({"distributed_config": {"tp_size": 2, "ep_size": 4}}, "ep_size=4"),
        ({"device_mesh": object()}, "device_mesh is not supported"),
        ({"distributed_config": {"tp_size": 2}, "tp_plan": "auto"}, "not both"),
        ({"tp_plan": "auto"}, "launch with torchrun"),
    ],
)
def test_parallel_settings_refused(kwargs, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(DeepseekV41ParallelError, match=message):
        parallel_request(dict(kwargs))


def test_no_parallel_argument_loads_as_before():
    kwargs = {"device_map": "cpu", "tp_plan": None}
    assert parallel_request(kwargs) is None
    assert kwargs == {"device_map": "cpu"}


def test_a_collective_refuses_gradients():
    shard = DeepseekV41Shard(rank=0, size=2)
    with pytest.raises(DeepseekV41ParallelError, match="training"):
        shard.all_reduce(torch.ones(2, requires_grad=True))


@pytest.mark.parametrize("rows, ranks", [(10, 4), (2, 3)])
def test_engram_rows_split_unevenly_add_up_exactly(rows, ranks, monkeypatch):
    """An Engram table whose rows do not divide by N (the released tables' do not): shares of
    ceil(rows / N), the last ones shorter or empty; the ranks' lookups (summed here as the
    all-reduce would) equal the whole table's, bit for bit."""
    from deepseek_v41_vl.modeling import parallel_deepseek_v41_vl as parallel
    from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import DeepseekV41EngramEmbedding

    whole = DeepseekV41EngramEmbedding(rows, 64)
    codes = torch.randint(0, 120, whole.weight.shape, dtype=torch.uint8)  # finite e4m3 codes
    whole.weight.data = codes.view(torch.float8_e4m3fn)
    whole.scale.data = torch.randint(120, 134, whole.scale.shape, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    indices = torch.randint(0, rows, (2, 5, 3))
    monkeypatch.setattr(DeepseekV41Shard, "all_reduce", lambda self, partial: partial.float())
    total = torch.zeros(2, 5, 3, 64)
    for rank in range(ranks):
        table = DeepseekV41EngramEmbedding(rows, 64)
        shard = DeepseekV41Shard(rank=rank, size=ranks)
        splits = {}
        parallel._shard_engram_table(table, shard, "layers.1.engram.embed", splits)
        table = table.to_empty(device="cpu")
        part = shard.part(rows, "rows", even=False)
        table.weight.data.copy_(whole.weight.data[part])
        table.scale.data.view(torch.uint8).copy_(whole.scale.data[part].view(torch.uint8))
        assert splits == {"layers.1.engram.embed.weight": (0, False), "layers.1.engram.embed.scale": (0, False)}
        total += table(indices).float()
    assert torch.equal(total.to(torch.bfloat16), whole(indices))


def test_a_rank_refuses_to_save_or_resize(converted_tiny_fp8, tmp_path):
    """A rank holds a share of the weights: saving it would write a broken folder, and a resize
    would cut the vocabulary share; both are refused by name."""
    from transformers import AutoConfig
    from deepseek_v41_vl.modeling.model_classes_deepseek_v41_vl import empty_model, model_class_for

    config = AutoConfig.from_pretrained(converted_tiny_fp8, trust_remote_code=True)
    model = empty_model(config, model_class_for(config))
    load_shards(model, converted_tiny_fp8, DeepseekV41Shard(rank=0, size=2), torch.device("cpu"))
    with pytest.raises(DeepseekV41ParallelError, match="one tensor-parallel rank"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    with pytest.raises(DeepseekV41ModelError, match="tensor-parallel rank"):
        model.resize_token_embeddings(600)


def test_the_readme_example_runs_as_written_on_two_ranks(converted_tiny_fp8, tmp_path):
    """README's parallel example as written, under ``torchrun --nproc-per-node 2`` and (one
    process) ``--nproc-per-node 1``: rank 0 prints the decoded tokens, the same text."""
    import shutil

    from test_readme_snippets import readme_example

    from deepseek_v41_vl.cli import bundled_photo

    shutil.copyfile(bundled_photo(), tmp_path / "cat.png")
    script = tmp_path / "example.py"
    script.write_text(f"DIR = {str(converted_tiny_fp8)!r}\n" + readme_example("parallel-example"), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    texts = []
    for ranks in (1, 2):
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)]
        done = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-6000:]
        texts.append(done.stdout.split())
    assert texts[0] and texts[1] == texts[0], texts


_EXIT_PROBE = """
import atexit, sys
import torch.distributed as dist
from deepseek_v41_vl.modeling.parallel_deepseek_v41_vl import _start_process_group

# registered first, so it runs after the load's handler (atexit runs handlers last in, first out)
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
if sys.argv[1] == "program":
    dist.init_process_group("gloo")
_start_process_group()
if sys.argv[1] == "raises":
    raise RuntimeError("the program failed")
"""


@pytest.mark.parametrize(
    "how, initialized",
    [("load", False), ("program", True), ("raises", True)],
)
def test_a_process_group_the_load_started_is_destroyed_at_exit(how, initialized, tmp_path):
    """The default group a rank's load started is destroyed at a normal exit (left to the
    interpreter's teardown, gloo at times aborts the process after its work is done); one the
    program started stays the program's, and a program ending on an uncaught exception is left
    as it is."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE, how], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == (1 if how == "raises" else 0), done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == f"initialized at exit: {initialized}", done.stdout


def test_readme_memory_table_is_what_the_model_holds():
    """README's weights per GPU (4x H200, 8x H100) are what rank 0 of the released model holds
    (`benchmarks/parallel_memory.py`, the sharding a load runs, on the meta device)."""
    import importlib.util
    import json

    from conftest import REPO_ROOT
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config

    spec = importlib.util.spec_from_file_location("parallel_memory", REPO_ROOT / "benchmarks" / "parallel_memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    config = DeepseekV41Config(**json.loads(memory.RELEASED.read_text()))
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    for node, ranks in (("8x H100 (80 GB)", 8), ("4x H200 (141 GB)", 4)):
        held = memory.rank_bytes(config, ranks)
        gib = {part: f"{size / memory.GIB:.1f}" for part, size in held.items()}
        row = (f"| {node} | {sum(held.values()) / memory.GIB:.1f} GiB (Engram {gib['Engram tables']}, "
               f"routed experts {gib['routed experts']}) |")
        assert row in readme, row


def test_a_rank_load_takes_config_arguments_and_refuses_others(converted_tiny_fp8, tmp_path):
    from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
    from deepseek_v41_vl.modeling.parallel_deepseek_v41_vl import sharded_load_config

    path, config = sharded_load_config(DeepseekV41Config, converted_tiny_fp8, {"numerics": "exact", "revision": None})
    assert path == converted_tiny_fp8 and config.text_config.numerics == "exact"
    with pytest.raises(DeepseekV41ParallelError, match=r"not taken with tensor parallelism: \['quantization_config'\]"):
        sharded_load_config(DeepseekV41Config, converted_tiny_fp8, {"quantization_config": {"x": 1}})
    with pytest.raises(DeepseekV41ParallelError, match="local converted folder"):
        sharded_load_config(DeepseekV41Config, tmp_path / "missing", {})
    with pytest.raises(DeepseekV41ParallelError, match="PEFT adapter"):
        sharded_load_config(DeepseekV41Config, converted_tiny_fp8, {"adapter_kwargs": {"_adapter_model_path": "a"}})


@pytest.mark.parametrize("path", ["exact", "grouped", "prefill", "kernels"])
def test_expert_parallel_moe_shares_add_up_to_one_process(path, monkeypatch):
    """The MoE of rank 0 and rank 1 of 2 (all-reduce replaced by collecting the shares), on each
    routed path: the exact loop, the grouped loop and the grouped prefill kernels run only the
    slots of the experts held here; the decode kernels give the other ranks' slots weight 0 on
    local expert 0 (a token whose two experts are both on rank 1 sends two such slots to rank 0's
    expert 0). The two shares (two fp32 terms a token) add up to one process's MoE output, bit for
    bit."""
    import copy

    from torch import nn

    from deepseek_v41_vl.modeling.moe_deepseek_v41_vl import DeepseekV41MoE
    from helpers import with_backends
    from random_storage import fill_quantized_storage

    config = DeepseekV41TextConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                   swiglu_limit=10.0, numerics="exact" if path == "exact" else "fast",
                                   expert_weight_dtype="fp4", weight_dtype="fp8")
    moe = DeepseekV41MoE(config, 0).eval()
    if path != "exact":
        backends = {"grouped": ("torch", "torch"), "prefill": ("torch", "triton"), "kernels": ("triton", "torch")}[path]
        with_backends(moe, moe_experts=backends[0], moe_prefill=backends[1])
    gen = torch.Generator().manual_seed(0)
    fill_quantized_storage(moe, gen)
    moe.gate.weight.data.copy_(torch.randn(moe.gate.weight.shape, generator=gen).bfloat16())
    moe.gate.bias.data.zero_()
    x = (torch.randn(1, 12, 64, generator=gen) * 3).bfloat16()
    _, indices = moe.gate(x[0])
    held_by = indices // 4
    assert ((held_by[:, 0] == held_by[:, 1]) & (held_by[:, 0] == 1)).any()  # both on rank 1: duplicates on rank 0
    with torch.no_grad():
        want = moe(x)
    shares = []
    monkeypatch.setattr(DeepseekV41Shard, "all_reduce", lambda self, partial: shares.append(partial.clone()) or partial)
    for rank in range(2):
        part = copy.deepcopy(moe)
        part.experts = nn.ModuleList(list(part.experts)[rank * 4 : (rank + 1) * 4])
        part.expert_offset, part.shard = rank * 4, DeepseekV41Shard(rank=rank, size=2)
        with torch.no_grad():
            part(x)
    got = (shares[0] + shares[1] + moe.shared_experts(x[0])).to(torch.bfloat16)
    if path == "kernels":  # the kernels' fp32 sums in another order than the combine of one process
        assert (got.float() - want[0].float()).abs().max() <= 2**-7 * want.float().abs().max()
    else:
        assert torch.equal(got, want[0])


def test_the_declared_plans_are_what_shards_the_model(four_way_tiny):
    """`base_model_tp_plan` / `base_model_ep_plan` and `shard_model` agree: every entry of the
    plans splits something (every layer and draft block), and nothing splits outside them."""
    from transformers import AutoConfig

    from deepseek_v41_vl.modeling.model_classes_deepseek_v41_vl import empty_model, model_class_for

    config = AutoConfig.from_pretrained(four_way_tiny, trust_remote_code=True)
    backbone = empty_model(config, model_class_for(config)).model
    experts_before = {name: len(m) for name, m in backbone.named_modules() if name.endswith("ffn.experts")}
    splits = shard_model(backbone, DeepseekV41Shard(rank=0, size=2))
    split = {name if name.endswith("attn_sink") else name.rsplit(".", 1)[0] for name, how in splits.items() if how}

    def matches(pattern: str, name: str) -> bool:
        return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None

    plan = DeepseekV41TextConfig.base_model_tp_plan
    stacks = {"layers": len(backbone.layers), "mtp": len(backbone.mtp)}
    for pattern in plan:
        hits = [name for name in split if matches(pattern, name)]
        want = stacks[pattern.split(".")[0]] if "*" in pattern else 1
        if pattern.startswith("layers.*.engram"):
            want = len(config.text_config.engram_layer_ids)
        assert len(hits) == want, (pattern, hits)
    assert all(any(matches(pattern, name) for pattern in plan) for name in split)
    for pattern in DeepseekV41TextConfig.base_model_ep_plan:
        held = {name: len(m) for name, m in backbone.named_modules() if matches(pattern, name)}
        assert held and all(2 * n == experts_before[name] for name, n in held.items())
