"""Every conversion mode loads through the transformers Auto classes and runs the golden prompts.

The golden fp8 tiny checkpoint (`model_tiny_fp8`, official layout) is converted with
`convert_checkpoint` in the ``--text-only``, ``--dtype bf16`` and ``--link`` modes and loaded with
``from_pretrained(dst, numerics="exact")``. Text-only and link folders hold the same values as the
default conversion, so their prefill logits must equal the golden ones bit for bit; the bf16 folder
changes the arithmetic (see its test) and is held to the golden README's end-to-end bounds.
"""

from __future__ import annotations

import json
from pathlib import Path


import pytest
import torch
from safetensors.torch import load_file

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.conversion.convert import convert_checkpoint
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import (
    DeepseekV41ForCausalLM,
    DeepseekV41ForConditionalGeneration,
)
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import DeepseekV41Linear
from helpers import rel_l2
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor
from golden_bits import CHAIN_REL_L2, assert_golden

# The golden README, "Recommendations for comparing model_tiny tensors" (3): end to end without
# bit-exactness, prefill logits rel L2 ~0.03-0.05 and argmax agreement >= ~93%. The bounds leave
# headroom for the chaotic tiny model (its +-1 ulp probe alone moves fp8 logits by rel L2 0.053).
MAX_LOGITS_REL_L2 = 0.1
MIN_ARGMAX_AGREEMENT = 0.90


# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def text_run(golden) -> dict:
    return load_file(golden / "model_tiny_fp8" / "text.safetensors")


@pytest.fixture(scope="module")
def vl_run(golden, converted_tiny_fp8) -> dict:
    """The golden VL run through the processor of a default conversion, and its golden tensors."""
    processor = AutoProcessor.from_pretrained(converted_tiny_fp8)
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["vl_run"]
    images = [str(golden / im["file"]) for im in meta["images"]]
    inputs = processor(images=images, text=meta["prompt"], return_tensors="pt")
    tensors = load_file(golden / "model_tiny_fp8" / "vl.safetensors")
    assert torch.equal(inputs["input_ids"], tensors["input_ids"])
    return {"inputs": inputs, "tensors": tensors}


def test_text_only_conversion_gives_golden_text_logits_bit_for_bit(golden, text_run, tmp_path):
    dst = tmp_path / "text_only"
    convert_checkpoint(golden / "model_tiny_fp8", dst, text_only=True, progress=False)
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["DeepseekV41ForCausalLM"]
    lm = AutoModelForCausalLM.from_pretrained(dst, numerics="exact")
    assert type(lm) is DeepseekV41ForCausalLM and not lm.model.vision_enabled
    assert not any(name.startswith(("model.vision.", "model.aligner.")) for name in lm.state_dict())
    with torch.no_grad():
        full = lm(text_run["input_ids"], use_cache=False, logits_to_keep=0).logits
        last = lm(text_run["input_ids"], use_cache=False, logits_to_keep=1).logits
    assert full.shape == text_run["prefill.logits"].shape  # [B, S, V]
    assert_golden(full, text_run["prefill.logits"], "text prefill logits", rel_l2=CHAIN_REL_L2)
    # logits_to_keep=1 (generate's path) runs the head as a GEMM over [B, D], as the reference's
    # decode does: other fp32 rounding than the [B, S, D] head of the golden full-logit run
    assert last.shape[1] == 1
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def test_a_folder_without_vision_weights_never_loads_a_random_tower(golden, tmp_path):
    # robustness: a config.json without vision_config (the released tower) over text-only weights
    # loaded into AutoModelForImageTextToText with a random 32-block tower, silently
    dst = tmp_path / "text_only"
    convert_checkpoint(golden / "model_tiny_fp8", dst, text_only=True, progress=False)
    config = json.loads((dst / "config.json").read_text())
    del config["vision_config"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(DeepseekV41ModelError, match=r"holds no weights for \d+ vision tensors? .*AutoModelForCausalLM"):
        AutoModelForImageTextToText.from_pretrained(dst)
    lm, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)  # the text model loads
    assert not lm.model.vision_enabled and not info["missing_keys"]


def test_bf16_conversion_is_within_the_golden_end_to_end_bounds(golden, vl_run, tmp_path):
    """A ``--dtype bf16`` folder cannot be bit-exact with the fp8 golden, although its weights are
    the exact dequantized values (power-of-two e8m0 scales): the reference's fp8 linear quantizes
    its ACTIVATIONS to fp8 per 128-wide block (`act_quant`) and accumulates in fp32 per 32-wide K
    block with the weight scale applied per block (`fp8_gemm`), while a bf16 linear multiplies the
    unquantized bf16 activations. Those rounding differences are amplified by the chaotic tiny
    model (fp8/fp4 KV fake-quantization, bf16 indexer top-k, discrete routing), so the check is the
    golden README's end-to-end recommendation: prefill logits rel L2 and argmax agreement."""
    dst = tmp_path / "bf16"
    convert_checkpoint(golden / "model_tiny_fp8", dst, dtype="bf16", progress=False)
    model = AutoModelForImageTextToText.from_pretrained(dst, numerics="exact")
    assert type(model) is DeepseekV41ForConditionalGeneration
    linears = [m for m in model.modules() if isinstance(m, DeepseekV41Linear)]
    assert linears and not any(m.is_quantized for m in linears)
    assert torch.float8_e4m3fn not in {p.dtype for n, p in model.named_parameters() if "engram" not in n}
    assert torch.float4_e2m1fn_x2 not in {p.dtype for p in model.parameters()}
    want = vl_run["tensors"]["prefill.logits"]
    with torch.no_grad():
        got = model(**vl_run["inputs"], use_cache=False).logits
    assert got.shape == want.shape
    assert not torch.equal(got, want)  # the arithmetic did change: the bounds below are not vacuous
    rel = rel_l2(got, want)
    agreement = float((got.argmax(-1) == want.argmax(-1)).double().mean())
    assert rel < MAX_LOGITS_REL_L2, f"prefill logits rel L2 {rel:.4f}"
    assert agreement >= MIN_ARGMAX_AGREEMENT, f"prefill argmax agreement {agreement:.3f}"


@pytest.fixture(scope="module")
def link_dir(golden, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("link") / "tiny_fp8_link"
    convert_checkpoint(golden / "model_tiny_fp8", dst, link=True, progress=False)
    return dst


def test_link_folder_loads_and_gives_golden_vl_logits_bit_for_bit(link_dir, vl_run):
    index = json.loads((link_dir / "model.safetensors.index.json").read_text())
    assert index["metadata"]["layout"] == "official"
    assert "layers.0.attn.wo_a.scale" in index["weight_map"]  # official names: the load-time transform is needed
    model, info = AutoModelForImageTextToText.from_pretrained(link_dir, numerics="exact", output_loading_info=True)
    assert type(model) is DeepseekV41ForConditionalGeneration
    assert not any(info.values()), info  # the wo_a scales are consumed by the load-time transform, not left over
    # wo_a is fp8 + scale in the source and dequantized bf16 in the model
    assert model.model.layers[0].attn.wo_a.weight.dtype == torch.bfloat16
    assert {torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.float8_e8m0fnu} <= {p.dtype for p in model.parameters()}
    assert int(model.model.engram_hash.token_map.min()) >= 0
    with torch.no_grad():
        out = model(**vl_run["inputs"], use_cache=False)
    assert_golden(out.logits, vl_run["tensors"]["prefill.logits"], "VL prefill logits", rel_l2=CHAIN_REL_L2)


def test_link_folder_refuses_a_device_map(link_dir):
    with pytest.raises(DeepseekV41ModelError, match="--link folder"):
        AutoModelForImageTextToText.from_pretrained(link_dir, device_map="meta")
