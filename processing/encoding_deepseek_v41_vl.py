"""Helpers around the DeepSeek-V4.1 chat format that a Jinja template cannot do.

The format itself is rendered by `chat_template.jinja`, which mirrors upstream
`encoding/encoding.py: encode_messages` (not public; its README and `test_encoding.py` are the
spec). This module holds the Python side:

- :func:`parse_completion` mirrors `parse_message_from_completion_text`: model output text ->
  assistant message (reasoning, content, OpenAI-style tool calls from the spaced V4.1 DSML tags);
- :func:`merge_tool_messages` mirrors the upstream preprocessing of the same name (tool results
  become `tool_result` blocks of a user turn);
- :func:`parse_tagged_text` mirrors the compact `text<image>path</image>text` notation;
- :func:`normalize_tool_call_arguments` parses JSON-string tool-call arguments into mappings,
  because the template has no JSON parser;
- :func:`mark_image_blocks` and :func:`image_block_source` let the processor find which image
  blocks the template emitted (and load exactly those).

Every error is a :class:`DeepseekV41ProcessorError` (a `ValueError`) naming the problem; upstream
raises `AssertionError`/`ValueError` in the same places.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from typing import Any

from .errors_deepseek_v41_vl import DeepseekV41ProcessorError

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SYSTEM_TOKEN = "<｜System｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
DSML_TOKEN = "｜DSML｜"
# V4.1 tag names carry a leading space; the unspaced V4 tags are not accepted.
DSML_CALLS = f"<{DSML_TOKEN} calls>"
DSML_CALLS_END = f"</{DSML_TOKEN} calls>"
DSML_INVOKE = f"<{DSML_TOKEN} invoke"
DSML_INVOKE_END = f"</{DSML_TOKEN} invoke"
DSML_PARAMETER = f"<{DSML_TOKEN} parameter"
DSML_PARAMETER_CLOSE = f"/{DSML_TOKEN} parameter"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
REASONING_EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}
REASONING_EFFORT_TEMPLATE = (
    SYSTEM_TOKEN + "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)

# The generated assistant turn, as transformers' declarative response parser reads it
# (`tokenizer.response_template`: the image-text-to-text pipeline, `transformers serve`,
# `tokenizer.parse_response`). It splits what :func:`parse_completion` splits: `reasoning_content` up
# to `</think>`, `content` up to EOS, one OpenAI-style tool call per DSML invoke, whitespace kept.
# It differs in being lenient where `parse_completion` raises: a generation cut before EOS (or
# inside the reasoning) parses as far as it got, and malformed DSML is not refused (a duplicate
# parameter keeps the last value; `ns::tool` stays one name). Tool-call `arguments` are a mapping
# (transformers' convention; `parse_completion` returns upstream's JSON string), and
# `string="false"` values stay strings unless `tools` is given, whose JSON schema casts them. The
# anchor also takes the `</think>` that a chat-mode prompt ends with.
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": re.escape(ASSISTANT_TOKEN) + "(?:" + re.escape(THINK_END) + ")?",
    "fields": {
        "reasoning_content": {"open": THINK_START, "close": THINK_END, "content": "text", "content_args": {"strip": False}},
        "tool_calls": {
            "open_pattern": r"(?:\n\n" + re.escape(DSML_CALLS) + r"\n)?" + re.escape(DSML_INVOKE) + r' name="(?P<name>[^"\n]+)">\n',
            "close_pattern": re.escape(DSML_INVOKE_END) + r">\n(?:" + re.escape(DSML_CALLS_END) + ")?",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": re.escape(DSML_PARAMETER)
                + r' name="(?P<key>[^"\n]+)" string="(?:true|false)">(?P<value>.*?)<'
                + re.escape(DSML_PARAMETER_CLOSE)
                + r">\n?"
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close": EOS_TOKEN, "content": "text", "content_args": {"strip": False}},
    },
}

_TAGGED_IMAGE = re.compile(r"<image>(.*?)</image>", re.DOTALL)
_INVOKE_NAME = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAMETER = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# The deepest nesting of lists and objects taken in a message, a tool schema or a call's
# arguments (each counted from its own top: `{"a": [1]}` is 2 deep). Deeper values would
# exhaust Python's recursion in the JSON parser, the copies and the template's data conversion;
# `deepseek-v41-vl serve` refuses request fields nesting deeper with the same limit.
MAX_JSON_DEPTH = 64


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of mappings, lists and tuples in `value` (0 for a scalar), counted without
    recursion; the count stops at ``limit + 1`` (so a cyclic value ends too)."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


def check_json_depth(value: Any, where: str) -> None:
    """Refuse `value` nesting deeper than :data:`MAX_JSON_DEPTH`.

    Raises:
        DeepseekV41ProcessorError: naming `where`.
    """
    if json_depth(value) > MAX_JSON_DEPTH:
        raise DeepseekV41ProcessorError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels of lists and objects")


def deep_message_part(message: Any) -> str | None:
    """Where `message` nests deeper than :data:`MAX_JSON_DEPTH`, or None: "" (the message, its
    tool calls' arguments left out), ``"tool_calls[j]"`` (a call, its arguments left out) or
    ``"tool_calls[j].function.arguments"`` / ``"tool_calls[j].arguments"`` (counted from their own
    top, so a call's arguments may nest as deep as a tool schema)."""
    if not isinstance(message, Mapping) or not isinstance(message.get("tool_calls"), (list, tuple)):
        return None if json_depth(message) <= MAX_JSON_DEPTH else ""
    if json_depth({key: value for key, value in message.items() if key != "tool_calls"}) > MAX_JSON_DEPTH:
        return ""
    for number, call in enumerate(message["tool_calls"]):
        if not isinstance(call, Mapping):
            if json_depth(call) > MAX_JSON_DEPTH - 2:  # inside the message and its list
                return f"tool_calls[{number}]"
            continue
        function = call.get("function")
        nested = isinstance(function, Mapping)
        holder = function if nested else call
        path = f"tool_calls[{number}].function.arguments" if nested else f"tool_calls[{number}].arguments"
        if json_depth(holder.get("arguments")) > MAX_JSON_DEPTH:
            return path
        rest = {key: value for key, value in call.items() if key != ("function" if nested else "arguments")}
        if nested:
            rest["function"] = {key: value for key, value in function.items() if key != "arguments"}
        if json_depth(rest) > MAX_JSON_DEPTH - 2:
            return f"tool_calls[{number}]"
    return None


def _loads(text: str, where: str) -> Any:
    """`json.loads`, refusing text nesting too deep for the parser (ValueError for invalid JSON)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise DeepseekV41ProcessorError(
            f"{where}: nested deeper than {MAX_JSON_DEPTH} levels of lists and objects"
        ) from None


def reasoning_effort_budget(reasoning_effort: Any = None) -> int:
    """The 1..100 budget of a reasoning effort, as the template computes it.

    `None` -> 75 (upstream default `"high"`); `"low"` 50, `"high"` 75, `"max"` 100; an `int`
    (not a `bool`) within [1, 100] is itself.

    Raises:
        DeepseekV41ProcessorError: anything else ("... int within [1,100] ...").
    """
    if reasoning_effort is None:
        return 75
    if isinstance(reasoning_effort, str) and reasoning_effort in REASONING_EFFORT_ALIASES:
        return REASONING_EFFORT_ALIASES[reasoning_effort]
    if type(reasoning_effort) is int and 1 <= reasoning_effort <= 100:
        return reasoning_effort
    raise DeepseekV41ProcessorError(
        "reasoning_effort must be 'low', 'high', 'max' or an int within [1,100], got " + repr(reasoning_effort)
    )


def split_tool_name(name: str, namespace: str | None = None) -> tuple[str | None, str]:
    """Split `ns::tool` into (namespace, tool), checking it against a separate namespace hint.

    Mirrors upstream `encoding.py: _split_tool_name`.

    Raises:
        DeepseekV41ProcessorError: "Conflicting tool namespaces", "Tool name must not contain
            '::'" or "Tool namespace must not contain '::'".
    """
    bare = name
    if "::" in name:
        prefix, bare = name.split("::", 1)
        if namespace and namespace != prefix:
            raise DeepseekV41ProcessorError(f"Conflicting tool namespaces: {namespace} != {prefix}")
        namespace = prefix
    if "::" in bare:
        raise DeepseekV41ProcessorError(f"Tool name must not contain '::': {bare}")
    if namespace and "::" in namespace:
        raise DeepseekV41ProcessorError(f"Tool namespace must not contain '::': {namespace}")
    return (namespace or None), bare


# --------------------------------------------------------------------------- completion parsing


def _read_until(text: str, index: int, stops: list[str]) -> tuple[int, str, str | None]:
    """Text from `index` to the earliest of `stops`; returns (index after the stop, text, stop)."""
    best, matched = len(text), None
    for stop in stops:
        pos = text.find(stop, index)
        if pos != -1 and pos < best:
            best, matched = pos, stop
    if matched is None:
        return len(text), text[index:], None
    return best + len(matched), text[index:best], matched


def _decode_arguments(arguments: dict[str, tuple[str, str]]) -> str:
    """DSML parameters -> the JSON-string arguments upstream builds (string values re-quoted)."""
    items = []
    for key, (value, is_string) in arguments.items():
        items.append(f"{_to_json(key)}: {_to_json(value) if is_string == 'true' else value}")
    return "{" + ", ".join(items) + "}"


def _parse_tool_calls(text: str, index: int) -> tuple[int, list[dict[str, Any]]]:
    """Parse the invokes that follow `\\n\\n<｜DSML｜ calls`; returns (index after the block, calls)."""
    calls: list[dict[str, Any]] = []
    while True:
        index, between, stop = _read_until(text, index, [DSML_INVOKE, DSML_CALLS_END])
        if between != ">\n":
            raise DeepseekV41ProcessorError(f"tool-call format error: expected '>\\n' but got {between!r}")
        if stop == DSML_CALLS_END:
            return index, calls
        if stop is None:
            raise DeepseekV41ProcessorError(f"tool-call block is not closed by {DSML_CALLS_END!r}")
        index, head, stop = _read_until(text, index, [DSML_PARAMETER, DSML_INVOKE_END])
        names = _INVOKE_NAME.findall(head)
        if len(names) != 1:
            raise DeepseekV41ProcessorError(f"tool name format error: {head!r}")
        arguments: dict[str, tuple[str, str]] = {}
        while stop == DSML_PARAMETER:
            index, body, stop = _read_until(text, index, [DSML_PARAMETER_CLOSE])
            found = _PARAMETER.findall(body)
            if len(found) != 1:
                raise DeepseekV41ProcessorError(f"tool parameter format error: {body!r}")
            key, is_string, value = found[0]
            if key in arguments:
                raise DeepseekV41ProcessorError(f"duplicate tool parameter name: {key!r}")
            arguments[key] = (value, is_string)
            index, between, stop = _read_until(text, index, [DSML_PARAMETER, DSML_INVOKE_END])
            if between != ">\n":
                raise DeepseekV41ProcessorError(f"tool parameter format error: expected '>\\n' but got {between!r}")
        if stop is None:
            raise DeepseekV41ProcessorError(f"tool invoke is not closed by {DSML_INVOKE_END + '>'!r}")
        namespace, name = split_tool_name(names[0])
        call: dict[str, Any] = {"type": "function"}
        if namespace is not None:
            call["namespace"] = namespace
        call["function"] = {"name": name, "arguments": _decode_arguments(arguments)}
        calls.append(call)


def parse_completion(text: str, thinking_mode: str | None = None) -> dict[str, Any]:
    """Parse one generated assistant turn into a message.

    Mirrors upstream `encoding.py: parse_message_from_completion_text` with the V4.1 spaced DSML
    tags. The text is what the model wrote after the prompt, ending with `<｜end▁of▁sentence｜>`
    (decode with `skip_special_tokens=False`).

    Args:
        text: the completion text.
        thinking_mode: `"thinking"` (the text is `reasoning</think>answer...`), `"chat"` (no
            reasoning part), or None to pick `"thinking"` exactly when `</think>` occurs.

    Returns:
        `{"role": "assistant", "content": str, "reasoning_content": str, "tool_calls": list}`;
        each tool call is `{"type": "function", ["namespace": ns,] "function": {"name", "arguments"}}`
        with `arguments` a JSON string.

    Raises:
        DeepseekV41ProcessorError: malformed text: missing `</think>` in thinking mode, missing
            EOS, malformed or unspaced (V4) DSML, text after the tool calls, or a special token
            (BOS, EOS, `<think>`, `</think>`, `｜DSML｜`) inside the reasoning or the content.
    """
    if not isinstance(text, str):
        raise DeepseekV41ProcessorError(f"completion must be a str, got {type(text).__name__}")
    if thinking_mode is None:
        thinking_mode = "thinking" if THINK_END in text else "chat"
    if thinking_mode not in ("chat", "thinking"):
        raise DeepseekV41ProcessorError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    calls_start = "\n\n" + DSML_CALLS[:-1]  # "\n\n<｜DSML｜ calls" (the '>' is checked by the parser)
    index, reasoning = 0, ""
    if thinking_mode == "thinking":
        index, reasoning, stop = _read_until(text, index, [THINK_END, calls_start])
        if stop != THINK_END:
            raise DeepseekV41ProcessorError("invalid thinking format: missing </think>")
    index, content, stop = _read_until(text, index, [EOS_TOKEN, calls_start])
    tool_calls: list[dict[str, Any]] = []
    if stop == calls_start:
        index, tool_calls = _parse_tool_calls(text, index)
        index, trailing, stop = _read_until(text, index, [EOS_TOKEN])
        if trailing:
            raise DeepseekV41ProcessorError(f"unexpected text after the tool calls: {trailing!r}")
    if stop != EOS_TOKEN:
        raise DeepseekV41ProcessorError("invalid completion: missing the end-of-sentence token")
    if index != len(text):
        raise DeepseekV41ProcessorError(f"unexpected text after the end-of-sentence token: {text[index:]!r}")
    for token in (BOS_TOKEN, EOS_TOKEN, THINK_START, THINK_END, DSML_TOKEN):
        if token in content or token in reasoning:
            raise DeepseekV41ProcessorError(f"unexpected special token {token!r} in the completion content")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


# --------------------------------------------------------------------------- preprocessing


def merge_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold `tool` messages into user turns made of content blocks.

    Mirrors upstream `encoding.py: merge_tool_messages` (V4.1 has no tool role in the prompt):
    a `tool` message becomes a `{"type": "tool_result", "tool_use_id", "content"}` block appended
    to the preceding user turn, or a new user turn; a user message gets `content_blocks` (its
    content as one text block, unless it has blocks already) and is appended to a preceding user
    turn that has no `task`. Other messages are copied as they are. The input is not modified.

    Raises:
        DeepseekV41ProcessorError: a message is not a mapping, or `content_blocks` is not a list.
    """
    merged: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict):
            raise DeepseekV41ProcessorError(f"messages must be dicts, got {type(message).__name__}")
        message = copy.deepcopy(message)
        role = message.get("role")
        previous = merged[-1] if merged else None
        if role == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": message.get("tool_call_id", ""),
                "content": message.get("content", ""),
            }
            if previous is not None and previous.get("role") == "user" and "content_blocks" in previous:
                previous["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = message.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": message.get("content", "")}]
            elif not isinstance(blocks, list):
                raise DeepseekV41ProcessorError("content_blocks must be a list")
            if (
                previous is not None
                and previous.get("role") == "user"
                and previous.get("task") is None
                and "content_blocks" in previous
            ):
                previous["content_blocks"].extend(blocks)
            else:
                message["content_blocks"] = blocks
                merged.append(message)
        else:
            merged.append(message)
    return merged


def parse_tagged_text(text: str) -> list[dict[str, Any]]:
    """Split the compact notation `text<image>path</image>text` into content blocks.

    Mirrors upstream `encoding.py: parse_tagged_text`: the result is the OpenAI-style blocks
    `{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url": path}}` in
    order; empty text pieces are left out, others are kept verbatim (no stripping).

    Raises:
        DeepseekV41ProcessorError: `text` is not a str, or an `<image>` tag is empty.
    """
    if not isinstance(text, str):
        raise DeepseekV41ProcessorError(f"tagged text must be a str, got {type(text).__name__}")
    blocks: list[dict[str, Any]] = []
    last = 0
    for match in _TAGGED_IMAGE.finditer(text):
        if match.start() > last:
            blocks.append({"type": "text", "text": text[last : match.start()]})
        url = match.group(1).strip()
        if not url:
            raise DeepseekV41ProcessorError(f"empty <image></image> tag at character {match.start()}")
        blocks.append({"type": "image_url", "image_url": {"url": url}})
        last = match.end()
    if last < len(text):
        blocks.append({"type": "text", "text": text[last:]})
    return blocks


_IMAGE_SOURCE_KEYS = ("source", "url", "data", "image", "path", "base64")


def _image_record(block: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {"type": "image"}
    if block.get("type") == "image_url":
        url = block.get("image_url")
        record["url"] = url.get("url", "") if isinstance(url, dict) else (url or "")
    else:
        record.update({key: block[key] for key in _IMAGE_SOURCE_KEYS if key in block})
    if not any(record.get(key) is not None and record.get(key) != "" for key in _IMAGE_SOURCE_KEYS):
        raise DeepseekV41ProcessorError(f"image block has no source (one of {', '.join(_IMAGE_SOURCE_KEYS)}): {block!r}")
    return record


def collect_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image records of a conversation, in prompt order.

    Mirrors the `media["images"]` of upstream `encode_messages(..., return_multi_modal_data=True)`:
    one `{"type": "image", <source key>: ...}` per `image` / `image_url` block of the messages'
    content lists (and of `tool_result` blocks inside them); an `image_url` block gives
    `{"type": "image", "url": ...}`.

    Raises:
        DeepseekV41ProcessorError: an image block has no source.
    """
    records: list[dict[str, Any]] = []

    def walk(blocks: Any) -> None:
        if not isinstance(blocks, list):
            return
        for block in blocks:
            if not isinstance(block, dict):
                continue
            if block.get("type") in ("image", "image_url"):
                records.append(_image_record(block))
            elif block.get("type") == "tool_result":
                walk(block.get("content"))

    for message in messages:
        if isinstance(message, dict):
            walk(message.get("content"))
            walk(message.get("content_blocks"))
    return records


def image_block_source(block: dict[str, Any]) -> Any:
    """The image an `image` / `image_url` content block points at, as the image processor takes it.

    `{"type": "image_url", "image_url": {"url": u}}` (or `"image_url": u`) gives `u`; an `image`
    block gives the value of its one source key (`source`, `url`, `data`, `image`, `path`,
    `base64`): a path, URL, data URL, bytes or PIL image. A `base64` string that is not already a
    data URL is wrapped as one.

    Raises:
        DeepseekV41ProcessorError: the block has no source, or several (which one is meant would
            be a guess), or a source that is a list, tuple, set or mapping (one block is one image).
    """
    if block.get("type") == "image_url":
        url = block.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if url is None or (isinstance(url, str) and not url.strip()):
            raise DeepseekV41ProcessorError(f"image block has no source (image_url.url): {block!r:.200}")
        return _one_image(url, block)
    present = [key for key in _IMAGE_SOURCE_KEYS if _has_value(block.get(key))]
    if not present:
        raise DeepseekV41ProcessorError(
            f"image block has no source (one of {', '.join(_IMAGE_SOURCE_KEYS)}): {block!r:.200}"
        )
    if len(present) > 1:
        raise DeepseekV41ProcessorError(
            f"image block has several sources {present}; give exactly one: {block!r:.200}"
        )
    value = _one_image(block[present[0]], block)
    if present[0] == "base64" and isinstance(value, str) and not value.startswith("data:"):
        return "data:;base64," + value
    return value


def _one_image(value: Any, block: dict[str, Any]) -> Any:
    # a list would reach the image processor as several images behind one placeholder
    if isinstance(value, (list, tuple, set, dict)):
        raise DeepseekV41ProcessorError(
            f"an image block holds one image, got a {type(value).__name__} as its source: {block!r:.200}"
        )
    return value


def _has_value(value: Any) -> bool:
    # Not `bool(value)`: arrays have no truth value, and an empty string means "no source".
    return value is not None and not (isinstance(value, str) and not value.strip())


def mark_image_blocks(
    messages: list[dict[str, Any]], marker: Any, start: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A copy of `messages` whose image blocks are text blocks `{"type": "text", "text": marker(k)}`.

    Image blocks (`image` / `image_url`) are replaced at the top level of each message's content
    list and inside the content lists of `tool_result` blocks, i.e. wherever the chat template
    renders one; k counts them from `start` in message order. The input is not modified.

    Returns:
        (marked messages, the replaced blocks in order of k).
    """
    found: list[dict[str, Any]] = []

    def mark(blocks: Any, nested: bool) -> Any:
        if not isinstance(blocks, list):
            return blocks
        out = []
        for block in blocks:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("image", "image_url"):
                out.append({"type": "text", "text": marker(start + len(found))})
                found.append(block)
            elif kind == "tool_result" and not nested and isinstance(block.get("content"), list):
                out.append(dict(block, content=mark(block["content"], nested=True)))
            else:
                out.append(block)
        return out

    marked = []
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = dict(message, content=mark(message["content"], nested=False))
        marked.append(message)
    return marked, found


def _arguments_mapping(arguments: Any, where: str) -> Any:
    """Tool-call arguments as a mapping: a mapping as it is, a JSON string of an object parsed
    (double-encoded JSON tolerated, as upstream `encode_arguments_to_dsml` does), an empty or
    whitespace-only string as `{}` (no arguments: what OpenAI-compatible clients send for a call
    of a tool without parameters).

    Raises:
        DeepseekV41ProcessorError: anything else (invalid JSON, a JSON array / number / string /
            null, a list, a number, None): upstream would render it as one `arguments` parameter,
            a call the tool's schema never describes; arguments nesting deeper than
            :data:`MAX_JSON_DEPTH`.
    """
    if isinstance(arguments, Mapping):
        check_json_depth(arguments, f"{where}: arguments")
        return arguments
    if isinstance(arguments, str) and not arguments.strip():
        return {}  # OpenAI-compatible clients send "" for a call without arguments
    if isinstance(arguments, str):
        parsed: Any = arguments
        error = None
        for _ in range(2):  # tolerate double-encoded JSON, as upstream does
            if not isinstance(parsed, str):
                break
            try:
                parsed = _loads(parsed, f"{where}: arguments")
            except DeepseekV41ProcessorError:
                raise
            except ValueError as err:
                error = err
                break
        if isinstance(parsed, dict):
            check_json_depth(parsed, f"{where}: arguments")
            return parsed
        found = f"invalid JSON ({error})" if error is not None and parsed is arguments else f"JSON {type(parsed).__name__}"
        raise DeepseekV41ProcessorError(
            f"{where}: arguments must be a JSON object (a mapping, or a string holding one), got {found}: {arguments!r:.120}"
        )
    raise DeepseekV41ProcessorError(
        f"{where}: arguments must be a JSON object (a mapping, or a string holding one), "
        f"got {type(arguments).__name__}: {arguments!r:.120}"
    )


def normalize_tool_call_arguments(messages: list[Any]) -> list[Any]:
    """A copy of `messages` whose tool-call `arguments` JSON strings are parsed into mappings
    (an empty or whitespace-only string is `{}`: a call without arguments).

    The chat template renders each argument as a DSML parameter and needs a mapping; OpenAI
    clients send a JSON string. Messages that are not dicts, and calls that are not dicts or have
    no `arguments` (the template names those), are left alone.

    Raises:
        DeepseekV41ProcessorError: `arguments` that are not a JSON object: invalid JSON
            (`'{not json'`), a JSON array / number / string / null, or a list, number or None.
            Upstream wraps them as `{"arguments": ...}`, which renders a call with a parameter the
            tool does not have; arguments nesting deeper than :data:`MAX_JSON_DEPTH`. The message
            names the message and call.
    """
    out = []
    for index, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            message = dict(message)
            calls = []
            for number, call in enumerate(message["tool_calls"]):
                if isinstance(call, dict):
                    call = dict(call)
                    target = call.get("function") if isinstance(call.get("function"), dict) else None
                    holder = target if target is not None else call
                    if "arguments" in holder:
                        name = holder.get("name", call.get("name"))
                        where = f"message {index} tool call {number} ({name!r})"
                        arguments = _arguments_mapping(holder["arguments"], where)
                        if target is not None:
                            call["function"] = dict(target, arguments=arguments)
                        else:
                            call["arguments"] = arguments
                calls.append(call)
            message["tool_calls"] = calls
        out.append(message)
    return out


__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "DSML_TOKEN",
    "EOS_TOKEN",
    "IMAGE_PLACEHOLDER",
    "LATEST_REMINDER_TOKEN",
    "MAX_JSON_DEPTH",
    "REASONING_EFFORT_ALIASES",
    "REASONING_EFFORT_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "SYSTEM_TOKEN",
    "TASK_TOKENS",
    "check_json_depth",
    "collect_images",
    "deep_message_part",
    "image_block_source",
    "json_depth",
    "mark_image_blocks",
    "THINK_END",
    "THINK_START",
    "USER_TOKEN",
    "merge_tool_messages",
    "normalize_tool_call_arguments",
    "parse_completion",
    "parse_tagged_text",
    "reasoning_effort_budget",
    "split_tool_name",
]
