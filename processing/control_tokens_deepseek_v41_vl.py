"""Control tokens typed as message text, encoded as plain text (`split_special_tokens=True`).

The DeepSeek tokenizer matches its added tokens (`<｜User｜>`, `<｜Assistant｜>`, `</think>`,
`｜DSML｜`, BOS, ...) wherever they occur in a string, so a user message or a tool result that
contains one would forge the structure the chat template writes. The reference encoder does the
same, which is why it stays the default. With `split_special_tokens=True` the processor:

1. wraps every added-token string inside the messages' (and tools') strings between two markers
   made of private-use characters and a per-call random nonce (:class:`ControlTokenMarkers`;
   user text cannot forge them);
2. renders the marked messages with the chat template; the template's own tokens are unmarked;
3. tokenizes the rendering piece by piece (:func:`split_marked`): unmarked text as usual, each
   marked token with :func:`encode_as_text`, which runs the tokenizer's normalizer, pre-tokenizer
   and model without matching any added token. Offsets index the rendering without the markers
   (the text `apply_chat_template(..., tokenize=False)` gives); :func:`marker_replacement_offsets`
   maps positions of the marked rendering there.

The tokenizer splits its input at every added token anyway, so the text around a marked token is
tokenized exactly as by default: only the marked tokens' ids change, and the ids decode back to
the same text.
"""

from __future__ import annotations

import bisect
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors_deepseek_v41_vl import DeepseekV41ProcessorError

_OPEN, _CLOSE = "\ue010", "\ue011"  # private-use characters around each marker's nonce


@dataclass(frozen=True)
class ControlTokenMarkers:
    """The two strings that enclose a control token typed as text, unique to one call.

    Attributes:
        start, end (`str`): the opening and closing marker.
        tokens (`tuple[str, ...]`): the control tokens marked, longest first.
    """

    start: str
    end: str
    tokens: tuple[str, ...]

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ControlTokenMarkers":
        """Markers for every added token of `tokenizer` (special or not), with a fresh nonce."""
        tokens = tuple(sorted(set(tokenizer.get_added_vocab()), key=lambda token: (-len(token), token)))
        nonce = uuid.uuid4().hex
        return cls(start=f"{_OPEN}{nonce}{_OPEN}", end=f"{_CLOSE}{nonce}{_CLOSE}", tokens=tokens)

    def _pattern(self) -> re.Pattern:
        return re.compile("|".join(map(re.escape, self.tokens)) or "(?!)")

    def mark(self, obj: Any) -> Any:
        """A copy of `obj` (a string, or lists / tuples / dicts of them, keys included) with every
        control token in its strings enclosed in the markers; other values are kept as they are."""
        pattern = self._pattern()

        def walk(value: Any) -> Any:
            if isinstance(value, str):
                return pattern.sub(lambda m: self.start + m.group(0) + self.end, value)
            if isinstance(value, dict):
                return {walk(key): walk(item) for key, item in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(walk(item) for item in value)
            return value

        return walk(obj)

    def strip(self, text: str) -> str:
        """`text` without the markers."""
        return text.replace(self.start, "").replace(self.end, "")


def split_marked(text: str, markers: ControlTokenMarkers) -> list[tuple[str, bool, int]]:
    """`text` as pieces `(piece, marked, start)`: `marked` is True for a marked control token (the
    markers left out); `start` is the piece's character position in `markers.strip(text)`, the
    text the caller sees (the rendering without the markers), so offsets built on it index that.

    Raises:
        DeepseekV41ProcessorError: a marker without its partner (the template cut a marked string
            apart), so which text was typed could not be told.
    """
    pieces: list[tuple[str, bool, int]] = []
    position = 0
    removed = 0  # marker characters before `position`
    while position < len(text):
        open_at = text.find(markers.start, position)
        stray_end = text.find(markers.end, position)
        if open_at == -1:
            if stray_end != -1:
                raise DeepseekV41ProcessorError("split_special_tokens: a control-token marker lost its opening half")
            pieces.append((text[position:], False, position - removed))
            break
        body = open_at + len(markers.start)
        close_at = text.find(markers.end, body)
        nested = text.find(markers.start, body)
        if -1 < stray_end < open_at or close_at == -1 or -1 < nested < close_at:
            raise DeepseekV41ProcessorError("split_special_tokens: a control-token marker lost its other half")
        if open_at > position:
            pieces.append((text[position:open_at], False, position - removed))
        removed += len(markers.start)
        pieces.append((text[body:close_at], True, body - removed))
        removed += len(markers.end)
        position = close_at + len(markers.end)
    return pieces


def marker_replacement_offsets(text: str, markers: ControlTokenMarkers) -> list[dict[str, tuple[int, int]]]:
    """Where the markers stand in `text` and where their removal leaves the text after them, in
    transformers' `text_replacement_offsets` form: one `{"span": (start, end), "new_span": (at, at)}`
    per marker, in order, `span` in `text` and `at` in `markers.strip(text)`. ProcessorMixin shifts
    the character positions it found in the marked rendering (the assistant spans of
    `return_assistant_tokens_mask`) by `new_span[1] - span[1]` of the last marker before them, which
    maps them into the text without markers that the offsets index."""
    pattern = re.compile(re.escape(markers.start) + "|" + re.escape(markers.end))
    out: list[dict[str, tuple[int, int]]] = []
    removed = 0
    for found in pattern.finditer(text):
        at = found.start() - removed
        out.append({"span": (found.start(), found.end()), "new_span": (at, at)})
        removed += found.end() - found.start()
    return out


def encode_as_text(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids of `text` tokenized as plain text, matching no added token (special or not), and the
    `(start, end)` characters of each token in `text`.

    Runs the fast tokenizer's normalizer, pre-tokenizer and model (the pipeline transformers'
    `split_special_tokens` uses for special tokens, here for every added token).

    Raises:
        DeepseekV41ProcessorError: the tokenizer is not a fast (`tokenizers`) one, or its model
            gives an added token's id for the plain text, so it cannot be written as text.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DeepseekV41ProcessorError("split_special_tokens needs a fast tokenizer (a `tokenizers` backend)")
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
    words = backend.pre_tokenizer.pre_tokenize_str(normalized) if backend.pre_tokenizer is not None else [
        (normalized, (0, len(normalized)))
    ]
    same_text = normalized == text
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for word, (start, end) in words:
        tokens = backend.model.tokenize(word)
        to_text = _word_offsets(word, text[start:end]) if same_text else None
        for token in tokens:
            ids.append(token.id)
            if to_text is None:
                offsets.append((start, end) if same_text else (0, len(text)))
            else:
                offsets.append((start + to_text(token.offsets[0], False), start + to_text(token.offsets[1], True)))
    added = set(tokenizer.get_added_vocab().values())
    forged = [i for i in ids if i in added]
    if forged:
        raise DeepseekV41ProcessorError(
            f"split_special_tokens: {text!r} tokenizes to the added token id {forged[0]} even as plain text"
        )
    return ids, offsets


def _word_offsets(word: str, original: str):
    """Map the UTF-8 byte offsets `model.tokenize(word)` reports to characters of `original`,
    the text the pre-tokenizer cut `word` from (a byte-level pre-tokenizer maps each byte of it
    to one character of `word`; others keep its characters). None where neither holds."""
    word_bytes = _cumulative(len(c.encode("utf-8")) for c in word)  # byte offset -> word character
    if len(word) == len(original):
        units = list(range(len(original) + 1))  # word character == original character
    elif len(word) == len(original.encode("utf-8")):
        units = _cumulative(len(c.encode("utf-8")) for c in original)  # word character == original byte
    else:
        return None

    def to_text(byte_offset: int, round_up: bool) -> int:
        chars = bisect.bisect_left(word_bytes, byte_offset)  # word characters before the offset
        index = bisect.bisect_left(units, chars) if round_up else bisect.bisect_right(units, chars) - 1
        return min(max(index, 0), len(original))

    return to_text


def _cumulative(sizes: Iterable[int]) -> list[int]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


__all__ = ["ControlTokenMarkers", "encode_as_text", "marker_replacement_offsets", "split_marked"]
