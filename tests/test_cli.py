"""The `deepseek-v41-vl` command: `run` end to end on real photos (the tiny model it builds)."""

from __future__ import annotations

import base64
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from deepseek_v41_vl.cli import CODE_STAMP, bundled_photo, cache_root, code_digest, ensure_tiny_model, main
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
    # built by other code (its remote-code copy is stale): built again, in place
    (model_dir / CODE_STAMP).write_text("0" * 64 + "\n")
    assert ensure_tiny_model(0) == model_dir
    assert "its code changed" in capsys.readouterr().out
    assert (model_dir / CODE_STAMP).read_text().strip() == code_digest()
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]


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


def _run_cli_process(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`deepseek-v41-vl` in its own process with a 4 GiB address-space cap, so an unbounded read fails
    with MemoryError rather than taking the machine's memory, and a blocked open fails the timeout."""

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    return subprocess.run(
        [sys.executable, "-m", "deepseek_v41_vl.cli", *argv], stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=timeout, preexec_fn=cap_memory,
    )


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_run_refuses_an_image_that_is_not_a_regular_file_in_one_line(cache_home, tmp_path, kind):
    # /dev/zero never ends; opening a FIFO blocks until a writer comes. Both used to be read as is.
    if kind == "fifo":
        image = tmp_path / "image.png"
        os.mkfifo(image)
        expected = "is a FIFO, not a regular file"
    else:
        image = Path("/dev/zero")
        expected = "is a device, not a regular file"
    result = _run_cli_process(["run", "--model", str(ensure_tiny_model(0)), "--image", str(image)], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == f"deepseek-v41-vl run: error: image {str(image)!r} {expected}"


def test_run_caps_the_encoded_bytes_of_files_and_urls(cache_home, capsys):
    model_dir = str(ensure_tiny_model(0))
    photo = bundled_photo()
    assert main(["run", "--model", model_dir, "--image", str(photo), "--max-image-bytes", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"has {photo.stat().st_size} bytes, over --max-image-bytes=1000" in err
    # a data URL's size is only known to the loader: the cap reaches it
    url = "data:image/png;base64," + base64.b64encode(photo.read_bytes()).decode()
    assert main(["run", "--model", model_dir, "--image", url, "--max-image-bytes", "1000"]) == 2
    err = capsys.readouterr().err  # after the model's loading progress bar: one line
    last = err.splitlines()[-1]
    assert "Traceback" not in err and last.startswith("deepseek-v41-vl run: error: ") and "max_image_bytes=1000" in last


def test_run_on_an_official_checkpoint_says_convert_it_first(golden, tmp_path, capsys):
    from deepseek_v41_vl.conversion.make_tiny import make_tiny

    nested = make_tiny(tmp_path / "official", seed=0, variant="fp8")  # nested config.json + inference/
    flat = golden / "model_tiny_fp8"  # a flat config.json, weights under the official names
    for folder in (nested, flat):
        assert main(["run", "--model", str(folder), "--max-new-tokens", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"{folder} is an official checkpoint" in err and f"`deepseek-v41-vl convert {folder} DST`" in err


@pytest.mark.parametrize("gib", ["inf", "nan", "0", "-1"])
def test_convert_refuses_a_shard_size_that_is_not_a_positive_finite_number(golden, tmp_path, capsys, gib):
    dst = tmp_path / "d"
    assert main(["convert", str(golden / "model_tiny_fp8"), str(dst), "--quiet", "--max-shard-gib", gib]) == 2
    assert "--max-shard-gib must be a positive, finite number" in capsys.readouterr().err
    assert not dst.exists()


class _LoopbackImageServer:
    """A local HTTP server on 127.0.0.1 for one test: ``body`` all at once, or (``trickle``) the
    headers and then one byte every ``trickle`` seconds. It stops itself after ``lifetime`` seconds
    at most, and on leaving the ``with`` block."""

    def __init__(self, body: bytes = b"", trickle: float | None = None, lifetime: float = 30.0):
        import socket
        import threading

        self.body, self.trickle, self.lifetime = body, trickle, lifetime
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/photo.png"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        import time

        end = time.monotonic() + self.lifetime
        while not self.stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.recv(65536)  # the request
                    length = len(self.body) if self.trickle is None else 10**6
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: %d\r\n\r\n" % length)
                    if self.trickle is None:
                        conn.sendall(self.body)
                    while self.trickle is not None and not self.stop.wait(self.trickle) and time.monotonic() < end:
                        conn.sendall(b"x")
                except OSError:
                    pass

    def __enter__(self) -> "_LoopbackImageServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.server.close()


@pytest.fixture
def no_model_load(monkeypatch):
    """`run` must refuse before the model loads: loading it fails the test."""
    import transformers

    def pipeline(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers, "pipeline", pipeline)


def test_run_refuses_a_slow_image_url_by_the_overall_deadline(cache_home, no_model_load, capsys):
    import time

    model_dir = str(ensure_tiny_model(0))
    with _LoopbackImageServer(trickle=0.2, lifetime=20) as server:
        t0 = time.monotonic()
        rc = main(["run", "--model", model_dir, "--image", server.url, "--image-fetch-timeout", "1"])
        elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 2 and elapsed < 8, (rc, elapsed)
    assert err == f"deepseek-v41-vl run: error: image URL {server.url!r} was not fetched within 1 s (--image-fetch-timeout)\n"


def test_run_refuses_bad_images_before_the_model_loads(cache_home, no_model_load, tmp_path, capsys):
    model_dir = str(ensure_tiny_model(0))
    bogus = tmp_path / "bogus.png"
    bogus.write_bytes(b"not an image\n")  # 13 bytes of text
    assert main(["run", "--model", model_dir, "--image", str(bundled_photo()), "--image", str(bogus)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deepseek-v41-vl run: error: ") and "Traceback" not in err
    # a URL over the byte cap, and a bad fetch timeout
    with _LoopbackImageServer(body=b"\x89PNG" + b"\0" * 5000) as server:
        assert main(["run", "--model", model_dir, "--image", server.url, "--max-image-bytes", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_image_bytes=1000" in err
    assert main(["run", "--model", model_dir, "--image-fetch-timeout", "0"]) == 2
    assert "--image-fetch-timeout must be a positive number" in capsys.readouterr().err


def test_a_deadline_hit_while_connecting_is_reported_as_the_fetch_timeout(monkeypatch):
    # urllib wraps an error raised while connecting (here the deadline) into a URLError
    from deepseek_v41_vl import serve_images
    from deepseek_v41_vl.cli import fetch_image_urls

    def late(self, address, timeout, source_address=None):
        raise TimeoutError("the deadline passed")

    monkeypatch.setattr(serve_images._Fetch, "connect", late)
    with pytest.raises(ValueError, match=r"was not fetched within 5 s \(--image-fetch-timeout\)"):
        fetch_image_urls(["http://127.0.0.1:9/x.png"], 5, 1024)
