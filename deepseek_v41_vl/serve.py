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

from .serve_policy import (
    ServeLimits,
    ServeRequestError,
    check_messages,
    check_request_fields,
    check_request_images,
    check_responses_input,
    request_template_kwargs,
)

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
        The server's exit status (2 for a bad option of this command, with argparse's message).
    """
    from transformers.cli.serving import server
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.transformers import app
    from transformers.models.auto import modeling_auto

    from .modeling.configuration_deepseek_v41_vl import DeepseekV41Config

    parser = _limit_options()
    try:
        limits, rest = parser.parse_known_args(argv)
    except SystemExit as bad:  # argparse has printed the problem
        return int(bad.code or 0)
    if "--help" in rest:
        parser.print_help()
    limits = ServeLimits(**vars(limits))
    if limits.image_dir is not None and not os.path.isdir(limits.image_dir):
        print(f"deepseek-v41-vl serve: --image-dir {limits.image_dir!r} is not a folder", file=sys.stderr)
        return 2
    modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.setdefault(
        DeepseekV41Config.model_type, "DeepseekV41ForConditionalGeneration"
    )
    # the model manager may load the pinned model before the app is built: limit its class
    ModelManager._load_processor = _with_image_limits(ModelManager._load_processor, limits)
    server.build_server = _with_request_policy(server.build_server, limits)
    try:
        app(args=["serve", *rest], prog_name="deepseek-v41-vl")
    except SystemExit as done:  # typer ends with SystemExit in standalone mode
        return int(done.code or 0)
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
    return parser


def _with_image_limits(load_processor, limits: ServeLimits):
    """`ModelManager._load_processor` whose processors carry the server's byte and pixel caps."""
    from .processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

    def load(*args, **kwargs):
        processor = load_processor(*args, **kwargs)
        image_processor = getattr(processor, "image_processor", None)
        if isinstance(image_processor, DeepseekV41ImageProcessor):
            image_processor.max_image_bytes = limits.max_image_bytes
            image_processor.max_image_pixels = limits.max_image_pixels
        return processor

    return load


def _with_request_policy(build_server, limits: ServeLimits):
    """`build_server` whose app applies the request policy of the module doc."""
    from starlette.exceptions import HTTPException

    from .processing.errors_deepseek_v41_vl import DeepseekV41ProcessingError

    def build(model_manager, chat_handler, *args, **kwargs):
        _apply_request_policy(chat_handler, limits, chat=True)
        _apply_request_policy(kwargs["response_handler"], limits, chat=False)
        _check_fields_only(kwargs["completion_handler"], limits)
        built = build_server(model_manager, chat_handler, *args, **kwargs)

        @built.middleware("http")
        async def refused_paths(request, call_next):
            if request.url.path in REFUSED_PATHS:
                return _openai_error(*REFUSED_PATHS[request.url.path])
            return await call_next(request)

        async def refused(_request, exc: Exception):
            return _openai_error(400, str(exc))

        async def http_error(_request, exc: HTTPException):
            # transformers' own refusals (a model the server is not pinned to, unexpected fields)
            # carry `detail` only, which OpenAI clients do not show: add the OpenAI error shape
            message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
            return _openai_error(exc.status_code, message, detail=exc.detail, headers=exc.headers)

        built.add_exception_handler(DeepseekV41ProcessingError, refused)
        built.add_exception_handler(ServeRequestError, refused)
        built.add_exception_handler(HTTPException, http_error)
        return built

    return build


def _openai_error(status: int, message: str, headers=None, **extra):
    """A JSON error response in the OpenAI shape (what OpenAI clients show)."""
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": "invalid_request_error"}, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


def _apply_request_policy(handler, limits: ServeLimits, chat: bool) -> None:
    """Wrap a transformers serving handler that takes messages with images (instance attributes,
    so only this app's): chat completions (`chat`) or responses."""
    if limits.allow_image_urls:
        # the server's own template kwargs reach the processor call; a request's cannot
        # (request_template_kwargs lets through only the template's switches)
        handler.chat_template_kwargs = {**handler.chat_template_kwargs, "processor_kwargs": {"allow_urls": True}}
    messages_to_inputs = handler.get_processor_inputs_from_messages

    def checked_inputs(messages, modality):
        try:
            inputs = messages_to_inputs(messages, modality)
        except KeyError as err:  # a part without its fields
            raise ServeRequestError(f"malformed message: a part lacks its field {err}") from err
        except (TypeError, ValueError, AttributeError) as err:
            raise ServeRequestError(f"malformed message: {type(err).__name__}: {err}") from err
        check_request_images(inputs, limits)
        return inputs

    handler.get_processor_inputs_from_messages = checked_inputs
    normalize = getattr(handler, "_normalize_input", None)  # responses: input items -> messages
    if normalize is not None:

        def checked_normalize(body):
            try:
                return normalize(body)
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise ServeRequestError(f"malformed input item: {type(err).__name__}: {err}") from err

        handler._normalize_input = checked_normalize
    handle_request = handler.handle_request

    async def handle(body: dict, request_id: str):
        body = check_request_fields(body, limits, "max_tokens" if chat else "max_output_tokens")
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
        return await handle_request(body, request_id)

    handler.handle_request = handle


def _check_fields_only(handler, limits: ServeLimits) -> None:
    """Wrap a handler that takes no messages (completions) with the field checks."""
    handle_request = handler.handle_request

    async def handle(body: dict, request_id: str):
        return await handle_request(check_request_fields(body, limits, "max_tokens"), request_id)

    handler.handle_request = handle
