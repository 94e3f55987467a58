"""Image processor of DeepSeek-V4.1-Flash (vision input), bit-exact with the reference.

Mirrors `inference/image_processor.py` of the official release (`plan_image_grid`, `safe_resize`,
`solve_resize_ratio`, `llm_grid`, `load_image`). An image of size (width, height) becomes:

- a pixel size (best_width, best_height), multiples of `patch_size`, chosen from the ORIGINAL size
  alone by :func:`plan_image_grid`;
- a ViT patch grid n_vit_h x n_vit_w = best_height/patch_size x best_width/patch_size;
- an LLM token grid n_llm_h x n_llm_w = ceil(n_vit / downsample_ratio) per side, which costs
  n_llm_h * (n_llm_w + 1) + 2 positions in the prompt (one IMAGE_NEW_LINE per row plus
  IMAGE_START / IMAGE_END).

Pixels: Pillow decode, first frame, `convert("RGB")`; `ImageOps.pad` (BICUBIC contain, centred on
a gray canvas) to the planned size; float32 /255; (x - mean) / std; patches in the order
(grid_y, grid_x, channel, y, x). The reference casts to bf16 right after normalising; the float32
values returned here are the ones it casts, so `pixel_values.to(torch.bfloat16)` equals its patches
bit for bit (checked against the golden fixtures for Pillow 13.0.0).

The planning arithmetic deliberately keeps the reference's float64 expressions and their order:
in some cases (e.g. 398x618 with a 64-token budget) they land one patch below the exact rational
answer, and the model was run with the float answer.
"""

from __future__ import annotations

import base64
import io
import math
import numbers
import operator
import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ImagesKwargs

from ..modeling.image_spans_deepseek_v41_vl import image_span_length, llm_grid, parse_image_grid
from .remote_code_deepseek_v41_vl import ProcessorSaveMixin, register_for_auto_class
from .errors_deepseek_v41_vl import (
    DeepseekV41ImageError,
    DeepseekV41ImagePlanError,
    DeepseekV41ImageTooLargeError,
    DeepseekV41ProcessingError,
)

# Default decompression-bomb cap on width * height: 50,000,000 pixels (e.g. 8660 x 5773).
# The released resize plan (1024 tokens, patch 14, merge 3) never gives the model more than about
# 1.8 Mpx (1512 x 1134 for a 4:3 photo, 42882 x 42 for the widest strip), so every larger image is
# downscaled first; the cap leaves a margin of about 28 times that, which a 48- or 50-megapixel
# camera photo at full resolution still fits (8160 x 6120 = 49.9 Mpx). Pillow's own limit
# (2 * Image.MAX_IMAGE_PIXELS = 178956970) let a few-kilobyte animated WebP announcing a 171 Mpx
# canvas decode for 24 s into 3.2 GB; at this cap the worst such canvas decodes into well under
# 1 GB. It is also the server's default (`serve_policy.ServeLimits.max_image_pixels`).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000

# Default cap on an image's encoded size (file, bytes, data URL payload, URL body): 20 MiB, as the
# server's `--max-image-bytes`. It also bounds reads from sources of unknown size (file objects,
# URLs), which would otherwise read until the source ends.
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024

# Decoded bytes per pixel that the pixel cap stands for: Pillow stores an 8-bit RGB / RGBA pixel
# in 4 bytes. Images whose decoded samples take more (16-bit-per-channel RGB / RGBA / LA) are
# capped by this memory instead of their pixel count alone (see `_decoded_bytes_per_pixel`).
CAP_BYTES_PER_PIXEL = 4

# The smallest span, a 1x1 token grid: IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END.
MIN_IMAGE_TOKENS = image_span_length(1, 1)

EXIF_ORIENTATION_POLICIES = ("ignore", "apply")

ImageSource = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO | Image.Image | np.ndarray | torch.Tensor


# --------------------------------------------------------------------------------------------
# Planning: a pure function of the original size.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImagePlan:
    """Resize plan of one image (`inference/image_processor.py: plan_image_grid` plus derived sizes).

    Attributes:
        n_llm_h, n_llm_w (`int`): LLM token grid after the aligner's ratio x ratio merge.
        best_height, best_width (`int`): pixel size the image is padded/resized to (multiples of
            the patch size).
        n_vit_h, n_vit_w (`int`): ViT patch grid, best_height // patch, best_width // patch.
        num_image_tokens (`int`): prompt positions of the image span, n_llm_h * (n_llm_w + 1) + 2.
    """

    n_llm_h: int
    n_llm_w: int
    best_height: int
    best_width: int
    n_vit_h: int
    n_vit_w: int
    num_image_tokens: int

    @property
    def num_patches(self) -> int:
        """Rows of `pixel_values` this image contributes: n_vit_h * n_vit_w."""
        return self.n_vit_h * self.n_vit_w


def _solve_resize_ratio(height, width, patch_size, downsample_ratio, max_image_tokens):
    """Largest aspect-preserving (height, width) whose token grid fits; `solve_resize_ratio`.

    The token count h * (w + 1) + 2 with h = w * rho is solved for w in float64; each expression is
    evaluated exactly as in the reference (operands, operators and order), float artifacts included.
    """
    rho = height / width
    max_w_float = math.sqrt((max_image_tokens - 2) / rho + 0.25) - 0.5
    max_h_float = max_w_float * rho
    cell = patch_size * downsample_ratio
    if max_w_float < 1.0:
        # Too tall for even one column at full height: one column of (budget - 2) // 2 rows.
        return (max_image_tokens - 2) // 2 * cell, cell
    if max_h_float < 1.0:
        # Too wide for even one row: one row of (budget - 3) cells.
        return cell, (max_image_tokens - 3) * cell
    beta = min(math.floor(max_w_float) * cell / width, math.floor(max_h_float) * cell / height)
    return math.floor(height * beta / patch_size) * patch_size, math.floor(width * beta / patch_size) * patch_size


def plan_image_grid(
    width: int,
    height: int,
    *,
    patch_size: int = 14,
    downsample_ratio: int = 3,
    max_image_tokens: int = 1024,
    min_pixels: int = 295936,
    max_wh_ratio: float | None = None,
) -> ImagePlan:
    """Resize plan for an image of the given original size (no pixels needed).

    Mirrors `inference/image_processor.py: plan_image_grid` + `safe_resize` + `solve_resize_ratio`:

    1. if `max_wh_ratio` is set and width > height * max_wh_ratio, width = height * max_wh_ratio;
    2. if width * height < min_pixels, scale both sides by sqrt(min_pixels / area), truncating;
    3. round each side up to a multiple of `patch_size`;
    4. if the token span exceeds `max_image_tokens`, shrink to the largest aspect-preserving size
       that fits (computed from the step-2 sizes, not the rounded ones).

    Args:
        width, height (`int`): original image size in pixels, both > 0.
        patch_size, downsample_ratio, max_image_tokens, min_pixels, max_wh_ratio: the vision
            settings (`DeepseekV41VisionConfig` fields of the same names).

    Returns:
        :class:`ImagePlan`.

    Raises:
        DeepseekV41ImageError: width or height is not a positive integer.
        DeepseekV41ImagePlanError: no grid fits `max_image_tokens` (fewer than 4 tokens; the
            reference asserts or returns an empty grid).
        DeepseekV41ProcessingError: a setting has the wrong type or range (patch_size or
            downsample_ratio not a positive integer, max_image_tokens not an integer, min_pixels
            negative, max_wh_ratio not None or a positive number).
    """
    patch_size = _integer("patch_size", patch_size, minimum=1)
    downsample_ratio = _integer("downsample_ratio", downsample_ratio, minimum=1)
    max_image_tokens = _integer("max_image_tokens", max_image_tokens)
    min_pixels = _integer("min_pixels", min_pixels, minimum=0)
    max_wh_ratio = _optional_positive_number("max_wh_ratio", max_wh_ratio)
    try:
        width, height = operator.index(width), operator.index(height)
    except TypeError as err:
        raise DeepseekV41ImageError(f"image size must be integers, got width={width!r}, height={height!r}") from err
    if width <= 0 or height <= 0:
        raise DeepseekV41ImageError(f"image has zero area: {width}x{height} pixels (width x height)")
    if max_image_tokens < MIN_IMAGE_TOKENS:
        raise DeepseekV41ImagePlanError(
            f"image {width}x{height} cannot fit max_image_tokens={max_image_tokens}: the smallest image span "
            f"(a 1x1 token grid) takes {MIN_IMAGE_TOKENS} tokens"
        )
    original = (width, height)

    p = patch_size
    if max_wh_ratio is not None and width > height * max_wh_ratio:
        width = height * max_wh_ratio
    if 0 < width * height < min_pixels:
        # `** 0.5` (libm pow), not math.sqrt: the reference's expression.
        ratio = (min_pixels / (width * height)) ** 0.5
        width = int(width * ratio)
        height = int(height * ratio)
    best_width = math.ceil(width / p) * p
    best_height = math.ceil(height / p) * p

    # the reference's `llm_grid` of the patch grid (its float ceil equals the integer one here)
    n_llm_h, n_llm_w = llm_grid(best_height // p, best_width // p, downsample_ratio)
    if image_span_length(n_llm_h, n_llm_w) > max_image_tokens:
        best_height, best_width = _solve_resize_ratio(height, width, p, downsample_ratio, max_image_tokens)
        n_llm_h, n_llm_w = llm_grid(best_height // p, best_width // p, downsample_ratio)
    num_tokens = image_span_length(n_llm_h, n_llm_w)
    if num_tokens > max_image_tokens or best_height <= 0 or best_width <= 0:
        raise DeepseekV41ImagePlanError(
            f"image {original[0]}x{original[1]}: no patch grid fits max_image_tokens={max_image_tokens} "
            f"(planned {best_width}x{best_height} pixels, {num_tokens} tokens)"
        )
    return ImagePlan(
        n_llm_h=n_llm_h,
        n_llm_w=n_llm_w,
        best_height=best_height,
        best_width=best_width,
        n_vit_h=best_height // p,
        n_vit_w=best_width // p,
        num_image_tokens=num_tokens,
    )


# --------------------------------------------------------------------------------------------
# Decoding.
# --------------------------------------------------------------------------------------------


def array_to_image(array: np.ndarray | torch.Tensor, input_data_format: str | None = None) -> Image.Image:
    """A numpy array or torch tensor as a PIL image, the documented conversion for array input.

    Layout: ``[H, W]`` (gray), ``[H, W, C]`` or ``[C, H, W]`` with C in 1, 3, 4. With
    `input_data_format` None the first axis is taken as channels when it has 1, 3 or 4 entries
    (transformers' rule), else the last; "channels_first" / "channels_last" (or transformers'
    `ChannelDimension.FIRST` / `.LAST`) name the channel axis of a 3-D array instead.
    Values: uint8 as they are; floats must lie in [0, 1] and become ``round(x * 255)``. The
    image then takes the PIL path (``convert("RGB")``: alpha dropped, gray replicated).

    Raises:
        DeepseekV41ImageError: another rank, channel count or dtype; floats outside [0, 1] or not
            finite; an empty array; a tensor whose values cannot be read (on the meta device, or
            a layout / dtype NumPy cannot hold, e.g. sparse or bfloat16); a named channel axis
            whose size is not 1, 3 or 4.
        DeepseekV41ProcessingError: `input_data_format` is not None, "channels_first" or
            "channels_last".
    """
    layout = _data_format(input_data_format)
    if isinstance(array, torch.Tensor):
        if array.device.type == "meta":
            raise DeepseekV41ImageError(
                f"image tensor {tuple(array.shape)} is on the meta device: it has no values to read"
            )
        try:
            array = array.detach().cpu().numpy()
        except (RuntimeError, TypeError, NotImplementedError) as err:
            raise DeepseekV41ImageError(
                f"cannot read image tensor {tuple(array.shape)} {array.dtype} ({array.layout}) as an array: {err}"
            ) from err
    if array.ndim == 3:
        if layout is not None:
            axis = 0 if layout == "channels_first" else -1
            if array.shape[axis] not in (1, 3, 4):
                raise DeepseekV41ImageError(
                    f"image array {array.shape} with input_data_format={layout!r} has {array.shape[axis]} channels, "
                    "not 1, 3 or 4"
                )
            if axis == 0:
                array = np.moveaxis(array, 0, -1)
        elif array.shape[0] in (1, 3, 4):
            array = np.moveaxis(array, 0, -1)
        elif array.shape[-1] not in (1, 3, 4):
            raise DeepseekV41ImageError(f"image array {array.shape} has no channel axis of 1, 3 or 4 (first or last)")
        if array.shape[-1] == 1:
            array = array[..., 0]
    elif array.ndim != 2:
        raise DeepseekV41ImageError(f"image array must be [H, W], [H, W, C] or [C, H, W], got shape {array.shape}")
    if array.size == 0:
        raise DeepseekV41ImageError(f"image array {array.shape} is empty")
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise DeepseekV41ImageError("float image arrays must hold finite values in [0, 1]")
        array = np.rint(array.astype(np.float64) * 255).astype(np.uint8)
    elif array.dtype != np.uint8:
        raise DeepseekV41ImageError(f"image arrays must be uint8 or float in [0, 1], got {array.dtype}")
    return Image.fromarray(np.ascontiguousarray(array))


def _read_source(
    src: Any, allow_urls: bool, max_image_bytes: int | None, input_data_format: str | None = None
) -> bytes | Image.Image:
    """The encoded bytes of `src` (or a PIL image: `src` itself, or an array converted).

    `max_image_bytes` is checked before the data is decoded, and where the size is known before
    reading (a file's size, a data URL's payload length), before it is read. `input_data_format`
    names an array's channel axis; any other input is decoded channels-last, so
    "channels_first" is refused for it.
    """
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return array_to_image(src, input_data_format)
    if _data_format(input_data_format) == "channels_first":
        raise DeepseekV41ProcessingError(
            f"input_data_format='channels_first' describes a [C, H, W] array, but the image is a "
            f"{type(src).__name__}, whose pixels are decoded channels-last: leave input_data_format unset"
        )
    if isinstance(src, Image.Image):
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        _check_bytes(len(src), max_image_bytes)
        return bytes(src)
    if hasattr(src, "read"):
        data = src.read() if max_image_bytes is None else src.read(max_image_bytes + 1)
        if not isinstance(data, (bytes, bytearray)):
            raise DeepseekV41ImageError(f"file object must be opened in binary mode, read() gave {type(data).__name__}")
        _check_bytes(len(data), max_image_bytes, at_least=True)
        return bytes(data)
    if isinstance(src, os.PathLike):
        src = os.fspath(src)
    if isinstance(src, str):
        scheme = src[:8].lower()  # URL schemes are case-insensitive (RFC 3986)
        if scheme.startswith(("http://", "https://")):
            if not allow_urls:
                raise DeepseekV41ImageError(
                    f"refusing to fetch image URL {src!r}: network access is off by default; pass allow_urls=True "
                    "or download the image and pass its bytes or path"
                )
            from urllib.request import urlopen

            try:
                with urlopen(src, timeout=30) as response:
                    data = response.read() if max_image_bytes is None else response.read(max_image_bytes + 1)
            except OSError as err:  # URLError, HTTPError, timeouts
                raise DeepseekV41ImageError(f"cannot fetch image URL {src!r}: {err}") from err
            _check_bytes(len(data), max_image_bytes, at_least=True)
            return data
        if scheme.startswith("data:"):
            header, _, payload = src.partition(",")
            if ";base64" not in header:
                raise DeepseekV41ImageError(f"unsupported data URL encoding {header!r}: only base64 data URLs are read")
            # valid base64 (no whitespace: validate=True) decodes to exactly this many bytes
            _check_bytes(len(payload.rstrip("=")) * 3 // 4, max_image_bytes)
            try:
                return base64.b64decode(payload, validate=True)
            except ValueError as err:
                raise DeepseekV41ImageError(f"data URL payload is not valid base64: {err}") from err
        return _read_file(src, max_image_bytes)
    raise DeepseekV41ImageError(
        f"unsupported image input of type {type(src).__name__}: pass a path, bytes, a binary file object, a PIL image, or a numpy array / torch tensor"
    )


def _read_file(path: str, max_image_bytes: int | None) -> bytes:
    """The bytes of the regular file at `path`, refusing anything else before reading.

    The path is checked (:func:`check_image_file`) before it is opened (a socket cannot be opened,
    a FIFO's `open` could block), then opened non-blocking and checked again with `fstat` on the
    open descriptor, so the check and the read see the same file. The size is checked against
    `max_image_bytes` before reading, and the read stops one byte past the cap (the file may grow
    meanwhile).
    """
    check_image_file(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError) as err:  # ValueError: a name the OS cannot take
        raise DeepseekV41ImageError(f"cannot read image file {path!r}: {err}") from err
    try:
        info = check_image_file(path, os.fstat(fd))
        _check_bytes(info.st_size, max_image_bytes)
        file, fd = os.fdopen(fd, "rb"), None  # the file object owns the descriptor now
        with file:
            data = file.read() if max_image_bytes is None else file.read(max_image_bytes + 1)
    except OSError as err:
        raise DeepseekV41ImageError(f"cannot read image file {path!r}: {err}") from err
    finally:
        if fd is not None:
            os.close(fd)
    _check_bytes(len(data), max_image_bytes, at_least=True)  # the file may have grown since
    return data


def check_image_file(path: str, info: os.stat_result | None = None) -> os.stat_result:
    """Refuse an image path that does not name a regular file, the only kind read as an image:
    a FIFO blocks `open` until a writer comes, a device such as /dev/zero never ends, a directory
    or a socket holds no image bytes.

    Args:
        path (`str`): the image's path.
        info (`os.stat_result`, *optional*): the file's status when the caller has it, e.g.
            `os.fstat` of the descriptor it reads (so the check and the read see the same file);
            None: `os.stat(path)`, which follows symlinks and never opens the file.

    Returns:
        `os.stat_result`: the file's status (`st_size` is its size in bytes).

    Raises:
        DeepseekV41ImageError: `path` holds a NUL byte, cannot be examined (missing, no
            permission) or is not a regular file ("image '/dev/zero' is a device, not a regular
            file"); the message names the path and the problem.
    """
    _check_path_name(path)
    if info is None:
        try:
            info = os.stat(path)
        except (OSError, ValueError) as err:
            raise DeepseekV41ImageError(f"cannot read image file {path!r}: {getattr(err, 'strerror', None) or err}") from None
    if not stat.S_ISREG(info.st_mode):
        raise DeepseekV41ImageError(f"image {path!r} is {_file_kind(info.st_mode)}, not a regular file")
    return info


def _check_path_name(path: str) -> None:
    if "\0" in path:
        raise DeepseekV41ImageError(f"image path {path!r} contains a NUL byte: not a valid file name")


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), f"a special file (mode {mode:o})")


def _check_bytes(size: int, max_image_bytes: int | None, at_least: bool = False) -> None:
    """Refuse encoded data over `max_image_bytes` (`at_least`: reading stopped at the cap + 1)."""
    if max_image_bytes is not None and size > max_image_bytes:
        amount = f"more than {max_image_bytes} bytes" if at_least else f"{size} bytes"
        raise DeepseekV41ImageTooLargeError(f"image data of {amount} exceeds max_image_bytes={max_image_bytes}")


def load_image(
    src: ImageSource,
    *,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    exif_orientation: str = "ignore",
    allow_urls: bool = False,
    max_image_bytes: int | None = DEFAULT_MAX_IMAGE_BYTES,
    input_data_format: str | None = None,
) -> Image.Image:
    """Open one image as an RGB PIL image, as `inference/image_processor.py: load_image` does.

    Encoded input (path, bytes, binary file object, base64 `data:` URL, or an http(s) URL when
    `allow_urls`) is opened with Pillow from its bytes; numpy arrays and torch tensors become PIL
    images by :func:`array_to_image`; the first frame is decoded and converted with
    `convert("RGB")`: alpha is dropped without compositing, I;16 / F are clipped to [0, 255] by
    Pillow, CMYK uses Pillow's plain conversion. A PIL image is converted as given (its current frame).

    Args:
        src: the image.
        max_image_pixels (`int`, *optional*, defaults to 50,000,000): decompression-bomb cap,
            checked from the header before any pixel is decoded: width * height must not exceed
            it, and neither may the decoded memory, width * height * bytes per decoded pixel, exceed
            that of an 8-bit RGB image at the cap (4 * max_image_pixels bytes; only 16-bit RGB /
            RGBA / LA images take more than 4 bytes a pixel). `None` disables both checks
            (Pillow's own global limit, `PIL.Image.MAX_IMAGE_PIXELS`, still applies while opening).
        exif_orientation (`str`): "ignore" (the reference: stored pixel order) or "apply" (transpose
            by the EXIF Orientation tag first, as a viewer shows the image).
        allow_urls (`bool`): allow fetching http(s) URLs with urllib (off by default).
        max_image_bytes (`int`, *optional*, defaults to 20 MiB): cap on the encoded size in bytes,
            checked before decoding (before reading, where the size is known first; a file object
            or URL is read to at most one byte past it). `None`: no cap.
        input_data_format (`str`, *optional*): channel axis of an array / tensor input,
            "channels_first" or "channels_last" (see :func:`array_to_image`); None guesses it.
            Other inputs are decoded channels-last: "channels_first" is refused for them.

    Returns:
        `PIL.Image.Image` in mode "RGB", fully loaded.

    Raises:
        DeepseekV41ImageError: unreadable, empty, truncated or non-image data (whatever exception
            Pillow's decoder raises), zero area, unsupported input type, a path that is not a
            regular file (FIFO, device, directory) or holds a NUL byte, or a URL while
            `allow_urls` is False.
        DeepseekV41ImageTooLargeError: width * height > max_image_pixels, decoded memory beyond
            what the cap allows, beyond Pillow's own limit, more encoded bytes than
            max_image_bytes (the message names the cap that refused it), or decoding ran out of
            memory (Pillow's `MemoryError`).
        DeepseekV41ProcessingError: a bad `input_data_format`, or "channels_first" for an input
            that is not an array / tensor.
    """
    if exif_orientation not in EXIF_ORIENTATION_POLICIES:
        raise DeepseekV41ImageError(
            f"exif_orientation must be one of {EXIF_ORIENTATION_POLICIES}, got {exif_orientation!r}"
        )
    data = _read_source(src, allow_urls, max_image_bytes, input_data_format)
    if isinstance(data, Image.Image):
        _check_size(data.width, data.height, max_image_pixels, data)
        try:
            image = ImageOps.exif_transpose(data) if exif_orientation == "apply" else data
            return image.convert("RGB")
        except MemoryError as err:
            raise _out_of_memory(data) from err
        except Exception as err:  # whatever a Pillow decoder raises: the documented ValueError
            raise DeepseekV41ImageError(f"cannot decode image: {type(err).__name__}: {err}") from err
    if not data:
        raise DeepseekV41ImageError("image data is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            if max_image_pixels is not None:
                # Our cap is checked from the header right below, before any pixel is decoded;
                # Pillow's DecompressionBombWarning (above 89M pixels) would only add noise for
                # images within it. Without our cap, Pillow's warning is the only guard: keep it.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            # Pillow reads only the header here; the bomb check runs before `convert` decodes pixels.
            with Image.open(io.BytesIO(data)) as source:
                _check_size(source.width, source.height, max_image_pixels, source)
                try:
                    image = ImageOps.exif_transpose(source) if exif_orientation == "apply" else source
                    return image.convert("RGB")
                except MemoryError as err:
                    raise _out_of_memory(source) from err
    except DeepseekV41ProcessingError:
        raise
    except Image.DecompressionBombError as err:
        # Pillow checks its own limit while opening, before our header check: name the cap in force
        pillow_limit = 2 * Image.MAX_IMAGE_PIXELS
        if max_image_pixels is not None and max_image_pixels <= pillow_limit:
            message = f"image exceeds max_image_pixels={max_image_pixels} (decompression-bomb guard; Pillow: {err})"
        else:
            message = (
                f"image refused by Pillow's decompression-bomb limit of {pillow_limit} pixels "
                f"(2 * PIL.Image.MAX_IMAGE_PIXELS), which is lower than max_image_pixels={max_image_pixels}: "
                f"raise PIL.Image.MAX_IMAGE_PIXELS to decode larger images (Pillow: {err})"
            )
        raise DeepseekV41ImageTooLargeError(message) from err
    except UnidentifiedImageError as err:
        raise DeepseekV41ImageError(
            f"cannot identify image file ({len(data)} bytes): not an image format Pillow can read"
        ) from err
    except MemoryError as err:  # while opening: a header whose tables Pillow cannot allocate
        raise DeepseekV41ImageTooLargeError(
            f"cannot open image data ({len(data)} bytes): Pillow ran out of memory reading its header (MemoryError)"
        ) from err
    except Exception as err:
        # e.g. "image file is truncated" (OSError), or a decoder's TypeError / NotImplementedError /
        # struct.error on a malformed header: every decoding failure is the documented ValueError
        raise DeepseekV41ImageError(
            f"cannot decode image data ({len(data)} bytes): {type(err).__name__}: {err}"
        ) from err


def _check_size(width: int, height: int, max_image_pixels: int | None, image: Image.Image | None = None) -> None:
    """Refuse a zero-area image, and one over the decompression-bomb cap (pixels, then decoded
    memory from the mode of `image`), from its header: nothing is decoded."""
    if width <= 0 or height <= 0:
        raise DeepseekV41ImageError(f"image has zero area: {width}x{height} pixels (width x height)")
    if max_image_pixels is None:
        return
    if width * height > max_image_pixels:
        raise DeepseekV41ImageTooLargeError(
            f"image of {width}x{height} = {width * height} pixels exceeds max_image_pixels={max_image_pixels} "
            "(decompression-bomb guard)"
        )
    per_pixel = _decoded_bytes_per_pixel(image) if image is not None else CAP_BYTES_PER_PIXEL
    if width * height * per_pixel > max_image_pixels * CAP_BYTES_PER_PIXEL:
        raise DeepseekV41ImageTooLargeError(
            f"image of {width}x{height} pixels in mode {_mode_name(image)} decodes to {per_pixel} bytes a pixel, "
            f"{width * height * per_pixel} bytes in all: more than max_image_pixels={max_image_pixels} allows "
            f"({max_image_pixels * CAP_BYTES_PER_PIXEL} bytes, {CAP_BYTES_PER_PIXEL} a pixel; decompression-bomb guard)"
        )


def _raw_mode(image: Image.Image) -> str | None:
    """The raw mode of the first tile the decoder will read (e.g. "RGBA;16B"), or None."""
    for tile in getattr(image, "tile", None) or ():
        args = tile[3] if len(tile) > 3 else None
        if isinstance(args, tuple):
            args = args[0] if args else None
        return args if isinstance(args, str) else None
    return None


def _decoded_bytes_per_pixel(image: Image.Image) -> int:
    """Bytes one pixel takes once decoded: the larger of Pillow's storage of `image.mode` (1 byte
    for "1" / "L" / "P", 2 for "I;16*", 4 for every other mode) and the raw samples the decoder
    reads (2 bytes a band for 16-bit-per-channel data: 8 for a 16-bit RGBA PNG, 6 for RGB, 4 for LA)."""
    mode = image.mode
    if mode in ("1", "L", "P"):
        stored = 1
    elif mode.startswith("I;16"):
        stored = 2
    else:
        stored = 4
    raw = _raw_mode(image) or ""
    if ";16" in raw and not mode.startswith("I;16"):
        try:
            stored = max(stored, 2 * Image.getmodebands(raw.split(";")[0]))
        except (KeyError, ValueError):  # a raw mode Pillow does not list: keep the storage size
            pass
    return stored


def _mode_name(image: Image.Image | None) -> str:
    if image is None:
        return "?"
    raw = _raw_mode(image)
    return f"{image.mode!r}" + (f" (raw {raw!r})" if raw and raw != image.mode else "")


def _out_of_memory(image: Image.Image) -> DeepseekV41ImageTooLargeError:
    return DeepseekV41ImageTooLargeError(
        f"image of {image.width}x{image.height} pixels in mode {_mode_name(image)} could not be decoded: "
        "Pillow ran out of memory (MemoryError); set or lower max_image_pixels to refuse such images from their header"
    )


# --------------------------------------------------------------------------------------------
# Pixels: resize/pad, normalise, patchify.
# --------------------------------------------------------------------------------------------


def resize_to_plan(
    image: Image.Image,
    plan: ImagePlan,
    *,
    pad_color: tuple[int, int, int] = (127, 127, 127),
    max_wh_ratio: float | None = None,
) -> Image.Image:
    """RGB image of exactly (plan.best_width, plan.best_height) pixels.

    Mirrors the resize step of `inference/image_processor.py: load_image`: when `max_wh_ratio` is set
    and image.width >= max_wh_ratio * image.height, a plain (stretching) BICUBIC `resize`;
    otherwise `ImageOps.pad` (BICUBIC contain, centred on `pad_color`), the V4.1 path.
    """
    size = (plan.best_width, plan.best_height)
    if max_wh_ratio is not None and image.width >= max_wh_ratio * image.height:
        return image.resize(size, Image.Resampling.BICUBIC)
    return ImageOps.pad(image, size, method=Image.Resampling.BICUBIC, color=tuple(pad_color))


def normalize_and_patchify(
    image: Image.Image,
    patch_size: int,
    image_mean: float | Sequence[float] = 0.5,
    image_std: float | Sequence[float] = 0.5,
) -> torch.Tensor:
    """Patch rows of an RGB image whose sides are multiples of `patch_size`.

    float32 x / 255, then (x - mean) / std, in float32 and in that order (the reference's ops, so a
    bf16 cast of the result equals its bf16 patches); then patches in the order
    (grid_y, grid_x, channel, y, x). Mirrors the tail of `inference/image_processor.py: load_image`.

    Computed in NumPy (each op correctly rounded in float32, the same bits as the reference's torch
    ops): no thread pool is touched, so a process that forks after preprocessing an image (a
    `datasets.map(num_proc=...)` worker, any fork-based pool) does not hang in OpenMP.

    Returns:
        `torch.FloatTensor` [n_vit_h * n_vit_w, 3 * patch_size**2], float32.
    """
    x = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)
    x = (x - _per_channel(image_mean)) / _per_channel(image_std)
    _, height, width = x.shape
    n_h, n_w = height // patch_size, width // patch_size
    x = x.reshape(3, n_h, patch_size, n_w, patch_size).transpose(1, 3, 0, 2, 4)
    return torch.from_numpy(np.ascontiguousarray(x.reshape(n_h * n_w, 3 * patch_size * patch_size)))


def _per_channel(value: float | Sequence[float]) -> np.float32 | np.ndarray:
    if isinstance(value, (int, float)):
        return np.float32(value)
    return np.asarray(list(value), dtype=np.float32).reshape(3, 1, 1)


# --------------------------------------------------------------------------------------------
# Transformers image processor.
# --------------------------------------------------------------------------------------------


class DeepseekV41ImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    patch_size (`int`, defaults to 14): ViT patch side in pixels.
    downsample_ratio (`int`, defaults to 3): the aligner merges ratio x ratio patches per token.
    max_image_tokens (`int`, defaults to 1024): prompt positions one image may take.
    min_pixels (`int`, defaults to 295936): smaller images are upscaled to about this area.
    max_wh_ratio (`float`, *optional*): width / height clamp; `None` in V4.1.
    pad_color (`tuple[int, int, int]`, defaults to (127, 127, 127)): padding colour.
    max_image_pixels (`int`, *optional*, defaults to 50,000,000): decompression-bomb cap on
        width * height (and on the decoded memory, 4 bytes a pixel).
    max_image_bytes (`int`, *optional*, defaults to 20 MiB): cap on an image's encoded size in bytes.
    exif_orientation (`str`, defaults to "ignore"): "ignore" or "apply".
    allow_urls (`bool`, defaults to False): allow fetching http(s) image URLs.

    transformers' standard `do_rescale`, `rescale_factor`, `do_normalize`, `do_convert_rgb` and
    `input_data_format` are inherited from `ImagesKwargs`; only the values of the reference's fixed
    pipeline are accepted (see `DeepseekV41ImageProcessor`).
    """

    patch_size: int
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None
    pad_color: tuple[int, int, int] | list[int]
    max_image_pixels: int | None
    max_image_bytes: int | None
    exif_orientation: str
    allow_urls: bool


# Keys transformers itself writes to / reads from preprocessor_config.json (and the processor's
# nested image-processor dict) besides the settings; the constructor accepts only these extra keys.
_SAVED_FILE_KEYS = ("auto_map", "processor_class", "feature_extractor_type", "_processor_class")

# transformers' standard image options with the only values the reference's pipeline has: it
# always converts to RGB, rescales by x / 255 (float32 division) and normalises with
# (x - image_mean) / image_std. These values are accepted (and saved) so that configs and calls
# written for transformers' image processors work; any other value would change the pixels and is
# refused by name. None means the default, as in transformers.
FIXED_PIPELINE_OPTIONS = {"do_convert_rgb": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}

# Channel layouts `input_data_format` may name (transformers' `ChannelDimension` values).
_DATA_FORMATS = ("channels_first", "channels_last")

# Attributes that define the processing; each may be overridden per call of `preprocess`.
_SETTINGS = (
    "patch_size",
    "downsample_ratio",
    "max_image_tokens",
    "min_pixels",
    "max_wh_ratio",
    "pad_color",
    "image_mean",
    "image_std",
    "max_image_pixels",
    "max_image_bytes",
    "exif_orientation",
    *FIXED_PIPELINE_OPTIONS,
)


class DeepseekV41ImageProcessor(ProcessorSaveMixin, BaseImageProcessor):
    r"""Image processor of DeepSeek-V4.1-Flash; mirrors `inference/image_processor.py`.

    Built with no arguments it has the released checkpoint's settings; build it from a model config
    with :meth:`from_vision_config`. Saved as `preprocessor_config.json` by `save_pretrained`.

    Args:
        patch_size (`int`, defaults to 14): ViT patch side (`vision_patch_size`).
        downsample_ratio (`int`, defaults to 3): aligner merge ratio (`vision_downsample_ratio`).
        max_image_tokens (`int`, defaults to 1024): span budget per image (`vision_max_n_token`).
        min_pixels (`int`, defaults to 295936): upscale target area (`vision_min_pixels`).
        max_wh_ratio (`float`, *optional*): width/height clamp (`vision_max_wh_ratio`, None in V4.1).
        pad_color (`tuple[int, int, int]`, defaults to (127, 127, 127)): `ImageOps.pad` colour.
        image_mean, image_std (`float` or 3 floats, default 0.5): normalisation, (x/255 - mean) / std.
        max_image_pixels (`int`, *optional*, defaults to 50,000,000): decompression-bomb cap on
            width * height, checked from the header BEFORE decoding; the decoded memory is capped
            alike (width * height * decoded bytes a pixel <= 4 * max_image_pixels, which only
            16-bit RGB / RGBA / LA images can exceed within the pixel count). The default is about
            28 times the largest image the released resize plan feeds the model (~1.8 Mpx): a
            50-megapixel photo fits (see `DEFAULT_MAX_IMAGE_PIXELS`). `None` disables the check
            (Pillow's own limit, 178956970 pixels by default, still applies).
        max_image_bytes (`int`, *optional*, defaults to 20 MiB = 20971520): cap on an image's
            encoded size (file, bytes, data URL payload, file object or URL body), checked before
            decoding; `None` sets none (reads from a file object or URL are then unbounded).
            Paths must name regular files: a FIFO, a device (`/dev/zero`) or a directory is
            refused before anything is read.
        exif_orientation (`str`, defaults to "ignore"): "ignore" keeps the stored pixel order like the
            reference (a photo with EXIF Orientation 6 stays sideways); "apply" transposes first.
        do_convert_rgb (`bool`, defaults to True), do_rescale (`bool`, defaults to True),
        rescale_factor (`float`, defaults to 1/255), do_normalize (`bool`, defaults to True):
            transformers' standard options, fixed by the reference's pipeline (RGB, float32
            x / 255, (x - image_mean) / image_std). Only these values (or None, the default) are
            accepted, at construction, in a saved config and per call; they are saved in
            `preprocessor_config.json`. `rescale_factor` must equal the Python float 1 / 255.

    Integer settings accept NumPy integers (stored as Python ints); bools and floats are refused.
    Besides the settings, only the keys transformers writes to `preprocessor_config.json`
    (`image_processor_type`, `auto_map`, `processor_class`) are accepted.

    Raises:
        DeepseekV41ProcessingError: an unknown keyword argument, or a setting of the wrong type or
            range (named in the message): patch_size / downsample_ratio / max_image_tokens not a
            positive integer, min_pixels negative, max_wh_ratio not None or > 0, pad_color not 3
            integers in [0, 255], image_mean not finite, image_std not > 0 (1 or 3 numbers),
            max_image_pixels / max_image_bytes not None or a positive integer, exif_orientation
            unknown; do_convert_rgb / do_rescale / do_normalize not True, rescale_factor not
            1 / 255 ("do_normalize=False would change the pixel values ...").

    Outputs of `preprocess` / `__call__` (a `BatchFeature`):
        pixel_values: float32 [sum_i n_vit_h_i * n_vit_w_i, 3 * patch_size**2], rows in image order,
            each row one patch in (channel, y, x) order.
        image_grid_thw: int64 [n_images, 3] = (1, n_vit_h, n_vit_w).
        image_llm_grid_hw: int64 [n_images, 2] = (n_llm_h, n_llm_w).
    """

    remote_code_auto_classes = ("AutoImageProcessor",)

    valid_kwargs = DeepseekV41ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_thw", "image_llm_grid_hw"]

    def __init__(
        self,
        patch_size: int = 14,
        downsample_ratio: int = 3,
        max_image_tokens: int = 1024,
        min_pixels: int = 295936,
        max_wh_ratio: float | None = None,
        pad_color: Sequence[int] = (127, 127, 127),
        image_mean: float | Sequence[float] = 0.5,
        image_std: float | Sequence[float] = 0.5,
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        max_image_bytes: int | None = DEFAULT_MAX_IMAGE_BYTES,
        exif_orientation: str = "ignore",
        do_convert_rgb: bool | None = True,
        do_rescale: bool | None = True,
        rescale_factor: float | None = 1 / 255,
        do_normalize: bool | None = True,
        **kwargs,
    ):
        kwargs.pop("image_processor_type", None)  # written by to_dict; the class is the type
        unknown = sorted(set(kwargs) - set(_SAVED_FILE_KEYS))
        if unknown:
            # BaseImageProcessor would keep any keyword as an attribute and save it to
            # preprocessor_config.json, so a typo would silently do nothing.
            raise DeepseekV41ProcessingError(
                f"unknown DeepseekV41ImageProcessor arguments: {unknown}; the settings are {list(_SETTINGS)}"
            )
        settings = _checked_settings(
            {
                "patch_size": patch_size,
                "downsample_ratio": downsample_ratio,
                "max_image_tokens": max_image_tokens,
                "min_pixels": min_pixels,
                "max_wh_ratio": max_wh_ratio,
                "pad_color": pad_color,
                "image_mean": image_mean,
                "image_std": image_std,
                "max_image_pixels": max_image_pixels,
                "max_image_bytes": max_image_bytes,
                "exif_orientation": exif_orientation,
                "do_convert_rgb": do_convert_rgb,
                "do_rescale": do_rescale,
                "rescale_factor": rescale_factor,
                "do_normalize": do_normalize,
            }
        )
        super().__init__(**kwargs)
        for name, value in settings.items():
            setattr(self, name, value)

    @classmethod
    def from_dict(cls, image_processor_dict: dict[str, Any], **kwargs):
        """A saved config, as `BaseImageProcessor.from_dict`; keys this version does not know (a
        config written by a newer one) are dropped with a warning instead of refused. Keyword
        arguments are still checked: a typo there is an error."""
        known = set(_SETTINGS) | set(_SAVED_FILE_KEYS) | {"image_processor_type"}
        extra = sorted(set(image_processor_dict) - known)
        if extra:
            warnings.warn(f"DeepseekV41ImageProcessor ignores the saved settings {extra}", UserWarning, stacklevel=2)
        return super().from_dict({k: v for k, v in image_processor_dict.items() if k in known}, **kwargs)

    @classmethod
    def from_vision_config(cls, vision_config, **kwargs) -> DeepseekV41ImageProcessor:
        """Image processor with the settings of a `DeepseekV41VisionConfig` (or anything with its
        fields patch_size, downsample_ratio, max_image_tokens, min_pixels, max_wh_ratio).

        `kwargs` set the remaining attributes (pad_color, max_image_pixels, exif_orientation, ...).
        """
        settings = {
            name: getattr(vision_config, name)
            for name in ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels", "max_wh_ratio")
        }
        return cls(**settings, **kwargs)

    def _settings(self, **overrides) -> dict[str, Any]:
        settings = {name: getattr(self, name) for name in _SETTINGS}
        settings.update(overrides)
        return settings

    # -- planning -------------------------------------------------------------------------------

    def plan_image_grid(self, width: int, height: int) -> ImagePlan:
        """Resize plan for an image of this original size; see module function :func:`plan_image_grid`."""
        return plan_image_grid(width, height, **self._plan_settings())

    def num_image_tokens(self, width: int, height: int) -> int:
        """Prompt positions of the image span for an image of this original size (no pixels needed)."""
        return self.plan_image_grid(width, height).num_image_tokens

    def num_image_tokens_from_grid(self, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[int]:
        """Span length per image from `image_grid_thw` rows (1, n_vit_h, n_vit_w):
        n_llm_h * (n_llm_w + 1) + 2 with n_llm = ceil(n_vit / downsample_ratio).
        """
        return [image_span_length(n_h, n_w) for n_h, n_w in self.llm_grid_from_grid(image_grid_thw)]

    def llm_grid_from_grid(self, image_grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """(n_llm_h, n_llm_w) per image from `image_grid_thw` rows (1, n_vit_h, n_vit_w).

        Raises:
            DeepseekV41ProcessingError: a malformed `image_grid_thw` (`parse_image_grid`).
        """
        grids = parse_image_grid(image_grid_thw, error=DeepseekV41ProcessingError)
        return [llm_grid(h, w, self.downsample_ratio) for h, w in grids]

    def _plan_settings(self, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        s = settings or self._settings()
        return {k: s[k] for k in ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels", "max_wh_ratio")}

    # -- pixels ---------------------------------------------------------------------------------

    def load_image(self, src: ImageSource, allow_urls: bool = False) -> Image.Image:
        """RGB PIL image of `src` with this processor's bomb cap and EXIF policy; see :func:`load_image`."""
        return load_image(
            src,
            max_image_pixels=self.max_image_pixels,
            exif_orientation=self.exif_orientation,
            allow_urls=allow_urls,
            max_image_bytes=self.max_image_bytes,
        )

    def process_one(
        self, src: ImageSource, allow_urls: bool = False, input_data_format: str | None = None, **overrides
    ) -> tuple[torch.Tensor, ImagePlan]:
        """Patches and plan of one image (`input_data_format`: an array's channel axis, see
        :func:`array_to_image`).

        Returns:
            (`torch.FloatTensor` [n_vit_h * n_vit_w, 3 * patch_size**2] float32, :class:`ImagePlan`).

        Raises:
            DeepseekV41ImageError, DeepseekV41ImageTooLargeError, DeepseekV41ImagePlanError.
        """
        settings = self._settings(**overrides)
        if overrides:
            settings = _checked_settings(settings)
        image = load_image(
            src,
            max_image_pixels=settings["max_image_pixels"],
            exif_orientation=settings["exif_orientation"],
            allow_urls=allow_urls,
            max_image_bytes=settings["max_image_bytes"],
            input_data_format=input_data_format,
        )
        plan = plan_image_grid(image.width, image.height, **self._plan_settings(settings))
        image = resize_to_plan(image, plan, pad_color=settings["pad_color"], max_wh_ratio=settings["max_wh_ratio"])
        patches = normalize_and_patchify(image, settings["patch_size"], settings["image_mean"], settings["image_std"])
        return patches, plan

    def preprocess(
        self,
        images: ImageSource | Sequence[ImageSource],
        return_tensors: str | None = None,
        allow_urls: bool = False,
        **kwargs,
    ) -> BatchFeature:
        """Patches and grids of one image or a list of images (nested lists are flattened in order).

        Args:
            images: path, bytes, binary file object, PIL image, or a (nested) list of them.
            return_tensors (`str`, *optional*): "pt" for torch tensors, "np" or None for numpy.
            allow_urls (`bool`): allow fetching http(s) URLs.
            input_data_format (`str` or `ChannelDimension`, *optional*): channel axis of array /
                tensor images, "channels_first" or "channels_last"; None guesses it per array.
                "channels_first" is refused for images that are not arrays (decoded channels-last).
            kwargs: per-call overrides of the settings (patch_size, max_image_tokens, ...; the
                fixed do_convert_rgb / do_rescale / rescale_factor / do_normalize accept only the
                reference's values). Other `ImagesKwargs` keys are accepted only when None.

        Returns:
            `BatchFeature` with `pixel_values` float32 [sum N_i, 3 * patch_size**2],
            `image_grid_thw` int64 [n_images, 3] = (1, n_vit_h, n_vit_w) and
            `image_llm_grid_hw` int64 [n_images, 2] = (n_llm_h, n_llm_w).

        Raises:
            DeepseekV41ImageError: no images, or an image cannot be loaded (see :func:`load_image`).
            DeepseekV41ImageTooLargeError, DeepseekV41ImagePlanError.
            DeepseekV41ProcessingError: an unknown option, a bad override value (same rules as the
                constructor, e.g. "rescale_factor=-1 would change the pixel values"), a bad
                `input_data_format`, or a `return_tensors` other than "pt", "np", None.
        """
        if return_tensors not in (None, "pt", "np"):
            raise DeepseekV41ProcessingError(f"return_tensors must be 'pt', 'np' or None, got {return_tensors!r}")
        input_data_format = _data_format(kwargs.pop("input_data_format", None))
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in _SETTINGS}
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise DeepseekV41ProcessingError(f"unsupported image processor options: {unknown}")
        sources = _flatten(images)
        if not sources:
            raise DeepseekV41ImageError("no images given")
        patches, grids, llm_grids = [], [], []
        for src in sources:
            rows, plan = self.process_one(src, allow_urls=allow_urls, input_data_format=input_data_format, **overrides)
            patches.append(rows.numpy())
            grids.append((1, plan.n_vit_h, plan.n_vit_w))
            llm_grids.append((plan.n_llm_h, plan.n_llm_w))
        data = {
            "pixel_values": np.concatenate(patches, axis=0),
            "image_grid_thw": np.array(grids, dtype=np.int64),
            "image_llm_grid_hw": np.array(llm_grids, dtype=np.int64),
        }
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, images, *args, **kwargs) -> BatchFeature:
        return self.preprocess(images, *args, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        # JSON has no tuples; keep the saved file stable and readable.
        output["pad_color"] = list(self.pad_color)
        for key in ("image_mean", "image_std"):
            if isinstance(output[key], tuple):
                output[key] = list(output[key])
        output["max_wh_ratio"] = self.max_wh_ratio  # saved even when None, for the reader
        # the caps are saved even when None (off), so a reload does not put the default back on
        output["max_image_pixels"] = self.max_image_pixels
        output["max_image_bytes"] = self.max_image_bytes
        return output


# `save_pretrained` writes `auto_map` {"AutoImageProcessor": ...} and the remote code next to
# preprocessor_config.json (`remote_code_deepseek_v41_vl.py` says how), so the folder loads with
# `AutoImageProcessor.from_pretrained(..., trust_remote_code=True)` without this package.
register_for_auto_class(DeepseekV41ImageProcessor, "AutoImageProcessor")


def _integer(name: str, value: Any, minimum: int | None = None) -> int:
    """`value` as a Python int (NumPy integers accepted), refusing bools, floats and values below
    `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (minimum is not None and value < minimum):
        kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
            minimum, f"an integer >= {minimum}"
        )
        raise DeepseekV41ProcessingError(f"{name} must be {kind}, got {value!r}")
    return int(value)


def _plain_number(value: numbers.Real) -> int | float:
    # Python numbers stay as given (the saved JSON keeps 4 as 4); NumPy scalars become floats.
    return value if type(value) in (int, float) else float(value)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _optional_positive_number(name: str, value: Any) -> int | float | None:
    if value is None:
        return None
    if not _is_real(value) or not value > 0:
        raise DeepseekV41ProcessingError(f"{name} must be None or a positive number, got {value!r}")
    return _plain_number(value)


def _three_items(value: Any) -> tuple | None:
    """The items of a 3-element sequence, or None for anything else (strings included)."""
    if isinstance(value, (str, bytes, dict)):
        return None
    try:
        items = tuple(value)
    except TypeError:
        return None
    return items if len(items) == 3 else None


def _channel_values(name: str, value: Any, positive: bool) -> float | tuple[float, float, float]:
    """A normalisation mean / std: one finite number or 3 (one per RGB channel); std must be > 0."""
    items = (value,) if _is_real(value) else _three_items(value)
    if items is None or not all(_is_real(v) and (not positive or v > 0) for v in items):
        rule = "positive finite" if positive else "finite"
        raise DeepseekV41ProcessingError(f"{name} must be a {rule} number or 3 {rule} numbers, got {value!r}")
    return _plain_number(value) if len(items) == 1 else tuple(_plain_number(v) for v in items)


def _checked_settings(s: dict[str, Any]) -> dict[str, Any]:
    """The settings checked and normalised (NumPy numbers -> Python, sequences -> tuples).

    Raises:
        DeepseekV41ProcessingError: the first setting with a wrong type or range, by name.
    """
    out = dict(s)
    for name in ("patch_size", "downsample_ratio", "max_image_tokens"):
        out[name] = _integer(name, s[name], minimum=1)
    out["min_pixels"] = _integer("min_pixels", s["min_pixels"], minimum=0)
    out["max_wh_ratio"] = _optional_positive_number("max_wh_ratio", s["max_wh_ratio"])
    color = _three_items(s["pad_color"])
    if color is None or not all(
        isinstance(c, numbers.Integral) and not isinstance(c, bool) and 0 <= c <= 255 for c in color
    ):
        raise DeepseekV41ProcessingError(f"pad_color must be 3 integers in [0, 255], got {s['pad_color']!r}")
    out["pad_color"] = tuple(int(c) for c in color)
    out["image_mean"] = _channel_values("image_mean", s["image_mean"], positive=False)
    out["image_std"] = _channel_values("image_std", s["image_std"], positive=True)
    for name in ("max_image_pixels", "max_image_bytes"):
        if s[name] is not None:
            out[name] = _integer(name, s[name], minimum=1)
    if s["exif_orientation"] not in EXIF_ORIENTATION_POLICIES:
        raise DeepseekV41ProcessingError(
            f"exif_orientation must be one of {EXIF_ORIENTATION_POLICIES}, got {s['exif_orientation']!r}"
        )
    for name in FIXED_PIPELINE_OPTIONS:
        out[name] = _fixed_pipeline_option(name, s.get(name))
    return out


def _fixed_pipeline_option(name: str, value: Any) -> bool | float:
    """The value of a fixed pipeline option (None: its only value); any other value is refused,
    naming the option and the value."""
    fixed = FIXED_PIPELINE_OPTIONS[name]
    if value is None:
        return fixed
    if name == "rescale_factor":
        agrees = _is_real(value) and float(value) == fixed
    else:
        agrees = isinstance(value, (bool, np.bool_)) and bool(value) is fixed
    if not agrees:
        raise DeepseekV41ProcessingError(
            f"{name}={value!r} would change the pixel values: DeepseekV41ImageProcessor reproduces the reference's "
            "fixed pipeline (convert to RGB, float32 x / 255, then (x - image_mean) / image_std), so only "
            f"{name}={fixed!r} (or None) is accepted"
        )
    return fixed


def _data_format(value: Any) -> str | None:
    """`input_data_format` as "channels_first" / "channels_last" (transformers' `ChannelDimension`
    members are str enums of these values), or None."""
    if value is None:
        return None
    if not isinstance(value, str) or str(getattr(value, "value", value)) not in _DATA_FORMATS:
        raise DeepseekV41ProcessingError(
            f"input_data_format={value!r} is not a channel layout: use 'channels_first' ([C, H, W] arrays), "
            "'channels_last' ([H, W, C]) or None (guessed per array)"
        )
    return str(getattr(value, "value", value))


def _flatten(images) -> list:
    if isinstance(images, (list, tuple)):
        return [item for entry in images for item in _flatten(entry)]
    return [images]


__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "FIXED_PIPELINE_OPTIONS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DeepseekV41ImageProcessor",
    "ImagePlan",
    "check_image_file",
    "load_image",
    "normalize_and_patchify",
    "plan_image_grid",
    "resize_to_plan",
]
