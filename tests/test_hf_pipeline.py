"""transformers' `image-text-to-text` pipeline on a real photo (scikit-image's `chelsea`).

The pipeline (chat messages with one and with two images; plain text with placeholders and images)
must produce exactly what the processor + `generate` + decode produce by hand: the pipeline adds
no preprocessing or decoding of its own that would change the result.
"""

from __future__ import annotations



import pytest

import deepseek_v41_vl  # noqa: F401
from deepseek_v41_vl.cli import bundled_photo
from deepseek_v41_vl.modeling.modeling_deepseek_v41_vl import DeepseekV41ForConditionalGeneration
from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor
from transformers import pipeline

NEW = 6


# one torch thread, as the golden fixtures were made (see conftest.one_torch_thread)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pipe(converted_tiny_fp8):
    return pipeline("image-text-to-text", model=str(converted_tiny_fp8), trust_remote_code=False)


def _by_hand(pipe, inputs) -> str:
    generated = pipe.model.generate(**inputs, do_sample=False, max_new_tokens=NEW)
    # the pipeline decodes prompt + answer and cuts the decoded prompt off, which keeps the space
    # the tokenizer drops when the answer is decoded alone: compare without edge whitespace
    return pipe.processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def _chat(pipe, messages) -> str:
    out = pipe(text=messages, max_new_tokens=NEW, return_full_text=False, generate_kwargs={"do_sample": False})
    return out[0]["generated_text"].strip()


def test_pipeline_classes(pipe):
    assert type(pipe.model) is DeepseekV41ForConditionalGeneration
    assert type(pipe.processor) is DeepseekV41Processor


@pytest.mark.parametrize("n_images", [1, 2])
def test_chat_messages_with_real_photos(golden, pipe, n_images):
    photos = [str(bundled_photo()), str(golden / "preprocess" / "images" / "rocket.jpg")][:n_images]
    messages = [{"role": "user", "content": [*({"type": "image", "url": p} for p in photos), {"type": "text", "text": "What is in the picture?"}]}]
    text = _chat(pipe, messages)
    inputs = pipe.processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert inputs["image_grid_thw"].shape[0] == n_images
    assert text and text == _by_hand(pipe, inputs)


def test_plain_text_with_images(pipe):
    prompt = "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>Describe the cat.<｜Assistant｜></think>"
    photo = str(bundled_photo())
    out = pipe(images=[photo], text=prompt, max_new_tokens=NEW, return_full_text=False, generate_kwargs={"do_sample": False})
    inputs = pipe.processor(images=[photo], text=prompt, return_tensors="pt")
    assert out[0]["generated_text"].strip() == _by_hand(pipe, inputs)
