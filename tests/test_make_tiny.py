"""`make-tiny`: a small random checkpoint in the official format with the real tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from deepseek_v41_vl.cli import main
from deepseek_v41_vl.modeling.checkpoint_names_deepseek_v41_vl import (
    DeepseekV41ConversionError,
    official_inventory,
)
from deepseek_v41_vl.conversion.make_tiny import make_tiny, quantize_fp8_blocks
from deepseek_v41_vl.conversion.source import load_source
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp4_weight, dequantize_fp8_weight

IMAGE_TOKEN = "<｜deepseek_image｜>"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {variant: make_tiny(root / variant, seed=7, variant=variant) for variant in ("fp8", "bf16")}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(folder / file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_byte_identical_for_a_seed(tiny, tmp_path):
    again = make_tiny(tmp_path / "again", seed=7, variant="fp8")
    assert _digests(again) == _digests(tiny["fp8"])
    other = make_tiny(tmp_path / "other", seed=8, variant="fp8")
    a, b = _digests(other), _digests(tiny["fp8"])
    assert a.keys() == b.keys() and a["config.json"] == b["config.json"] and a["tokenizer.json"] == b["tokenizer.json"]
    assert a["model-00001-of-00002.safetensors"] != b["model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("variant", ["fp8", "bf16"])
def test_official_layout_sharded_with_both_configs(tiny, variant):
    folder = tiny[variant]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    nested = DeepseekV41Config(**json.loads((folder / "config.json").read_text()))
    flat = DeepseekV41Config.from_reference_args(folder / "inference" / "config.json")
    assert official_inventory(nested) == official_inventory(flat)
    assert nested.text_config.vocab_size == 129280 and nested.image_token_id == 129264
    assert nested.text_config.weight_dtype == ("fp8" if variant == "fp8" else "bf16")
    assert nested.text_config.expert_weight_dtype == ("fp4" if variant == "fp8" else "bf16")
    assert ("quantization_config" in json.loads((folder / "config.json").read_text())) == (variant == "fp8")
    source = load_source(folder)  # every header checked against the config's official inventory
    assert source.inventory == official_inventory(nested)
    assert sum(p.stat().st_size for p in folder.glob("*.safetensors")) < 40 * 1024**2


def test_real_tokenizer_with_the_image_token_respelled(tiny):
    folder = tiny["fp8"]
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    entry = [e for e in data["added_tokens"] if e["id"] == 129264]
    assert entry == [dict(entry[0], content=IMAGE_TOKEN, special=False, normalized=False)]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 129280
    assert tokenizer.token_to_id(IMAGE_TOKEN) == 129264 and tokenizer.token_to_id("<｜image2｜>") is None
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(folder)
    assert fast.convert_tokens_to_ids(IMAGE_TOKEN) == 129264 and fast.bos_token_id == 0 and fast.eos_token_id == 1
    assert fast.encode("Hello world") == tokenizer.encode("Hello world").ids


def test_fp8_weights_are_block_quantizations_of_the_bf16_ones(tiny):
    fp8, bf16 = _tensors(tiny["fp8"]), _tensors(tiny["bf16"])
    name = "layers.3.attn.wq_b"
    w, s = fp8[f"{name}.weight"], fp8[f"{name}.scale"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and tuple(s.shape) == (8, 1)
    # e8m0 holds powers of two by construction; the block amax lands in [224, 448] after scaling
    blocks = w.float().view(8, 32, 1, 32).abs().amax(dim=(1, 3))
    assert bool(((blocks >= 224) & (blocks <= 448)).all())
    master = bf16[f"{name}.weight"]
    deq = dequantize_fp8_weight(w, s, dtype=torch.float32)
    assert torch.equal(quantize_fp8_blocks(master)[0].view(torch.uint8), w.view(torch.uint8))
    assert (deq - master.float()).norm() / master.float().norm() < 0.05


def test_fp4_experts_are_packed_low_nibble_first(tiny):
    fp8, bf16 = _tensors(tiny["fp8"]), _tensors(tiny["bf16"])
    name = "layers.2.ffn.experts.5.w1"
    packed, scale = fp8[f"{name}.weight"], fp8[f"{name}.scale"]
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (32, 32) and tuple(scale.shape) == (32, 2)
    master = bf16[f"{name}.weight"].float()
    values = dequantize_fp4_weight(packed, scale, dtype=torch.float32)
    # decode byte (0, 0) by hand: low nibble = element 0, high nibble = element 1
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    byte = int(packed[0, 0].view(torch.uint8))
    decode = lambda code: (-1 if code & 8 else 1) * magnitudes[code & 7] * float(scale[0, 0].float())  # noqa: E731
    assert (decode(byte & 15), decode(byte >> 4)) == (float(values[0, 0]), float(values[0, 1]))
    assert (values - master).norm() / master.norm() < 0.2  # E2M1 keeps ~1 significant bit
    assert torch.sign(values[master.abs() > master.abs().amax() / 2]).eq(torch.sign(master[master.abs() > master.abs().amax() / 2])).all()


def test_engram_tables_fp8_with_per_32_scales_in_both_variants(tiny):
    for variant in ("fp8", "bf16"):
        t = _tensors(tiny[variant])
        w, s = t["layers.5.engram.embed.weight"], t["layers.5.engram.embed.scale"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
        assert s.shape[0] == w.shape[0] and s.shape[1] * 32 == w.shape[1]
        assert bool(((w.float().abs().amax(dim=1) >= 224) & (w.float().abs().amax(dim=1) <= 448)).all())


def test_weight_scales_keep_the_model_calm(tiny):
    t = _tensors(tiny["bf16"])
    norms = torch.cat([t[n].float() for n in t if n.endswith("attn_norm.weight") or n.endswith("kv_norm.weight")])
    assert abs(norms.mean().item() - 1) < 0.02 and 0.07 < norms.std().item() < 0.13
    # output projections are 10x smaller than an input projection of the same fan-in
    wo_b, wq_a = t["layers.0.attn.wo_b.weight"].float(), t["layers.0.attn.wq_a.weight"].float()
    ratio = (wo_b.std() * wo_b.shape[1] ** 0.5) / (wq_a.std() * wq_a.shape[1] ** 0.5)
    assert 0.08 < ratio.item() < 0.12
    assert t["head.weight"].dtype == torch.bfloat16 and t["layers.1.attn.compressor.wgate.weight"].dtype == torch.bfloat16
    assert t["vision.blocks.0.norm1.weight"].dtype == torch.float32


def test_cli_make_tiny(tmp_path, capsys):
    dst = tmp_path / "tiny"
    assert main(["make-tiny", str(dst), "--seed", "3", "--variant", "bf16"]) == 0
    assert "bf16, seed 3" in capsys.readouterr().out
    assert main(["make-tiny", str(dst)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["make-tiny", str(dst), "--force", "--mtp"]) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert "mtp.0.markov_head.head.weight" in index["weight_map"]


def test_unknown_variant():
    with pytest.raises(DeepseekV41ConversionError, match="variant must be one of"):
        make_tiny("/nonexistent/never", variant="fp4")
