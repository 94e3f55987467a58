"""What `deepseek-v41-vl serve` accepts from a request, checked before the model or any image is
touched (the app wiring is `serve.py`).

- Images: at most ``max_images`` per request (all turns together). Each image is a base64 data
  URL; an http(s) URL only with ``--allow-image-urls``; a local path only inside ``--image-dir``
  (resolved, symlinks followed, a regular file). Other schemes (``file:``, ``ftp:``...) are refused.
  The byte and pixel caps per image are the image processor's (``max_image_bytes``,
  ``max_image_pixels``), set from the options and checked before decoding.
- Thinking: ``reasoning_effort`` ("none" for chat mode; otherwise thinking mode with the effort,
  which the chat template checks) on chat completions; the request's ``chat_template_kwargs`` may
  set only the template's switches, never the processor's options.
- Fields transformers' handlers would turn into a bare 500 (``messages`` not a list of role
  messages, sampling numbers that are not numbers, a ``generation_config`` that does not parse,
  ``logit_bias`` ids outside the vocabulary, a lone UTF-16 surrogate in any text, ``tools`` not a
  list of function tools, a field or tool-call ``arguments`` nesting lists and objects deeper than
  the processor's ``MAX_JSON_DEPTH`` (64) levels) or answer wrongly or silently (``n`` other than 1,
  a conversation with no user message, a text part whose text is not a string, a part of a type
  other than text or image); integer ``logit_bias`` values become the floats transformers takes.

Every refusal is a :class:`ServeRequestError`, answered with HTTP 400 and its message.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from .processing.encoding_deepseek_v41_vl import MAX_JSON_DEPTH, deep_message_part, json_depth

# The chat template's switches a request may set through `chat_template_kwargs`.
REQUEST_TEMPLATE_SWITCHES = ("thinking_mode", "enable_thinking", "reasoning_effort", "drop_thinking")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# OpenAI's ranges of the sampling numbers; frequency_penalty becomes transformers'
# repetition_penalty = 1 + frequency_penalty, which must stay > 0
_NUMBER_FIELDS = {"temperature": (0, 2), "top_p": (0, 1), "frequency_penalty": (-0.99, 2), "presence_penalty": (-2, 2)}
# `generation_config` keys a request may set: sampling and token biases, nothing that changes the
# search (beams, candidate generation) or the cache
GENERATION_CONFIG_KEYS = (
    "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "eos_token_id", "pad_token_id",
    "sequence_bias", "min_new_tokens", "max_new_tokens",
)
# the token-count fields of chat completions, completions and responses
_COUNT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# the message part types transformers' handlers turn into text or an image (chat completions and
# Responses spellings); others (audio, video, files) it would drop silently
TEXT_PART_TYPES = ("text", "input_text", "output_text")
IMAGE_PART_TYPES = ("image_url", "input_image")
# the longest logit_bias key read as a token id (a longer one is no id of any vocabulary, and
# Python refuses to convert more than 4300 digits)
_MAX_ID_DIGITS = 20


@dataclass(frozen=True)
class ServeLimits:
    """The server's image limits (command-line options of `deepseek-v41-vl serve`).

    Attributes:
        max_images: ``--max-images``, images in one request, all turns together (default 16).
        max_image_bytes: ``--max-image-bytes``, encoded bytes of one image (default 20 MiB).
        max_image_pixels: ``--max-image-pixels``, width * height of one image, from its header
            (default 50,000,000, e.g. 8660 x 5773; the model resizes every image to at most 1024
            prompt positions anyway).
        allow_image_urls: ``--allow-image-urls``, fetch http(s) image URLs (off by default: the
            server would fetch any address a client names).
        image_dir: ``--image-dir DIR``, the folder local image paths may name (None, the
            default: local paths are refused, since the server would read any file it can).
        max_tokens: ``--max-tokens``, new tokens one request may ask for (default 32768, the
            released generation config's); a request that names none gets this many at most.
            Requests run one at a time, so this bounds how long one can hold the server.
        max_prompt_tokens: ``--max-prompt-tokens``, the longest prompt served, in tokens (None,
            the default: the model's context, its config's ``max_position_embeddings``).
        image_fetch_timeout: ``--image-fetch-timeout``, seconds to fetch a request's image URLs,
            the whole fetch (default 30; with ``allow_image_urls``).
        allow_special_tokens_in_messages: ``--allow-special-tokens-in-messages``, let control
            tokens typed in message text become the special tokens (off by default: a message
            could forge turns).
    """

    max_images: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    allow_image_urls: bool = False
    image_dir: str | None = None
    max_tokens: int = 32768
    max_prompt_tokens: int | None = None
    image_fetch_timeout: float = 30.0
    allow_special_tokens_in_messages: bool = False


class ServeRequestError(ValueError):
    """A request this server refuses (answered with HTTP 400 and this message)."""


def request_template_kwargs(body: dict) -> dict:
    """The `chat_template_kwargs` a chat request asks for, with ``reasoning_effort`` mapped in.

    Args:
        body: the request's JSON body (not changed).

    Returns:
        The template switches: the request's own, plus ``enable_thinking`` (and
        ``reasoning_effort``) from a ``reasoning_effort`` field: "none" is chat mode, any other
        value thinking mode with that effort (the template refuses efforts it does not take).

    Raises:
        ServeRequestError: `chat_template_kwargs` not an object or setting anything but
            :data:`REQUEST_TEMPLATE_SWITCHES`; a ``reasoning_effort`` that contradicts them.
    """
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ServeRequestError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    other = sorted(set(kwargs) - set(REQUEST_TEMPLATE_SWITCHES))
    if other:
        raise ServeRequestError(f"chat_template_kwargs may set only {list(REQUEST_TEMPLATE_SWITCHES)}; got {other}")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs
    wanted = {"enable_thinking": False} if effort == "none" else {"enable_thinking": True, "reasoning_effort": effort}
    if kwargs.get("thinking_mode") is not None:
        kwargs.setdefault("enable_thinking", kwargs["thinking_mode"] == "thinking")
    for key, value in wanted.items():
        if kwargs.get(key, value) != value:
            raise ServeRequestError(f"reasoning_effort={effort!r} contradicts chat_template_kwargs {key}={kwargs[key]!r}")
        kwargs[key] = value
    return kwargs


def check_request_fields(body: dict, limits: ServeLimits, count_field: str, vocab_size: int | None = None) -> dict:
    """Refuse the fields transformers' handlers would fail on with a 500, and bound the new tokens.

    Args:
        body: the request's JSON body (not changed).
        limits: the server's limits (``max_tokens``).
        count_field: the endpoint's token-count field, set to ``limits.max_tokens`` when the
            request names none (``max_tokens`` or ``max_output_tokens``).
        vocab_size: the model's vocabulary size (``logit_bias`` ids are below it); None: not
            checked here.

    Returns:
        The body to serve (a copy when a count was added or ``logit_bias`` values became floats,
        as transformers' ``sequence_bias`` takes them).

    Raises:
        ServeRequestError: a sampling number outside its range (temperature [0, 2], top_p [0, 1],
            frequency_penalty [-0.99, 2], presence_penalty [-2, 2]) or not a number; a token
            count that is not an integer in [1, ``limits.max_tokens``]; a ``seed`` outside 64
            bits; a ``stop`` that is not a string or list of strings; a ``logit_bias`` that is
            not token ids (below `vocab_size`) to numbers in [-100, 100]; a ``suffix`` that is not
            a string; a ``generation_config`` that is not a JSON object string of
            :data:`GENERATION_CONFIG_KEYS` transformers' `GenerationConfig` takes; an ``n`` other
            than 1 (one choice per request is served); a field nesting lists and objects deeper
            than ``MAX_JSON_DEPTH`` levels (each message and each tool counted from its own top,
            as the processor counts them; checked first: deeper values exhaust Python's
            recursion); a string anywhere in the body holding a lone UTF-16 surrogate (it cannot be
            encoded as UTF-8, so not tokenized).
    """
    from transformers import GenerationConfig

    for name, value in body.items():
        if name == "messages" and isinstance(value, list):
            # each message as the processor counts it: a tool call's arguments from their own top
            for i, message in enumerate(value):
                part = deep_message_part(message)
                if part is not None:
                    raise ServeRequestError(_too_deep(f"messages[{i}]{'.' + part if part else ''}"))
        elif name == "tools" and isinstance(value, list):
            # each tool from its own top, as the processor counts it
            for i, tool in enumerate(value):
                if json_depth(tool) > MAX_JSON_DEPTH:
                    raise ServeRequestError(_too_deep(f"tools[{i}]"))
        elif json_depth(value) > MAX_JSON_DEPTH:
            raise ServeRequestError(_too_deep(str(name)[:100]))
    _check_encodable(body, "body")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ServeRequestError(f"n must be 1: this server answers one choice per request, got n={n!r:.100}")

    for name, (low, high) in _NUMBER_FIELDS.items():
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high):
            raise ServeRequestError(f"{name} must be a number in [{low}, {high}], got {value!r:.100}")
    for name in _COUNT_FIELDS:
        value = body.get(name)
        if value is not None and (type(value) is not int or not 1 <= value <= limits.max_tokens):
            raise ServeRequestError(
                f"{name} must be an integer in [1, {limits.max_tokens}] (--max-tokens), got {value!r:.100}"
            )
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not -(2**63) <= seed < 2**64):
        raise ServeRequestError(f"seed must be an integer in [-2**63, 2**64), got {seed!r:.100}")
    stop = body.get("stop")
    if stop is not None and not (
        (isinstance(stop, str) and stop)
        or (isinstance(stop, list) and stop and all(isinstance(item, str) and item for item in stop))
    ):
        raise ServeRequestError(f"stop must be a non-empty string or a non-empty list of them, got {stop!r:.100}")
    bias = body.get("logit_bias")
    if bias is not None and not (
        isinstance(bias, dict)
        # not "²", which int() refuses, nor more digits than any token id has
        and all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= _MAX_ID_DIGITS for k in bias)
        and all(not isinstance(v, bool) and isinstance(v, (int, float)) and -100 <= v <= 100 for v in bias.values())
    ):
        raise ServeRequestError(
            f"logit_bias must map token ids (strings of at most {_MAX_ID_DIGITS} ASCII digits) to numbers in "
            f"[-100, 100], got {bias!r:.100}"
        )
    if bias is not None:
        outside = [k for k in bias if vocab_size is not None and int(k) >= vocab_size]
        if outside:
            raise ServeRequestError(
                f"logit_bias names token ids outside the vocabulary (ids 0 to {vocab_size - 1}): {outside[:5]}"
            )
        body = {**body, "logit_bias": {k: float(v) for k, v in bias.items()}}
    if body.get("suffix") is not None and not isinstance(body["suffix"], str):
        raise ServeRequestError(f"suffix must be a string, got {body['suffix']!r:.100}")
    config = body.get("generation_config")
    if config is not None:
        try:
            fields = json.loads(config) if isinstance(config, str) else None
            if not isinstance(fields, dict):
                raise TypeError("not a JSON object string")
            other = sorted(set(fields) - set(GENERATION_CONFIG_KEYS))
            if other:
                raise KeyError(f"keys {other} are not taken; it may set {list(GENERATION_CONFIG_KEYS)}")
            penalty = fields.get("repetition_penalty", 1.0)
            if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or penalty <= 0:
                raise ValueError(f"repetition_penalty must be a number > 0, got {penalty!r}")
            GenerationConfig(**fields).validate()
        except Exception as err:  # whatever GenerationConfig raises for bad values
            raise ServeRequestError(f"generation_config is not usable: {type(err).__name__}: {err}") from err
    if all(body.get(name) is None for name in _COUNT_FIELDS):
        # the handlers apply the request's count last, over the model's and generation_config's
        body = {**body, count_field: limits.max_tokens}
    return body


def _check_encodable(value, where: str) -> None:
    """Refuse a lone surrogate in any string of a JSON value (keys too)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ServeRequestError(
                f"{where} holds a lone UTF-16 surrogate {value[err.start]!r} at character {err.start}: not valid "
                "Unicode text"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_encodable(key, where)
            _check_encodable(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_encodable(item, f"{where}[{i}]")


def _too_deep(where: str) -> str:
    return f"{where} nests lists and objects deeper than {MAX_JSON_DEPTH} levels (the most this server takes)"


def check_tools(body: dict, responses: bool = False) -> None:
    """Refuse ``tools`` that are not a list of OpenAI function tools.

    Args:
        body: the request's JSON body.
        responses: a Responses request, whose tools may also be flat
            (``{"type": "function", "name": ...}``).

    Raises:
        ServeRequestError: ``tools`` present and not a list of objects
            ``{"type": "function", "function": {"name": <non-empty string>, ...}}`` (its
            ``parameters``, if given, an object), naming the tool.
    """
    tools = body.get("tools")
    if tools is None:
        return
    shape = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
    if responses:
        shape += ' or {"type": "function", "name": ..., "parameters": {...}}'
    if not isinstance(tools, list):
        raise ServeRequestError(f"tools must be a list of function tools ({shape}), got {tools!r:.100}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if responses and isinstance(tool, dict) and "function" not in tool:
            function = tool
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
            and isinstance(function.get("parameters", {}), dict)
        ):
            raise ServeRequestError(f"tools[{i}] must be a function tool ({shape}), got {tool!r:.200}")


def check_message_parts(messages: list, where: str = "messages") -> None:
    """Refuse content parts transformers' handlers would drop or fail on, and tool-call
    ``arguments`` strings nesting deeper than ``MAX_JSON_DEPTH`` levels.

    Args:
        messages: chat messages (or the messages a Responses ``input`` becomes).
        where: the field named in the refusal.

    Raises:
        ServeRequestError: a part of a type that is neither text (:data:`TEXT_PART_TYPES`) nor
            image (:data:`IMAGE_PART_TYPES`); a text part whose ``text`` is not a string; a tool
            call's ``arguments`` JSON string nesting too deep.
    """
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) and not message.get("tool_calls") else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES:
                if not isinstance(part.get("text"), str):
                    raise ServeRequestError(f"{where}[{i}].content[{j}].text must be a string, got {part.get('text')!r:.100}")
            elif kind not in IMAGE_PART_TYPES:
                raise ServeRequestError(
                    f"{where}[{i}].content[{j}] has type {kind!r:.50}: this server takes text parts "
                    f"({', '.join(TEXT_PART_TYPES)}) and image parts ({', '.join(IMAGE_PART_TYPES)}) only"
                )
        calls = message.get("tool_calls")
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            function = call.get("function") or call if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(arguments, str):
                continue
            field = f"{where}[{i}].tool_calls[{j}].function.arguments"
            try:
                value = json.loads(arguments)
            except RecursionError:
                raise ServeRequestError(_too_deep(field)) from None
            except ValueError:
                continue  # not JSON: transformers' handler refuses it as a malformed message
            if json_depth(value) > MAX_JSON_DEPTH:
                raise ServeRequestError(_too_deep(field))


def check_model_name(body: dict, pinned: bool = True) -> None:
    """Refuse a ``model`` that is not a string (checked first: the server looks the model up by it).

    Args:
        body: the request's JSON body.
        pinned: the server was started with a model, the one a request naming none gets.

    Raises:
        ServeRequestError: ``model`` present and not a string, or holding a lone UTF-16 surrogate;
            ``model`` missing (or null) on a server that was not `pinned` to a model.
    """
    name = body.get("model")
    if name is None and not pinned:
        raise ServeRequestError(
            "model is required: this server was started without a model, so each request names the model to serve"
        )
    if name is not None and not isinstance(name, str):
        raise ServeRequestError(f"model must be a string naming the model, got {type(name).__name__} {name!r:.100}")
    _check_encodable(name, "model")


def blank_arguments_as_empty_object(body: dict) -> dict:
    """`body` with each tool call's blank ``arguments`` string (empty or whitespace only, what
    OpenAI-compatible clients send for a call without arguments) written as ``"{}"``, as the
    processor reads it: transformers' handlers parse the string as JSON before the processor sees
    it. Chat ``messages``' ``tool_calls`` and Responses ``function_call`` input items.

    Returns:
        `body` itself when no call has blank arguments, else a copy (`body` is not changed).
    """

    def blank(arguments) -> bool:
        return isinstance(arguments, str) and not arguments.strip()

    def call_fixed(call):
        if not isinstance(call, dict):
            return call
        function = call.get("function")
        if isinstance(function, dict):
            return {**call, "function": {**function, "arguments": "{}"}} if blank(function.get("arguments")) else call
        return {**call, "arguments": "{}"} if not function and blank(call.get("arguments")) else call

    def message_fixed(message):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not isinstance(calls, list):
            return message
        fixed = [call_fixed(call) for call in calls]
        return message if all(a is b for a, b in zip(fixed, calls)) else {**message, "tool_calls": fixed}

    def item_fixed(item):
        if isinstance(item, dict) and item.get("type") == "function_call" and blank(item.get("arguments")):
            return {**item, "arguments": "{}"}
        return message_fixed(item)

    changed = {}
    for field, fix in (("messages", message_fixed), ("input", item_fixed)):
        value = body.get(field)
        if isinstance(value, list):
            fixed = [fix(entry) for entry in value]
            if any(a is not b for a, b in zip(fixed, value)):
                changed[field] = fixed
    return {**body, **changed} if changed else body


def check_responses_input(body: dict) -> None:
    """Refuse a Responses request whose ``input`` is not a non-empty string or list of objects.

    Raises:
        ServeRequestError: ``input`` missing, empty, or a list holding something but objects.
    """
    value = body.get("input")
    if not ((isinstance(value, str) and value) or (isinstance(value, list) and value and all(isinstance(v, dict) for v in value))):
        raise ServeRequestError(f"input must be a non-empty string or a list of input items, got {value!r:.100}")


def check_messages(body: dict) -> None:
    """Refuse a chat request whose ``messages`` are not a non-empty list of role messages.

    Raises:
        ServeRequestError: ``messages`` missing or empty, a message that is not an object with a
            string ``role``, content that is not a string, null or a list of typed parts, parts
            :func:`check_message_parts` refuses, or no user (or tool) message: a conversation of
            system messages only has no assistant prompt to answer.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ServeRequestError("messages must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ServeRequestError(f"messages[{i}] must be an object with a string role, got {message!r:.200}")
        content = message.get("content")
        typed_parts = isinstance(content, list) and all(
            isinstance(part, dict) and isinstance(part.get("type"), str) for part in content
        )
        if not (content is None or isinstance(content, str) or typed_parts):
            raise ServeRequestError(
                f"messages[{i}].content must be a string, null or a list of parts with a type, got {content!r:.200}"
            )
    check_message_parts(messages)
    check_user_turn(messages)


def check_user_turn(messages: list[dict]) -> None:
    """Refuse a conversation with no user message (or tool result): one of system messages only
    has no assistant prompt to answer. The one rule for chat ``messages`` and for a Responses
    ``input`` (checked on the messages transformers turns its items into).

    Raises:
        ServeRequestError: no message with the role "user" or "tool".
    """
    if not any(isinstance(message, dict) and message.get("role") in ("user", "tool") for message in messages):
        # the template writes the assistant header after a user turn (or tool results), as the
        # reference encoding does: without one the model would go on writing the prompt itself
        raise ServeRequestError("messages hold no user message: the model answers a user turn (or tool results)")


def check_request_images(processor_messages: list[dict], limits: ServeLimits) -> None:
    """Refuse a request with too many images or an image source the server does not read, before
    any is read; local paths are rewritten in place to their resolved absolute path.

    Args:
        processor_messages: the request's messages as transformers' server hands them to the
            processor (image parts are ``{"type": "image", "url": ...}``).
        limits: the server's limits.

    Raises:
        ServeRequestError: more images than ``limits.max_images``; a source that is not a string;
            an http(s) URL while ``limits.allow_image_urls`` is off; another URL scheme; a local
            path without ``limits.image_dir``, outside it, or not a regular file.
    """
    parts = [
        part
        for message in processor_messages
        for part in (message.get("content") if isinstance(message.get("content"), list) else [])
        if isinstance(part, dict) and part.get("type") == "image"
    ]
    check_image_count(len(parts), limits)
    for part in parts:
        part["url"] = _checked_source(part.get("url"), limits)


def check_image_count(count: int, limits: ServeLimits) -> None:
    """Refuse a request with more images than the server takes.

    Raises:
        ServeRequestError: `count` > ``limits.max_images``.
    """
    if count > limits.max_images:
        raise ServeRequestError(
            f"the request has {count} images; this server takes at most {limits.max_images} (--max-images)"
        )


def _checked_source(url, limits: ServeLimits) -> str:
    if not isinstance(url, str) or not url.strip() or "\x00" in url:
        raise ServeRequestError(f"an image URL must be a non-empty string (a base64 data URL), got {url!r:.100}")
    scheme = _SCHEME.match(url)
    if scheme is not None:
        name = scheme.group(1).lower()
        if name == "data":
            return url
        if name in ("http", "https"):
            if not limits.allow_image_urls:
                raise ServeRequestError(
                    f"image URL {url[:100]!r} refused: this server does not fetch http(s) URLs; send the image as a "
                    "base64 data URL, or start the server with --allow-image-urls"
                )
            return url
        raise ServeRequestError(f"image URL scheme {name!r} is not read: send a base64 data URL")
    if limits.image_dir is None:
        raise ServeRequestError(
            f"local image path {url[:100]!r} refused: send the image as a base64 data URL, or start the server "
            "with --image-dir DIR to read images under DIR"
        )
    root = os.path.realpath(limits.image_dir)
    path = os.path.realpath(os.path.join(root, url))
    if os.path.commonpath([root, path]) != root or not os.path.isfile(path):
        raise ServeRequestError(f"local image path {url[:100]!r} is not a file under --image-dir")
    return path
