"""`from_pretrained` of a folder that lacks some weights follows transformers: each missing weight is
initialized by `_init_weights` (fp8 / fp4 storage with valid codes and e8m0 scales, never the bytes
`torch.empty` left) and reported (``missing_keys``, the loading report), and the model runs. It
refuses, with the reason, only where a random value would be silently wrong: a vision tensor of a
model with a vision tower, the Engram token map beside loaded Engram tables, and one half of a
quantized (weight, scale) pair beside its loaded other half (a pair missing whole is initialized).

Each case is a copy of the converted golden tiny folder (fp8 linears, packed fp4 experts, fp8
Engram tables, a vision tower) with some tensors left out of its safetensors file. The last tests
replay transformers' `test_can_init_all_missing_weights` on the text class.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel, set_seed
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError
from deepseek_v41_vl.modeling.load_checks_deepseek_v41_vl import (
    E8M0_FIRST_REFUSED,
    nonfinite_mask,
    refuse_a_half_loaded_pair,
)
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import (
    DeepseekV41ForCausalLM,
    DeepseekV41ForConditionalGeneration,
)
from deepseek_v41_vl.modeling.quantization_deepseek_v41_vl import (
    DeepseekV41Linear,
    DeepseekV41QuantizationError,
    e8m0_scale_byte,
    init_quantized_storage,
    unpack_fp4,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEIGHTS = "model.safetensors"
INPUT_IDS = torch.tensor([[0, 5, 17, 33, 99, 7, 8, 9]])
TOKEN_MAP = "model.engram_hash.token_map"
ENGRAM_TABLES = [f"model.layers.{i}.engram.embed.{p}" for i in (1, 5) for p in ("weight", "scale")]

# case -> the tensors left out of the folder; each is initialized, reported and the model runs
# (a quantized weight always with its scale: a pair missing whole)
CASES = {
    "linears, an expert, a norm and the head": [
        "model.layers.2.attn.wq_a.weight",  # fp8, with its scale
        "model.layers.2.attn.wq_a.scale",
        "model.layers.2.attn.wo_a.weight",  # bf16
        "model.layers.2.attn_norm.weight",
        "model.head.weight",
        "model.layers.2.ffn.experts.3.w1.weight",  # packed fp4, with its scale
        "model.layers.2.ffn.experts.3.w1.scale",
    ],
    "the gate, the sink, the mHC and an Engram table": [
        "model.layers.4.ffn.gate.bias",
        "model.layers.4.attn.attn_sink",
        "model.layers.4.hc_ffn_fn",
        "model.layers.4.hc_ffn_scale",
        "model.layers.1.engram.embed.weight",
        "model.layers.1.engram.embed.scale",
    ],
}


@pytest.fixture(scope="module")
def saved(converted_tiny_fp8) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """The converted tiny folder, its tensors and its safetensors metadata."""
    with safe_open(str(converted_tiny_fp8 / WEIGHTS), framework="pt") as f:
        return converted_tiny_fp8, {key: f.get_tensor(key) for key in f.keys()}, f.metadata()


def _folder_without(saved, dst: Path, names: list[str]) -> Path:
    """A copy of the saved folder (links) whose safetensors file lacks the tensors `names`."""
    src, tensors, metadata = saved
    missing = set(names) - set(tensors)
    assert not missing, missing
    dst.mkdir()
    for path in src.iterdir():
        if path.name != WEIGHTS:
            (dst / path.name).symlink_to(path.resolve())
    save_file({k: v for k, v in tensors.items() if k not in names}, str(dst / WEIGHTS), metadata=metadata)
    return dst


def _tensor(model, name: str) -> torch.Tensor:
    module, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module), leaf)


def _without_indices(text: str) -> str:
    return re.sub(r"\{[\d, ]+\}|\d+", "N", text)


def _valid(tensor: torch.Tensor) -> bool:
    """No NaN / Inf value nor refused code (the load check's rule); packed fp4 codes are all finite."""
    if tensor.dtype == torch.float4_e2m1fn_x2 or not (tensor.is_floating_point() or tensor.dtype.itemsize == 1):
        return True
    return not bool(nonfinite_mask(tensor, tensor.dtype).any())


def _check_fresh_values(model, name: str) -> None:
    """The value `_init_weights` gives `name`: the documented draw, not what `torch.empty` left."""
    tensor = _tensor(model, name).detach()
    std = model.config.text_config.initializer_range
    assert _valid(tensor), name
    if tensor.dtype == torch.float8_e8m0fnu:
        assert bool((tensor.view(torch.uint8) == e8m0_scale_byte(std)).all()), name
    elif tensor.dtype == torch.float8_e4m3fn:
        values = tensor.float()
        assert values.abs().max() < 8 and 0.8 < values.std() < 1.2, name  # N(0, 1) codes
    elif tensor.dtype == torch.float4_e2m1fn_x2:
        values = unpack_fp4(tensor)
        assert 0.7 < values.std() < 1.3, name  # N(0, 1) rounded to E2M1
    elif name.endswith(("norm.weight", "hc_ffn_scale")):
        assert bool((tensor == 1).all()), name
    elif name.endswith(("gate.bias", "attn_sink")):
        assert bool((tensor == 0).all()), name
    else:
        assert 0.5 * std < float(tensor.float().std()) < 2 * std, name


def _check_loaded_bytes_kept(model, tensors: dict[str, torch.Tensor], missing: list[str]) -> None:
    """Every tensor the folder held keeps its bytes (packed fp4 viewed, nothing drawn again)."""
    state = model.state_dict()
    changed = [
        name for name, stored in tensors.items()
        if name not in missing and name in state
        and not torch.equal(state[name].contiguous().view(torch.uint8), stored.contiguous().view(torch.uint8))
    ]
    assert changed == []


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_weight_is_initialized_reported_and_runs(saved, tmp_path, case):
    names = CASES[case]
    folder = _folder_without(saved, tmp_path / "folder", names)
    with CaptureLogger(hf_logging.get_logger("transformers.modeling_utils")) as report:
        model, info = AutoModelForImageTextToText.from_pretrained(folder, numerics="exact", output_loading_info=True)
    assert set(info["missing_keys"]) == set(names)
    for name in names:  # the loading report names it (layer indices may be grouped: "layers.{1, 5}")
        assert _without_indices(name) in _without_indices(report.out), name
        _check_fresh_values(model, name)
    _check_loaded_bytes_kept(model, saved[1], names)
    with torch.no_grad():
        logits = model(input_ids=INPUT_IDS).logits
    assert bool(torch.isfinite(logits).all())


def test_the_text_class_initializes_missing_weights_too(saved, tmp_path):
    names = CASES["linears, an expert, a norm and the head"]
    folder = _folder_without(saved, tmp_path / "folder", names)
    model, info = AutoModelForCausalLM.from_pretrained(folder, numerics="exact", output_loading_info=True)
    assert isinstance(model, DeepseekV41ForCausalLM)
    assert set(info["missing_keys"]) == set(names)
    for name in names:
        _check_fresh_values(model, name)
    _check_loaded_bytes_kept(model, saved[1], names)
    with torch.no_grad():
        assert bool(torch.isfinite(model(input_ids=INPUT_IDS).logits).all())


def test_a_token_map_missing_with_every_engram_table_gets_the_stand_in(saved, tmp_path):
    names = ENGRAM_TABLES + [TOKEN_MAP]
    folder = _folder_without(saved, tmp_path / "folder", names)
    model, info = AutoModelForCausalLM.from_pretrained(folder, numerics="exact", output_loading_info=True)
    assert set(info["missing_keys"]) == set(names)
    for name in ENGRAM_TABLES:
        _check_fresh_values(model, name)
    hasher = model.model.engram_hash
    ids = torch.arange(hasher.token_map.numel())
    assert torch.equal(hasher.token_map, ids % hasher.layout.compressed_vocab_size)
    with torch.no_grad():
        assert bool(torch.isfinite(model(input_ids=INPUT_IDS).logits).all())


def test_a_token_map_missing_beside_loaded_engram_tables_is_refused(saved, tmp_path):
    folder = _folder_without(saved, tmp_path / "folder", [TOKEN_MAP])
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        with pytest.raises(DeepseekV41ModelError, match=r"no model\.engram_hash\.token_map") as raised:
            auto.from_pretrained(folder)
        assert "rows trained for other n-grams" in str(raised.value)
        assert "without any error" in str(raised.value)


def test_a_missing_vision_tensor_is_refused_by_the_image_text_class(saved, tmp_path):
    folder = _folder_without(saved, tmp_path / "folder", ["model.vision.norm.weight", "model.image_newline"])
    with pytest.raises(DeepseekV41ModelError, match=r"no weights for 2 vision tensors") as raised:
        AutoModelForImageTextToText.from_pretrained(folder)
    assert "silently wrong" in str(raised.value)
    # the text class has no vision tower: the folder loads, nothing is missing
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert set(info["missing_keys"]) == set()


# case -> the half of a quantized pair left out of the folder, and the half the folder holds
HALF_PAIRS = {
    "an fp8 linear's scale": ("model.layers.3.attn.wkv.scale", "model.layers.3.attn.wkv.weight"),
    "a packed fp4 expert's weight": ("model.layers.2.ffn.experts.3.w1.weight", "model.layers.2.ffn.experts.3.w1.scale"),
    "an Engram table's scale": ("model.layers.5.engram.embed.scale", "model.layers.5.engram.embed.weight"),
}


@pytest.mark.parametrize("case", list(HALF_PAIRS))
def test_half_a_quantized_pair_is_refused(saved, tmp_path, case):
    lacked, held = HALF_PAIRS[case]
    folder = _folder_without(saved, tmp_path / "folder", [lacked])
    refused = r"holds only one half of 1 quantized \(weight, e8m0 scale\) pairs"
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        with pytest.raises(DeepseekV41ModelError, match=refused) as raised:
            auto.from_pretrained(folder)
        message = str(raised.value)
        assert f"({held} without {lacked})" in message, message
        assert "must come from one checkpoint" in message and "silently wrong" in message


def test_a_mismatched_half_of_a_pair_is_refused_too():
    # `ignore_mismatched_sizes=True` initializes a tensor stored at another shape, like a missing one
    layer = torch.nn.Sequential(DeepseekV41Linear(64, 64, "fp8"))
    refuse_a_half_loaded_pair(layer, {"missing_keys": {"0.weight", "0.scale"}}, None)  # missing whole: fine
    with pytest.raises(DeepseekV41ModelError, match=r"\(0\.scale without 0\.weight\)"):
        info = {"missing_keys": set(), "mismatched_keys": {("0.weight", (64, 32), (64, 64))}}
        refuse_a_half_loaded_pair(layer, info, None)


def test_init_quantized_storage_fills_only_unflagged_tensors():
    std = 0.02
    weight = torch.zeros(64, 32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    scale = torch.zeros(64, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    scale._is_hf_initialized = True  # loaded: kept
    init_quantized_storage(weight, scale, std)
    assert bool((scale.view(torch.uint8) == 0).all())
    assert bool(weight.view(torch.uint8).any())
    assert e8m0_scale_byte(std) == 127 - 6  # 2^-6 is the power of two nearest 0.02
    assert e8m0_scale_byte(0.0) == 0 and e8m0_scale_byte(1e60) == E8M0_FIRST_REFUSED - 1
    with pytest.raises(DeepseekV41QuantizationError, match="e8m0 scale"):
        init_quantized_storage(torch.zeros(4, 4, dtype=torch.bfloat16), scale, std)


@pytest.mark.parametrize("std", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_std_is_refused_before_anything_is_written(std):
    weight = torch.zeros(64, 32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    scale = torch.zeros(64, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(DeepseekV41QuantizationError, match="must be a finite number"):
        e8m0_scale_byte(std)
    with pytest.raises(DeepseekV41QuantizationError, match="must be a finite number"):
        init_quantized_storage(weight, scale, std)
    assert not weight.view(torch.uint8).any() and not scale.view(torch.uint8).any()


# ----------------------------------------------------------------------------------------------
# transformers' `ModelTesterMixin.test_can_init_all_missing_weights`, on the tiny config
# ----------------------------------------------------------------------------------------------


def _from_config_and_from_nothing(model_class, config):
    """`model_class(config)` and `from_pretrained(None, config=config, state_dict={})`, each module's
    `_init_weights` seeded the same (as the transformers test patches it)."""
    original = PreTrainedModel._initialize_weights

    def seeded(self, module, *args, **kwargs):
        set_seed(0)
        original(self, module, *args, **kwargs)

    PreTrainedModel._initialize_weights = seeded
    try:
        from_config = model_class(copy.deepcopy(config))
        from_nothing = model_class.from_pretrained(None, config=config, state_dict={})
    finally:
        PreTrainedModel._initialize_weights = original
    return from_config, from_nothing


def test_can_init_all_missing_weights(converted_tiny_fp8):
    config = AutoConfig.from_pretrained(converted_tiny_fp8)
    from_config, from_nothing = _from_config_and_from_nothing(DeepseekV41ForCausalLM, config)
    assert [k for k, v in from_nothing.named_parameters() if v.device.type == "meta"] == []
    state, again = from_config.state_dict(), from_nothing.state_dict()
    assert list(state) == list(again)
    buffers = {name for name, _ in from_config.named_buffers()}
    different = [k for k in state if k not in buffers and not re.search(r"\.parametrizations\.", k) and not (state[k] == again[k]).all()]
    assert different == [], f"not handled by _init_weights: {different[:10]}"
    # every stored value valid (quantized storage included), the stand-in token map, a forward
    assert [k for k, v in again.items() if not _valid(v)] == []
    assert torch.equal(again[TOKEN_MAP], state[TOKEN_MAP])
    with torch.no_grad():
        assert bool(torch.isfinite(from_nothing(input_ids=INPUT_IDS).logits).all())


def test_init_all_missing_weights_of_the_image_text_class_is_refused(converted_tiny_fp8):
    config = AutoConfig.from_pretrained(converted_tiny_fp8)
    with pytest.raises(DeepseekV41ModelError, match="the state dict given holds no weights for .* vision tensors?"):
        DeepseekV41ForConditionalGeneration.from_pretrained(None, config=config, state_dict={})
