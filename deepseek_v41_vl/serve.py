"""`deepseek-v41-vl serve`: transformers' own OpenAI-compatible server (`transformers serve`) with
this model registered and a request policy for images and thinking.

`transformers serve` picks a model's loader from the config: a model type listed in transformers'
table of multimodal LMs (`MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES`, built-in types only) loads with
`AutoModelForMultimodalLM`, and any other type by the class named in ``architectures``, looked up
in the `transformers` namespace, where a remote-code class never is. So a converted folder does not
load under plain `transformers serve`, with or without ``--trust-remote-code``. This command adds
the model type to that table, registers the classes (importing this package does), and runs
`transformers serve` itself with the remaining arguments: the HTTP server, the chat template, image
loading and generation are transformers'.

What it adds to the app transformers builds:

- the request policy of `serve_policy.py` on chat completions, responses and completions: image
  limits (count, bytes, pixels, sources; see :class:`ServeLimits` for the options), the
  ``reasoning_effort`` mapping, and checks of the fields transformers would fail on with a 500;
- each request's model resolved (loaded, on its first request) before any check, so the checks
  that need the model (vocabulary, prompt cap) run for every request; a model whose processor
  lacks the server's limits is refused (500 naming it), and the app is not built at all when
  transformers' model manager does not load through the hooks;
- image URLs (``--allow-image-urls``) fetched off the event loop within ``--image-fetch-timeout``,
  a few at a time per request (`serve_images.py`);
- the processor's limits (`serve_processor.py`): image caps, message text tokenized as text
  (typed control tokens cannot forge turns), ``--max-prompt-tokens``; on completions, the prompt
  cap and a refusal of the image placeholder. The hooks into transformers' internals, which differ
  between 5.24 and 5.25, are `serve_hooks.py`;
- ``/v1/systemone`` answers 400: its pipeline loads images its own way, past these limits, and
  cannot run this model's processor; ``/load_model`` and ``/reset`` answer 403 (a client would
  load another model into the server or unload this one);
- errors: a request refused by the policy or by the processor (a broken data URL, a truncated
  file, an image over a limit, more images than placeholders, a bad template switch) is answered
  with HTTP 400 and a message naming the problem, in the OpenAI error shape; transformers would
  answer a processor error with a bare 500. The server goes on serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .serve_images import fetch_image_urls
from .serve_policy import (
    ServeLimits,
    ServeRequestError,
    blank_arguments_as_empty_object,
    check_message_parts,
    check_messages,
    check_model_name,
    check_request_fields,
    check_request_images,
    check_responses_input,
    check_tools,
    check_user_turn,
    request_template_kwargs,
)
from .serve_processor import check_prompt_length, served_model

# Endpoints of transformers' app this command refuses: path -> (HTTP status, message).
REFUSED_PATHS = {
    # its pipeline loads images its own way, past every limit, and cannot run this processor
    "/v1/systemone": (400, "/v1/systemone is not served for DeepSeek-V4.1: use /v1/chat/completions"),
    # a client would load another model into this server, or unload this one
    "/load_model": (403, "/load_model is not served by deepseek-v41-vl serve"),
    "/reset": (403, "/reset is not served by deepseek-v41-vl serve"),
}


def serve(argv: list[str]) -> int:
    """Run ``transformers serve ARGV`` with DeepSeek-V4.1 loadable (see the module doc).

    Args:
        argv: this command's options (:class:`ServeLimits`) and `transformers serve` arguments,
            e.g. ``[folder, "--port", "8000", "--max-images", "4"]``.

    Returns:
        The server's exit status (2 for a bad option of this command, with argparse's message, or
        for a transformers whose server internals the hooks do not know, naming its version).
    """
    from transformers.cli.serving import server
    from transformers.cli.transformers import app

    from .serve_hooks import ServeHooksError, install

    parser = _limit_options()
    try:
        limits, rest = parser.parse_known_args(argv)
    except SystemExit as bad:  # argparse has printed the problem
        return int(bad.code or 0)
    if "--help" in rest:
        parser.print_help()
    options = vars(limits)
    if options.pop("api_server_count") != 1:
        # transformers spawns the other API servers afresh, without this command's request policy
        print("deepseek-v41-vl serve: --api-server-count must be 1 (the request policy runs in this process only)",
              file=sys.stderr)
        return 2
    limits = ServeLimits(**options)
    if limits.image_dir is not None and not os.path.isdir(limits.image_dir):
        print(f"deepseek-v41-vl serve: --image-dir {limits.image_dir!r} is not a folder", file=sys.stderr)
        return 2
    try:
        # the model manager may load the pinned model before the app is built: hook its loader first
        install(limits)
    except ServeHooksError as err:
        print(f"deepseek-v41-vl serve: {err}", file=sys.stderr)
        return 2
    server.build_server = _with_request_policy(server.build_server, limits)
    try:
        app(args=["serve", *rest], prog_name="deepseek-v41-vl")
    except SystemExit as done:  # typer ends with SystemExit in standalone mode
        return int(done.code or 0)
    except ServeHooksError as err:  # the app transformers built does not load through the hooks
        print(f"deepseek-v41-vl serve: {err}", file=sys.stderr)
        return 2
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _limit_options() -> argparse.ArgumentParser:
    defaults = ServeLimits()
    parser = argparse.ArgumentParser(
        prog="deepseek-v41-vl serve", add_help=False, allow_abbrev=False,
        description="Limits of deepseek-v41-vl serve (the other options are transformers serve's):",
    )
    parser.add_argument("--max-images", type=_positive_int, default=defaults.max_images,
                        help=f"images per request, all turns together (default {defaults.max_images})")
    parser.add_argument("--max-image-bytes", type=_positive_int, default=defaults.max_image_bytes,
                        help=f"encoded bytes per image (default {defaults.max_image_bytes})")
    parser.add_argument("--max-image-pixels", type=_positive_int, default=defaults.max_image_pixels,
                        help=f"width * height per image (default {defaults.max_image_pixels})")
    parser.add_argument("--allow-image-urls", action="store_true", help="fetch http(s) image URLs (off by default)")
    parser.add_argument("--image-dir", help="read local image paths under this folder (off by default)")
    parser.add_argument("--max-tokens", type=_positive_int, default=defaults.max_tokens,
                        help=f"new tokens one request may ask for, and its default (default {defaults.max_tokens})")
    parser.add_argument("--max-prompt-tokens", type=_positive_int, default=defaults.max_prompt_tokens,
                        help="the longest prompt served, in tokens (default: the model's context)")
    parser.add_argument("--image-fetch-timeout", type=_positive_float, default=defaults.image_fetch_timeout,
                        help=f"seconds to fetch a request's image URLs, the whole fetch "
                             f"(default {defaults.image_fetch_timeout:g})")
    parser.add_argument("--allow-special-tokens-in-messages", action="store_true",
                        help="let control tokens typed in message text become special tokens (off by default)")
    parser.add_argument("--api-server-count", type=int, default=1, help=argparse.SUPPRESS)  # only 1 is served
    return parser


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _with_request_policy(build_server, limits: ServeLimits):
    """`build_server` whose app applies the request policy of the module doc."""
    from starlette.exceptions import HTTPException

    from .processing.errors_deepseek_v41_vl import DeepseekV41ProcessingError
    from .serve_hooks import ServeHooksError, check_installed

    def build(model_manager, chat_handler, *args, **kwargs):
        check_installed(model_manager)  # fails closed: no app whose processors lack the limits
        _apply_request_policy(chat_handler, limits, chat=True)
        _apply_request_policy(kwargs["response_handler"], limits, chat=False)
        _check_completions(kwargs["completion_handler"], limits)
        built = build_server(model_manager, chat_handler, *args, **kwargs)

        @built.middleware("http")
        async def refused_paths(request, call_next):
            if request.url.path in REFUSED_PATHS:
                return _openai_error(*REFUSED_PATHS[request.url.path])
            return await call_next(request)

        async def refused(_request, exc: Exception):
            return _openai_error(400, str(exc))

        async def unhooked(_request, exc: ServeHooksError):
            return _openai_error(500, str(exc), error_type="server_error")

        async def http_error(_request, exc: HTTPException):
            # transformers' own refusals (a model the server is not pinned to, unexpected fields)
            # carry `detail` only, which OpenAI clients do not show: add the OpenAI error shape
            message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
            return _openai_error(exc.status_code, message, detail=exc.detail, headers=exc.headers)

        if ValueError in built.exception_handlers:
            # transformers (5.25) answers a ValueError (a model it does not serve, a value `generate`
            # refuses) with 400 and `detail` only: add the OpenAI error shape
            built.add_exception_handler(ValueError, lambda request, exc: _openai_error(400, str(exc), detail=str(exc)))
        built.add_exception_handler(DeepseekV41ProcessingError, refused)
        built.add_exception_handler(ServeRequestError, refused)
        built.add_exception_handler(ServeHooksError, unhooked)
        built.add_exception_handler(HTTPException, http_error)
        return built

    return build


def _openai_error(status: int, message: str, headers=None, error_type: str = "invalid_request_error", **extra):
    """A JSON error response in the OpenAI shape (what OpenAI clients show)."""
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": error_type}, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


def _apply_request_policy(handler, limits: ServeLimits, chat: bool) -> None:
    """Wrap a transformers serving handler that takes messages with images (instance attributes,
    so only this app's): chat completions (`chat`) or responses."""
    messages_to_inputs = handler.get_processor_inputs_from_messages

    def checked_inputs(messages, modality):
        try:
            inputs = messages_to_inputs(messages, modality)
        except KeyError as err:  # a part without its fields
            raise ServeRequestError(f"malformed message: a part lacks its field {err}") from err
        except (TypeError, ValueError, AttributeError) as err:
            raise ServeRequestError(f"malformed message: {type(err).__name__}: {err}") from err
        except RecursionError:  # the policy caps nesting first; this is the fallback
            raise ServeRequestError("malformed message: nested too deep") from None
        check_request_images(inputs, limits)
        return inputs

    handler.get_processor_inputs_from_messages = checked_inputs
    normalize = getattr(handler, "_normalize_input", None)  # responses: input items -> messages
    if normalize is not None:

        def checked_normalize(body):
            try:
                messages = normalize(body)
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise ServeRequestError(f"malformed input item: {type(err).__name__}: {err}") from err
            except RecursionError:  # the policy caps nesting first; this is the fallback
                raise ServeRequestError("malformed input item: nested too deep") from None
            check_message_parts(messages, "input")  # the rules of chat message parts
            check_user_turn(messages)  # the rule of chat messages, on the messages the items become
            return messages

        handler._normalize_input = checked_normalize
    handle_request = handler.handle_request

    async def handle(body: dict, request_id: str):
        served = await _served_model(handler, body)
        body = check_request_fields(body, limits, "max_tokens" if chat else "max_output_tokens",
                                    vocab_size=served.vocab_size)
        check_tools(body, responses=not chat)
        if chat:
            check_messages(body)
            template_kwargs = request_template_kwargs(body)
            body = {key: value for key, value in body.items() if key != "reasoning_effort"}  # mapped in above
            if template_kwargs or "chat_template_kwargs" in body:
                body["chat_template_kwargs"] = template_kwargs
        else:
            check_responses_input(body)
            if isinstance(body.get("reasoning"), dict) and body["reasoning"].get("effort") is not None:
                # the Responses schema takes no chat_template_kwargs to carry it (transformers ignores it)
                raise ServeRequestError("reasoning.effort is not mapped on /v1/responses: use /v1/chat/completions "
                                        "with reasoning_effort")
        # transformers parses a call's arguments before the processor, which reads "" as no arguments
        body = blank_arguments_as_empty_object(body)
        body = await fetch_image_urls(body, limits)  # the processor then reads data URLs only
        return await handle_request(body, request_id)

    handler.handle_request = handle


async def _served_model(handler, body: dict):
    """The record of the model `body` names (see `serve_hooks.request_processor`), its model
    loaded first on its first request: the checks that need it run for every request.

    Raises:
        ServeRequestError: ``model`` not a string, or missing on a server started without a model.
        ServeHooksError: the model's processor does not carry the server's limits.
    """
    import asyncio

    from .serve_hooks import request_processor

    # a server started without a model has none to give a request naming none
    check_model_name(body, pinned=getattr(handler.model_manager, "force_model", None) is not None)
    processor = await asyncio.to_thread(request_processor, handler, body)
    return served_model(processor, body.get("model"))


def _check_completions(handler, limits: ServeLimits) -> None:
    """Wrap the completions handler (a raw prompt, no messages) with the field checks, and refuse a
    prompt over the prompt cap or holding the image placeholder (it takes no images)."""
    import asyncio

    handle_request = handler.handle_request

    async def handle(body: dict, request_id: str):
        served = await _served_model(handler, body)
        body = check_request_fields(body, limits, "max_tokens", vocab_size=served.vocab_size)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            image_token = getattr(served.processor, "image_token", None)
            if image_token and image_token in prompt:
                raise ServeRequestError(
                    f"the prompt holds the image placeholder {image_token!r}: /v1/completions takes no images; "
                    "send images to /v1/chat/completions"
                )
            # a token covers at least one byte (byte-level BPE), BOS aside: tokenize only a prompt that may be over
            if len(prompt.encode()) + 2 > served.max_prompt_tokens:
                tokenizer = getattr(served.processor, "tokenizer", served.processor)
                ids = (await asyncio.to_thread(tokenizer, prompt))["input_ids"]
                check_prompt_length(len(ids), served.max_prompt_tokens)
        return await handle_request(body, request_id)

    handler.handle_request = handle
