"""A resized head survives `post_init`, and dtype casts keep each module's storage (issue [polish]
items 1 and 4).

1. transformers' `test_resize_embeddings_untied_no_reinit_on_post_init`: after
   `resize_token_embeddings(n)`, `post_init()` must not re-initialise the head (nor anything else:
   a second `post_init` leaves a built or loaded model as it was).
4. `model.float()`, `.half()`, `.to(torch.float32)`, ... do what `from_pretrained(dtype=...)` does:
   every stored tensor keeps its dtype (fp8 / fp4 weights, e8m0 scales, the fp32 head and norms,
   bf16 elsewhere), float32 makes the vision tower and aligner fp32, bfloat16 makes them bf16 again,
   and the next forward computes what the equally loaded model computes. One warning per model
   and dtype names what was kept.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import (
    DeepseekV41ForCausalLM,
    DeepseekV41ForConditionalGeneration,
    DeepseekV41Model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>"
CLASSES = [DeepseekV41ForConditionalGeneration, DeepseekV41ForCausalLM, DeepseekV41Model]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float4_e2m1fn_x2 else tensor


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: _bits(tensor).clone() for name, tensor in model.state_dict().items()}


def _changed(model, before: dict[str, torch.Tensor]) -> list[str]:
    after = model.state_dict()
    assert after.keys() == before.keys()
    return [
        name for name, tensor in after.items()
        if _bits(tensor).dtype != before[name].dtype or not torch.equal(_bits(tensor), before[name])
    ]


def _same_state(model, other) -> list[str]:
    """Names whose dtype or bits differ between the two models."""
    ours, theirs = model.state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys()
    return [
        name for name, tensor in ours.items()
        if tensor.dtype != theirs[name].dtype or not torch.equal(_bits(tensor), _bits(theirs[name]))
    ]


# -- 1. resize, then post_init ---------------------------------------------------------------
@pytest.mark.parametrize("model_class", CLASSES, ids=lambda c: c.__name__)
def test_resize_embeddings_untied_no_reinit_on_post_init(golden, model_class):
    # transformers' common test, for a model built from its config
    from golden_models import golden_config

    config = golden_config(golden, "model_tiny_fp8")
    config.tie_word_embeddings = False
    config.get_text_config().tie_word_embeddings = False
    torch.manual_seed(0)
    model = model_class(copy.deepcopy(config)).eval()
    vocab = config.get_text_config().vocab_size
    model.resize_token_embeddings(vocab + 10)
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear) and head.weight.shape[0] == vocab + 10
    assert head.weight.dtype == torch.float32
    weights_before = head.weight.data.clone()
    before = _snapshot(model)
    model.post_init()
    assert torch.equal(weights_before, model.get_output_embeddings().weight.data), "post_init re-initialised the head"
    assert _changed(model, before) == []  # nor the embedding, the quantized storage, the token map


@pytest.mark.parametrize("auto_class", [AutoModelForImageTextToText, AutoModelForCausalLM], ids=lambda c: c.__name__)
def test_post_init_keeps_a_loaded_model_resized_or_not(converted_tiny_fp8, auto_class):
    model = auto_class.from_pretrained(converted_tiny_fp8, numerics="exact")
    ids = torch.tensor([[0, 11, 7, 42]])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    before = _snapshot(model)
    model.post_init()
    assert _changed(model, before) == []  # the checkpoint's fp8 / fp4 codes and scales included
    vocab = model.config.text_config.vocab_size
    model.resize_token_embeddings(vocab + 8, mean_resizing=False)
    before = _snapshot(model)
    model.post_init()
    assert _changed(model, before) == []
    with torch.no_grad():
        again = model(ids, use_cache=False).logits
    assert torch.equal(again[..., :vocab], logits)


# -- 4. dtype casts -------------------------------------------------------------------------
FP32_CASTS = {
    "float()": lambda m: m.float(),
    "to(torch.float32)": lambda m: m.to(torch.float32),
    "to(dtype=torch.float32)": lambda m: m.to(dtype=torch.float32),
    "to('cpu', torch.float32)": lambda m: m.to("cpu", torch.float32),
}
UNUSED_CASTS = {
    "half()": (lambda m: m.half(), torch.float16),
    "to(torch.float16)": (lambda m: m.to(torch.float16), torch.float16),
    "double()": (lambda m: m.double(), torch.float64),
}


def _load(folder, **kwargs):
    # a fresh load for every model that is cast (a deep copy is not always bitwise the same model)
    return AutoModelForImageTextToText.from_pretrained(folder, numerics="exact", **kwargs)


@pytest.fixture(scope="module")
def loaded(converted_tiny_fp8):
    return _load(converted_tiny_fp8)


@pytest.fixture(scope="module")
def loaded_fp32(converted_tiny_fp8):
    return _load(converted_tiny_fp8, dtype=torch.float32)


@pytest.fixture(scope="module")
def image_inputs(tiny_processor, photos):
    return tiny_processor(images=[photos[0]], text=[PROMPT], return_tensors="pt")


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


@pytest.mark.parametrize("cast", list(FP32_CASTS), ids=str)
def test_a_float32_cast_does_what_loading_in_float32_does(converted_tiny_fp8, loaded, loaded_fp32, image_inputs, cast):
    model = _load(converted_tiny_fp8)
    kept = r"every other module keeps its storage dtype \(kept: .*float4_e2m1fn_x2.*float8_e4m3fn.*\)"
    with pytest.warns(UserWarning, match=r"vision tower and aligner are now torch.float32, and " + kept):
        assert FP32_CASTS[cast](model) is model
    assert _same_state(model, loaded_fp32) == []  # fp8 / fp4 / e8m0 / fp32 / bf16 storage as loaded
    assert torch.equal(_logits(model, image_inputs), _logits(loaded_fp32, image_inputs))
    text = {"input_ids": image_inputs["input_ids"][:, :1]}
    assert torch.equal(_logits(model, text), _logits(loaded, text))  # no image: the bf16 load's bits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning comes once per model and dtype
        model.float()
        model.to("cpu")  # a device move alone never warns


def test_bfloat16_after_float32_gives_back_the_default_load(converted_tiny_fp8, loaded, image_inputs):
    model = _load(converted_tiny_fp8)
    with pytest.warns(UserWarning):
        model.float()
    with pytest.warns(UserWarning, match="vision tower and aligner are now torch.bfloat16"):
        model.bfloat16()
    assert _same_state(model, loaded) == []  # the ViT norms stay fp32, as built
    assert torch.equal(_logits(model, image_inputs), _logits(loaded, image_inputs))
    fresh = _load(converted_tiny_fp8)
    with pytest.warns(UserWarning, match="vision tower and aligner are now torch.bfloat16"):
        assert fresh.to(torch.bfloat16) is fresh  # the bf16 load's own dtypes: nothing changes
    assert _same_state(fresh, loaded) == []


@pytest.mark.parametrize("cast", list(UNUSED_CASTS), ids=str)
def test_a_cast_to_an_unused_dtype_keeps_everything(converted_tiny_fp8, loaded, image_inputs, cast):
    model = _load(converted_tiny_fp8)
    apply, dtype = UNUSED_CASTS[cast]
    with pytest.warns(UserWarning, match=rf"keeps the storage dtype of every module.*{dtype} changes nothing \(kept: "):
        assert apply(model) is model
    assert _same_state(model, loaded) == []
    assert torch.equal(_logits(model, image_inputs), _logits(loaded, image_inputs))


def test_the_text_model_keeps_everything_under_float(converted_tiny_fp8):
    model = AutoModelForCausalLM.from_pretrained(converted_tiny_fp8, numerics="exact")
    reference = AutoModelForCausalLM.from_pretrained(converted_tiny_fp8, numerics="exact")
    ids = torch.tensor([[0, 11, 7, 42]])
    with pytest.warns(UserWarning, match="keeps the storage dtype of"):
        model.float()
    assert _same_state(model, reference) == []
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)


def test_a_cast_to_a_non_float_dtype_is_refused(converted_tiny_fp8):
    model = _load(converted_tiny_fp8)
    before = _snapshot(model)
    with pytest.raises(TypeError, match="floating point"):
        model.to(torch.int8)
    assert _changed(model, before) == []



def test_module_type_cast_is_refused_with_the_fix_named(converted_tiny_fp8):
    model = _load(converted_tiny_fp8)
    before = _snapshot(model)
    with pytest.raises(TypeError, match=r"\.to\(dtype\)"):
        model.type(torch.float32)
    assert _changed(model, before) == []
