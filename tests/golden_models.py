"""The golden tiny models and their runs, as the test modules load them.

One place for what several test modules need: the config of a golden variant, its checkpoint in
module dtypes (golden README section 6, "Converting to module dtypes"), the whole
`DeepseekV41Transformer` with the Engram token map built from the variant's tokenizer, and the
tensors and prefill inputs of the golden runs (the VL run adds its two images from
`preprocess/patches_small`).

Loaded models are cached per process, keyed by (variant, numerics, device): tests that share a
model share one instance, so a test that changes a model's state must restore it.

This module does not set TRITON_INTERPRET: a test module that must interpret Triton kernels on
CPU sets it before importing this module (which imports the model); tests/test_gpu.py needs the
compiled kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config
from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import build_compressed_token_map
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41Transformer
from deepseek_v41_vl.modeling.image_spans_deepseek_v41_vl import llm_grid, parse_image_grid
from deepseek_v41_vl.modeling.numerics_deepseek_v41_vl import DeepseekV41Numerics, as_numerics
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import dequantize_fp8_weight
from deepseek_v41_vl.modeling.vision_deepseek_v41_vl import DeepseekV41VisionAligner, DeepseekV41VisionTransformer

VARIANTS = ("model_tiny_bf16", "model_tiny_fp8")
RUNS = ("vl", "text")
DECODE_STEPS = 12  # decode steps stored per golden run

_MODELS: dict[tuple[str, str, torch.device], DeepseekV41Transformer] = {}


def golden_config(golden: Path, variant: str, **overrides) -> DeepseekV41Config:
    """The variant's flat reference `config.json` as a `DeepseekV41Config` (overrides such as
    `numerics="exact"` passed to `from_reference_args`)."""
    return DeepseekV41Config.from_reference_args(golden / variant / "config.json", **overrides)


def golden_checkpoint(golden: Path, variant: str) -> dict[str, torch.Tensor]:
    """The variant's `model.safetensors` as stored (reference names and storage dtypes), on CPU."""
    return load_file(golden / variant / "model.safetensors")


def checkpoint_to_module_dtypes(
    checkpoint: dict[str, torch.Tensor], config: DeepseekV41Config
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> module dtypes: I8 experts viewed as packed fp4, `head` and ratio>1
    compressor weights to fp32, fp8 `wo_a` dequantized to bf16 with its block scale (dropped)."""
    ratios = config.text_config.compress_ratios
    out = {}
    for name, tensor in checkpoint.items():
        if name.endswith("attn.wo_a.scale"):
            continue
        if name.endswith("attn.wo_a.weight") and tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8_weight(tensor, checkpoint[name.removesuffix("weight") + "scale"])
        elif name == "head.weight" or (".attn.compressor.w" in name and ratios[int(name.split(".")[1])] > 1):
            tensor = tensor.float()
        elif tensor.dtype == torch.int8:
            tensor = tensor.view(torch.float4_e2m1fn_x2)
        out[name] = tensor
    return out


def load_golden_model(golden: Path, variant: str, numerics: str = "exact", device="cpu") -> DeepseekV41Transformer:
    """A fresh golden tiny model in eval mode, loaded strictly, then moved to `device`."""
    config = golden_config(golden, variant, numerics=numerics)
    model = DeepseekV41Transformer(config).eval()
    state = checkpoint_to_module_dtypes(golden_checkpoint(golden, variant), config)
    # the one tensor the checkpoint lacks: the Engram token map, built from the tokenizer
    token_map, _ = build_compressed_token_map(
        Tokenizer.from_file(str(golden / variant / "tokenizer.json")), config.text_config.engram_compressed_vocab_size
    )
    state["engram_hash.token_map"] = token_map
    model.load_state_dict(state, strict=True)
    device = torch.device(device)
    return model if device.type == "cpu" else model.to(device)


def golden_model(golden: Path, variant: str, numerics: str = "exact", device="cpu") -> DeepseekV41Transformer:
    """`load_golden_model`, cached per process by (variant, numerics, device)."""
    key = (variant, numerics, torch.device(device))
    if key not in _MODELS:
        _MODELS[key] = load_golden_model(golden, variant, numerics, device)
    return _MODELS[key]


def golden_run(golden: Path, variant: str, run: str, device="cpu") -> dict[str, torch.Tensor]:
    """The tensors of golden run `run` ("vl" or "text") of `variant`, on `device`."""
    return load_file(golden / variant / f"{run}.safetensors", device=str(torch.device(device)))


def prefill_inputs(golden: Path, variant: str, run: str, tensors: dict, device="cpu") -> dict:
    """Model inputs of the golden prefill of `run` (its `tensors` from `golden_run`), on `device`;
    the VL run adds `mm_token_type_ids`, its two images' `pixel_values` and `image_grid_thw`."""
    inputs = {"input_ids": tensors["input_ids"]}
    if run == "vl":
        device = torch.device(device)
        images = json.loads((golden / variant / "meta.json").read_text())["vl_run"]["images"]
        patches = load_file(golden / "preprocess" / "patches_small.safetensors", device=str(device))
        inputs["mm_token_type_ids"] = (tensors["token_types"] >= 0).long()
        inputs["pixel_values"] = torch.cat([patches[im["patches_key_in_preprocess_patches_small"]] for im in images])
        inputs["image_grid_thw"] = torch.tensor([[1, im["n_vit_h"], im["n_vit_w"]] for im in images], device=device)
    return inputs


def run_inputs(golden: Path, variant: str, run: str, device="cpu") -> tuple[dict, dict]:
    """(golden tensors of the run, model inputs of its prefill), both on `device`."""
    tensors = golden_run(golden, variant, run, device)
    return tensors, prefill_inputs(golden, variant, run, tensors, device)


class VisionTower(nn.Module):
    """The ViT and the aligner composed as `inference/model.py: Transformer.encode_image` runs
    them, for tests of the vision part alone (the golden `vision_tiny` checkpoint holds only
    `vision.*` and `aligner.*`). The VL model holds the same two modules as `model.vision` and
    `model.aligner`; this holder adds nothing to them.
    """

    def __init__(self, config, numerics: DeepseekV41Numerics | str = "fast"):
        super().__init__()
        self.config = config
        numerics = as_numerics(numerics)
        self.vision = DeepseekV41VisionTransformer(config, numerics)
        self.aligner = DeepseekV41VisionAligner(config, numerics)

    def llm_grids(self, image_grid_thw) -> list[tuple[int, int]]:
        return [llm_grid(h, w, self.config.downsample_ratio) for h, w in parse_image_grid(image_grid_thw)]

    def forward(self, pixel_values: torch.Tensor, image_grid_thw) -> torch.Tensor:
        return self.aligner(self.vision(pixel_values, image_grid_thw), image_grid_thw)
