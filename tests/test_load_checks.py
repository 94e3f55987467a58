"""What `from_pretrained` refuses in a model folder: weights holding NaN / Inf (named), and config
values of the wrong type (named as `text_config.<key>`), each instead of a silent NaN model or a
bare TypeError / AttributeError. Each case is a copy of the converted golden tiny folder with one
thing broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForImageTextToText

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config, DeepseekV41ConfigError
from deepseek_v41_vl.modeling.load_checks_deepseek_v41_vl import DeepseekV41NonFiniteWeightError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WEIGHTS = "model.safetensors"


def _copy(src: Path, dst: Path, skip: tuple[str, ...]) -> Path:
    """`dst` with links to every file of `src` but those in `skip` (written by the caller)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.name not in skip:
            (dst / path.name).symlink_to(path.resolve())
    return dst


def _with_weights_changed(src: Path, dst: Path, name: str, change) -> Path:
    """A copy of `src` whose tensor `name` went through `change` (in place, on its bytes or values)."""
    _copy(src, dst, (WEIGHTS,))
    with safe_open(str(src / WEIGHTS), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata()
    assert name in tensors, sorted(tensors)[:20]
    change(tensors[name])
    save_file(tensors, str(dst / WEIGHTS), metadata=metadata)
    return dst


def _with_config_changed(src: Path, dst: Path, change) -> Path:
    _copy(src, dst, ("config.json",))
    config = json.loads((src / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _set_value(value):
    def change(tensor):
        tensor.view(-1)[3] = value

    return change


def _set_byte(code: int):
    def change(tensor):
        tensor.view(torch.uint8).view(-1)[3] = code

    return change


@pytest.mark.parametrize(
    "name, change, what",
    [
        ("model.head.weight", _set_value(float("nan")), "NaN / Inf"),  # fp32
        ("model.embed.weight", _set_value(float("-inf")), "NaN / Inf"),  # bf16
        ("model.layers.0.attn.wq_a.scale", _set_byte(0xFF), "e8m0 scale bytes of 0xF7 or more"),
        ("model.layers.1.ffn.experts.0.w1.scale", _set_byte(0xFF), "e8m0 scale bytes of 0xF7 or more"),  # an fp4 expert's
        ("model.layers.0.attn.wq_a.scale", _set_byte(0xFE), "e8m0 scale bytes of 0xF7 or more"),  # 2^127: Inf weights
        ("model.layers.0.attn.wq_a.weight", _set_byte(0x7F), "e4m3 NaN codes"),
        ("model.layers.0.attn.wq_a.weight", _set_byte(0xFF), "e4m3 NaN codes"),
    ],
)
def test_from_pretrained_refuses_a_non_finite_weight_and_names_it(converted_tiny_fp8, tmp_path, name, change, what):
    folder = _with_weights_changed(converted_tiny_fp8, tmp_path / "corrupt", name, change)
    with pytest.raises(DeepseekV41NonFiniteWeightError, match=rf"^{name} in .*holds 1 {what}") as caught:
        AutoModelForImageTextToText.from_pretrained(folder)
    assert "check_finite=False" in str(caught.value)


def test_check_finite_false_loads_the_corrupt_folder_and_greedy_picks_token_0(converted_tiny_fp8, tmp_path):
    # why the check exists: nothing else notices; one NaN in the head's row 0 and greedy emits token 0
    folder = _with_weights_changed(converted_tiny_fp8, tmp_path / "corrupt", "model.head.weight", _set_value(float("nan")))
    model = AutoModelForImageTextToText.from_pretrained(folder, check_finite=False)
    with torch.no_grad():
        logits = model(torch.tensor([[0, 10, 11, 12]]), use_cache=False).logits
    assert bool(logits[..., 0].isnan().all()) and logits.argmax(-1).eq(0).all()


def test_a_finite_folder_loads_with_the_check(converted_tiny_fp8):
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8)
    assert model.model.head.weight.isfinite().all()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["text_config"].update(num_hidden_layers="abc"), r"text_config\.num_hidden_layers must be an integer, got 'abc'"),
        (lambda c: c["text_config"].update(hidden_size=None), r"text_config\.hidden_size must be an integer, got None"),
        (lambda c: c["text_config"].update(compress_ratios=[0, "a"]), r"text_config\.compress_ratios must be a list of integers"),
        (lambda c: c["text_config"].update(rms_norm_eps="small"), r"text_config\.rms_norm_eps must be a number"),
        (lambda c: c["vision_config"].update(patch_size=14.5), r"vision_config\.patch_size must be an integer"),
        (lambda c: c.update(text_config="x"), r"text_config must be a mapping of its settings, got 'x'"),
        (lambda c: c.update(vision_config=[1, 2]), r"vision_config must be a mapping of its settings"),
        (lambda c: c.update(image_token_id="129264"), r"config\.image_token_id must be an integer"),
    ],
)
def test_from_pretrained_names_a_config_value_of_the_wrong_type(converted_tiny_fp8, tmp_path, change, message):
    folder = _with_config_changed(converted_tiny_fp8, tmp_path / "bad_config", change)
    with pytest.raises(DeepseekV41ConfigError, match=message):
        AutoModelForImageTextToText.from_pretrained(folder)
    with pytest.raises(DeepseekV41ConfigError, match=message):
        AutoConfig.from_pretrained(folder)


def test_the_config_types_accept_the_released_and_tiny_configs():
    # what the checks must never refuse: the shipped configs, ints where floats are declared
    for path in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.json")):
        DeepseekV41Config(**json.loads(path.read_text()))
    config = DeepseekV41Config(text_config={"rope_theta": 10000, "gate_temp": 1}, vision_config={"max_wh_ratio": None})
    assert config.text_config.rope_theta == 10000
