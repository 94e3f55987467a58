"""`get_image_features` and the VL forward's image outputs as transformers v5 VLMs return them
(issue [polish] item 2): the ViT's per-block hidden states on request, one pooled tensor per
image, `image_outputs` on the forward output, and a clear refusal of `output_attentions`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41ModelError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜><｜deepseek_image｜>Compare the two.<｜Assistant｜></think>"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def inputs(tiny_processor, photos):
    return tiny_processor(images=photos, text=LONG, return_tensors="pt")


def _vit_states_by_hand(model, pixel_values, grid):
    """patch embedding, every block's output but the last, final norm: per image, then joined."""
    tower = model.model.vision
    patches = tower.check_pixel_values(pixel_values).split([int(h * w) for _, h, w in grid.tolist()])
    per_image = []
    for x, (_, n_h, n_w) in zip(patches, grid.tolist()):
        h = tower.patch_embed(x)
        cos, sin = tower.rotary_emb(n_h, n_w, h.device)
        states = [h]
        for block in tower.blocks:
            h = block(h, cos, sin)
            states.append(h)
        states[-1] = tower.norm(h)
        per_image.append(states)
    return [torch.cat(level) for level in zip(*per_image)]


def test_get_image_features_hidden_states(model, inputs):
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    layers = model.config.vision_config.num_hidden_layers
    with torch.no_grad():
        plain = model.get_image_features(pv, grid)
        out = model.get_image_features(pv, grid, output_hidden_states=True)
        as_tuple = model.get_image_features(pv, grid, output_hidden_states=True, return_dict=False)
        expected = _vit_states_by_hand(model, pv, grid)
    assert plain.hidden_states is None
    assert isinstance(out.hidden_states, tuple) and len(out.hidden_states) == layers + 1
    width = model.config.vision_config.hidden_size
    for got, want in zip(out.hidden_states, expected, strict=True):
        assert got.shape == (int(grid.prod(-1).sum()), width)
        assert torch.equal(got, want)
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert torch.equal(out.last_hidden_state, plain.last_hidden_state)
    assert len(as_tuple) == 3 and len(as_tuple[2]) == layers + 1
    model.config.output_hidden_states = True
    try:
        with torch.no_grad():
            from_config = model.get_image_features(pv, grid)
    finally:
        model.config.output_hidden_states = False
    assert len(from_config.hidden_states) == layers + 1


def test_get_image_features_attentions_are_refused(model, inputs):
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with pytest.raises(DeepseekV41ModelError, match="output_attentions"):
        model.get_image_features(pv, grid, output_attentions=True)
    model.config.output_attentions = True
    try:
        with pytest.raises(DeepseekV41ModelError, match="output_attentions"):
            model.get_image_features(pv, grid)
        with pytest.raises(DeepseekV41ModelError, match="output_attentions"):
            model(**inputs, use_cache=False)
    finally:
        model.config.output_attentions = False


def test_output_attentions_is_refused_by_every_forward(model, inputs, converted_tiny_fp8):
    with pytest.raises(DeepseekV41ModelError, match="attention weights"):
        model(**inputs, use_cache=False, output_attentions=True)
    with pytest.raises(DeepseekV41ModelError, match="attention weights"):
        model.generate(**inputs, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    backbone = AutoModel.from_pretrained(converted_tiny_fp8, numerics="exact")
    with pytest.raises(DeepseekV41ModelError, match="attention weights"):
        backbone(**inputs, use_cache=False, output_attentions=True)


def test_get_image_features_pooler_output_is_one_tensor_per_image(model, inputs):
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with torch.no_grad():
        out = model.get_image_features(pv, grid)
        as_tuple = model.get_image_features(pv, grid, return_dict=False)
        rows = model.model.get_image_features(pv, grid)
    llm_grids = model.model.image_llm_grids(grid)
    assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == len(llm_grids) == 2
    for pooled, (n_h, n_w) in zip(out.pooler_output, llm_grids):
        assert pooled.shape == (n_h * n_w, model.config.text_config.hidden_size) and pooled.dtype == torch.bfloat16
    assert torch.equal(torch.cat(out.pooler_output), rows)
    assert len(as_tuple) == 2 and isinstance(as_tuple[1], tuple) and torch.equal(torch.cat(as_tuple[1]), rows)


def test_multimodal_outputs_are_returned(model, inputs, tiny_processor, converted_tiny_fp8):
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    layers = model.config.vision_config.num_hidden_layers
    with torch.no_grad():
        features = model.get_image_features(pv, grid)
        out = model(**inputs, use_cache=False)
        with_states = model(**inputs, use_cache=False, output_hidden_states=True)
        as_tuple = model(**inputs, use_cache=False, return_dict=False)
        text = model(**tiny_processor(text=["<｜begin▁of▁sentence｜>hello"], return_tensors="pt"), use_cache=False)
    assert isinstance(out.image_outputs, BaseModelOutputWithPooling)
    assert torch.equal(out.image_outputs.last_hidden_state, features.last_hidden_state)
    assert len(out.image_outputs.pooler_output) == 2
    for got, want in zip(out.image_outputs.pooler_output, features.pooler_output, strict=True):
        assert torch.equal(got, want)
    assert out.image_outputs.hidden_states is None
    assert len(with_states.image_outputs.hidden_states) == layers + 1
    assert torch.equal(with_states.logits, out.logits)
    assert torch.equal(as_tuple[0], out.logits) and isinstance(as_tuple[-1], tuple)
    assert text.image_outputs is None
    backbone = AutoModel.from_pretrained(converted_tiny_fp8, numerics="exact")
    with torch.no_grad():
        base = backbone(**inputs, use_cache=False)
    assert isinstance(base.image_outputs, BaseModelOutputWithPooling)
    assert torch.equal(base.image_outputs.last_hidden_state, features.last_hidden_state)
