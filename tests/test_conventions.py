"""transformers conventions a user meets in ordinary work (issue [conventions]): tuple outputs,
`**kwargs` reaching the loss, explicit forward signatures, and beam search / several samples per
prompt with images."""

from __future__ import annotations

import inspect

import numpy as np

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
from deepseek_v41_vl.modeling.exceptions_deepseek_v41_vl import DeepseekV41AttentionError, DeepseekV41ModelError
from deepseek_v41_vl.cli import bundled_photo
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import (
    DeepseekV41ForCausalLM,
    DeepseekV41ForConditionalGeneration,
    DeepseekV41Model,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def processor(tiny_processor):
    return tiny_processor

SHORT = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>What is it?<｜Assistant｜></think>"
LONG = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜><｜deepseek_image｜>Compare the two.<｜Assistant｜></think>"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def test_return_dict_false_returns_a_tuple_loss_first(converted_tiny_fp8, model, processor):
    inputs = processor(text=["<｜begin▁of▁sentence｜>hello there"], return_tensors="pt")
    labels = inputs["input_ids"].clone()
    with torch.no_grad():
        out = model(**inputs, labels=labels, use_cache=False)
        loss, logits = model(**inputs, labels=labels, use_cache=False, return_dict=False)[:2]
        (only_logits,) = model(**inputs, use_cache=False, return_dict=False)
    assert torch.equal(loss, out.loss) and torch.equal(logits, out.logits) and torch.equal(only_logits, out.logits)
    backbone = AutoModel.from_pretrained(converted_tiny_fp8, numerics="exact")  # a tuple too
    with torch.no_grad():
        first = backbone(**inputs, use_cache=False, return_dict=False)[0]
    assert type(backbone) is DeepseekV41Model
    assert isinstance(first, torch.Tensor) and first.shape[:2] == inputs["input_ids"].shape


def test_kwargs_reach_the_loss_function(model, processor):
    inputs = processor(text=["<｜begin▁of▁sentence｜>a few words to score"], return_tensors="pt")
    labels = inputs["input_ids"].clone()
    n_scored = labels.size(1) - 1  # the causal shift scores every position but the first
    with torch.no_grad():
        mean = model(**inputs, labels=labels, use_cache=False).loss
        summed = model(**inputs, labels=labels, use_cache=False, num_items_in_batch=torch.tensor(1)).loss
    # num_items_in_batch turns the mean into sum / num_items_in_batch (gradient accumulation)
    torch.testing.assert_close(summed, mean * n_scored, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [DeepseekV41ForConditionalGeneration, DeepseekV41ForCausalLM, DeepseekV41Model])
def test_forward_signatures_are_explicit(cls):
    # Trainer keeps only the dataset columns that forward names (`_set_signature_columns_if_needed`)
    parameters = inspect.signature(cls.forward).parameters
    assert not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values())
    assert {"input_ids", "attention_mask", "return_dict"} <= set(parameters)
    if cls is not DeepseekV41Model:
        assert "labels" in parameters


def test_causal_lm_takes_the_same_keywords(converted_tiny_fp8, model, processor):
    text_model = AutoModelForCausalLM.from_pretrained(converted_tiny_fp8, numerics="exact")
    inputs = processor(text=["<｜begin▁of▁sentence｜>hello there"], return_tensors="pt")
    with torch.no_grad():
        ours = text_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False, return_dict=False)
        theirs = model(**inputs, use_cache=False)
    assert torch.equal(ours[0], theirs.logits)


def test_expanding_a_batch_repeats_each_rows_images(model, processor, photos):
    batch = processor(images=[photos, [photos[1]]], text=[LONG, SHORT], return_tensors="pt")
    _, expanded = model._expand_inputs_for_generation(
        expand_size=2, input_ids=batch["input_ids"], **{k: v for k, v in batch.items() if k != "input_ids"}
    )
    grid, pixels = batch["image_grid_thw"], batch["pixel_values"]
    n = grid.prod(-1).tolist()
    first, second, third = pixels[: n[0]], pixels[n[0] : n[0] + n[1]], pixels[n[0] + n[1] :]
    want = torch.cat([first, second, first, second, third, third])
    assert torch.equal(expanded["pixel_values"], want)
    assert torch.equal(expanded["image_grid_thw"], grid[[0, 1, 0, 1, 2, 2]])
    assert torch.equal(expanded["mm_token_type_ids"], batch["mm_token_type_ids"].repeat_interleave(2, 0))


def test_beam_search_with_images_gives_each_row_what_it_gives_alone(model, processor, photos):
    batch = processor(images=[photos, [photos[1]]], text=[LONG, SHORT], return_tensors="pt")
    kwargs = {"num_beams": 2, "num_return_sequences": 2, "do_sample": False, "max_new_tokens": 4}
    out = model.generate(**batch, **kwargs)
    assert out.shape[0] == 4
    new = out[:, batch["input_ids"].shape[1] :].tolist()
    for row, (images, text) in enumerate([(photos, LONG), ([photos[1]], SHORT)]):
        alone = processor(images=[images], text=[text], return_tensors="pt")
        single = model.generate(**alone, **kwargs)[:, alone["input_ids"].shape[1] :].tolist()
        assert new[2 * row : 2 * row + 2] == single


def test_several_samples_per_image_prompt(model, processor, photos):
    inputs = processor(images=[photos[1]], text=SHORT, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**inputs, do_sample=True, num_return_sequences=3, max_new_tokens=3)
    assert out.shape == (3, inputs["input_ids"].shape[1] + 3)
    assert model.config.image_token_id not in out[:, inputs["input_ids"].shape[1] :]


def test_expansion_refuses_images_that_do_not_fill_the_spans(model, processor, photos):
    batch = processor(images=[photos[1]], text=SHORT, return_tensors="pt")
    with pytest.raises(DeepseekV41ModelError, match="images for 1 image spans"):
        model._expand_images(
            torch.cat([batch["pixel_values"]] * 2), torch.cat([batch["image_grid_thw"]] * 2), batch["mm_token_type_ids"], 2
        )



def test_output_hidden_states_in_forward(converted_tiny_fp8, model, processor, photos):
    inputs = processor(images=[photos[1]], text=SHORT, return_tensors="pt")
    layers = model.config.text_config.num_hidden_layers
    with torch.no_grad():
        plain = model(**inputs, use_cache=False)
        out = model(**inputs, use_cache=False, output_hidden_states=True)
        embedded = model.model.embed(inputs["input_ids"])
        backbone = AutoModel.from_pretrained(converted_tiny_fp8, numerics="exact")(**inputs, use_cache=False, output_hidden_states=True)
    assert plain.hidden_states is None
    assert torch.equal(out.logits, plain.logits)  # asking for them changes nothing else
    states = out.hidden_states
    assert len(states) == layers + 1 and all(s.shape == (*inputs["input_ids"].shape, embedded.size(-1)) for s in states)
    text = inputs["mm_token_type_ids"][0] == 0  # image positions carry the merged aligner rows instead
    assert torch.equal(states[0][0, text], embedded[0, text])
    assert not torch.equal(states[0], embedded)
    assert torch.equal(states[-1], backbone.last_hidden_state)
    assert all(torch.equal(a, b) for a, b in zip(states, backbone.hidden_states))
    assert all(not torch.equal(a, b) for a, b in zip(states[:-1], states[1:]))


def test_output_hidden_states_in_generate(model, processor, photos):
    inputs = processor(images=[photos[1]], text=SHORT, return_tensors="pt")
    layers = model.config.text_config.num_hidden_layers
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=3)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=3, return_dict_in_generate=True, output_hidden_states=True)
    assert torch.equal(out.sequences, plain)
    assert len(out.hidden_states) == 3
    prompt = inputs["input_ids"].shape[1]
    for step, states in enumerate(out.hidden_states):
        assert len(states) == layers + 1
        assert all(s.shape[:2] == (1, prompt if step == 0 else 1) for s in states)


def test_get_image_features_follows_transformers_v5(converted_tiny_fp8, model, processor, photos):
    inputs = processor(images=photos, text=LONG, return_tensors="pt")
    grid = inputs["image_grid_thw"]
    with torch.no_grad():
        out = model.get_image_features(inputs["pixel_values"], grid)
        as_tuple = model.get_image_features(inputs["pixel_values"], grid, return_dict=False)
        rows = model.model.get_image_features(inputs["pixel_values"], grid)
        vit = model.model.vision(inputs["pixel_values"], grid)
    assert torch.equal(torch.cat(out.pooler_output), rows) and torch.equal(out.last_hidden_state, vit)
    assert out.last_hidden_state.shape == (int(grid.prod(-1).sum()), model.config.vision_config.hidden_size)
    n_rows = sum(h * w for h, w in model.model.image_llm_grids(grid))
    assert len(out.pooler_output) == len(grid) and sum(p.shape[0] for p in out.pooler_output) == n_rows
    assert all(p.shape[1] == model.config.text_config.hidden_size for p in out.pooler_output)
    assert len(as_tuple) == 2 and torch.equal(as_tuple[0], vit) and torch.equal(torch.cat(as_tuple[1]), rows)
    text_model = AutoModelForCausalLM.from_pretrained(converted_tiny_fp8)
    assert not hasattr(text_model, "get_image_features")
    # transformers' mixins ask the class: it must not have the method either
    assert not hasattr(type(text_model), "get_image_features") and hasattr(type(model), "get_image_features")


def test_right_padded_training_batch_with_labels(model, processor):
    tokenizer = processor.tokenizer
    texts = ["<｜begin▁of▁sentence｜>a longer training example here", "<｜begin▁of▁sentence｜>short"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    assert not mask[1].all() and mask[1, 0] == 1  # right padding
    other = ids.masked_fill(mask == 0, 7)  # other tokens where the padding was
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        masked = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        changed = model(input_ids=other, attention_mask=mask, labels=other)
    assert out.cache is None  # labels: no cache unless asked for
    assert torch.equal(out.loss, masked.loss) and torch.equal(out.loss, changed.loss)  # pads are never scored
    for b, r in enumerate(rows):
        # what sits after a row's last token never reaches it (same shapes, so the same kernels)
        assert torch.equal(out.logits[b, : len(r)], changed.logits[b, : len(r)])
    assert not torch.equal(out.logits[1, len(rows[1]) :], changed.logits[1, len(rows[1]) :])
    with pytest.raises(DeepseekV41AttentionError, match="only left padding"):
        model(input_ids=ids, attention_mask=mask, use_cache=True)  # a cache would record the pads


def test_a_left_padded_row_never_scores_a_token_from_a_pad(model, processor):
    batch = processor(text=["<｜begin▁of▁sentence｜>a longer training example", "<｜begin▁of▁sentence｜>short"], return_tensors="pt")
    mask = batch["attention_mask"]
    assert mask[1, 0] == 0  # left padding, the generation convention
    ids = batch["input_ids"]
    first_real = mask.argmax(-1)
    by_hand = ids.masked_fill(mask == 0, -100)
    by_hand[1, first_real[1]] = -100  # predicted from the last pad
    with torch.no_grad():
        loss = model(**batch, labels=ids).loss
        want = model(**batch, labels=by_hand).loss
    assert torch.equal(loss, want)


def test_processor_takes_numpy_arrays_and_torch_tensors(processor):
    from PIL import Image

    from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ImageError

    photo = Image.open(bundled_photo()).convert("RGB")
    hwc = np.asarray(photo)
    want = processor(images=[photo], text=SHORT, return_tensors="pt")
    for image in (hwc, hwc.transpose(2, 0, 1), hwc.astype(np.float32) / 255, torch.from_numpy(hwc.transpose(2, 0, 1).copy())):
        got = processor(images=[image], text=SHORT, return_tensors="pt")
        assert torch.equal(got["pixel_values"], want["pixel_values"])
        assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    gray = np.asarray(photo.convert("L"))
    assert torch.equal(
        processor(images=[gray], text=SHORT, return_tensors="pt")["pixel_values"],
        processor(images=[photo.convert("L")], text=SHORT, return_tensors="pt")["pixel_values"],
    )
    bad = [(hwc.astype(np.float32), "finite values in \\[0, 1\\]"), (hwc.astype(np.int32), "uint8 or float"),
           (hwc[..., :2], "channel axis"), (hwc[None], "must be \\[H, W\\]")]
    for image, message in bad:
        with pytest.raises(DeepseekV41ImageError, match=message):
            processor(images=[image], text=SHORT, return_tensors="pt")


def test_from_pretrained_image_settings_override_the_saved_ones(converted_tiny_fp8, photos):
    saved = AutoProcessor.from_pretrained(converted_tiny_fp8)
    small = AutoProcessor.from_pretrained(converted_tiny_fp8, max_image_tokens=16)
    assert small.image_processor.max_image_tokens == 16 != saved.image_processor.max_image_tokens
    grid = small(images=[photos[0]], text=SHORT, return_tensors="pt")["image_grid_thw"][0]
    # at most 16 aligner rows, each from ratio x ratio ViT patches
    assert int(grid.prod()) <= 16 * small.image_processor.downsample_ratio**2


def test_processor_padding_truncation_and_grouped_kwargs(processor, photos):
    from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ProcessorError

    short, long = "<｜begin▁of▁sentence｜>hi", "<｜begin▁of▁sentence｜>a rather longer prompt than that"
    n_long = len(processor(text=long, return_tensors="pt")["input_ids"][0])
    padded = processor(text=[short, long], padding="max_length", max_length=n_long + 3, return_tensors="pt")
    assert padded["input_ids"].shape == (2, n_long + 3) and int(padded["attention_mask"][1].sum()) == n_long
    cut = processor(text=[long], truncation=True, max_length=4, return_tensors="pt")
    assert torch.equal(cut["input_ids"], processor(text=[long], return_tensors="pt")["input_ids"][:, :4])
    grouped = processor(text=[long], text_kwargs={"truncation": True, "max_length": 4}, return_tensors="pt")
    assert torch.equal(grouped["input_ids"], cut["input_ids"])
    with pytest.raises(DeepseekV41ProcessorError, match="more than max_length"):
        processor(text=[long], padding="max_length", max_length=4, return_tensors="pt")
    # an image span is never cut: the prompt with its image is refused, not silently broken
    with pytest.raises(DeepseekV41ProcessorError, match="would cut an image span"):
        processor(images=[photos[1]], text=SHORT, truncation=True, max_length=10, return_tensors="pt")
    whole = processor(images=[photos[1]], text=SHORT + " trailing words to cut", return_tensors="pt")
    n_span_end = int(whole["mm_token_type_ids"][0].nonzero().max()) + 1
    kept = processor(images=[photos[1]], text=SHORT + " trailing words to cut", truncation=True, max_length=n_span_end + 1, return_tensors="pt")
    assert torch.equal(kept["input_ids"], whole["input_ids"][:, : n_span_end + 1])
    with pytest.warns(UserWarning, match="ignores the options"):
        processor(text=[short], not_an_option=3, return_tensors="pt")


def test_tokenizers_name_the_image_token(converted_tiny_fp8, model):
    from transformers import AutoTokenizer

    from deepseek_v41_vl.processing.tokenizer_deepseek_v41_vl import IMAGE_TOKEN_ID, V41_IMAGE_TOKEN, load_deepseek_v41_tokenizer

    real = load_deepseek_v41_tokenizer()
    assert (real.image_token, real.image_token_id) == (V41_IMAGE_TOKEN, IMAGE_TOKEN_ID)
    folder = AutoTokenizer.from_pretrained(converted_tiny_fp8)
    assert folder.image_token_id == model.config.image_token_id


def test_rope_tables_of_a_meta_built_model_are_real(model):
    from deepseek_v41_vl.modeling.rope_deepseek_v41_vl import DeepseekV41RotaryEmbedding

    text = model.config.text_config
    with torch.device("meta"):
        meta_built = [DeepseekV41RotaryEmbedding.for_layer(text, i) for i in range(text.num_hidden_layers)]
    positions = torch.arange(40)
    for i, rope in enumerate(meta_built):
        assert not rope.inv_freq.is_meta
        assert torch.equal(rope.to_empty(device="cpu")(positions), DeepseekV41RotaryEmbedding.for_layer(text, i)(positions))


def test_resize_token_embeddings_keeps_the_fp32_head_and_the_engram_map(converted_tiny_fp8):
    model = AutoModelForImageTextToText.from_pretrained(converted_tiny_fp8, numerics="exact")
    old_vocab = model.config.text_config.vocab_size
    ids = torch.tensor([[0, 11, 7, 42]])
    with torch.no_grad():
        before = model(ids, use_cache=False).logits
    old_map = model.model.engram_hash.token_map.clone()
    embeddings = model.resize_token_embeddings(old_vocab + 8, mean_resizing=False)
    head = model.get_output_embeddings()
    assert embeddings.weight.shape[0] == old_vocab + 8 and embeddings.weight.dtype == torch.bfloat16
    assert head.weight.shape[0] == old_vocab + 8 and head.weight.dtype == torch.float32
    assert model.config.text_config.vocab_size == old_vocab + 8
    hash_map = model.model.engram_hash.token_map
    assert torch.equal(hash_map[:old_vocab], old_map)
    assert bool((hash_map[old_vocab:] == model.model.engram_hash.pad_id).all())  # no n-gram signal yet
    with torch.no_grad():
        after = model(torch.cat([ids, torch.tensor([[old_vocab + 3]])], dim=1), use_cache=False).logits
    assert torch.equal(after[:, :4, :old_vocab], before)  # the old tokens compute what they computed
    model.resize_token_embeddings(old_vocab)
    assert model.model.engram_hash.token_map.shape == (old_vocab,)


def test_a_model_built_from_its_config_runs(golden, processor):
    # random init with Engram and fp8 / fp4 storage: a valid token map and finite quantized
    # storage, never uninitialised memory
    from golden_models import golden_config

    config = golden_config(golden, "model_tiny_fp8")
    torch.manual_seed(0)
    model = DeepseekV41ForConditionalGeneration(config).eval()
    hasher = model.model.engram_hash
    assert torch.equal(hasher.token_map, torch.arange(hasher.token_map.numel()) % hasher.layout.compressed_vocab_size)
    fp8 = [p for p in model.parameters() if p.dtype == torch.float8_e4m3fn]
    scales = [p for p in model.parameters() if p.dtype == torch.float8_e8m0fnu]
    assert fp8 and all(bool(torch.isfinite(p.float()).all()) for p in fp8)
    assert scales and all(bool((p.float() == 2.0**-6).all()) for p in scales)  # the power of two nearest 0.02
    assert any(p.dtype == torch.float4_e2m1fn_x2 for p in model.parameters())
    inputs = processor(text=["<｜begin▁of▁sentence｜>hello there"], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_a_saved_config_with_extra_keys_loads_with_a_warning(converted_tiny_fp8, tmp_path):
    import json
    import shutil

    from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ProcessingError
    from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

    folder = tmp_path / "newer"
    shutil.copytree(converted_tiny_fp8, folder, symlinks=True)
    for name, where in (("processor_config.json", ("image_processor",)), ("preprocessor_config.json", ())):
        data = json.loads((folder / name).read_text(encoding="utf-8"))
        target = data[where[0]] if where else data
        target["a_setting_of_a_newer_version"] = 3
        (folder / name).write_text(json.dumps(data), encoding="utf-8")
    with pytest.warns(UserWarning, match="a_setting_of_a_newer_version"):
        processor = AutoProcessor.from_pretrained(folder)
    assert processor.image_processor.max_image_tokens == AutoProcessor.from_pretrained(converted_tiny_fp8).image_processor.max_image_tokens
    with pytest.warns(UserWarning, match="a_setting_of_a_newer_version"):
        DeepseekV41ImageProcessor.from_pretrained(folder)
    with pytest.raises(DeepseekV41ProcessingError, match="unknown DeepseekV41ImageProcessor arguments"):
        DeepseekV41ImageProcessor(max_image_tokenz=16)  # a typo in code is still an error


@pytest.mark.parametrize("variant", ["model_tiny_fp8", "model_tiny_bf16"])
def test_fast_numerics_padded_row_picks_what_it_picks_next_to_other_padding(golden, variant):
    # the indexer's top-k ties (the relu makes many index scores exactly 0) went by the width the
    # batch ranks, which a longer row in the batch widens: now ties go to the lower position
    from golden_models import golden_model
    from deepseek_v41_vl.modeling.cache_deepseek_v41_vl import DeepseekV41Cache

    model = golden_model(golden, variant, "fast")
    torch.manual_seed(0)
    long, short = torch.randint(3, 500, (1, 40)), torch.randint(3, 500, (1, 22))
    padded = torch.cat([torch.full((1, 18), 2), short], dim=1)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :18] = 0
    with torch.no_grad():
        beside_long = model(torch.cat([long, padded]), cache=DeepseekV41Cache(model.config), logits_to_keep=0, attention_mask=mask).logits
        beside_padded = model(
            torch.cat([padded, padded]), cache=DeepseekV41Cache(model.config), logits_to_keep=0,
            attention_mask=torch.cat([mask[1:], mask[1:]]),
        ).logits
    assert torch.equal(beside_long[1], beside_padded[1])


def test_processor_routes_image_settings_and_refuses_what_it_cannot_honour(processor, photos):
    from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ProcessorError

    top = processor(images=[photos[0]], text=SHORT, max_image_tokens=16, return_tensors="pt")
    grouped = processor(images=[photos[0]], text=SHORT, images_kwargs={"max_image_tokens": 16}, return_tensors="pt")
    assert torch.equal(top["image_grid_thw"], grouped["image_grid_thw"])
    long = "<｜begin▁of▁sentence｜>a rather longer prompt than that"
    # the top level wins over text_kwargs, which wins over common_kwargs
    out = processor(text=[long], max_length=3, text_kwargs={"max_length": 5, "truncation": True},
                    common_kwargs={"max_length": 7}, return_tensors="pt")
    assert out["input_ids"].shape[1] == 3
    with pytest.raises(DeepseekV41ProcessorError, match="sanitize_control_tokens"):
        processor(text=[long], sanitize_control_tokens=True, return_tensors="pt")


def test_resize_is_checked_before_anything_changes_and_reaches_the_backbone_class(converted_tiny_fp8):
    from deepseek_v41_vl.modeling.engram_deepseek_v41_vl import DeepseekV41EngramError

    backbone = AutoModel.from_pretrained(converted_tiny_fp8)
    vocab = backbone.config.text_config.vocab_size
    backbone.resize_token_embeddings(vocab + 4, mean_resizing=False)
    assert backbone.model.engram_hash.token_map.numel() == vocab + 4 == backbone.model.embed.num_embeddings
    pad = backbone.model.engram_hash.layout.pad_token_id
    with pytest.raises(DeepseekV41EngramError, match="engram_pad_token_id"):
        backbone.resize_token_embeddings(pad)
    assert backbone.model.embed.num_embeddings == vocab + 4  # refused before the embedding changed


def test_return_assistant_tokens_mask_marks_what_the_assistant_generates(processor, photos):
    # the template's {% generation %} blocks: each assistant turn's text and EOS are 1; headers,
    # user turns and the image span are 0 (chat mode; thinking mode below)
    messages = [
        {"role": "user", "content": [{"type": "image", "url": photos[0]}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And its colour?"},
        {"role": "assistant", "content": "Orange."},
    ]
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt")
    # transformers converts `assistant_masks` only when return_tensors reaches apply_chat_template
    ids, mask = out["input_ids"][0].tolist(), torch.as_tensor(out["assistant_masks"])[0].tolist()
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    tok = processor.tokenizer
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(ids[start:i])
            start = None

    def ids_of(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    assert spans == [ids_of("A cat.<｜end▁of▁sentence｜>"), ids_of("Orange.<｜end▁of▁sentence｜>")]
    # the mask's tokens are the prompt's: rendering with the mask changes nothing else
    plain = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert out["input_ids"].tolist() == plain["input_ids"].tolist()
    thinking = processor.apply_chat_template(
        messages[:2], tokenize=True, return_dict=True, return_assistant_tokens_mask=True, thinking_mode="thinking",
        drop_thinking=False, return_tensors="pt",
    )
    ids, mask = thinking["input_ids"][0].tolist(), torch.as_tensor(thinking["assistant_masks"])[0].tolist()
    first = mask.index(1)
    assert ids[first:] == ids_of("</think>A cat.<｜end▁of▁sentence｜>") and all(mask[first:])


def test_processor_returns_lists_unless_asked_for_tensors(processor, photos):
    from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ProcessorError

    # transformers' processors: return_tensors=None by default (token columns as lists)
    out = processor(images=[photos[1]], text=SHORT)
    assert isinstance(out["input_ids"], list) and isinstance(out["mm_token_type_ids"][0], list)
    assert isinstance(out["pixel_values"], torch.Tensor)  # the image processor's tensors, unchanged
    pt = processor(images=[photos[1]], text=SHORT, return_tensors="pt")
    assert out["input_ids"] == pt["input_ids"].tolist() and torch.equal(out["pixel_values"], pt["pixel_values"])
    # without padding, unequal lengths are fine as lists, refused as tensors
    texts = ["<｜begin▁of▁sentence｜>a", "<｜begin▁of▁sentence｜>a b c"]
    assert [len(ids) for ids in processor(text=texts, padding=False)["input_ids"]] == [2, 4]
    with pytest.raises(DeepseekV41ProcessorError, match="different lengths"):
        processor(text=texts, padding=False, return_tensors="pt")
