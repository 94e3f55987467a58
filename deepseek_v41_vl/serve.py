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

What it adds to the app transformers builds (see :class:`ServeLimits` for the options):

- Limits, checked before any image is decoded: images per request (counted over all turns), and
  per image its encoded bytes and its pixels (read from the header). http(s) image URLs are
  refused unless the server is started with ``--allow-image-urls``; base64 data URLs and local
  paths are read (a local path is read with the server's permissions: bind to 127.0.0.1).
- Thinking: the request field ``reasoning_effort`` ("low", "high", "max", an int in [1, 100], or
  "none" for chat mode) selects thinking mode with that effort in the chat template; the request's
  ``chat_template_kwargs`` may set only the template's switches (``thinking_mode``,
  ``enable_thinking``, ``reasoning_effort``, ``drop_thinking``), never the processor's options.
- Errors: a request refused by this policy or by the processor (a broken data URL, a truncated
  file, an image over a limit, more images than placeholders, a bad template switch) is answered
  with HTTP 400 and a message naming the problem, in the OpenAI error shape; transformers would
  answer a processor error with a bare 500. The server goes on serving.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

# The chat template's switches a request may set through `chat_template_kwargs`.
REQUEST_TEMPLATE_SWITCHES = ("thinking_mode", "enable_thinking", "reasoning_effort", "drop_thinking")
# `reasoning_effort` values the template takes by name (ints in [1, 100] are taken too).
NAMED_EFFORTS = ("low", "high", "max")


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
    """

    max_images: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 50_000_000
    allow_image_urls: bool = False


class ServeRequestError(ValueError):
    """A request this server refuses (answered with HTTP 400 and this message)."""


def serve(argv: list[str]) -> int:
    """Run ``transformers serve ARGV`` with DeepSeek-V4.1 loadable (see the module doc).

    Args:
        argv: this command's options (:class:`ServeLimits`) and `transformers serve` arguments,
            e.g. ``[folder, "--port", "8000", "--max-images", "4"]``.

    Returns:
        The server's exit status (2 for a bad option of this command).
    """
    from transformers.cli.serving import server
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.transformers import app
    from transformers.models.auto import modeling_auto

    from .modeling.configuration_deepseek_v41_vl import DeepseekV41Config

    parser = _limit_options()
    limits, rest = parser.parse_known_args(argv)
    if "--help" in rest:
        parser.print_help()
    limits = ServeLimits(**vars(limits))
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
    return parser


def request_template_kwargs(body: dict) -> dict:
    """The `chat_template_kwargs` a chat request asks for, with ``reasoning_effort`` mapped in.

    Args:
        body: the request's JSON body (not changed).

    Returns:
        The template switches: the request's own, plus ``enable_thinking`` and
        ``reasoning_effort`` from a ``reasoning_effort`` field ("none": ``enable_thinking=False``).

    Raises:
        ServeRequestError: `chat_template_kwargs` not an object or setting anything but the
            switches in :data:`REQUEST_TEMPLATE_SWITCHES`; a ``reasoning_effort`` the template does
            not take; a ``reasoning_effort`` that contradicts the request's own switches.
    """
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ServeRequestError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    other = sorted(set(kwargs) - set(REQUEST_TEMPLATE_SWITCHES))
    if other:
        raise ServeRequestError(
            f"chat_template_kwargs may set only {list(REQUEST_TEMPLATE_SWITCHES)}; got {other}"
        )
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is None:
        return kwargs
    if effort == "none":
        wanted = {"enable_thinking": False}
    elif effort in NAMED_EFFORTS or (type(effort) is int and 1 <= effort <= 100):
        wanted = {"enable_thinking": True, "reasoning_effort": effort}
    else:
        raise ServeRequestError(
            f"reasoning_effort must be one of {list(NAMED_EFFORTS)}, an integer in [1, 100], or 'none' "
            f"(chat mode, no thinking); got {effort!r}"
        )
    if kwargs.get("thinking_mode") is not None:
        kwargs.setdefault("enable_thinking", kwargs["thinking_mode"] == "thinking")
    for key, value in wanted.items():
        if kwargs.get(key, value) != value:
            raise ServeRequestError(
                f"reasoning_effort={effort!r} contradicts chat_template_kwargs {key}={kwargs[key]!r}"
            )
        kwargs[key] = value
    return kwargs


def check_request_images(processor_messages: list[dict], limits: ServeLimits) -> None:
    """Refuse a request with too many images or a refused image URL, before any is read.

    Args:
        processor_messages: the request's messages as transformers' server hands them to the
            processor (image parts are ``{"type": "image", "url": ...}``).
        limits: the server's limits.

    Raises:
        ServeRequestError: more images than ``limits.max_images``; an http(s) URL while
            ``limits.allow_image_urls`` is off.
    """
    urls = [
        part.get("url")
        for message in processor_messages
        for part in (message.get("content") if isinstance(message.get("content"), list) else [])
        if isinstance(part, dict) and part.get("type") == "image"
    ]
    if len(urls) > limits.max_images:
        raise ServeRequestError(
            f"the request has {len(urls)} images; this server takes at most {limits.max_images} (--max-images)"
        )
    if not limits.allow_image_urls:
        for url in urls:
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                raise ServeRequestError(
                    f"image URL {url[:100]!r} refused: this server does not fetch http(s) URLs; send the image as a "
                    "base64 data URL, or start the server with --allow-image-urls"
                )


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
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    from .processing.errors_deepseek_v41_vl import DeepseekV41ProcessingError

    def build(model_manager, chat_handler, *args, **kwargs):
        # the handlers that take chat messages with images: chat completions and responses
        for handler in (chat_handler, kwargs.get("response_handler")):
            if handler is not None:
                _apply_request_policy(handler, limits)
        built = build_server(model_manager, chat_handler, *args, **kwargs)

        async def refused(_request, exc: Exception):
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)

        async def http_error(_request, exc: HTTPException):
            # transformers' own refusals (a model the server is not pinned to, unexpected fields)
            # carry `detail` only, which OpenAI clients do not show: add the OpenAI error shape
            message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
            body = {"error": {"message": message, "type": "invalid_request_error"}, "detail": exc.detail}
            return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

        built.add_exception_handler(DeepseekV41ProcessingError, refused)
        built.add_exception_handler(ServeRequestError, refused)
        built.add_exception_handler(HTTPException, http_error)
        return built

    return build


def _apply_request_policy(handler, limits: ServeLimits) -> None:
    """Wrap one transformers serving handler (instance attributes, so only this app's)."""
    if limits.allow_image_urls:
        # the server's own template kwargs reach the processor call; a request's cannot
        # (request_template_kwargs lets through only the template's switches)
        handler.chat_template_kwargs = {**handler.chat_template_kwargs, "processor_kwargs": {"allow_urls": True}}
    messages_to_inputs = handler.get_processor_inputs_from_messages

    def checked_inputs(messages, modality):
        inputs = messages_to_inputs(messages, modality)
        check_request_images(inputs, limits)
        return inputs

    handler.get_processor_inputs_from_messages = checked_inputs
    handle_request = handler.handle_request

    async def handle(body: dict, request_id: str):
        template_kwargs = request_template_kwargs(body)
        body = {key: value for key, value in body.items() if key != "reasoning_effort"}  # mapped in above
        if template_kwargs or "chat_template_kwargs" in body:
            body["chat_template_kwargs"] = template_kwargs
        return await handle_request(body, request_id)

    handler.handle_request = handle
