"""Exceptions raised by the DeepSeek-V4.1 processing code (image processor, processor).

Every error is a `ValueError`, so callers that already guard against bad input with
`except ValueError` keep working. The subclasses let a caller tell the cases apart:

- :class:`DeepseekV41ImageError`: the input is not a usable image (cannot be read or decoded,
  zero area, unsupported object, URL not allowed, a path that is not a regular file).
- :class:`DeepseekV41ImageTooLargeError`: the header announces more pixels (or decoded memory)
  than the decompression-bomb cap allows, or more encoded bytes than the byte cap; raised before
  any pixel is decoded. Also a decoder's `MemoryError`.
- :class:`DeepseekV41ImagePlanError`: no patch grid fits the token budget (the reference
  `inference/image_processor.py: safe_resize` asserts instead).
"""

from __future__ import annotations


class DeepseekV41ProcessingError(ValueError):
    """Base class of every processing error of this project."""


class DeepseekV41ImageError(DeepseekV41ProcessingError):
    """The input cannot be turned into an RGB image: unreadable, undecodable, empty or refused."""


class DeepseekV41ImageTooLargeError(DeepseekV41ImageError):
    """The image is over `max_image_pixels` (pixels or decoded memory, from its header) or
    `max_image_bytes`, or decoding it ran out of memory (decompression-bomb guard)."""


class DeepseekV41ImagePlanError(DeepseekV41ProcessingError):
    """No patch grid for this image size fits the per-image token budget."""


__all__ = [
    "DeepseekV41ImageError",
    "DeepseekV41ImagePlanError",
    "DeepseekV41ImageTooLargeError",
    "DeepseekV41ProcessingError",
]


class DeepseekV41ProcessorError(DeepseekV41ProcessingError):
    """Bad text or chat input to the processor: placeholder/image count mismatch, an image
    placeholder inside chat text, text that is not valid Unicode, tool-call arguments that are not
    a JSON object, a message, tool or arguments nesting deeper than `MAX_JSON_DEPTH`, an invalid
    chat-template option, a malformed completion."""


__all__.append("DeepseekV41ProcessorError")
