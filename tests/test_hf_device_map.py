"""`device_map` through accelerate on a CPU machine: a split across "cpu" and "disk".

A CPU-only machine has one compute device, so the split accelerate supports there is CPU + disk
offload: `infer_auto_device_map` with a `max_memory` budget puts the first decoder layers on
"cpu" and the rest on "disk"; `from_pretrained(device_map=..., offload_folder=...)` then loads the
offloaded layers' weights from disk when each layer runs. The split model must give the same
logits (bit for bit) and the golden greedy tokens. On GPUs the same `_no_split_modules` keep each
decoder layer and ViT block on one device.
"""

from __future__ import annotations

import json
import re


import pytest
import torch
from accelerate import infer_auto_device_map, init_empty_weights
from accelerate.utils import compute_module_sizes
from safetensors.torch import load_file

import deepseek_v41_vl  # noqa: F401
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from golden_bits import CHAIN_REL_L2, TOKENS_PREFIX, assert_golden


# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cpu_disk_split_keeps_layers_whole_and_gives_the_same_logits(golden, converted_tiny_fp8, tmp_path):
    model_dir = converted_tiny_fp8
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights():
        empty = AutoModelForImageTextToText.from_config(config)
    assert set(empty._no_split_modules) == {"DeepseekV41DecoderLayer", "DeepseekV41DSparkBlock", "DeepseekV41VisionBlock"}
    sizes = compute_module_sizes(empty)
    n_layers = config.text_config.num_hidden_layers
    # room for the embedding, the first three layers and the tower, not for more
    budget = sizes["model.embed"] + sum(sizes[f"model.layers.{i}"] for i in range(3)) + sizes["model.vision"] // 2
    device_map = infer_auto_device_map(
        empty, max_memory={"cpu": budget, "disk": 10**12}, no_split_module_classes=list(empty._no_split_modules)
    )
    layer_devices = {int(m.group(1)): d for k, d in device_map.items() if (m := re.fullmatch(r"model\.layers\.(\d+)", k))}
    # every decoder layer is one entry (never split), the early ones in memory, the rest on disk
    assert sorted(layer_devices) == list(range(n_layers))
    assert not any(re.match(r"model\.layers\.\d+\.", k) for k in device_map)
    assert not any(re.match(r"model\.vision\.blocks\.\d+\.", k) for k in device_map)
    assert layer_devices[0] == "cpu" and layer_devices[n_layers - 1] == "disk"
    assert set(layer_devices.values()) == {"cpu", "disk"}

    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["vl_run"]
    processor = AutoProcessor.from_pretrained(model_dir)
    inputs = processor(images=[str(golden / im["file"]) for im in meta["images"]], text=meta["prompt"], return_tensors="pt")
    split = AutoModelForImageTextToText.from_pretrained(
        model_dir, numerics="exact", device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    assert split.hf_device_map == device_map
    assert any(p.is_meta for p in split.model.layers[n_layers - 1].parameters())  # really offloaded
    with torch.no_grad():
        logits = split(**inputs, use_cache=False).logits
    assert_golden(logits, load_file(golden / "model_tiny_fp8" / "vl.safetensors")["prefill.logits"], "prefill logits",
                  rel_l2=CHAIN_REL_L2)
    generated = split.generate(**inputs, do_sample=False, max_new_tokens=13)
    assert_golden(generated[:, inputs["input_ids"].shape[1] :].tolist(), meta["generated_tokens"], "greedy tokens",
                  prefix=TOKENS_PREFIX)
