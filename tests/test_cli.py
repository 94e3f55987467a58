"""The `deepseek-v41-vl` command on real photos."""

from __future__ import annotations

from deepseek_v41_vl.cli import bundled_photo, main


def test_run_default_uses_bundled_real_photo(capsys):
    assert bundled_photo().is_file()
    assert main(["run"]) == 0
    out = capsys.readouterr().out
    # chelsea.png is 451x300: the reference plans ViT 32x48 -> LLM 11x16, a 189-token span.
    assert "chelsea.png" in out
    assert "ViT grid 32x48" in out and "LLM grid 11x16" in out and "span 189 tokens" in out


def test_run_two_images(golden, capsys):
    images = golden / "preprocess" / "images"
    assert main(["run", "--image", str(images / "rocket.jpg"), "--image", str(images / "camera.png")]) == 0
    out = capsys.readouterr().out
    assert "span 189 tokens" in out and "span 184 tokens" in out and "373 image tokens" in out


def test_run_bad_image_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"definitely not a png")
    assert main(["run", "--image", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not_an_image.png" in err or "cannot identify" in err
