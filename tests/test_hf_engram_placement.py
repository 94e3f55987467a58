"""Engram tables resident on the CPU under a `device_map` (`engram_placement_deepseek_v41_vl.py`).

What a CPU machine can check: the map arithmetic (which tables stay resident, which maps are
refused), that transformers places a table entry below its layer's entry, the map
`engram_offload_device_map` builds on a meta model for two fake GPUs (tables on "cpu" and out of
the GPU budget, layers and ViT blocks whole, the rest spread), and a real load on the CPU with the
tables pinned by entries of their own while later layers go to disk: the tables stay real CPU
tensors without accelerate hooks and the logits are the golden ones, bit for bit. The GPU half
(indices crossing to the table and rows coming back) is in tests/test_gpu.py.
"""

from __future__ import annotations

import json
import re


import pytest
import torch
from safetensors.torch import load_file

import deepseek_v41_vl  # noqa: F401
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import ENGRAM_SCALE_BLOCK, DeepseekV41EngramEmbedding
from deepseek_v41_vl.modeling.engram_placement_deepseek_v41_vl import (
    DeepseekV41EngramPlacementError,
    check_engram_placement,
    device_map_with_engram_tables,
    engram_offload_device_map,
    engram_table_names,
    explicit_engram_tables,
    resident_engram_tables,
)
from deepseek_v41_vl.modeling.model_classes_deepseek_v41_vl import empty_model
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.integrations.accelerate import compute_module_sizes, expand_device_map
from golden_bits import CHAIN_REL_L2, TOKENS_PREFIX, assert_golden

# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TABLES = ["model.layers.1.engram.embed", "model.layers.5.engram.embed"]  # engram_layer_ids [1, 5] of the tiny model


@pytest.fixture(scope="module")
def model_dir(converted_tiny_fp8):
    return converted_tiny_fp8


@pytest.fixture(scope="module")
def vl_run(golden, model_dir):
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["vl_run"]
    processor = AutoProcessor.from_pretrained(model_dir)
    images = [str(golden / im["file"]) for im in meta["images"]]
    inputs = processor(images=images, text=meta["prompt"], return_tensors="pt")
    logits = load_file(golden / "model_tiny_fp8" / "vl.safetensors")["prefill.logits"]
    return inputs, logits, meta["generated_tokens"]


def _device_of(name: str, device_map: dict):
    # the most specific entry covering `name`, as transformers resolves it
    keys = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
    return device_map[max(keys, key=len)]


# --------------------------------------------------------------------------------------------
# Map arithmetic
# --------------------------------------------------------------------------------------------


def test_tables_under_layers_on_a_gpu_stay_resident():
    device_map = {"": 0, "model.layers.3": 1, TABLES[0]: "cpu", TABLES[1]: "cpu"}
    assert resident_engram_tables(TABLES, device_map) == (TABLES, [])
    # a table without an entry of its own follows its layer
    assert resident_engram_tables(TABLES, {"": 0, TABLES[1]: "cpu"}) == ([TABLES[1]], [])
    # entries per parameter count as the table's own when all say "cpu"
    per_param = {"": 0, f"{TABLES[0]}.weight": "cpu", f"{TABLES[0]}.scale": "cpu"}
    assert resident_engram_tables(TABLES, per_param) == ([TABLES[0]], [])
    assert resident_engram_tables(TABLES, {"": 0, f"{TABLES[0]}.weight": "cpu", f"{TABLES[0]}.scale": 0}) == ([], [])
    # a machine without GPUs: "cpu" is where everything runs, nothing is offloaded
    assert resident_engram_tables(TABLES, {"": "cpu", "model.layers.7": "disk", TABLES[0]: "cpu"}) == ([TABLES[0]], [])


@pytest.mark.parametrize(
    "layer_device",
    ["disk", "cpu"],  # "cpu" beside a GPU is offloaded too: executed on the GPU, weights copied per forward
)
def test_a_table_inside_an_offloaded_layer_is_refused(layer_device):
    device_map = {"": 0, "model.layers.1": layer_device, TABLES[0]: "cpu"}
    assert resident_engram_tables(TABLES, device_map) == ([], [TABLES[0]])
    with pytest.raises(DeepseekV41EngramPlacementError, match=r"model\.layers\.1\.engram\.embed in 'model\.layers\.1'"):
        check_engram_placement(device_map)


def test_table_names_are_read_from_the_map_keys():
    device_map = {"": 0, TABLES[0]: "cpu", f"{TABLES[1]}.weight": "cpu", "model.layers.10": 1, "xengram.embed": 0}
    assert explicit_engram_tables(device_map) == TABLES
    assert check_engram_placement("auto") == [] and check_engram_placement(None) == []


def test_transformers_places_a_table_entry_below_its_layer_entry():
    """`from_pretrained` loads each parameter where the most specific key puts it, so a table
    entry overrides its layer's entry (also next to layers whose names extend it: 1 vs 10)."""
    device_map = {"model.layers.1": 0, "model.layers.10": 1, TABLES[0]: "cpu", "": 0}
    params = [f"{TABLES[0]}.weight", f"{TABLES[0]}.scale", "model.layers.1.attn.wq_a.weight"]
    params.append("model.layers.10.hc_attn_fn")
    assert expand_device_map(device_map, params) == dict(zip(params, ["cpu", "cpu", 0, 1]))


def test_device_map_with_engram_tables_forms(golden):
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
    model = empty_model(config)
    assert engram_table_names(model) == TABLES
    assert device_map_with_engram_tables(0, "cpu", model) == {"": 0, TABLES[0]: "cpu", TABLES[1]: "cpu"}
    given = {"model.layers": 1, "": 0, f"{TABLES[0]}.weight": "cpu"}
    want = {"model.layers": 1, "": 0, TABLES[0]: "cpu", TABLES[1]: "cpu"}
    assert device_map_with_engram_tables(given, "cpu", model) == want
    assert device_map_with_engram_tables("cuda:1", "cpu", model) == {"": "cuda:1", TABLES[0]: "cpu", TABLES[1]: "cpu"}
    # a table the map puts elsewhere contradicts engram_device="cpu": refused, not overridden
    for elsewhere in ({"": 0, TABLES[1]: "disk"}, {"": 0, f"{TABLES[0]}.weight": 0}):
        with pytest.raises(DeepseekV41EngramPlacementError, match="puts every Engram table on the CPU"):
            device_map_with_engram_tables(elsewhere, "cpu", model)
    for bogus in ("bogus", -1, True, 1.5):
        with pytest.raises(DeepseekV41EngramPlacementError, match="neither a device, a dict nor one of"):
            device_map_with_engram_tables(bogus, "cpu", model)
    with pytest.raises(DeepseekV41EngramPlacementError, match="engram_device must be 'cpu'"):
        device_map_with_engram_tables("auto", "cuda", model)
    with pytest.raises(DeepseekV41EngramPlacementError, match="needs a device_map"):
        device_map_with_engram_tables(None, "cpu", model)


# --------------------------------------------------------------------------------------------
# engram_offload_device_map on a meta model, two fake GPUs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_offload_map_puts_tables_on_cpu_and_spreads_the_rest_over_two_gpus(golden, strategy):
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
    # tables that dominate the model, as the released ones do (~91.5 GiB each of ~470 GiB)
    config.text_config.engram_num_embeddings = [400_000, 400_000]
    model = empty_model(config)
    sizes, _ = compute_module_sizes(model)
    tables = sum(sizes[name] for name in TABLES)
    rest = sizes[""] - tables
    assert tables > rest
    budget = int(0.7 * rest)  # the rest needs both GPUs; with the tables it would fit on neither
    params_before = {name: p for name, p in model.named_parameters()}

    device_map = engram_offload_device_map(model, max_memory={0: budget, 1: budget}, strategy=strategy)

    assert {name: p for name, p in model.named_parameters()} == params_before  # the model is left as it was
    assert {k: device_map[k] for k in TABLES} == {TABLES[0]: "cpu", TABLES[1]: "cpu"}
    # no other entry below a decoder layer or a ViT block: they stay whole
    others = [k for k in device_map if k not in TABLES]
    assert not any(re.match(r"model\.layers\.\d+\.", k) or re.match(r"model\.vision\.blocks\.\d+\.", k) for k in others)
    used = {0: 0, 1: 0}
    for name, param in model.named_parameters():
        device = _device_of(name, device_map)
        if name.rsplit(".", 1)[0] in TABLES:
            assert device == "cpu", name
            continue
        assert device in (0, 1), (name, device)  # nothing else on the CPU or the disk
        used[device] += param.numel() * param.element_size()
    assert used[0] > 0 and used[1] > 0 and max(used.values()) <= budget, used
    for i in range(config.text_config.num_hidden_layers):
        layer = {_device_of(n, device_map) for n, _ in model.named_parameters() if n.startswith(f"model.layers.{i}.")}
        assert len(layer - {"cpu"}) == 1, (i, layer)
    # from a config: the same map
    assert engram_offload_device_map(config, max_memory={0: budget, 1: budget}, strategy=strategy) == device_map


def test_offload_map_lets_a_table_follow_a_layer_that_is_offloaded(golden, caplog):
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
    sizes, _ = compute_module_sizes(empty_model(config))
    # room on the GPU for the first layers only: layer 5 lands on the disk
    device_map = engram_offload_device_map(config, max_memory={0: sizes[""] // 2}, strategy="sequential")
    assert _device_of("model.layers.5.attn", device_map) == "disk"
    assert TABLES[1] not in device_map and "follows its decoder layer" in caplog.text
    check_engram_placement(device_map)  # a map it builds is always accepted
    with pytest.raises(DeepseekV41EngramPlacementError, match="strategy must be one of"):
        engram_offload_device_map(config, strategy="fastest")


@pytest.mark.parametrize(
    "max_memory, message",
    [
        ([("cpu", 10)], "must be a dict"),
        ({0: "lots"}, "is not a size"),
        ({0: -1}, "non-negative size"),
        ({0: None}, "non-negative size"),
        ({0: True}, "non-negative size"),
        ({0: "1GiB", "cpu": 1000}, "Engram tables need"),
    ],
)
def test_offload_map_refuses_bad_memory_budgets(golden, max_memory, message):
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
    given = dict(max_memory) if isinstance(max_memory, dict) else max_memory
    with pytest.raises(DeepseekV41EngramPlacementError, match=message):
        engram_offload_device_map(config, max_memory=max_memory, strategy="sequential")
    assert max_memory == given  # the caller's dict is not rewritten


def test_offload_map_takes_size_strings(golden):
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
    as_bytes = engram_offload_device_map(config, max_memory={0: 2**30, "cpu": 2**30}, strategy="sequential")
    as_text = engram_offload_device_map(config, max_memory={0: "1GiB", "cpu": "1GiB"}, strategy="sequential")
    assert as_text == as_bytes and {as_text[t] for t in TABLES} == {"cpu"}


# --------------------------------------------------------------------------------------------
# The lookup and a real load on the CPU
# --------------------------------------------------------------------------------------------


def test_embedding_gathers_and_dequantizes_each_row_on_the_table_device():
    g = torch.Generator().manual_seed(3)
    table = DeepseekV41EngramEmbedding(50, 64)
    table.weight.data = (torch.randn(50, 64, generator=g) * 4).to(torch.float8_e4m3fn)
    table.scale.data = torch.randint(120, 134, (50, 64 // ENGRAM_SCALE_BLOCK), generator=g, dtype=torch.uint8).view(
        torch.float8_e8m0fnu
    )
    indices = torch.randint(0, 50, (2, 3, 4), generator=g)
    rows = table(indices)
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 3, 4, 64) and rows.device == indices.device
    scales = torch.exp2(table.scale.view(torch.uint8).float() - 127).repeat_interleave(ENGRAM_SCALE_BLOCK, dim=-1)
    want = (table.weight.float() * scales).to(torch.bfloat16)[indices]
    assert torch.equal(rows, want)


def test_cpu_load_with_tables_pinned_next_to_disk_layers_gives_golden_logits(model_dir, vl_run, tmp_path):
    inputs, golden_logits, golden_tokens = vl_run
    # everything on the CPU (the execution device here) but the last layer on disk, and an entry of
    # their own for the tables: the dispatch runs, and the tables are kept out of it
    device_map = {
        **{f"model.{name}": "cpu" for name in ("embed", "norm", "head", "hc", "engram_hash", "vision", "aligner")},
        **{f"model.{name}": "cpu" for name in ("image_start", "image_end", "image_newline")},
        **{f"model.layers.{i}": "disk" if i == 7 else "cpu" for i in range(8)},
        **dict.fromkeys(TABLES, "cpu"),
    }
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, numerics="exact", device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    assert model.hf_device_map == device_map
    assert any(p.is_meta for p in model.model.layers[7].parameters())  # the dispatch did run
    tables = [model.get_submodule(name) for name in TABLES]
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    assert_golden(logits, golden_logits, "prefill logits", rel_l2=CHAIN_REL_L2)
    for table in tables:
        assert not hasattr(table, "_hf_hook")
        for param in table.parameters():
            assert param.device.type == "cpu" and not param.is_meta
    generated = model.generate(**inputs, do_sample=False, max_new_tokens=13)
    assert_golden(generated[:, inputs["input_ids"].shape[1] :].tolist(), golden_tokens, "greedy tokens", prefix=TOKENS_PREFIX)


def test_a_table_inside_a_disk_layer_is_refused_before_loading(model_dir, tmp_path):
    device_map = {"": "cpu", "model.layers.5": "disk", TABLES[1]: "cpu"}
    with pytest.raises(DeepseekV41EngramPlacementError, match="offloaded"):
        AutoModelForImageTextToText.from_pretrained(model_dir, device_map=device_map, offload_folder=str(tmp_path))


def test_engram_device_kwarg_builds_the_map(model_dir, vl_run):
    inputs, golden_logits, _ = vl_run
    # no GPU here: "auto" puts the rest on the CPU too, and the tables get entries of their own
    model = AutoModelForImageTextToText.from_pretrained(
        model_dir, numerics="exact", device_map="auto", engram_device="cpu"
    )
    assert all(model.get_submodule(name).weight.device.type == "cpu" for name in TABLES)
    with torch.no_grad():
        assert_golden(model(**inputs, use_cache=False).logits, golden_logits, "prefill logits", rel_l2=CHAIN_REL_L2)
    with pytest.raises(DeepseekV41EngramPlacementError, match="engram_device must be 'cpu'"):
        AutoModelForImageTextToText.from_pretrained(model_dir, device_map="auto", engram_device="disk")
