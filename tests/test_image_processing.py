"""Image processor vs the reference (`inference/image_processor.py: load_image`).

Golden: `preprocess/` (25 files x settings real / small / ratio4): grids, token counts, sha256 of
the bf16 patches, the full `small` patch tensors, and the errors the reference raised.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import struct
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import (
    FLAT_TO_VISION,
    DeepseekV41Config,
    DeepseekV41VisionConfig,
)
from deepseek_v41_vl.processing.errors_deepseek_v41_vl import (
    DeepseekV41ImageError,
    DeepseekV41ImagePlanError,
    DeepseekV41ImageTooLargeError,
    DeepseekV41ProcessingError,
)
from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DeepseekV41ImageProcessor,
    load_image,
    plan_image_grid,
)
from helpers import png_header_only

SETTINGS = ["real", "small", "ratio4"]
PATCH = 14


def processor_for(flat_settings: dict, **kwargs) -> DeepseekV41ImageProcessor:
    """Processor for a golden setting, given as reference `ModelArgs` keys (vision_*)."""
    config = DeepseekV41VisionConfig(**{FLAT_TO_VISION[k]: v for k, v in flat_settings.items()})
    return DeepseekV41ImageProcessor.from_vision_config(config, **kwargs)


def bf16_patches(pixel_values: torch.Tensor) -> torch.Tensor:
    """[N, 588] float32 -> the reference's layout and dtype, bf16 [N, 3, 14, 14]."""
    return pixel_values.to(torch.bfloat16).reshape(-1, 3, PATCH, PATCH)


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def pre(golden):
    return json.loads((golden / "preprocess" / "preprocess.json").read_text())


@pytest.fixture(scope="module")
def outputs(golden, pre):
    """(setting, file) -> BatchFeature, or the exception our processor raised."""
    result = {}
    for setting in SETTINGS:
        processor = processor_for(pre["settings"][setting])
        for entry in pre["images"]:
            data = (golden / "preprocess" / entry["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["file_sha256"]
            try:
                result[setting, entry["file"]] = processor(data, return_tensors="pt")
            except ValueError as err:
                result[setting, entry["file"]] = err
    return result


# ---------------------------------------------------------------------------------------------
# Golden parity.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting", SETTINGS)
def test_golden_patches_bit_identical(pre, outputs, setting):
    checked, mismatches = 0, []
    for entry in pre["images"]:
        want = entry["results"][setting]
        if "error" in want:
            continue
        out = outputs[setting, entry["file"]]
        assert not isinstance(out, Exception), f"{entry['file']}: reference loads it, we raised {out!r}"
        n = want["n_vit_h"] * want["n_vit_w"]
        assert out["pixel_values"].dtype == torch.float32
        assert tuple(out["pixel_values"].shape) == (n, 3 * PATCH * PATCH)
        assert out["image_grid_thw"].dtype == torch.int64 and out["image_llm_grid_hw"].dtype == torch.int64
        got = {
            "grid": out["image_grid_thw"].tolist(),
            "llm": out["image_llm_grid_hw"].tolist(),
            "sha": sha256(bf16_patches(out["pixel_values"])),
        }
        expected = {
            "grid": [[1, want["n_vit_h"], want["n_vit_w"]]],
            "llm": [[want["n_llm_h"], want["n_llm_w"]]],
            "sha": want["patches_sha256"],
        }
        if got != expected:
            mismatches.append((entry["file"], got, expected))
        processor = processor_for(pre["settings"][setting])
        assert processor.num_image_tokens_from_grid(out["image_grid_thw"]) == [want["num_image_tokens"]]
        pil = entry["pil"]
        assert processor.num_image_tokens(pil["width"], pil["height"]) == want["num_image_tokens"]
        checked += 1
    assert not mismatches, mismatches
    assert checked == 23


@pytest.mark.parametrize("setting", SETTINGS)
def test_golden_errors_raise_project_error(pre, outputs, setting):
    errors = [e for e in pre["images"] if "error" in e["results"][setting]]
    assert {e["file"] for e in errors} == {"images/multipage_rgb.tif", "images/syn_truncated.png"}
    for entry in errors:
        out = outputs[setting, entry["file"]]
        assert isinstance(out, DeepseekV41ImageError), out
        # The reference's message, without Pillow's object repr, names the problem in ours too.
        reference_message = entry["results"][setting]["error"]["message"].split(" <")[0]
        assert reference_message in str(out)


def test_golden_small_patch_tensors_equal(golden, pre, outputs):
    tensors = load_file(golden / "preprocess" / "patches_small.safetensors")
    loadable = [e["file"] for e in pre["images"] if "error" not in e["results"]["small"]]
    assert sorted(tensors) == sorted(f.split("/")[-1] for f in loadable)
    for file in loadable:
        want = tensors[file.split("/")[-1]]
        got = bf16_patches(outputs["small", file]["pixel_values"])
        assert want.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got, want), file


def test_golden_covers_the_pillow_modes(pre):
    """The parity above covers every conversion path the brief names; keep it that way."""
    modes = {e["pil"].get("mode") for e in pre["images"]}
    assert {"RGB", "L", "LA", "RGBA", "P", "I;16", "CMYK", "F", "1"} <= modes
    assert any(e["pil"].get("n_frames", 1) > 1 for e in pre["images"])
    assert any(e["pil"].get("exif_orientation", 1) == 6 for e in pre["images"])


# ---------------------------------------------------------------------------------------------
# Input kinds.
# ---------------------------------------------------------------------------------------------


def test_path_file_object_pil_and_data_url_agree(golden, pre, outputs):
    entry = next(e for e in pre["images"] if e["file"] == "images/chelsea.png")
    path = golden / "preprocess" / entry["file"]
    processor = processor_for(pre["settings"]["small"])
    want = entry["results"]["small"]["patches_sha256"]
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    with open(path, "rb") as file, Image.open(path) as pil:
        for src in (path, str(path), file, pil, data_url, bytearray(path.read_bytes())):
            assert sha256(bf16_patches(processor(src, return_tensors="pt")["pixel_values"])) == want


def test_batch_concatenates_in_order(golden, pre, outputs):
    files = ["images/chelsea.png", "images/camera.png", "images/syn_rgb_w639_h31.png"]
    processor = processor_for(pre["settings"]["real"])
    data = [(golden / "preprocess" / f).read_bytes() for f in files]
    batch = processor([data[:2], data[2:]], return_tensors="pt")  # nested lists are flattened
    singles = [outputs["real", f] for f in files]
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in singles]))
    assert torch.equal(batch["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in singles]))
    assert torch.equal(batch["image_llm_grid_hw"], torch.cat([s["image_llm_grid_hw"] for s in singles]))
    as_numpy = processor(data)
    assert isinstance(as_numpy["pixel_values"], np.ndarray)
    assert np.array_equal(as_numpy["pixel_values"], batch["pixel_values"].numpy())


def test_no_images_raises():
    with pytest.raises(DeepseekV41ImageError, match="no images"):
        DeepseekV41ImageProcessor()([])


def test_unsupported_input_type_raises():
    with pytest.raises(DeepseekV41ImageError, match="unsupported image input of type int"):
        load_image(12345)


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------


def test_empty_bytes_raises():
    with pytest.raises(DeepseekV41ImageError, match="empty"):
        DeepseekV41ImageProcessor()(b"")


def test_empty_file_raises(tmp_path):
    path = tmp_path / "empty.png"
    path.write_bytes(b"")
    with pytest.raises(DeepseekV41ImageError, match="empty"):
        DeepseekV41ImageProcessor()(path)


def test_missing_file_raises(tmp_path):
    with pytest.raises(DeepseekV41ImageError, match="cannot read image file"):
        load_image(tmp_path / "nope.png")


def test_truncated_png_raises(golden):
    data = (golden / "preprocess" / "images" / "chelsea.png").read_bytes()
    with pytest.raises(DeepseekV41ImageError, match="truncated"):
        DeepseekV41ImageProcessor()(data[: len(data) // 3])


def test_non_image_bytes_raise():
    with pytest.raises(DeepseekV41ImageError, match="cannot identify image file"):
        DeepseekV41ImageProcessor()(b"this is plainly not an image, just some text bytes")


@pytest.mark.parametrize("size", [(0, 0), (0, 7), (7, 0)])
def test_zero_area_image_raises(size):
    with pytest.raises(DeepseekV41ImageError, match="zero area"):
        DeepseekV41ImageProcessor()(Image.new("RGB", size))


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bomb_refused_from_header_before_decoding():
    # 12000 x 12000 passes Pillow's hard limit (it only warns); our cap refuses it from the header.
    # The file has no pixel data: had decoding started, the error would be a decode error.
    data = png_header_only(12000, 12000)
    processor = DeepseekV41ImageProcessor(max_image_pixels=10**8)
    with pytest.raises(DeepseekV41ImageTooLargeError, match="max_image_pixels=100000000"):
        processor(data)
    with pytest.raises(DeepseekV41ImageError, match="truncated|decode") as info:
        DeepseekV41ImageProcessor(max_image_pixels=None)(data)
    assert not isinstance(info.value, DeepseekV41ImageTooLargeError)


def test_bomb_beyond_pillow_limit_refused():
    assert DeepseekV41ImageProcessor().max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    with pytest.raises(DeepseekV41ImageTooLargeError, match="decompression"):
        DeepseekV41ImageProcessor()(png_header_only(100000, 100000))


def test_bomb_message_names_the_cap_in_force():
    # regression: above Pillow's own limit the message quoted Pillow's number only, even when the
    # user's cap was the smaller one
    data = png_header_only(100000, 100000)
    with pytest.raises(DeepseekV41ImageTooLargeError, match=r"exceeds max_image_pixels=1000000 "):
        load_image(data, max_image_pixels=10**6)
    with pytest.raises(DeepseekV41ImageTooLargeError, match=r"lower than max_image_pixels=100000000000.*MAX_IMAGE_PIXELS"):
        load_image(data, max_image_pixels=10**11)


def _malformed_tiff(field_type: int) -> bytes:
    """An 8x6 TIFF whose StripOffsets tag is re-typed (2 ASCII, 5 RATIONAL): Pillow raises TypeError."""
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 20, 30)).save(out, "TIFF")
    data = bytearray(out.getvalue())
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        if struct.unpack_from("<H", data, ifd + 2 + 12 * i)[0] == 273:  # StripOffsets
            struct.pack_into("<H", data, ifd + 2 + 12 * i + 2, field_type)
    return bytes(data)


def _dds_without_pixel_format_flags() -> bytes:
    """An 8x6 DDS with pixel-format flags 0: Pillow raises NotImplementedError."""
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 20, 30)).save(out, "DDS")
    data = bytearray(out.getvalue())
    struct.pack_into("<I", data, 4 + 76, 0)  # DDS_PIXELFORMAT.dwFlags
    return bytes(data)


@pytest.mark.parametrize(
    "make", [lambda: _malformed_tiff(2), lambda: _malformed_tiff(5), _dds_without_pixel_format_flags], ids=["tiff-ascii", "tiff-rational", "dds-flags-0"]
)
def test_decoder_exceptions_of_any_type_become_the_image_error(make):
    # regression: Pillow's TypeError / NotImplementedError escaped a caller's `except ValueError`
    with pytest.raises(DeepseekV41ImageError, match="cannot decode image data") as info:
        DeepseekV41ImageProcessor()(make())
    assert isinstance(info.value, ValueError)


def test_mutated_golden_images_raise_only_the_image_error_or_decode(golden):
    """A bounded fuzz: bytes of the golden images mutated at random; each either decodes or raises
    the documented error (never another exception type)."""
    rng = np.random.default_rng(0)
    sources = [p.read_bytes() for p in sorted((golden / "preprocess" / "images").iterdir()) if p.stat().st_size < 200_000]
    outcomes = {"decoded": 0, "refused": 0}
    for k in range(150):
        data = bytearray(sources[k % len(sources)])
        for pos in rng.integers(0, len(data), size=int(rng.integers(1, 8))):
            data[pos] = int(rng.integers(0, 256))
        try:
            load_image(bytes(data[: int(rng.integers(len(data) // 2, len(data) + 1))]))
            outcomes["decoded"] += 1
        except DeepseekV41ImageError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 150


def test_bomb_cap_is_checked_before_decoding(golden):
    # The truncated 64x64 PNG: with the cap just below its size we refuse it for size, not truncation.
    data = (golden / "preprocess" / "images" / "syn_truncated.png").read_bytes()
    with pytest.raises(DeepseekV41ImageTooLargeError, match="64x64"):
        load_image(data, max_image_pixels=64 * 64 - 1)
    with pytest.raises(DeepseekV41ImageError, match="truncated"):
        load_image(data, max_image_pixels=64 * 64)


def test_byte_cap_refuses_every_source_before_decoding(golden, tmp_path):
    data = (golden / "preprocess" / "images" / "chelsea.png").read_bytes()
    path = tmp_path / "chelsea.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    cap = len(data) - 1
    for source in (data, path, str(path), io.BytesIO(data), url):
        with pytest.raises(DeepseekV41ImageTooLargeError, match=f"exceeds max_image_bytes={cap}"):
            load_image(source, max_image_bytes=cap)
        # at exactly its size it loads, so the count is the encoded size, not an estimate
        assert load_image(source if not isinstance(source, io.BytesIO) else io.BytesIO(data),
                          max_image_bytes=len(data)).size == Image.open(io.BytesIO(data)).size
    # a data URL is refused from its length: a payload too long for the cap is never decoded
    with pytest.raises(DeepseekV41ImageTooLargeError, match="3000 bytes exceeds max_image_bytes=2999"):
        load_image("data:image/png;base64," + "@" * 4000, max_image_bytes=2999)
    processor = DeepseekV41ImageProcessor(max_image_bytes=cap)
    assert processor.to_dict()["max_image_bytes"] == cap
    with pytest.raises(DeepseekV41ImageTooLargeError, match="max_image_bytes"):
        processor(data)
    with pytest.raises(DeepseekV41ProcessingError, match="max_image_bytes"):
        DeepseekV41ImageProcessor(max_image_bytes=0)


def test_url_refused_by_default():
    # schemes are case-insensitive: an upper-case one is a URL too, not a file name
    for url in ("http://example.invalid/cat.png", "https://example.invalid/cat.png", "HTTPS://example.invalid/cat.png"):
        with pytest.raises(DeepseekV41ImageError, match="allow_urls=True"):
            DeepseekV41ImageProcessor()(url)
        with pytest.raises(DeepseekV41ImageError, match="allow_urls=True"):
            load_image(url)


def test_url_allowed_explicitly(golden, pre):
    data = (golden / "preprocess" / "images" / "chelsea.png").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/chelsea.png"
        out = processor_for(pre["settings"]["real"])(url, allow_urls=True, return_tensors="pt")
    finally:
        server.shutdown()
        server.server_close()
    want = next(e for e in pre["images"] if e["file"] == "images/chelsea.png")["results"]["real"]
    assert sha256(bf16_patches(out["pixel_values"])) == want["patches_sha256"]


def test_url_fetch_failure_raises():
    import socket

    with socket.socket() as sock:  # a local port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(DeepseekV41ImageError, match="cannot fetch image URL"):
        load_image(f"http://127.0.0.1:{port}/cat.png", allow_urls=True)


def test_plan_that_cannot_fit_raises(golden):
    data = (golden / "preprocess" / "images" / "chelsea.png").read_bytes()
    with pytest.raises(DeepseekV41ImagePlanError, match="max_image_tokens=3"):
        DeepseekV41ImageProcessor(max_image_tokens=3)(data)
    out = DeepseekV41ImageProcessor(max_image_tokens=4)(data, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 3, 3]]


def test_bad_settings_raise():
    with pytest.raises(DeepseekV41ProcessingError, match="exif_orientation"):
        DeepseekV41ImageProcessor(exif_orientation="rotate")
    with pytest.raises(DeepseekV41ProcessingError, match="patch_size"):
        DeepseekV41ImageProcessor(patch_size=0)
    with pytest.raises(DeepseekV41ProcessingError, match="pad_color"):
        DeepseekV41ImageProcessor(pad_color=(0, 0, 256))
    with pytest.raises(DeepseekV41ProcessingError, match="unsupported image processor options"):
        DeepseekV41ImageProcessor()(Image.new("RGB", (8, 8)), do_resize=False)


# ---------------------------------------------------------------------------------------------
# Conversion semantics (the reference's `convert("RGB")`), on small synthetic images.
# ---------------------------------------------------------------------------------------------


def test_alpha_dropped_without_compositing():
    rgba = Image.new("RGBA", (5, 3), (255, 0, 255, 0))
    assert load_image(rgba).getpixel((2, 1)) == (255, 0, 255)
    la = Image.new("LA", (5, 3), (100, 0))
    assert load_image(la).getpixel((2, 1)) == (100, 100, 100)


def test_sixteen_bit_is_clipped():
    image = Image.new("I;16", (2, 1))
    image.putpixel((0, 0), 100)
    image.putpixel((1, 0), 1000)
    rgb = load_image(image)
    assert rgb.getpixel((0, 0)) == (100, 100, 100)
    assert rgb.getpixel((1, 0)) == (255, 255, 255)


def test_cmyk_plain_conversion():
    assert load_image(Image.new("CMYK", (2, 2), (0, 255, 0, 0))).getpixel((0, 0)) == (255, 0, 255)


def test_multi_frame_uses_first_frame(golden):
    path = golden / "preprocess" / "images" / "syn_2frame_w80_h60.gif"
    with Image.open(path) as gif:
        assert gif.n_frames == 2
        first = np.asarray(gif.convert("RGB"))
        gif.seek(1)
        second = np.asarray(gif.convert("RGB"))
    assert not np.array_equal(first, second)
    assert np.array_equal(np.asarray(load_image(path)), first)


def test_padding_is_gray_127(pre, outputs):
    # 639x31 is contained in 2478x126 pixels: about 3 rows of gray above the image, 3 below.
    out = outputs["real", "images/syn_rgb_w639_h31.png"]
    n_vit_w = out["image_grid_thw"][0, 2]
    top_row = out["pixel_values"][0].view(3, PATCH, PATCH)[:, 0, :]
    bottom_row = out["pixel_values"][-n_vit_w].view(3, PATCH, PATCH)[:, -1, :]
    pad = torch.tensor((127 / 255 - 0.5) / 0.5).to(torch.bfloat16)  # README: -0.00392
    for row in (top_row, bottom_row):
        assert torch.equal(row.to(torch.bfloat16), pad.expand_as(row))
    assert not torch.equal(out["pixel_values"][0].to(torch.bfloat16), pad.expand(3 * PATCH * PATCH))


# ---------------------------------------------------------------------------------------------
# EXIF policy.
# ---------------------------------------------------------------------------------------------


def test_exif_orientation_ignored_by_default(golden, pre, outputs):
    path = golden / "preprocess" / "images" / "syn_exif_orient6_w200_h120.jpg"
    assert DeepseekV41ImageProcessor().exif_orientation == "ignore"
    assert load_image(path).size == (200, 120)
    want = next(e for e in pre["images"] if e["file"].endswith("syn_exif_orient6_w200_h120.jpg"))
    out = outputs["real", want["file"]]
    real = want["results"]["real"]
    assert out["image_grid_thw"].tolist() == [[1, real["n_vit_h"], real["n_vit_w"]]]


def test_exif_orientation_applied_on_request(golden, pre):
    path = golden / "preprocess" / "images" / "syn_exif_orient6_w200_h120.jpg"
    stored = load_image(path)
    upright = load_image(path, exif_orientation="apply")
    assert upright.size == (120, 200)
    # Orientation 6: the stored image must be turned 90 degrees clockwise to display.
    assert np.array_equal(np.asarray(upright), np.asarray(stored.transpose(Image.Transpose.ROTATE_270)))
    processor = processor_for(pre["settings"]["real"], exif_orientation="apply")
    out = processor(path, return_tensors="pt")
    plan = processor.plan_image_grid(120, 200)
    assert out["image_grid_thw"].tolist() == [[1, plan.n_vit_h, plan.n_vit_w]]
    assert out["image_llm_grid_hw"].tolist() == [[plan.n_llm_h, plan.n_llm_w]]


# ---------------------------------------------------------------------------------------------
# Construction and serialisation.
# ---------------------------------------------------------------------------------------------


def test_from_vision_config_of_the_golden_tiny_model(golden, pre, outputs):
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_bf16" / "config.json")
    processor = DeepseekV41ImageProcessor.from_vision_config(config.vision_config)
    flat = json.loads((golden / "model_tiny_bf16" / "config.json").read_text())
    assert processor.patch_size == flat["vision_patch_size"]
    assert processor.downsample_ratio == flat["vision_downsample_ratio"]
    assert processor.max_image_tokens == flat["vision_max_n_token"]
    assert processor.min_pixels == flat["vision_min_pixels"]
    assert processor.max_wh_ratio == flat["vision_max_wh_ratio"]
    # The tiny model uses the `small` setting.
    data = (golden / "preprocess" / "images" / "rocket.jpg").read_bytes()
    got = processor(data, return_tensors="pt")["pixel_values"]
    assert torch.equal(got, outputs["small", "images/rocket.jpg"]["pixel_values"])


def test_from_vision_config_defaults_are_the_release():
    assert DeepseekV41ImageProcessor.from_vision_config(DeepseekV41VisionConfig()).to_dict() == (
        DeepseekV41ImageProcessor().to_dict()
    )


def test_save_and_load_round_trip(tmp_path, golden, pre, outputs):
    processor = processor_for(pre["settings"]["ratio4"], pad_color=(127, 127, 127), max_image_pixels=10**7)
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "DeepseekV41ImageProcessor"
    assert (saved["max_image_tokens"], saved["max_wh_ratio"], saved["max_image_pixels"]) == (256, 4, 10**7)
    loaded = DeepseekV41ImageProcessor.from_pretrained(tmp_path)
    assert loaded.to_dict() == processor.to_dict()
    assert loaded.pad_color == (127, 127, 127)
    data = (golden / "preprocess" / "images" / "syn_rgb_w2000_h20.png").read_bytes()
    got = loaded(data, return_tensors="pt")["pixel_values"]
    assert torch.equal(got, outputs["ratio4", "images/syn_rgb_w2000_h20.png"]["pixel_values"])
    # Saved with None (released settings) and overridden at load time.
    DeepseekV41ImageProcessor().save_pretrained(tmp_path / "release")
    reloaded = DeepseekV41ImageProcessor.from_pretrained(tmp_path / "release", max_image_tokens=64)
    assert reloaded.max_wh_ratio is None and reloaded.max_image_tokens == 64


# ---------------------------------------------------------------------------------------------
# Settings validation: every bad value is a project error naming the setting.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pad_color": 5}, "pad_color"),
        ({"pad_color": None}, "pad_color"),
        ({"pad_color": "red"}, "pad_color"),
        ({"pad_color": (1, 2)}, "pad_color"),
        ({"pad_color": (0.5, 0, 0)}, "pad_color"),
        ({"image_mean": "abc"}, "image_mean"),
        ({"image_mean": float("nan")}, "image_mean"),
        ({"image_std": 0}, "image_std"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_std"),
        ({"image_std": -0.5}, "image_std"),
        ({"image_std": [0.5, 0.5]}, "image_std"),
        ({"max_image_tokens": 64.0}, "max_image_tokens"),
        ({"max_image_tokens": True}, "max_image_tokens"),
        ({"min_pixels": -1}, "min_pixels"),
        ({"max_wh_ratio": 0}, "max_wh_ratio"),
        ({"max_image_pixels": 0}, "max_image_pixels"),
    ],
)
def test_bad_setting_values_raise_project_error(kwargs, match):
    # Formerly TypeError (pad_color=5 / None), torch's ValueError (image_mean="abc"), or inf pixel
    # values (image_std=0); both in the constructor and as a per-call override.
    with pytest.raises(DeepseekV41ProcessingError, match=match):
        DeepseekV41ImageProcessor(**kwargs)
    with pytest.raises(DeepseekV41ProcessingError, match=match):
        DeepseekV41ImageProcessor()(Image.new("RGB", (8, 8)), **kwargs)


def test_numpy_integer_settings_are_accepted(golden):
    data = (golden / "preprocess" / "images" / "chelsea.png").read_bytes()
    want = DeepseekV41ImageProcessor(max_image_tokens=64)(data, return_tensors="pt")
    processor = DeepseekV41ImageProcessor(max_image_tokens=np.int64(64), pad_color=np.array([127, 127, 127]))
    assert type(processor.max_image_tokens) is int and processor.pad_color == (127, 127, 127)
    json.dumps(processor.to_dict())  # plain Python values: the config stays serialisable
    got = processor(data, return_tensors="pt")
    per_call = DeepseekV41ImageProcessor()(data, max_image_tokens=np.int64(64), return_tensors="pt")
    for out in (got, per_call):
        assert torch.equal(out["pixel_values"], want["pixel_values"])
        assert torch.equal(out["image_grid_thw"], want["image_grid_thw"])


def test_unknown_constructor_arguments_are_refused_and_unknown_saved_keys_warn(tmp_path):
    with pytest.raises(DeepseekV41ProcessingError, match="bogus"):
        DeepseekV41ImageProcessor(bogus=1)
    # a saved config from a newer version: its unknown keys are dropped with a warning
    with pytest.warns(UserWarning, match="foo"):
        assert DeepseekV41ImageProcessor.from_dict({"foo": 1}).to_dict() == DeepseekV41ImageProcessor().to_dict()
    # The keys transformers writes next to the settings are still read back.
    auto_map = {"AutoImageProcessor": "image_processing_deepseek_v41_vl.DeepseekV41ImageProcessor"}
    processor = DeepseekV41ImageProcessor(
        image_processor_type="DeepseekV41ImageProcessor", processor_class="DeepseekV41Processor", auto_map=auto_map
    )
    assert processor.to_dict()["auto_map"] == auto_map
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert "bogus" not in saved and saved["auto_map"]["AutoImageProcessor"] == auto_map["AutoImageProcessor"]
    assert DeepseekV41ImageProcessor.from_pretrained(tmp_path).to_dict() == processor.to_dict()


def test_return_tensors_is_checked():
    with pytest.raises(DeepseekV41ProcessingError, match="return_tensors"):
        DeepseekV41ImageProcessor()(Image.new("RGB", (8, 8)), return_tensors="tf")


def test_pillow_bomb_warning_silenced_within_our_cap():
    # 13000 x 13000 = 169M pixels: above Pillow's warning threshold (89M), within a cap of 170M.
    # Our cap is checked from the header, so Pillow's warning is noise there; with the cap off it
    # is the only guard left and stays.
    data = png_header_only(13000, 13000)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DeepseekV41ImageError, match="truncated|decode"):
            DeepseekV41ImageProcessor(max_image_pixels=170_000_000)(data)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    with pytest.warns(Image.DecompressionBombWarning):
        with pytest.raises(DeepseekV41ImageError, match="truncated|decode"):
            load_image(data, max_image_pixels=None)


def _preprocess_in_child(path: str) -> float:
    out = DeepseekV41ImageProcessor(max_image_tokens=64)(path, return_tensors="pt")
    return float(out["pixel_values"].numpy().astype(np.float64).sum())  # no torch op here either


def test_preprocessing_then_forking_does_not_hang(golden):
    # robustness: a fork-based pool (datasets.map(num_proc=2)) hung forever once the parent had
    # preprocessed one image: the child blocked in torch's OpenMP pool, which is not fork-safe
    import multiprocessing

    path = str(golden / "preprocess" / "images" / "chelsea.png")
    torch.ones(1 << 20).mul_(2)  # the parent's own torch work: its OpenMP pool exists
    want = _preprocess_in_child(path)  # "check one sample first", in the parent
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.map_async(_preprocess_in_child, [path] * 4).get(timeout=60)
    assert got == [want] * 4


# ---------------------------------------------------------------------------------------------
# Hardening: unreadable sources, the default caps, decoded memory.
# ---------------------------------------------------------------------------------------------


def test_meta_tensor_is_refused_by_name():
    # regression: torch's NotImplementedError ("Cannot copy out of meta tensor") escaped
    with pytest.raises(DeepseekV41ImageError, match="meta device"):
        load_image(torch.empty(3, 8, 8, device="meta"))


def test_path_with_a_nul_byte_is_the_image_error(tmp_path):
    # regression: os.path.getsize's plain ValueError ("embedded null byte")
    with pytest.raises(DeepseekV41ImageError, match="NUL byte") as info:
        DeepseekV41ImageProcessor()(str(tmp_path / "a\0b.png"))
    assert "a\\x00b.png" in str(info.value)


def test_paths_that_are_not_regular_files_are_refused_before_reading(tmp_path):
    # regression: a FIFO blocked in open() forever; /dev/zero was read until memory ran out
    import os
    import threading

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    outcome = {}

    def load():
        try:
            load_image(str(fifo))
        except Exception as err:  # noqa: BLE001 - the test checks the type below
            outcome["error"] = err

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():  # unblock the reader so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO blocked")
    assert isinstance(outcome.get("error"), DeepseekV41ImageError), outcome
    assert str(outcome["error"]) == f"image {str(fifo)!r} is a FIFO, not a regular file"
    # explicit byte cap so that the old unbounded read cannot run away here
    with pytest.raises(DeepseekV41ImageError, match=r"^image '/dev/zero' is a device, not a regular file$"):
        load_image("/dev/zero", max_image_bytes=1 << 20)
    with pytest.raises(DeepseekV41ImageError, match="is a directory, not a regular file"):
        load_image(str(tmp_path))


def test_the_regular_file_rule_is_one_public_check_shared_with_the_cli(tmp_path):
    # regression: the CLI had its own copy of the rule, worded differently, calling a socket "a device"
    import os
    import socket

    from deepseek_v41_vl.cli import check_image_path
    from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import check_image_file

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    path = tmp_path / "s.png"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        kinds = {str(path): "a socket", str(fifo): "a FIFO", "/dev/zero": "a device", str(tmp_path): "a directory"}
        for src, kind in kinds.items():
            expected = f"image {src!r} is {kind}, not a regular file"
            for check in (check_image_file, check_image_path, lambda s: load_image(s, max_image_bytes=1 << 20)):
                with pytest.raises(DeepseekV41ImageError) as info:
                    check(src)
                assert str(info.value) == expected, check
    photo = tmp_path / "ok.png"
    Image.new("RGB", (4, 4)).save(photo)
    assert check_image_file(str(photo)).st_size == photo.stat().st_size
    with pytest.raises(DeepseekV41ImageError, match="cannot read image file .*missing.png"):
        check_image_file(str(tmp_path / "missing.png"))
    with pytest.raises(DeepseekV41ImageError, match="NUL byte"):
        check_image_path(str(tmp_path / "a\0b.png"))


def test_the_cli_byte_default_is_the_image_processors():
    from deepseek_v41_vl import cli
    from deepseek_v41_vl.processing import image_processing_deepseek_v41_vl as module

    # one definition: the CLI imports it (a copy would be a different object)
    assert cli.DEFAULT_MAX_IMAGE_BYTES is module.DEFAULT_MAX_IMAGE_BYTES


@pytest.mark.parametrize("cap", ["max_image_bytes", "max_image_pixels"])
def test_a_cap_turned_off_stays_off_through_save_and_load(cap, tmp_path):
    # regression: max_image_bytes=None was not saved, so the reload put the 20 MiB default back on
    processor = DeepseekV41ImageProcessor(**{cap: None})
    processor.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())[cap] is None
    assert getattr(DeepseekV41ImageProcessor.from_pretrained(tmp_path), cap) is None


def test_folders_saved_with_the_old_caps_keep_them_and_settings_passed_override(tmp_path):
    import deepseek_v41_vl  # noqa: F401  (registers the Auto classes)
    from transformers import AutoProcessor

    from deepseek_v41_vl.processing.processing_deepseek_v41_vl import DeepseekV41Processor
    from deepseek_v41_vl.processing.tokenizer_deepseek_v41_vl import load_deepseek_v41_tokenizer

    # what a folder converted before the caps changed holds: the old pixel cap, no byte cap
    old = DeepseekV41ImageProcessor(max_image_pixels=178_956_970, max_image_bytes=None)
    DeepseekV41Processor(image_processor=old, tokenizer=load_deepseek_v41_tokenizer()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    config["image_processor"].pop("max_image_bytes")
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    loaded = AutoProcessor.from_pretrained(tmp_path).image_processor
    assert (loaded.max_image_pixels, loaded.max_image_bytes) == (178_956_970, 20 * 1024 * 1024)
    raised = AutoProcessor.from_pretrained(tmp_path, max_image_pixels=200_000_000, max_image_bytes=64 << 20).image_processor
    assert (raised.max_image_pixels, raised.max_image_bytes) == (200_000_000, 64 << 20)


def test_default_byte_cap_bounds_every_read():
    from deepseek_v41_vl.processing import image_processing_deepseek_v41_vl as module

    cap = DeepseekV41ImageProcessor().max_image_bytes
    assert cap is not None and cap == getattr(module, "DEFAULT_MAX_IMAGE_BYTES", None)
    assert DeepseekV41ImageProcessor().to_dict()["max_image_bytes"] == cap
    with pytest.raises(DeepseekV41ImageTooLargeError, match=f"more than {cap} bytes exceeds max_image_bytes={cap}"):
        load_image(io.BytesIO(bytes(cap + 10)))


def _png_rgba16(width: int, height: int) -> bytes:
    """A 16-bit RGBA PNG header (plus a few bytes of pixel data) of width x height."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(3))) + chunk(b"IEND", b"")


def test_sixteen_bit_bomb_is_refused_by_its_decoded_memory():
    # regression: a 68-byte PNG announcing 40,000,000 x 1 16-bit RGBA pixels raised Pillow's
    # MemoryError. Within the pixel count of the default cap, its samples (8 bytes a pixel) exceed
    # the memory the cap stands for, so it is refused from the header.
    data = _png_rgba16(40_000_000, 1)
    assert len(data) < 100 and 40_000_000 < DEFAULT_MAX_IMAGE_PIXELS
    with pytest.raises(DeepseekV41ImageTooLargeError, match=r"40000000x1 pixels in mode 'RGBA'.*8 bytes a pixel"):
        load_image(data)
    # without the cap Pillow's MemoryError is still the project's error, naming the image
    with pytest.raises(DeepseekV41ImageTooLargeError, match=r"40000000x1 .*out of memory"):
        load_image(data, max_image_pixels=None)
    # 8-bit images are capped by their pixel count alone (4 bytes a pixel at most)
    assert not isinstance(_error(png_header_only(40_000_000, 1)), DeepseekV41ImageTooLargeError)


def _error(data: bytes) -> Exception:
    with pytest.raises(DeepseekV41ImageError) as info:
        load_image(data)
    return info.value


def _animated_webp(width: int, height: int) -> bytes:
    """A two-frame 16x16 animated WebP whose canvas (VP8X) claims width x height."""
    out = io.BytesIO()
    frames = [Image.new("RGB", (16, 16), color) for color in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(out, "WEBP", save_all=True, append_images=frames[1:], duration=50, lossless=True)
    data = bytearray(out.getvalue())
    at = data.index(b"VP8X") + 12
    data[at : at + 3] = (width - 1).to_bytes(3, "little")
    data[at + 3 : at + 6] = (height - 1).to_bytes(3, "little")
    return bytes(data)


def test_default_pixel_cap_refuses_a_small_animated_webp_bomb_and_keeps_real_photos():
    # regression: a few-hundred-byte animated WebP announcing a 13000 x 13000 canvas (169 Mpx,
    # under Pillow's own 179 Mpx limit) decoded for seconds into gigabytes.
    data = _animated_webp(13000, 13000)
    assert len(data) < 1000
    assert DEFAULT_MAX_IMAGE_PIXELS < 13000 * 13000  # checked first: decoding it is what is refused
    with pytest.raises(DeepseekV41ImageTooLargeError, match="13000x13000"):
        DeepseekV41ImageProcessor()(data)
    # the cap keeps the images the model can use: far above the largest image the released plan
    # feeds it, and a full-resolution 50-megapixel camera photo (8160 x 6120) still passes it
    plan_max = max(
        plan.best_width * plan.best_height
        for plan in (plan_image_grid(w, h) for w, h in [(4032, 3024), (3024, 4032), (100000, 1), (1, 100000), (8000, 8000)])
    )
    assert DEFAULT_MAX_IMAGE_PIXELS >= 20 * plan_max
    assert not isinstance(_error(png_header_only(8160, 6120)), DeepseekV41ImageTooLargeError)
