"""The `deepseek-v41-vl` command: `run` end to end on real photos (the tiny model it builds)."""

from __future__ import annotations

import os


import re

import pytest
from PIL import Image

from deepseek_v41_vl.cli import bundled_photo, cache_root, ensure_tiny_model, main
from deepseek_v41_vl.processing.image_processing_deepseek_v41_vl import DeepseekV41ImageProcessor


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """A private XDG cache for the module: `run` builds its tiny model there once."""
    home = tmp_path_factory.mktemp("xdg")
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    yield home
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous


def _expected_plan_line(model_dir, image_path) -> str:
    processor = DeepseekV41ImageProcessor.from_pretrained(model_dir)
    width, height = Image.open(image_path).size
    plan = processor.plan_image_grid(width, height)
    return (f"ViT grid {plan.n_vit_h}x{plan.n_vit_w} = {plan.num_patches} patches, "
            f"LLM grid {plan.n_llm_h}x{plan.n_llm_w}, span {plan.num_image_tokens} tokens")


def test_run_default_builds_the_tiny_model_once_and_uses_the_bundled_photo(cache_home, capsys):
    assert bundled_photo().is_file()
    assert main(["run", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    model_dir = cache_root() / "tiny-0"
    assert str(model_dir).startswith(str(cache_home)) and (model_dir / "config.json").is_file()
    assert "building the tiny model" in out
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no scratch left behind
    assert "chelsea.png" in out and _expected_plan_line(model_dir, bundled_photo()) in out
    assert re.search(r"^generated: '.+'$", out, re.MULTILINE)
    timings = re.search(r"timings: preprocess [\d.]+ ms, vision [\d.]+ ms, prefill [\d.]+ ms \((\d+) tokens.*decode (\d+) tokens", out)
    assert timings and int(timings.group(2)) <= 4 and "tokens/s" in out
    prompt = re.search(r"prompt: (\d+) tokens, (\d+) of them image tokens", out)
    assert int(prompt.group(1)) == int(timings.group(1))
    # second run: the cached folder, no rebuild
    assert main(["run", "--max-new-tokens", "2"]) == 0
    assert "building" not in capsys.readouterr().out
    assert ensure_tiny_model(0) == model_dir


def test_run_two_images(golden, cache_home, capsys):
    images = golden / "preprocess" / "images"
    model_dir = ensure_tiny_model(0)
    argv = ["run", "--model", str(model_dir), "--image", str(images / "rocket.jpg"), "--image", str(images / "camera.png"),
            "--prompt", "Which is older?", "--max-new-tokens", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {name: next(l for l in out.splitlines() if l.strip().startswith(name)) for name in ("rocket.jpg", "camera.png")}
    for name, line in lines.items():
        assert _expected_plan_line(model_dir, images / name) in line
    spans = [int(re.search(r"span (\d+) tokens", line).group(1)) for line in lines.values()]
    assert f"{sum(spans)} of them image tokens" in out


def test_run_bad_image_is_a_clear_error(cache_home, tmp_path, capsys):
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"definitely not a png")
    assert main(["run", "--model", str(ensure_tiny_model(0)), "--image", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not_an_image.png" in err or "cannot identify" in err


def test_run_refuses_a_folder_that_is_not_a_model(tmp_path, capsys):
    assert main(["run", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
