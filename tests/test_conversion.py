"""Official checkpoint layout, name table and the `convert` command (issue 6).

Sources: the golden tiny checkpoints (flat config.json, one unsharded model.safetensors, tiny
WordLevel tokenizer) and make-tiny checkpoints (sharded with an index, nested + flat configs, the
real tokenizer). Every mode converts them with `verify=True`, and the written tensors are compared
with `state_dict_adapter_deepseek_v41_vl.convert_tensor` of the whole source tensors (independent of the tile streaming).
"""

from __future__ import annotations

import os


import json
import shutil
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepseek_v41_vl.cli import main
from deepseek_v41_vl.conversion import convert as convert_module
from deepseek_v41_vl.conversion import streaming
from deepseek_v41_vl.modeling.checkpoint_names_deepseek_v41_vl import (
    RULES,
    TOKEN_MAP_NAME,
    DeepseekV41ConversionError,
    matching_rules,
    official_inventory,
    plan_all,
    plan_tensor,
    tensor_nbytes,
)
from deepseek_v41_vl.conversion.convert import convert_checkpoint, target_config
from deepseek_v41_vl.modeling.state_dict_adapter_deepseek_v41_vl import convert_state_dict, convert_tensor
from deepseek_v41_vl.conversion.make_tiny import make_tiny, tiny_reference_args, write_official_checkpoint
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

from golden_models import run_inputs
from golden_bits import CHAIN_REL_L2, DRAFT_REL_L2, assert_golden, assert_golden_chain

REPO_ROOT = Path(__file__).resolve().parent.parent


def _released_config() -> DeepseekV41Config:
    text = resources.files("deepseek_v41_vl.configs").joinpath("deepseek_v41_flash.json").read_text(encoding="utf-8")
    return DeepseekV41Config(**json.loads(text))


def _golden_config(golden: Path, variant: str) -> DeepseekV41Config:
    return DeepseekV41Config.from_reference_args(golden / f"model_tiny_{variant}" / "config.json")


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    out = {}
    for file in files:
        with safe_open(folder / file, "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


# --------------------------------------------------------------------------------------------
# Official inventory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_official_inventory_equals_golden_checkpoint_inventory(golden, variant):
    meta = json.loads((golden / f"model_tiny_{variant}" / "meta.json").read_text())
    expected = {name: (tuple(shape), dtype) for name, dtype, shape in meta["checkpoint"]["inventory"]}
    assert official_inventory(_golden_config(golden, variant)) == expected


def test_official_inventory_of_the_released_config():
    inv = official_inventory(_released_config())
    # 96,085 tensors and 475.3 GiB in the released checkpoint (REFERENCE.md section 11)
    assert len(inv) == 96085
    assert abs(sum(tensor_nbytes(s, d) for s, d in inv.values()) / 1024**3 - 475.3) < 0.05
    spot = {
        "embed.weight": ((129280, 5120), "BF16"),
        "head.weight": ((129280, 5120), "BF16"),
        "layers.0.hc_attn_fn": ((24, 20480), "F32"),
        "layers.7.attn.attn_sink": ((64,), "F32"),
        "layers.7.attn.wq_a.weight": ((1280, 5120), "F8_E4M3"),
        "layers.7.attn.wq_a.scale": ((40, 160), "F8_E8M0"),
        "layers.7.attn.wq_b.scale": ((1024, 40), "F8_E8M0"),
        "layers.7.attn.wkv.scale": ((16, 160), "F8_E8M0"),
        "layers.7.attn.wo_a.weight": ((8192, 4096), "F8_E4M3"),
        "layers.7.attn.wo_a.scale": ((256, 128), "F8_E8M0"),
        "layers.7.attn.wo_b.scale": ((160, 256), "F8_E8M0"),
        "layers.2.attn.compressor.wgate.weight": ((512, 5120), "BF16"),
        "layers.20.attn.compressor.wkv.weight": ((512, 5120), "BF16"),
        "layers.24.attn.indexer.wq_b.scale": ((128, 40), "F8_E8M0"),
        "layers.24.attn.indexer.weights_proj.weight": ((32, 5120), "BF16"),
        "layers.20.attn.indexer.wk.weight": ((128, 512), "BF16"),
        "layers.39.ffn.gate.bias_vl": ((384,), "F32"),
        "layers.39.ffn.experts.383.w1.weight": ((2304, 2560), "I8"),
        "layers.39.ffn.experts.383.w1.scale": ((2304, 160), "F8_E8M0"),
        "layers.39.ffn.experts.0.w2.weight": ((5120, 1152), "I8"),
        "layers.39.ffn.experts.0.w2.scale": ((5120, 72), "F8_E8M0"),
        "layers.39.ffn.shared_experts.w1.scale": ((72, 160), "F8_E8M0"),
        "layers.39.ffn.shared_experts.w2.scale": ((160, 72), "F8_E8M0"),
        "layers.1.engram.embed.weight": ((384006168, 256), "F8_E4M3"),
        "layers.1.engram.embed.scale": ((384006168, 8), "F8_E8M0"),
        "layers.14.engram.embed.weight": ((384016682, 256), "F8_E4M3"),
        "layers.14.engram.wkv.scale": ((800, 192), "F8_E8M0"),
        "layers.14.engram.q_weight": ((4, 5120), "BF16"),
        "mtp.0.main_proj.weight": ((5120, 15360), "F8_E4M3"),
        "mtp.0.main_proj.scale": ((160, 480), "F8_E8M0"),
        "mtp.1.ffn.gate.weight": ((128, 5120), "BF16"),
        "mtp.2.markov_head.embed.weight": ((129280, 256), "BF16"),
        "mtp.2.markov_head.head.weight": ((129280, 256), "F32"),
        "mtp.2.confidence_head.proj.weight": ((1, 5376), "BF16"),
        "vision.blocks.31.attn.wqkv.weight": ((3072, 1024), "BF16"),
        "vision.blocks.31.mlp.w1.weight": ((5632, 1024), "BF16"),
        "vision.blocks.31.norm2.weight": ((1024,), "F32"),
        "aligner.w1.weight": ((5120, 9216), "BF16"),
        "image_newline": ((5120,), "BF16"),
    }
    assert {name: inv.get(name) for name in spot} == spot
    absent = [
        "layers.20.attn.compressor.wgate.weight",  # ratio 1: no gate
        "layers.24.attn.compressor.wkv.weight",  # not a kv source
        "layers.24.attn.indexer.wk.weight",  # reads layer 20's keys
        "layers.3.attn.indexer.wq_b.weight",  # not an index source
        "layers.2.engram.q_weight",
        "mtp.0.ffn.experts.128.w1.weight",  # DSpark MoE has 128 experts
        "mtp.0.embed.weight",  # alias of the backbone's, not stored
        "mtp.1.main_proj.weight",
        "vision.blocks.32.norm1.weight",
    ]
    assert [name for name in absent if name in inv] == []
    assert sum(1 for n in inv if n.startswith("layers.") and ".experts." in n) == 40 * 384 * 6


# --------------------------------------------------------------------------------------------
# Name table
# --------------------------------------------------------------------------------------------


def _all_inventories(golden) -> dict[str, tuple]:
    names = {}
    for config in (_released_config(), _golden_config(golden, "fp8"), _golden_config(golden, "bf16"),
                   DeepseekV41Config.from_reference_args(tiny_reference_args("fp8", mtp=True))):
        names.update(official_inventory(config))
    return names


def test_every_official_name_is_matched_by_exactly_one_rule_and_every_rule_is_used(golden):
    names = _all_inventories(golden)
    counts = {name: len(matching_rules(name)) for name in names}
    assert [n for n, c in counts.items() if c != 1] == []
    used = {rule.name for name in names for rule in matching_rules(name)}
    assert used == {rule.name for rule in RULES}


def test_rules_touch_only_the_names_they_were_written_for():
    strangers = [
        "model.embed.weight",
        "embed.weight.scale",
        "layers.1.ffn.gate.bias.extra",
        "layers.1.ffn.gate.biasvl",
        "layers.1.attn.wq_a.weight_scale",
        "layers.1.attn.wq_c.weight",
        "xlayers.1.attn_norm.weight",
        "layers.x.attn_norm.weight",
        "layers.1.ffn.experts.x.w1.weight",
        "layers.1.ffn.experts.0.w4.weight",
        "layers.1.attn.compressor.wq.weight",
        "layers.1.engram.embed.bias",
        "vision.blocks.0.mlp.w3.weight",
        "vision.blocks.0.norm3.weight",
        "aligner.w3.weight",
        "image_pad",
        "mtp.x.attn_norm.weight",
    ]
    assert {name: [r.name for r in matching_rules(name)] for name in strangers} == {name: [] for name in strangers}
    bias = [r.name for r in matching_rules("layers.3.ffn.gate.bias")]
    bias_vl = [r.name for r in matching_rules("layers.3.ffn.gate.bias_vl")]
    assert bias == ["gate_bias"] and bias_vl == ["gate_bias_vl"]


def test_gate_bias_and_bias_vl_map_to_different_targets_and_targets_are_unique(golden):
    config = _golden_config(golden, "fp8")
    inv = official_inventory(config)
    plans = plan_all(inv, config)
    targets = [p.target for p in plans if p.target is not None]
    assert len(targets) == len(set(targets))
    a = plan_tensor("layers.3.ffn.gate.bias", *inv["layers.3.ffn.gate.bias"], config)
    b = plan_tensor("layers.3.ffn.gate.bias_vl", *inv["layers.3.ffn.gate.bias_vl"], config)
    assert (a.target, b.target) == ("model.layers.3.ffn.gate.bias", "model.layers.3.ffn.gate.bias_vl")
    with pytest.raises(DeepseekV41ConversionError, match="not a tensor name of the official checkpoint"):
        plan_tensor("layers.3.ffn.gate.bias_text", (8,), "F32", config)


def test_plans_of_the_released_checkpoint():
    source = _released_config()
    inv = official_inventory(source)

    def plan(name, config):
        p = plan_tensor(name, *inv[name], config)
        return p.op, p.dtype, p.shape

    keep = target_config(source, None, False)
    assert plan("layers.5.attn.wo_a.weight", keep) == ("dequant_fp8", "BF16", (8192, 4096))
    assert plan("layers.5.attn.wo_a.scale", keep)[0] == "drop"
    assert plan("layers.5.attn.wq_a.weight", keep) == ("copy", "F8_E4M3", (1280, 5120))
    assert plan("layers.5.attn.wq_a.scale", keep) == ("copy", "F8_E8M0", (40, 160))
    assert plan("head.weight", keep) == ("to_fp32", "F32", (129280, 5120))
    assert plan("layers.2.attn.compressor.wkv.weight", keep) == ("to_fp32", "F32", (512, 5120))
    assert plan("layers.2.attn.compressor.wgate.weight", keep) == ("to_fp32", "F32", (512, 5120))
    assert plan("layers.20.attn.compressor.wkv.weight", keep) == ("copy", "BF16", (512, 5120))
    assert plan("layers.5.ffn.experts.3.w2.weight", keep) == ("copy", "I8", (5120, 1152))
    assert plan("layers.1.engram.embed.weight", keep) == ("copy", "F8_E4M3", (384006168, 256))
    assert plan("mtp.0.main_proj.weight", keep) == ("copy", "F8_E4M3", (5120, 15360))
    assert plan("mtp.1.ffn.experts.3.w2.weight", keep) == ("copy", "I8", (5120, 1152))
    assert plan("mtp.2.confidence_head.proj.weight", keep) == ("to_fp32", "F32", (1, 5376))
    assert plan("mtp.2.markov_head.head.weight", keep) == ("copy", "F32", (129280, 256))
    bf16 = target_config(source, "bf16", False)
    assert plan("layers.5.ffn.experts.3.w2.weight", bf16) == ("dequant_fp4", "BF16", (5120, 2304))
    assert plan("layers.5.ffn.experts.3.w2.scale", bf16)[0] == "drop"
    assert plan("layers.5.ffn.shared_experts.w1.weight", bf16) == ("dequant_fp8", "BF16", (2304, 5120))
    assert plan("layers.14.engram.wkv.weight", bf16) == ("dequant_fp8", "BF16", (25600, 6144))
    assert plan("layers.1.engram.embed.scale", bf16) == ("copy", "F8_E8M0", (384006168, 8))
    text = target_config(source, None, True)
    assert plan("vision.blocks.0.attn.wqkv.weight", text)[0] == "drop"
    assert plan("image_start", text)[0] == "drop"
    assert plan("layers.5.ffn.gate.bias_vl", text)[0] == "copy"  # the model's router always holds it
    assert text.vision_config.num_hidden_layers == 0 and text.architectures == ["DeepseekV41ForCausalLM"]


def test_load_time_transform_on_golden_fp8(golden):
    config = target_config(_golden_config(golden, "fp8"), None, False)
    tensors = load_file(golden / "model_tiny_fp8" / "model.safetensors")
    name, wo_a = convert_tensor("layers.2.attn.wo_a.weight", tensors["layers.2.attn.wo_a.weight"], config, tensors.__getitem__)
    scale = tensors["layers.2.attn.wo_a.scale"].float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert name == "model.layers.2.attn.wo_a.weight" and wo_a.dtype == torch.bfloat16
    assert torch.equal(wo_a, (tensors["layers.2.attn.wo_a.weight"].float() * scale).bfloat16())
    name, w1 = convert_tensor("layers.0.ffn.experts.1.w1.weight", tensors["layers.0.ffn.experts.1.w1.weight"], config)
    assert w1.dtype == torch.float4_e2m1fn_x2 and torch.equal(w1.view(torch.int8), tensors["layers.0.ffn.experts.1.w1.weight"])
    assert convert_tensor("head.weight", tensors["head.weight"], config)[1].dtype == torch.float32
    assert convert_tensor("layers.2.attn.wo_a.scale", tensors["layers.2.attn.wo_a.scale"], config) is None
    with pytest.raises(DeepseekV41ConversionError, match="get_tensor"):
        convert_tensor("layers.2.attn.wo_a.weight", tensors["layers.2.attn.wo_a.weight"], config)


# --------------------------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------------------------

MODES = {
    "default": {},
    "bf16": {"dtype": "bf16"},
    "link": {"link": True},
    "text_only": {"text_only": True},
}


@pytest.fixture(scope="module")
def sources(golden, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {
        "golden_bf16": golden / "model_tiny_bf16",
        "golden_fp8": golden / "model_tiny_fp8",
        "tiny_fp8": make_tiny(root / "tiny_fp8", seed=1, variant="fp8"),
        "tiny_bf16": make_tiny(root / "tiny_bf16", seed=1, variant="bf16"),
    }


def _expected_token_map(golden: Path, source_name: str) -> torch.Tensor:
    if source_name.startswith("golden"):
        meta = json.loads((golden / f"model_{source_name.replace('golden_', 'tiny_')}" / "meta.json").read_text())
        return torch.tensor(meta["tokenizer"]["compressed_token_map"], dtype=torch.int64)
    with safe_open(golden / "engram" / "engram.safetensors", "pt") as f:
        return f.get_tensor("token_map").long()  # the real tokenizer's map (golden section 4)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("source_name", ["golden_bf16", "golden_fp8", "tiny_fp8", "tiny_bf16"])
def test_every_mode_converts_and_verifies(golden, sources, tmp_path, source_name, mode):
    src = sources[source_name]
    dst = tmp_path / "out"
    # golden tensors are small: a tiny budget forces multi-tile (and column-band) streaming
    budget = 64 * 1024 if source_name.startswith("golden") else 1024**2
    summary = convert_checkpoint(src, dst, verify=True, progress=False, max_slice_bytes=budget, **MODES[mode])
    assert summary.verified and dst.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial folder left

    data = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in data and data["auto_map"]["AutoConfig"] == "configuration_deepseek_v41_vl.DeepseekV41Config"
    config = DeepseekV41Config(**data)
    source_config = convert_module.load_source(src).config
    stored = "bf16" if mode == "bf16" else source_config.text_config.weight_dtype
    assert config.text_config.weight_dtype == stored
    assert config.vision_config.num_hidden_layers == (0 if mode == "text_only" else source_config.vision_config.num_hidden_layers)
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (dst / "configuration_deepseek_v41_vl.py").is_file() and (dst / "state_dict_adapter_deepseek_v41_vl.py").is_file()
    assert (dst / "preprocessor_config.json").is_file() == (mode != "text_only")

    source = _read_all(src)
    expected = dict(convert_state_dict(sorted(source), source.__getitem__, config))
    expected[TOKEN_MAP_NAME] = _expected_token_map(golden, source_name)
    if mode == "link":
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert index["metadata"]["layout"] == "official"
        assert all((dst / f).is_symlink() for f in set(index["weight_map"].values()) if f != "engram_token_map.safetensors")
        linked = _read_all(dst)  # official names, read through the links
        got = dict(convert_state_dict(sorted(n for n in linked if n != TOKEN_MAP_NAME), linked.__getitem__, config))
        got[TOKEN_MAP_NAME] = linked[TOKEN_MAP_NAME]
    else:
        got = _read_all(dst)
    assert sorted(got) == sorted(expected)
    for name in expected:
        want = expected[name]
        have = got[name].view(torch.float4_e2m1fn_x2) if want.dtype == torch.float4_e2m1fn_x2 else got[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(_bits(have), _bits(want)), name


def test_written_conversion_equals_link_conversion_at_load_time(sources, tmp_path):
    # a linked folder keeps the source storage (link with dtype="bf16" is refused:
    # test_conversion_hardening.py), and its load-time transform equals the written folder
    src = sources["tiny_fp8"]
    convert_checkpoint(src, tmp_path / "written", progress=False)
    convert_checkpoint(src, tmp_path / "linked", link=True, progress=False)
    written = _read_all(tmp_path / "written")
    linked = _read_all(tmp_path / "linked")
    config = DeepseekV41Config(**json.loads((tmp_path / "linked" / "config.json").read_text()))
    converted = dict(convert_state_dict([n for n in linked if n != TOKEN_MAP_NAME], linked.__getitem__, config))
    converted[TOKEN_MAP_NAME] = linked[TOKEN_MAP_NAME]
    assert sorted(converted) == sorted(written)
    assert all(torch.equal(_bits(converted[n]), _bits(written[n])) for n in written)


def test_multi_shard_output_with_index(sources, tmp_path):
    dst = tmp_path / "out"
    summary = convert_checkpoint(sources["tiny_fp8"], dst, verify=True, progress=False, max_shard_bytes=8 * 1024**2)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files == summary.shards
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _read_all(dst).values())


@pytest.mark.usefixtures("one_torch_thread")
def test_mtp_weights_are_kept_and_the_converted_folder_drafts_like_the_reference(golden, tmp_path):
    """The DSpark draft head (``mtp.*``) is converted with the rest; the folder loads through the
    auto class with its draft head, whose first draft of the text run equals the reference's."""
    from transformers import AutoModelForImageTextToText

    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    src = golden / "model_tiny_dspark"
    convert_checkpoint(src, tmp_path / "dst", verify=True, progress=False)
    official = json.loads((src / "meta.json").read_text())["checkpoint"]["inventory"]
    # every mtp.* tensor but the wo_a scales (folded into the bf16 wo_a, as the backbone's)
    n_mtp = sum(1 for name, _, _ in official if name.startswith("mtp.") and not name.endswith("wo_a.scale"))
    assert n_mtp > 150 and sum(1 for n in _read_all(tmp_path / "dst") if n.startswith("model.mtp.")) == n_mtp
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "dst", numerics="exact").model
    want = load_file(src / "text.safetensors")
    cache = DeepseekV41Cache(model.config)
    with torch.no_grad():
        out = model(want["input_ids"], cache=cache, output_main_hidden=True)
        rings = model.draft_cache(2)
        model.draft(out.logits[:, -1].argmax(-1), out.main_hidden, 0, rings)
        out = model(want["step.0.input_token"].view(-1, 1), cache=cache, output_main_hidden=True)
        ids, logits, confidence = model.draft(out.logits[:, -1].argmax(-1), out.main_hidden, want["input_ids"].size(1), rings)
    assert_golden_chain(ids, want["step.0.draft_ids"], "step.0.draft_ids")
    assert_golden_chain(logits, want["step.0.draft_logits"], "step.0.draft_logits", DRAFT_REL_L2)
    assert_golden_chain(confidence, want["step.0.confidence"], "step.0.confidence", DRAFT_REL_L2)


def test_a_folder_without_the_draft_head_loads_as_before_and_refuses_to_draft(golden, tmp_path, caplog):
    """A converted folder whose config enables DSpark but that holds no ``mtp.*`` tensor (converted
    before they were kept) loads without a draft head and without a missing-weight report; one
    holding part of them is refused."""
    from transformers import AutoModelForImageTextToText

    dst = tmp_path / "dst"
    convert_checkpoint(golden / "model_tiny_dspark", dst, progress=False)
    tensors = _read_all(dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    save_file({n: t for n, t in tensors.items() if not n.startswith("model.mtp.")}, dst / "model.safetensors")
    model, info = AutoModelForImageTextToText.from_pretrained(dst, numerics="exact", output_loading_info=True)
    assert model.model.mtp is None and not info["missing_keys"]
    assert "mtp" not in caplog.text
    with pytest.raises(DeepseekV41ModelError, match="no draft head"):
        model.model.draft_cache(1)
    save_file({n: t for n, t in tensors.items() if not n.startswith("model.mtp.2.")}, dst / "model.safetensors")
    with pytest.raises(DeepseekV41ModelError, match="only part of the draft head"):
        AutoModelForImageTextToText.from_pretrained(dst, numerics="exact")


# --------------------------------------------------------------------------------------------
# Bounded memory
# --------------------------------------------------------------------------------------------

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    from deepseek_v41_vl.conversion.convert import convert_checkpoint
    src, warm, out, bound = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    # warm-up on a small checkpoint: imports, processor files, first-use allocations
    for i, kw in enumerate(({}, {"dtype": "bf16"})):
        convert_checkpoint(warm, f"{out}/warm{i}", verify=True, progress=False, max_slice_bytes=bound, **kw)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    convert_checkpoint(src, f"{out}/big", dtype="bf16", verify=True, progress=False, max_slice_bytes=bound)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak}))
    """
)


@pytest.fixture(scope="module")
def big_tensor_source(golden, tmp_path_factory) -> Path:
    """Golden tiny fp8 config with a 32.5 MiB fp8 Engram `wkv` [1280, 26624] in a 2-shard checkpoint."""
    from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import engram_primes

    g = golden / "model_tiny_fp8"
    args = json.loads((g / "config.json").read_text())
    args.update(engram_layer_ids=[1], engram_head_dim=6656, engram_vocab_size=100)
    primes = engram_primes([1], args["engram_max_ngram_size"], args["engram_n_heads"], 100)
    args["engram_num_embeddings"] = [sum(sum(heads) for heads in layer) for layer in primes]
    return write_official_checkpoint(
        tmp_path_factory.mktemp("big") / "src",
        args,
        seed=5,
        tokenizer_json=(g / "tokenizer.json").read_bytes(),
        tokenizer_config=json.loads((g / "tokenizer_config.json").read_text()),
        max_shard_bytes=24 * 1024**2,
    )


def test_peak_memory_stays_within_the_slice_bound(golden, big_tensor_source, tmp_path):
    bound = 8 * 1024**2
    inventory = convert_module.load_source(big_tensor_source).inventory
    big = {n: tensor_nbytes(s, d) for n, (s, d) in inventory.items() if tensor_nbytes(s, d) > 4 * bound}
    assert list(big) == ["layers.1.engram.wkv.weight"]
    assert len(list(big_tensor_source.glob("model-*.safetensors"))) >= 2
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(big_tensor_source), str(golden / "model_tiny_fp8"), str(tmp_path), str(bound)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    growth = figures["peak"] - figures["base"]
    # The bf16 conversion turns the 32.5 MiB fp8 tensor into 65 MiB of bf16 and verifies it; holding
    # either whole would grow the process by far more than the bound plus a few MiB of headers.
    assert growth <= bound + 4 * 1024**2, f"peak RSS grew by {growth / 1024**2:.1f} MiB with an {bound >> 20} MiB bound"


# --------------------------------------------------------------------------------------------
# Bad sources: a clear error before anything is written
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden_tensors(golden) -> dict[str, torch.Tensor]:
    return load_file(golden / "model_tiny_fp8" / "model.safetensors")


def _bad_source(golden: Path, root: Path, tensors: dict, args: dict | None = None) -> Path:
    g = golden / "model_tiny_fp8"
    args = args or json.loads((g / "config.json").read_text())
    return _write_source(root, tensors, args, g)


def _write_source(root: Path, tensors: dict, args: dict, g: Path) -> Path:
    from deepseek_v41_vl.conversion.make_tiny import write_shards

    root.mkdir(parents=True)
    write_shards(root, tensors, max_shard_bytes=4 * 1024**2)
    (root / "config.json").write_text(json.dumps(args))
    shutil.copyfile(g / "tokenizer.json", root / "tokenizer.json")
    shutil.copyfile(g / "tokenizer_config.json", root / "tokenizer_config.json")
    return root


def _copy(folder: Path, dst: Path) -> Path:
    """A writable copy of a (read-only) golden folder."""
    dst.mkdir(parents=True)
    for path in folder.iterdir():
        if path.is_dir():
            _copy(path, dst / path.name)
        else:
            shutil.copyfile(path, dst / path.name)
    return dst


def _assert_refused(src: Path, dst: Path, match: str, **kwargs) -> None:
    with pytest.raises(DeepseekV41ConversionError, match=match):
        convert_checkpoint(src, dst, progress=False, **kwargs)
    assert not dst.exists()
    assert list(dst.parent.glob(f".{dst.name}.*")) == []


def test_missing_tensor(golden, golden_tensors, tmp_path):
    tensors = {n: t for n, t in golden_tensors.items() if n != "layers.3.attn.wq_a.scale"}
    _assert_refused(_bad_source(golden, tmp_path / "src", tensors), tmp_path / "dst", r"1 missing tensors \(layers\.3\.attn\.wq_a\.scale\)")


def test_unexpected_tensor(golden, golden_tensors, tmp_path):
    tensors = dict(golden_tensors, **{"layers.3.attn.wq_c.weight": torch.zeros(4, 4, dtype=torch.bfloat16)})
    _assert_refused(_bad_source(golden, tmp_path / "src", tensors), tmp_path / "dst", r"1 unexpected tensors \(layers\.3\.attn\.wq_c\.weight\)")


def test_shape_that_does_not_match_the_config(golden, golden_tensors, tmp_path):
    tensors = dict(golden_tensors, **{"layers.2.ffn.gate.weight": torch.zeros(8, 128, dtype=torch.bfloat16)})
    _assert_refused(
        _bad_source(golden, tmp_path / "src", tensors), tmp_path / "dst",
        r"layers\.2\.ffn\.gate\.weight: stored BF16\[8, 128\], the config expects BF16\[8, 256\]",
    )


def test_dtype_that_does_not_match_the_config(golden, golden_tensors, tmp_path):
    tensors = dict(golden_tensors, **{"head.weight": golden_tensors["head.weight"].float()})
    _assert_refused(_bad_source(golden, tmp_path / "src", tensors), tmp_path / "dst", r"head\.weight: stored F32\[512, 256\], the config expects BF16")


def test_fp8_config_with_bf16_tensors(golden, tmp_path):
    # the bf16 checkpoint's tensors under the fp8 checkpoint's config
    src = _copy(golden / "model_tiny_bf16", tmp_path / "src")
    shutil.copyfile(golden / "model_tiny_fp8" / "config.json", src / "config.json")
    _assert_refused(src, tmp_path / "dst", "missing tensors .*scale")


def test_bias_vl_on_some_moe_layers_only(golden, golden_tensors, tmp_path):
    tensors = {n: t for n, t in golden_tensors.items() if n != "layers.5.ffn.gate.bias_vl"}
    _assert_refused(
        _bad_source(golden, tmp_path / "src", tensors), tmp_path / "dst",
        r"gate\.bias_vl is present on 7 MoE layers .* and missing on 1 \(layers\.5\.ffn\.gate\)",
    )


def test_index_that_names_a_missing_shard(golden, golden_tensors, tmp_path):
    src = _bad_source(golden, tmp_path / "src", golden_tensors)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["embed.weight"] = "model-00009-of-00009.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_refused(src, tmp_path / "dst", r"names shards that do not exist: model-00009-of-00009\.safetensors")


def test_index_that_disagrees_with_the_shards(golden, golden_tensors, tmp_path):
    src = _bad_source(golden, tmp_path / "src", golden_tensors)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_refused(src, tmp_path / "dst", r"shards hold tensors the index does not list: norm\.weight")


def test_truncated_shard(golden, tmp_path):
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    _assert_refused(src, tmp_path / "dst", r"past the end of the file \(truncated\?\)")


def test_nested_and_flat_configs_that_disagree(sources, tmp_path):
    src = _copy(sources["tiny_fp8"], tmp_path / "src")
    flat = json.loads((src / "inference" / "config.json").read_text())
    flat["moe_inter_dim"] = 64
    (src / "inference" / "config.json").write_text(json.dumps(flat))
    _assert_refused(src, tmp_path / "dst", r"config\.json and .*inference/config\.json describe different checkpoints")


def test_missing_tokenizer_and_wrong_engram_vocab(golden, tmp_path):
    src = _copy(golden / "model_tiny_fp8", tmp_path / "src")
    (src / "tokenizer.json").unlink()
    _assert_refused(src, tmp_path / "dst", "no tokenizer.json")
    shutil.copyfile(golden / "model_tiny_fp8" / "tokenizer.json", src / "tokenizer.json")
    args = json.loads((src / "config.json").read_text())
    args["engram_compressed_vocab_size"] = 490
    (src / "config.json").write_text(json.dumps(args))
    _assert_refused(src, tmp_path / "dst", "compressed Engram vocab of 491 ids.*engram_compressed_vocab_size is 490")


def test_no_weights_and_bad_requests(golden, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(golden / "model_tiny_fp8" / "config.json", src / "config.json")
    _assert_refused(src, tmp_path / "dst", "no model.safetensors.index.json and no model.safetensors")
    _assert_refused(tmp_path / "nowhere", tmp_path / "dst", "is not a directory")
    _assert_refused(golden / "model_tiny_fp8", tmp_path / "dst", "dtype must be one of", dtype="fp4")


def test_destination_inside_the_source_is_refused(golden, tmp_path):
    src = _copy(golden / "model_tiny_bf16", tmp_path / "src")
    _assert_refused(src, src / "converted", "must lie outside the source")


# --------------------------------------------------------------------------------------------
# Overwrite safety
# --------------------------------------------------------------------------------------------


def test_no_overwrite_without_force_and_replace_with_force(golden, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(DeepseekV41ConversionError, match="exists; pass --force"):
        convert_checkpoint(golden / "model_tiny_bf16", dst, progress=False)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    convert_checkpoint(golden / "model_tiny_bf16", dst, force=True, verify=True, progress=False)
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_a_failure_while_writing_leaves_nothing_behind(golden, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = streaming.write_tensor

    def failing(plan, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 50:
            raise OSError("disk on fire")
        return original(plan, *args, **kwargs)

    monkeypatch.setattr(convert_module, "write_tensor", failing)
    dst = tmp_path / "dst"
    with pytest.raises(DeepseekV41ConversionError, match=f"converting into {dst} failed: disk on fire"):
        convert_checkpoint(golden / "model_tiny_fp8", dst, progress=False)
    assert list(tmp_path.iterdir()) == []
    # an existing destination survives a failed --force conversion
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    calls["n"] = 0
    with pytest.raises(DeepseekV41ConversionError, match="disk on fire"):
        convert_checkpoint(golden / "model_tiny_fp8", dst, force=True, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["dst"] and (dst / "keep.txt").read_text() == "mine"


def test_verify_detects_a_corrupted_write(golden, tmp_path, monkeypatch):
    original = streaming.write_tensor

    def corrupting(plan, source, writer, budget, progress):
        original(plan, source, writer, budget, progress)
        if plan.target == "model.layers.4.attn.wo_a.weight":
            writer.write_at(plan.target, 10, b"\x7f\x7f")

    monkeypatch.setattr(convert_module, "write_tensor", corrupting)
    _assert_refused(golden / "model_tiny_fp8", tmp_path / "dst", r"verify: model\.layers\.4\.attn\.wo_a\.weight differs", verify=True)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def test_cli_convert(golden, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert main(["convert", str(golden / "model_tiny_fp8"), str(dst), "--verify", "--quiet", "--dtype", "bf16", "--max-slice-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "425 tensors" in out and "dropped 262 tensors: block scale folded" in out
    assert main(["convert", str(golden / "model_tiny_fp8"), str(dst), "--quiet"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["convert", str(golden / "model_tiny_fp8"), str(dst), "--quiet", "--force", "--link", "--text-only"]) == 0
    out = capsys.readouterr().out
    assert "link, text-only" in out and "653 tensors" in out and "linked 1 source shards" in out


def test_flat_config_only_in_inference_folder(golden, tmp_path):
    src = _copy(golden / "model_tiny_bf16", tmp_path / "src")
    (src / "inference").mkdir()
    (src / "config.json").rename(src / "inference" / "config.json")
    summary = convert_checkpoint(src, tmp_path / "dst", verify=True, progress=False)
    assert summary.verified and summary.tensors == 424 + 1
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["text_config"]["hidden_size"] == 256
    (src / "inference" / "config.json").unlink()
    _assert_refused(src, tmp_path / "dst2", r"no config\.json or inference/config\.json")


# --------------------------------------------------------------------------------------------
# Converted folders load into the model and reproduce the golden logits
# --------------------------------------------------------------------------------------------


def _load_core(folder: Path):
    from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41Transformer

    data = json.loads((folder / "config.json").read_text())
    data["text_config"]["numerics"] = "exact"
    config = DeepseekV41Config(**data)
    tensors = _read_all(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file() and json.loads(index.read_text())["metadata"].get("layout") == "official":
        state = dict(convert_state_dict([n for n in tensors if n != TOKEN_MAP_NAME], tensors.__getitem__, config))
        state[TOKEN_MAP_NAME] = tensors[TOKEN_MAP_NAME]
    else:
        state = tensors
    model = DeepseekV41Transformer(config).eval()
    prefix = len("model.")
    model.load_state_dict({name[prefix:]: t for name, t in state.items()}, strict=True)
    return model


@pytest.mark.parametrize("mode", ["default", "link"])
@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_converted_folder_reproduces_the_golden_vl_prefill_logits(golden, tmp_path, variant, mode):
    folder = golden / f"model_tiny_{variant}"
    convert_checkpoint(folder, tmp_path / "out", progress=False, **MODES[mode])
    model = _load_core(tmp_path / "out")
    tensors, inputs = run_inputs(golden, folder.name, "vl")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model(**inputs, logits_to_keep=0)
    finally:
        torch.set_num_threads(previous)
    assert_golden(out.logits, tensors["prefill.logits"], f"{variant} {mode} prefill logits", rel_l2=CHAIN_REL_L2)
