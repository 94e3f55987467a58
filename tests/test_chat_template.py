"""The V4.1 chat template and chat helpers against upstream `encoding/test_encoding.py` + README.

Every case of golden `tokenizer/encoding_cases.json` goes through the processor's public methods:
rendering through `apply_chat_template` (template kwargs), `render_message`, errors as
`DeepseekV41ProcessorError` naming the problem, `parse_completion`, `merge_tool_messages`,
`parse_tagged_text`; where a case has `expected_prompt_token_ids_real_tokenizer`, the rendered
prompt must tokenize to those ids. Further tests cover upstream behaviours that have no golden
string (namespaced tools, tool-result order, tasks) from upstream test expectations.
"""

from __future__ import annotations

import copy
import json
import re

import pytest

from deepseek_v41_vl.processing import encoding_deepseek_v41_vl as enc
from deepseek_v41_vl.processing.errors_deepseek_v41_vl import DeepseekV41ProcessorError
from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor, default_chat_template
from deepseek_v41_vl.processing.tokenizer_deepseek_v41_vl import load_deepseek_v41_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _load_cases():
    from conftest import golden_dir

    return json.loads((golden_dir() / "tokenizer" / "encoding_cases.json").read_text(encoding="utf-8"))


ENCODING = _load_cases()
CASES = {case["id"]: case for case in ENCODING["cases"]}


@pytest.fixture(scope="module")
def processor():
    return DeepseekV41Processor(tokenizer=load_deepseek_v41_tokenizer())


def _template_kwargs(case):
    kwargs = {"thinking_mode": case["thinking_mode"]}
    if case.get("reasoning_effort") is not None:  # null means the argument is omitted upstream
        kwargs["reasoning_effort"] = case["reasoning_effort"]
    if "drop_thinking" in case:
        kwargs["drop_thinking"] = case["drop_thinking"]
    return kwargs


def _render(processor, case):
    if case["call"] == "encode_messages":
        return processor.apply_chat_template(copy.deepcopy(case["messages"]), **_template_kwargs(case))
    if case["call"] == "render_message":
        return processor.render_message(case["index"], copy.deepcopy(case["messages"]), **_template_kwargs(case))
    raise AssertionError(case["call"])


def _check_prompt(processor, case, prompt):
    if "expected_prompt" in case:
        assert prompt == case["expected_prompt"]
    for text in case.get("expected_contains", []):
        assert text in prompt
    for text in case.get("expected_not_contains", []):
        assert text not in prompt
    if "expected_endswith" in case:
        assert prompt.endswith(case["expected_endswith"])
    if "expected_prompt_token_ids_real_tokenizer" in case:
        # Default special-token handling, as the reference's `tokenizer.encode(prompt)`.
        assert processor.tokenizer.encode(prompt) == case["expected_prompt_token_ids_real_tokenizer"]
        assert processor.tokenizer(prompt)["input_ids"] == case["expected_prompt_token_ids_real_tokenizer"]


def _lookup(obj, path):
    """Evaluate the golden's small path language: `a[0].b`, `json.loads(a[0].b)`."""
    loads = path.startswith("json.loads(")
    if loads:
        path = path[len("json.loads(") : -1]
    for name, index in re.findall(r"([A-Za-z_]+)|\[(\d+)\]", path):
        obj = obj[name] if name else obj[int(index)]
    return json.loads(obj) if loads else obj


RENDER_IDS = [i for i, c in CASES.items() if c["call"] in ("encode_messages", "render_message") and "expected_error" not in c]
ERROR_IDS = [i for i, c in CASES.items() if c["call"] in ("encode_messages", "render_message") and "expected_error" in c]
PARSE_IDS = [i for i, c in CASES.items() if c["call"] == "parse_message_from_completion_text"]


def test_all_cases_are_dispatched():
    handled = set(RENDER_IDS) | set(ERROR_IDS) | set(PARSE_IDS)
    handled |= {i for i, c in CASES.items() if c["call"] in ("merge_tool_messages", "parse_tagged_text")}
    assert handled == set(CASES) and len(CASES) == 32


@pytest.mark.parametrize("case_id", RENDER_IDS)
def test_render_case(case_id, processor):
    case = CASES[case_id]
    prompt = _render(processor, case)
    _check_prompt(processor, case, prompt)
    if "expected_media" in case:
        assert processor.multi_modal_data(case["messages"]) == case["expected_media"]
    if case.get("return_multi_modal_data"):
        images = processor.multi_modal_data(case["messages"])["images"]
        assert prompt.count(ENCODING["image_placeholder"]) == len(images)


@pytest.mark.parametrize("case_id", ERROR_IDS)
def test_error_case(case_id, processor):
    case = CASES[case_id]
    with pytest.raises(DeepseekV41ProcessorError, match=case.get("expected_error_match")) as info:
        _render(processor, case)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("case_id", PARSE_IDS)
def test_parse_case(case_id, processor):
    case = CASES[case_id]
    if "expected_error" in case:
        with pytest.raises(DeepseekV41ProcessorError):
            processor.parse_completion(case["completion"], thinking_mode=case["thinking_mode"])
        return
    parsed = processor.parse_completion(case["completion"], thinking_mode=case["thinking_mode"])
    for path, expected in case["expected_parsed"].items():
        assert _lookup(parsed, path) == expected, path
    then = case.get("then")
    if then:
        context = then["context"]
        messages = [parsed if m == "<parsed>" else m for m in then["messages"]]
        prompt = processor.apply_chat_template(
            context + messages, thinking_mode=then["thinking_mode"], context_length=len(context)
        )
        assert prompt == then["expected_prompt"]


def test_merge_tool_messages_case(processor):
    case = CASES["test_merge_tool_messages_creates_tool_result_blocks"]
    merged = processor.merge_tool_messages(copy.deepcopy(case["messages"]))
    expected = case["expected"]
    assert len(merged) == expected["len"]
    assert merged[1]["role"] == expected["[1].role"]
    assert [block["type"] for block in merged[1]["content_blocks"]] == expected["[1].content_blocks[*].type"]


def test_parse_tagged_text_case(processor):
    case = CASES["readme_compact_txt_notation"]
    blocks = processor.parse_tagged_text(case["text"])
    # "the same standard content blocks as readme_openai_style_image_message"
    assert blocks == CASES["readme_openai_style_image_message"]["messages"][0]["content"]
    prompt = processor.apply_chat_template([{"role": "user", "content": blocks}], thinking_mode="chat")
    assert prompt == case["expected_prompt_when_encoded_as_user_message_chat"]


# --------------------------------------------------------------------------- beyond the golden cases


def _tool():
    return {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a value",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            },
        },
    }


def _tool_call_messages():
    return copy.deepcopy(CASES["test_v41_renders_spaced_dsml_with_v4_assistant_semantics"]["messages"])


TOOL_CALL_OUTPUT = CASES["test_v41_renders_spaced_dsml_with_v4_assistant_semantics"]["expected_prompt"]


def test_openai_string_and_mapping_arguments_render_alike(processor):
    messages = _tool_call_messages()
    as_mapping = copy.deepcopy(messages)
    as_mapping[1]["tool_calls"][0]["function"]["arguments"] = {"query": "value", "limit": 2}
    for msgs in (messages, as_mapping):
        assert processor.render_message(1, msgs, thinking_mode="thinking") == TOOL_CALL_OUTPUT
    # In chat mode there is no reasoning part.
    assert processor.render_message(1, messages, thinking_mode="chat") == TOOL_CALL_OUTPUT.split("</think>", 1)[1]


@pytest.mark.parametrize("location", ["tool", "function"])
@pytest.mark.parametrize("namespace", ["search", {"name": "search", "description": "Search tools."}])
def test_namespaced_tool_schemas(location, namespace, processor):
    """Upstream `test_v41_renders_namespaced_tool_schemas`."""
    tool = _tool()
    (tool if location == "tool" else tool["function"])["namespace"] = namespace
    original = copy.deepcopy(tool)
    prompt = processor.apply_chat_template(
        [{"role": "system", "content": "system", "tools": [tool]}], thinking_mode="chat"
    )
    schema = dict(_tool()["function"], name="search::lookup")
    if isinstance(namespace, dict):
        schema["description"] = "Search tools.\nLook up a value"
    assert json.dumps(schema) in prompt
    assert '"namespace":' not in prompt
    assert tool == original


@pytest.mark.parametrize("thinking_mode", ["chat", "thinking"])
@pytest.mark.parametrize("location", ["tool", "function", "qualified_name"])
def test_namespaced_tool_calls_roundtrip(thinking_mode, location, processor):
    """Upstream `test_v41_namespaced_tool_calls_roundtrip`."""
    messages = _tool_call_messages()
    call = messages[1]["tool_calls"][0]
    if location == "qualified_name":
        call["function"]["name"] = "search::lookup"
    else:
        (call if location == "tool" else call["function"])["namespace"] = "search"
    expected = TOOL_CALL_OUTPUT.replace('name="lookup"', 'name="search::lookup"')
    if thinking_mode == "chat":
        expected = expected.split("</think>", 1)[1]
    assert processor.render_message(1, messages, thinking_mode=thinking_mode) == expected
    parsed = processor.parse_completion(expected, thinking_mode=thinking_mode)
    assert parsed["tool_calls"] == [
        {
            "type": "function",
            "namespace": "search",
            "function": {"name": "lookup", "arguments": '{"query": "value", "limit": 2}'},
        }
    ]
    again = processor.apply_chat_template(messages[:1] + [parsed], thinking_mode=thinking_mode, context_length=1)
    assert again == expected


@pytest.mark.parametrize(
    ("name", "namespace", "error"),
    [
        ("search::lookup", "files", "Conflicting tool namespaces"),
        ("search::nested::lookup", None, "Tool name must not contain"),
        ("lookup", "search::nested", "Tool namespace must not contain"),
    ],
)
def test_ambiguous_tool_namespaces_are_refused(name, namespace, error, processor):
    """Upstream `test_v41_rejects_ambiguous_tool_namespaces`."""
    tool = _tool()
    tool["function"]["name"] = name
    tool["namespace"] = namespace
    with pytest.raises(DeepseekV41ProcessorError, match=error):
        processor.apply_chat_template([{"role": "system", "content": "s", "tools": [tool]}], thinking_mode="chat")
    messages = _tool_call_messages()
    messages[1]["tool_calls"][0]["function"]["name"] = name
    messages[1]["tool_calls"][0]["namespace"] = namespace
    with pytest.raises(DeepseekV41ProcessorError, match=error):
        processor.render_message(1, messages, thinking_mode="thinking")
    with pytest.raises(DeepseekV41ProcessorError, match=error):
        enc.split_tool_name(name, namespace)


def test_tool_results_merge_into_one_user_turn_in_call_order(processor):
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": '{"x": [1, 2]}'}},
    ]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "rb"},
        {"role": "tool", "tool_call_id": "a", "content": "ra"},
        {"role": "user", "content": "and?"},
    ]
    prompt = processor.apply_chat_template(messages, thinking_mode="thinking")
    invoke_f = '<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>'
    invoke_g = '<｜DSML｜ invoke name="g">\n<｜DSML｜ parameter name="x" string="false">[1, 2]</｜DSML｜ parameter>\n</｜DSML｜ invoke>'
    assert prompt == (
        BOS
        + "<｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
        + "<｜User｜>q<｜Assistant｜></think>"  # tools-free conversation: earlier reasoning dropped
        + f"\n\n<｜DSML｜ calls>\n{invoke_f}\n{invoke_g}\n</｜DSML｜ calls>{EOS}"
        + "<｜User｜><tool_result>ra</tool_result>\n\n<tool_result>rb</tool_result>\n\nand?<｜Assistant｜><think>"
    )
    merged = processor.merge_tool_messages(messages)
    assert [m["role"] for m in merged] == ["user", "assistant", "user"]
    assert [b["type"] for b in merged[2]["content_blocks"]] == ["tool_result", "tool_result", "text"]


def test_tools_argument_goes_to_the_system_turn(processor):
    with_kwarg = processor.apply_chat_template(
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}], tools=[_tool()], thinking_mode="chat"
    )
    on_message = processor.apply_chat_template(
        [{"role": "system", "content": "sys", "tools": [_tool()]}, {"role": "user", "content": "q"}],
        thinking_mode="chat",
    )
    assert with_kwarg == on_message
    assert on_message.startswith(BOS + "<｜System｜>sys\n\n## Tools\n\n")
    assert json.dumps(_tool()["function"], ensure_ascii=False) in on_message
    bare = processor.apply_chat_template([{"role": "user", "content": "q"}], tools=[_tool()], thinking_mode="chat")
    assert bare.startswith(BOS + "<｜System｜>\n\n## Tools\n\n") and bare.endswith("<｜User｜>q<｜Assistant｜></think>")


def test_tools_keep_reasoning_of_earlier_turns(processor):
    messages = [
        {"role": "system", "content": "s", "tools": [_tool()]},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
    ]
    prompt = processor.apply_chat_template(messages, thinking_mode="thinking")
    assert "<｜User｜>q1<｜Assistant｜><think>r1</think>a1" + EOS + "<｜User｜>q2<｜Assistant｜><think>" in prompt
    kept = processor.apply_chat_template(messages[1:], thinking_mode="thinking", drop_thinking=False)
    assert "<think>r1</think>a1" in kept


def test_tasks_consecutive_users_reminder_and_aliases(processor):
    action = processor.apply_chat_template([{"role": "user", "content": "do", "task": "action"}], thinking_mode="thinking")
    assert action.endswith("do<｜Assistant｜><think><｜action｜>")
    with pytest.raises(DeepseekV41ProcessorError, match="Invalid task"):
        processor.apply_chat_template([{"role": "user", "content": "x", "task": "nope"}], thinking_mode="chat")
    merged = processor.apply_chat_template(
        [{"role": "user", "content": "A"}, {"role": "user", "content": "B"}], thinking_mode="chat"
    )
    assert merged == BOS + "<｜User｜>A\n\nB<｜Assistant｜></think>"
    reminder = processor.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "latest_reminder", "content": "be brief"}], thinking_mode="chat"
    )
    assert reminder == BOS + "<｜User｜>q<｜Assistant｜></think><｜latest_reminder｜>be brief"
    messages = [{"role": "user", "content": "q"}]
    assert processor.apply_chat_template(messages, enable_thinking=True) == processor.apply_chat_template(
        messages, thinking_mode="thinking"
    )
    assert processor.apply_chat_template(messages) == processor.apply_chat_template(messages, thinking_mode="chat")
    no_eos = processor.apply_chat_template(
        messages + [{"role": "assistant", "content": "partial", "wo_eos": True}], thinking_mode="chat"
    )
    assert no_eos.endswith("<｜Assistant｜></think>partial")


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "text", "text": "hi <｜deepseek_image｜>"}]}],
        [{"role": "assistant", "content": "a", "reasoning_content": "<｜deepseek_image｜>"}],
        [{"role": "tool", "tool_call_id": "x", "content": "<｜deepseek_image｜>"}],
        [{"role": "user", "content": [{"type": "tool_result", "content": "r <｜deepseek_image｜>"}]}],
    ],
)
def test_placeholder_in_any_text_is_refused(messages, processor):
    with pytest.raises(DeepseekV41ProcessorError, match="image placeholder"):
        processor.apply_chat_template(messages, thinking_mode="chat")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"thinking_mode": "fast"}, "thinking_mode"),
        ({"context_length": -1}, "context_length"),
    ],
)
def test_bad_template_options_are_refused(kwargs, match, processor):
    with pytest.raises(DeepseekV41ProcessorError, match=match):
        processor.apply_chat_template([{"role": "user", "content": "q"}], **kwargs)


def test_unknown_role_is_refused(processor):
    with pytest.raises(DeepseekV41ProcessorError, match="unknown role"):
        processor.apply_chat_template([{"role": "developer", "content": "q"}], thinking_mode="chat")


@pytest.mark.parametrize("effort", [None, "low", "high", "max", 1, 42, 100, 0, 101, -1, "medium", True, False, 1.5, "75"])
def test_python_budget_agrees_with_the_template(effort, processor):
    messages = [{"role": "user", "content": "q"}]
    try:
        budget = enc.reasoning_effort_budget(effort)
    except DeepseekV41ProcessorError:
        with pytest.raises(DeepseekV41ProcessorError, match=r"int within \[1,100\]"):
            processor.apply_chat_template(messages, thinking_mode="thinking", reasoning_effort=effort)
        return
    prompt = processor.apply_chat_template(messages, thinking_mode="thinking", reasoning_effort=effort)
    assert prompt.startswith(BOS + ENCODING["reasoning_effort_template"].format(budget=budget))


@pytest.mark.parametrize(
    ("completion", "mode", "match"),
    [
        ("no think" + EOS, "thinking", "missing </think>"),
        ("r</think>answer", "thinking", "end-of-sentence"),
        ("answer" + EOS + "more", "chat", "after the end-of-sentence"),
        ("a<think>b" + EOS, "chat", "special token"),
        ('x\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\nbad\n</｜DSML｜ invoke>\n</｜DSML｜ calls>' + EOS, "chat", "format"),
    ],
)
def test_malformed_completions_are_refused(completion, mode, match, processor):
    with pytest.raises(DeepseekV41ProcessorError, match=match):
        processor.parse_completion(completion, thinking_mode=mode)


def test_parse_tagged_text_variants():
    assert enc.parse_tagged_text("<image>a.png</image>") == [{"type": "image_url", "image_url": {"url": "a.png"}}]
    assert enc.parse_tagged_text("x<image>a</image><image>b</image>") == [
        {"type": "text", "text": "x"},
        {"type": "image_url", "image_url": {"url": "a"}},
        {"type": "image_url", "image_url": {"url": "b"}},
    ]
    with pytest.raises(DeepseekV41ProcessorError, match="empty"):
        enc.parse_tagged_text("<image> </image>")


def test_packaged_template_is_the_processor_default(processor):
    assert processor.chat_template == default_chat_template()
    assert "raise_exception" in processor.chat_template


IMAGE = "<｜deepseek_image｜>"


def _schema(name="get_weather", description="Weather.", properties=None):
    parameters = {"type": "object", "properties": properties or {"city": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _called(name="f", arguments=None):
    return [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments or {}}}],
        },
        {"role": "tool", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("messages", "tools"),
    [
        ([{"role": "user", "content": "q"}], [_schema(description="w " + IMAGE)]),
        ([{"role": "user", "content": "q"}], [_schema(properties={"city": {"type": "string", "description": IMAGE}})]),
        ([{"role": "user", "content": "q"}], [_schema(name="w" + IMAGE)]),
        (_called(arguments={"q": IMAGE}), None),
        (_called(arguments={IMAGE: 1}), None),
        (_called(arguments='{"q": "' + IMAGE + '"}'), None),
        (_called(name="f" + IMAGE), None),
        ([{"role": "system", "content": "s", "response_format": {"type": IMAGE}}, {"role": "user", "content": "q"}], None),
        ([{"role": "user", "content": [{"type": IMAGE}]}], None),
    ],
)
def test_placeholder_in_tools_tool_calls_and_other_fields_is_refused(messages, tools, processor):
    # Formerly rendered as is: the extra placeholder then met "Found 2 image tokens but got 1 images"
    # when tokenizing, or silently shifted the images of a later processor call.
    for tokenize in (False, True):
        with pytest.raises(DeepseekV41ProcessorError, match="image placeholder"):
            processor.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=tokenize, return_dict=tokenize)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_thinking": "no"}, "enable_thinking must be true or false"),
        ({"enable_thinking": 1}, "enable_thinking must be true or false"),
        ({"thinking_mode": "chat", "enable_thinking": True}, "conflicts"),
        ({"thinking_mode": "thinking", "enable_thinking": False}, "conflicts"),
        ({"drop_thinking": "no"}, "drop_thinking"),
        ({"add_default_bos_token": 0}, "add_default_bos_token"),
    ],
)
def test_thinking_switches_must_be_bools_that_agree(kwargs, match, processor):
    # Formerly enable_thinking="no" turned thinking ON and a contradicting pair was silently resolved.
    with pytest.raises(DeepseekV41ProcessorError, match=match):
        processor.apply_chat_template([{"role": "user", "content": "q"}], **kwargs)


def test_agreeing_thinking_switches_are_accepted(processor):
    messages = [{"role": "user", "content": "q"}]
    for mode, flag in (("thinking", True), ("chat", False)):
        assert processor.apply_chat_template(messages, thinking_mode=mode, enable_thinking=flag) == (
            processor.apply_chat_template(messages, thinking_mode=mode)
        )
    assert processor.apply_chat_template(messages, enable_thinking=False) == processor.apply_chat_template(messages)
