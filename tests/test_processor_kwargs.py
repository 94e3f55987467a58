"""transformers' standard processor / image-processor keyword arguments.

The image processor takes transformers' standard image options (`do_rescale`, `rescale_factor`,
`do_normalize`, `do_convert_rgb`, `input_data_format`) where they describe the reference's fixed
pipeline (RGB, x / 255, (x - mean) / std) and refuses, by name, any value that would change the
pixels. The processor's `padding_side` is a call option whose default is the tokenizer's
`padding_side` (one setting, not an init argument beside a call option). The tests named after
transformers' `ProcessorTesterMixin` / `ImageProcessingTestMixin` checks port what those check,
with values that keep the pixels bit-identical.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer
from transformers.image_utils import ChannelDimension

from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ProcessingError, DeepseekV41ProcessorError
from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor
from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor
from deepseek_v41_vl.processing.tokenizer_deepseek_v41_vl import load_deepseek_v41_tokenizer

PLACEHOLDER = "<｜deepseek_image｜>"
AGREEING = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}
# (option, value) pairs that would change the pixels of the reference's fixed pipeline
BIT_CHANGING = [
    ("do_rescale", False),
    ("rescale_factor", -1),
    ("rescale_factor", 1 / 256),
    ("rescale_factor", float(np.float32(1 / 255))),
    ("do_normalize", False),
    ("do_convert_rgb", False),
    ("do_rescale", "yes"),
]


def _image(width=40, height=30, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def image_processor():
    return DeepseekV41ImageProcessor(max_image_tokens=64)


@pytest.fixture(scope="module")
def processor():
    image_processor = DeepseekV41ImageProcessor(max_image_tokens=64)
    return DeepseekV41Processor(image_processor=image_processor, tokenizer=load_deepseek_v41_tokenizer())


@pytest.fixture(scope="module")
def saved(tmp_path_factory, processor):
    path = tmp_path_factory.mktemp("processor")
    processor.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# Image processor: standard options.
# ---------------------------------------------------------------------------------------------


def test_agreeing_standard_options_keep_the_bits(image_processor):
    image = _image()
    want = image_processor(image, return_tensors="pt")
    got = image_processor(image, return_tensors="pt", input_data_format="channels_last", **AGREEING)
    built = DeepseekV41ImageProcessor(max_image_tokens=64, **AGREEING)(image, return_tensors="pt")
    nones = image_processor(image, return_tensors="pt", **{key: None for key in [*AGREEING, "input_data_format"]})
    for out in (got, built, nones):
        assert torch.equal(out["pixel_values"], want["pixel_values"])
        assert torch.equal(out["image_grid_thw"], want["image_grid_thw"])
    for key, value in AGREEING.items():
        assert getattr(image_processor, key) == value and image_processor.to_dict()[key] == value


@pytest.mark.parametrize(("name", "value"), BIT_CHANGING)
def test_bit_changing_standard_options_are_refused_by_name(image_processor, name, value):
    with pytest.raises(DeepseekV41ProcessingError, match=rf"{name}={value!r}"):
        image_processor(_image(), return_tensors="pt", **{name: value})
    with pytest.raises(DeepseekV41ProcessingError, match=rf"{name}={value!r}"):
        DeepseekV41ImageProcessor(**{name: value})
    with pytest.raises(DeepseekV41ProcessingError, match=rf"{name}={value!r}"):
        DeepseekV41ImageProcessor.from_dict(DeepseekV41ImageProcessor().to_dict(), **{name: value})


def test_a_saved_config_with_a_bit_changing_option_is_refused(tmp_path):
    DeepseekV41ImageProcessor().save_pretrained(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "do_normalize": False}))
    with pytest.raises(DeepseekV41ProcessingError, match="do_normalize=False"):
        DeepseekV41ImageProcessor.from_pretrained(tmp_path)


def test_input_data_format_names_the_array_layout(image_processor):
    # An [H, W, C] array with H == 3: the first axis would be taken for the channels.
    array = np.random.default_rng(1).integers(0, 256, size=(3, 50, 3), dtype=np.uint8)
    want = image_processor(Image.fromarray(array), return_tensors="pt")
    for layout in ("channels_last", ChannelDimension.LAST):
        got = image_processor(array, return_tensors="pt", input_data_format=layout)
        assert torch.equal(got["pixel_values"], want["pixel_values"])
    first = image_processor(np.moveaxis(array, -1, 0), return_tensors="pt", input_data_format="channels_first")
    assert torch.equal(first["pixel_values"], want["pixel_values"])
    tensor = torch.from_numpy(np.moveaxis(array, -1, 0).copy())
    torch_first = image_processor(tensor, input_data_format=ChannelDimension.FIRST)
    assert np.array_equal(torch_first["pixel_values"], want["pixel_values"].numpy())
    with pytest.raises(DeepseekV41ProcessingError, match="input_data_format='channels_first'"):
        image_processor(Image.fromarray(array), input_data_format="channels_first")
    with pytest.raises(DeepseekV41ProcessingError, match="input_data_format='channels_first'.*50"):
        image_processor(array.transpose(1, 0, 2), input_data_format="channels_first")  # 50 "channels"
    with pytest.raises(DeepseekV41ProcessingError, match="input_data_format='hwc'"):
        image_processor(array, input_data_format="hwc")


def test_image_processor_from_dict_with_kwargs_has_attributes(tmp_path):
    kwargs = {**AGREEING, "max_image_tokens": 16, "pad_color": (0, 0, 0)}
    loaded = DeepseekV41ImageProcessor.from_dict(DeepseekV41ImageProcessor().to_dict(), **kwargs)
    for key, value in kwargs.items():
        assert getattr(loaded, key) == value, key
    loaded.save_pretrained(tmp_path)
    again = DeepseekV41ImageProcessor.from_pretrained(tmp_path)
    assert again.to_dict() == loaded.to_dict()
    assert again.rescale_factor == 1 / 255


# ---------------------------------------------------------------------------------------------
# Processor.
# ---------------------------------------------------------------------------------------------


def test_init_arguments_not_in_processor_kwargs():
    """No `__init__` argument is also a call option: each setting has one place."""
    from deepseek_v41_vl.processing.processing_deepseek_v41_vl import _CALL_OPTIONS
    from transformers.processing_utils import ImagesKwargs, TextKwargs

    call_options = set(_CALL_OPTIONS) | set(TextKwargs.__annotations__) | set(ImagesKwargs.__annotations__)
    call_options |= set(DeepseekV41ImageProcessor.valid_kwargs.__annotations__)
    parameters = inspect.signature(DeepseekV41Processor.__init__).parameters
    init_arguments = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    init_arguments -= {"self", *DeepseekV41Processor.get_attributes(), "chat_template"}
    assert init_arguments and not init_arguments & call_options, init_arguments & call_options


def test_padding_side_is_the_tokenizers_setting(processor):
    assert processor.tokenizer.padding_side == "left" and processor.padding_side == "left"
    texts = ["a", "a b c d"]
    left = processor(text=texts, return_tensors="pt")
    assert left["attention_mask"][0].tolist()[0] == 0
    right = processor(text=texts, return_tensors="pt", padding_side="right")
    assert right["attention_mask"][0].tolist()[-1] == 0
    # A tokenizer built with a side keeps it; the processor pads on it by default.
    chosen = load_deepseek_v41_tokenizer()
    chosen.padding_side = "right"
    chosen.init_kwargs["padding_side"] = "right"
    other = DeepseekV41Processor(tokenizer=chosen)
    assert other.padding_side == "right"
    assert torch.equal(other(text=texts, return_tensors="pt")["input_ids"], right["input_ids"])
    with pytest.raises(DeepseekV41ProcessorError, match="padding_side is a call option"):
        DeepseekV41Processor(tokenizer=load_deepseek_v41_tokenizer(), padding_side="right")
    with pytest.raises(DeepseekV41ProcessorError, match="padding_side must be 'left' or 'right'"):
        processor(text=texts, padding_side="middle")


def test_saved_padding_side_is_read_back(saved, tmp_path):
    assert DeepseekV41Processor.from_pretrained(saved).padding_side == "left"
    assert DeepseekV41Processor.from_pretrained(saved, padding_side="right").padding_side == "right"
    # a folder written when padding_side was a processor setting: its value is honoured
    for name in ("processor_config.json", "tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        if (saved / name).is_file():
            (tmp_path / name).write_bytes((saved / name).read_bytes())
    config = json.loads((tmp_path / "processor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps({**config, "padding_side": "right"}))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tokenizer_config.pop("padding_side", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    legacy = DeepseekV41Processor.from_pretrained(tmp_path)
    assert legacy.padding_side == "right" and legacy.tokenizer.padding_side == "right"


def test_standard_image_options_reach_the_image_processor(processor):
    image, text = _image(), f"look {PLACEHOLDER}"
    want = processor(text=text, images=[image], return_tensors="pt")
    got = processor(text=text, images=[image], return_tensors="pt", input_data_format="channels_last", **AGREEING)
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    with pytest.raises(DeepseekV41ProcessingError, match="rescale_factor=-1"):
        processor(text=text, images=[image], return_tensors="pt", do_rescale=True, rescale_factor=-1)
    with pytest.raises(DeepseekV41ProcessorError, match="do_normalize"):
        processor(text=text, images=[image], images_kwargs={"do_normalize": True}, do_normalize=False)


def test_structured_kwargs_nested_from_dict(processor):
    image, text = _image(), f"lower newer {PLACEHOLDER}"
    all_kwargs = {
        "common_kwargs": {"return_tensors": "pt"},
        "images_kwargs": {"do_rescale": True, "rescale_factor": 1 / 255},
        "text_kwargs": {"padding": "max_length", "max_length": 176},
    }
    inputs = processor(text=text, images=image, **all_kwargs)
    assert inputs["input_ids"].shape[-1] == 176
    assert torch.equal(inputs["pixel_values"], processor.image_processor(image, return_tensors="pt")["pixel_values"])


def test_subprocessor_defaults_preserved_by_kwargs(saved):
    """Settings the components were built with are the defaults of a processor call."""
    image_processor = DeepseekV41ImageProcessor.from_pretrained(saved, max_image_tokens=16)
    tokenizer = AutoTokenizer.from_pretrained(saved, max_length=117, padding="max_length")
    processor = DeepseekV41Processor(image_processor=image_processor, tokenizer=tokenizer)
    inputs = processor(text=f"lower newer {PLACEHOLDER}", images=_image(), return_tensors="pt")
    assert inputs["input_ids"].shape[-1] == 117
    assert torch.equal(inputs["pixel_values"], image_processor(_image(), return_tensors="pt")["pixel_values"])
    # a call option still wins over the component's default
    assert processor(text="lower newer", return_tensors="pt", max_length=50)["input_ids"].shape[-1] == 50


def test_save_load_pretrained_additional_features(saved):
    processor = DeepseekV41Processor.from_pretrained(saved, max_image_tokens=16, padding_side="right", **AGREEING)
    assert processor.image_processor.max_image_tokens == 16
    for key, value in AGREEING.items():
        assert getattr(processor.image_processor, key) == value
    assert processor.tokenizer.padding_side == "right"
    with pytest.raises(DeepseekV41ProcessingError, match="do_normalize=False"):
        DeepseekV41Processor.from_pretrained(saved, do_normalize=False)
