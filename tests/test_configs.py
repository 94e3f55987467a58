"""The shipped configs: the released nested config equals the flat `inference/config.json`, the tiny
config equals the golden tiny model's, and the released config builds on the meta device with the
checkpoint's tensor names, dtypes and shapes (REFERENCE.md sections 1 and 11)."""

from __future__ import annotations



import json
from importlib import resources

import pytest
import torch

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41Transformer

# `inference/config.json` of DeepSeek-V4.1-Flash, all 64 keys verbatim (REFERENCE.md 1.1).
RELEASED_FLAT = {
    "vocab_size": 129280,
    "dim": 5120,
    "moe_inter_dim": 2304,
    "n_layers": 40,
    "n_mtp_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_n_activated_experts": 3,
    "n_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "n_activated_experts": 6,
    "score_func": "sqrtsoftplus",
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "q_lora_rank": 1280,
    "head_dim": 512,
    "rope_head_dim": 64,
    "norm_eps": 1e-20,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "window_size": 128,
    "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "original_seq_len": 65536,
    "rope_theta": 10000,
    "rope_factor": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000,
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092,
    "dtype": "fp8",
    "expert_dtype": "fp4",
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "vision_n_layers": 32,
    "vision_dim": 1024,
    "vision_n_heads": 16,
    "vision_inter_dim": 2816,
    "vision_patch_size": 14,
    "vision_downsample_ratio": 3,
    "vision_max_n_token": 1024,
    "vision_min_pixels": 295936,
    "vision_max_wh_ratio": None,
    "image_token_id": 129264,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "vision_rope_theta": 10000,
}

# Serialization-only fields that legitimately differ between the two spellings.
_NOT_MODEL = ("architectures", "dtype", "transformers_version", "_name_or_path")


def _shipped(name: str) -> dict:
    return json.loads((resources.files("deepseek_v41_vl.configs") / name).read_text(encoding="utf-8"))


def _model_fields(config: DeepseekV41Config) -> dict:
    d = config.to_dict()
    for key in _NOT_MODEL:
        d.pop(key, None)
    return d


def test_flat_release_config_has_the_64_reference_keys():
    assert len(RELEASED_FLAT) == 64
    assert len(RELEASED_FLAT["compress_ratios"]) == RELEASED_FLAT["n_layers"] + RELEASED_FLAT["n_mtp_layers"]


def test_nested_release_config_equals_flat_reference_config():
    nested = DeepseekV41Config(**_shipped("deepseek_v41_flash.json"))
    flat = DeepseekV41Config.from_reference_args(RELEASED_FLAT)
    assert _model_fields(nested) == _model_fields(flat)
    text, vision = nested.text_config, nested.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (5120, 40, 64)
    assert (text.weight_dtype, text.expert_weight_dtype) == ("fp8", "fp4")
    assert text.compress_rope_scaling["original_max_position_embeddings"] == 65536
    assert (vision.num_hidden_layers, vision.hidden_size, vision.out_hidden_size) == (32, 1024, 5120)
    assert nested.image_token_id == 129264


def test_nested_release_config_round_trips():
    config = DeepseekV41Config(**_shipped("deepseek_v41_flash.json"))
    again = DeepseekV41Config(**config.to_dict())
    assert _model_fields(again) == _model_fields(config)


def test_tiny_config_equals_the_golden_tiny_models(golden):
    tiny = _model_fields(DeepseekV41Config(**_shipped("tiny_vl.json")))
    assert tiny == _model_fields(DeepseekV41Config.from_reference_args(golden / "model_tiny_bf16" / "config.json"))
    # the fp8 variant differs only in weight storage
    fp8 = _model_fields(DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json"))
    tiny["text_config"].update(weight_dtype="fp8", expert_weight_dtype="fp4")
    assert fp8 == tiny


# A sample of REFERENCE.md section 11 (name, module dtype, shape): every role of every module.
RELEASED_TENSORS = [
    ("embed.weight", torch.bfloat16, (129280, 5120)),
    ("head.weight", torch.float32, (129280, 5120)),
    ("norm.weight", torch.bfloat16, (5120,)),
    ("image_start", torch.bfloat16, (5120,)),
    ("image_newline", torch.bfloat16, (5120,)),
    ("layers.39.hc_attn_fn", torch.float32, (24, 20480)),
    ("layers.0.hc_ffn_base", torch.float32, (24,)),
    ("layers.7.hc_ffn_scale", torch.float32, (3,)),
    ("layers.0.attn_norm.weight", torch.bfloat16, (5120,)),
    ("layers.0.attn.attn_sink", torch.float32, (64,)),
    ("layers.0.attn.wq_a.weight", torch.float8_e4m3fn, (1280, 5120)),
    ("layers.0.attn.wq_a.scale", torch.float8_e8m0fnu, (40, 160)),
    ("layers.0.attn.q_norm.weight", torch.bfloat16, (1280,)),
    ("layers.0.attn.wq_b.scale", torch.float8_e8m0fnu, (1024, 40)),
    ("layers.0.attn.wkv.scale", torch.float8_e8m0fnu, (16, 160)),
    ("layers.0.attn.kv_norm.weight", torch.bfloat16, (512,)),
    ("layers.0.attn.wo_a.weight", torch.bfloat16, (8192, 4096)),
    ("layers.0.attn.wo_b.scale", torch.float8_e8m0fnu, (160, 256)),
    ("layers.2.attn.compressor.wkv.weight", torch.float32, (512, 5120)),
    ("layers.14.attn.compressor.wgate.weight", torch.float32, (512, 5120)),
    ("layers.20.attn.compressor.wkv.weight", torch.bfloat16, (512, 5120)),
    ("layers.8.attn.compressor.norm.weight", torch.bfloat16, (512,)),
    ("layers.36.attn.indexer.wq_b.weight", torch.float8_e4m3fn, (4096, 1280)),
    ("layers.36.attn.indexer.wq_b.scale", torch.float8_e8m0fnu, (128, 40)),
    ("layers.24.attn.indexer.weights_proj.weight", torch.bfloat16, (32, 5120)),
    ("layers.20.attn.indexer.wk.weight", torch.bfloat16, (128, 512)),
    ("layers.2.attn.indexer.k_norm.weight", torch.bfloat16, (128,)),
    ("layers.5.ffn.gate.weight", torch.bfloat16, (384, 5120)),
    ("layers.5.ffn.gate.bias", torch.float32, (384,)),
    ("layers.5.ffn.gate.bias_vl", torch.float32, (384,)),
    ("layers.5.ffn.experts.383.w1.weight", torch.float4_e2m1fn_x2, (2304, 2560)),
    ("layers.5.ffn.experts.0.w3.scale", torch.float8_e8m0fnu, (2304, 160)),
    ("layers.5.ffn.experts.17.w2.weight", torch.float4_e2m1fn_x2, (5120, 1152)),
    ("layers.5.ffn.experts.17.w2.scale", torch.float8_e8m0fnu, (5120, 72)),
    ("layers.5.ffn.shared_experts.w1.scale", torch.float8_e8m0fnu, (72, 160)),
    ("layers.5.ffn.shared_experts.w2.weight", torch.float8_e4m3fn, (5120, 2304)),
    ("layers.1.engram.q_weight", torch.bfloat16, (4, 5120)),
    ("layers.14.engram.k_weight", torch.bfloat16, (4, 5120)),
    ("layers.1.engram.embed.weight", torch.float8_e4m3fn, (384006168, 256)),
    ("layers.14.engram.embed.scale", torch.float8_e8m0fnu, (384016682, 8)),
    ("layers.1.engram.wkv.weight", torch.float8_e4m3fn, (25600, 6144)),
    ("layers.1.engram.wkv.scale", torch.float8_e8m0fnu, (800, 192)),
    ("vision.patch_embed.proj.weight", torch.bfloat16, (1024, 588)),
    ("vision.patch_embed.proj.bias", torch.bfloat16, (1024,)),
    ("vision.blocks.31.norm1.weight", torch.float32, (1024,)),
    ("vision.blocks.0.attn.wqkv.bias", torch.bfloat16, (3072,)),
    ("vision.blocks.0.attn.wo.weight", torch.bfloat16, (1024, 1024)),
    ("vision.blocks.0.mlp.w1.weight", torch.bfloat16, (5632, 1024)),
    ("vision.blocks.0.mlp.w2.weight", torch.bfloat16, (1024, 2816)),
    ("vision.norm.weight", torch.float32, (1024,)),
    ("aligner.w1.weight", torch.bfloat16, (5120, 9216)),
    ("aligner.w2.bias", torch.bfloat16, (5120,)),
]


@pytest.fixture(scope="module")
def released_meta_state():
    config = DeepseekV41Config(**_shipped("deepseek_v41_flash.json"))
    with torch.device("meta"):
        model = DeepseekV41Transformer(config)
    return {name: (t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("name,dtype,shape", RELEASED_TENSORS, ids=[r[0] for r in RELEASED_TENSORS])
def test_released_config_builds_checkpoint_tensors(released_meta_state, name, dtype, shape):
    assert released_meta_state[name] == (dtype, shape)


def test_released_layer_roles(released_meta_state):
    names = released_meta_state
    compressors = {int(n.split(".")[1]) for n in names if n.endswith("attn.compressor.wkv.weight")}
    gated = {int(n.split(".")[1]) for n in names if n.endswith("attn.compressor.wgate.weight")}
    indexers = {int(n.split(".")[1]) for n in names if n.endswith("attn.indexer.wq_b.weight")}
    index_keys = {int(n.split(".")[1]) for n in names if n.endswith("attn.indexer.wk.weight")}
    engrams = {int(n.split(".")[1]) for n in names if n.endswith("engram.q_weight")}
    assert compressors == {2, 8, 14, 20} and gated == {2, 8, 14}
    assert indexers == {2, 8, 14, 20, 24, 28, 32, 36} and index_keys == {2, 8, 14, 20}
    assert engrams == {1, 14}
    assert not any(n.endswith("wo_a.scale") for n in names)
    # The released checkpoint has 96,085 tensors, 2,401 of them the DSpark draft head's `mtp.*`
    # (3 blocks of 798, plus main_proj/scale, main_norm, norm, markov embed/head, confidence proj).
    # Not here: the 40 + 3 `wo_a.scale` folded into bf16 `wo_a`; added: `engram_hash.token_map`.
    assert {int(n.split(".")[1]) for n in names if n.startswith("mtp.")} == {0, 1, 2}
    assert sum(n.startswith("mtp.") for n in names) == 2401 - 3
    assert len(names) == 96085 - 40 - 3 + 1
