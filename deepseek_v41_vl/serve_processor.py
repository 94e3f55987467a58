"""The processor `deepseek-v41-vl serve` renders requests with: the model's own, with the server's
limits (the app wiring is `serve.py`, the transformers hooks `serve_hooks.py`).

- Images: the byte and pixel caps of the image processor (``--max-image-bytes``,
  ``--max-image-pixels``), checked before decoding.
- Message text is tokenized as text: a control token typed in a message or a tool result
  (``<｜Assistant｜>``, ``</think>``, DSML tags...) does not become the special token, so a user or
  a tool's output cannot forge a turn; the template's own structure tokens stay special
  (``split_special_tokens=True``; ``--allow-special-tokens-in-messages`` turns it off).
- Prompt length: at most ``--max-prompt-tokens`` tokens (default: the model's context).

:data:`SERVED_MODELS` records each model this process has loaded a processor for, with what the
request policy checks against (vocabulary size, prompt cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .serve_policy import ServeLimits, ServeRequestError


@dataclass(frozen=True)
class ServedModel:
    """A model this server runs, as the request policy sees it.

    Attributes:
        processor: its processor, rendering with the server's limits.
        vocab_size: token ids a request may name (``logit_bias``) are below this.
        max_prompt_tokens: the longest prompt served, in tokens.
    """

    processor: Any
    vocab_size: int
    max_prompt_tokens: int


# model name, as transformers' server loads it -> the model (filled as processors load)
SERVED_MODELS: dict[str, ServedModel] = {}


def served_model(processor, name: str) -> ServedModel:
    """The record of the model whose processor a request is rendered with.

    Args:
        processor: the processor transformers' server resolved for the request.
        name: the model's name, for the message.

    Raises:
        ServeHooksError: `processor` was not loaded through :func:`serve_processor`, so the
            server's limits are not on it (the request is refused, not served without them).
    """
    for served in list(SERVED_MODELS.values()):
        if served.processor is processor:
            return served
    from .serve_hooks import ServeHooksError

    raise ServeHooksError(
        f"the processor of model {name!r} was not loaded through deepseek-v41-vl serve's hooks, so the server's "
        "limits are not on it: the request is refused"
    )


def serve_processor(processor, config, limits: ServeLimits, name: str):
    """Give a loaded processor the server's limits (see the module doc) and record the model.

    Args:
        processor: what transformers loaded for the model (a tokenizer alone is recorded only).
        config: the model's config (its text config's ``max_position_embeddings`` and
            ``vocab_size``).
        limits: the server's options.
        name: the model's name, as transformers' server loads it.

    Returns:
        `processor`, its ``apply_chat_template`` wrapped in place.

    Raises:
        ValueError: ``limits.max_prompt_tokens`` longer than the model's context.
    """
    from .processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

    text_config = config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None)
    cap = limits.max_prompt_tokens if limits.max_prompt_tokens is not None else context
    if cap is None:
        raise ValueError(f"the config of {name} gives no max_position_embeddings: pass --max-prompt-tokens")
    if context is not None and cap > context:
        raise ValueError(f"--max-prompt-tokens {cap} is longer than the model's context ({context} tokens)")
    tokenizer = getattr(processor, "tokenizer", processor)
    SERVED_MODELS[name] = ServedModel(processor, int(text_config.vocab_size), int(cap))

    image_processor = getattr(processor, "image_processor", None)
    if isinstance(image_processor, DeepseekV41ImageProcessor):
        image_processor.max_image_bytes = limits.max_image_bytes
        image_processor.max_image_pixels = limits.max_image_pixels
    render = getattr(processor, "apply_chat_template", None)
    if render is None or tokenizer is processor:
        return processor

    def apply_chat_template(conversation, *args, **kwargs):
        if not limits.allow_special_tokens_in_messages:
            kwargs.setdefault("split_special_tokens", True)
        # a decoder's MemoryError is the image processor's DeepseekV41ImageTooLargeError already
        out = render(conversation, *args, **kwargs)
        if kwargs.get("tokenize"):
            check_prompt_length(_length(out["input_ids"]), cap)
        return out

    processor.apply_chat_template = apply_chat_template
    return processor


def check_prompt_length(length: int, cap: int) -> None:
    """Refuse a prompt longer than the server's cap.

    Raises:
        ServeRequestError: `length` > `cap`.
    """
    if length > cap:
        raise ServeRequestError(
            f"the prompt has {length} tokens; this server takes at most {cap} (--max-prompt-tokens)"
        )


def _length(input_ids) -> int:
    """Tokens of one prompt: a [1, L] tensor, a list of ids, or a list of one list of ids."""
    if hasattr(input_ids, "shape"):
        return int(input_ids.shape[-1])
    if input_ids and isinstance(input_ids[0], list):
        return max(len(ids) for ids in input_ids)
    return len(input_ids)
