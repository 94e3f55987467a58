"""A conversion stopped from outside leaves nothing behind (`conversion/staging.py`).

SIGTERM and SIGHUP (what `timeout`, Slurm and Kubernetes send) remove the partial folder as Ctrl-C
does; SIGKILL cannot, and the next conversion to the same DST removes what it left. A child process
runs a real conversion of the golden tiny checkpoint, held at its last step until signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deepseek_v41_vl.conversion.convert import convert_checkpoint
from deepseek_v41_vl.modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError

# the child converts for real and stops after the weights are written, inside the partial folder
CHILD = """
import sys, time
import deepseek_v41_vl.conversion.convert as convert
real = convert._write_tokenizer
def held(*args, **kwargs):
    real(*args, **kwargs)
    print("READY", flush=True)
    time.sleep(120)
convert._write_tokenizer = held
convert.convert_checkpoint(sys.argv[1], sys.argv[2], progress=False)
"""


def _partials(dst: Path) -> list[Path]:
    return sorted(p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.partial-"))


def _start_held_conversion(src: Path, dst: Path) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(src), str(dst)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(child.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=240)
    if line != ["READY\n"]:
        child.kill()
        pytest.fail(f"the conversion did not reach its held step: {line!r} {child.stderr.read()[-2000:]}")
    return child


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stopping_signal_removes_the_partial_folder(golden, tmp_path, signum):
    dst = tmp_path / "out"
    child = _start_held_conversion(golden / "model_tiny_fp8", dst)
    assert len(_partials(dst)) == 1
    child.send_signal(signum)
    assert child.wait(timeout=60) == 128 + signum
    assert _partials(dst) == [] and not dst.exists()


def test_the_next_run_removes_what_a_killed_run_left(golden, tmp_path):
    dst = tmp_path / "out"
    child = _start_held_conversion(golden / "model_tiny_fp8", dst)
    child.kill()  # SIGKILL: no cleanup possible
    child.wait(timeout=60)
    left = _partials(dst)
    assert len(left) == 1
    summary = convert_checkpoint(golden / "model_tiny_fp8", dst, progress=False)
    assert summary.removed_partials == left and "left by an earlier conversion" in summary.format()
    assert _partials(dst) == [] and (dst / "config.json").is_file()


def test_a_partial_folder_of_a_live_process_is_refused(golden, tmp_path):
    dst = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = tmp_path / f".out.partial-{live.pid}-0123456789ab"
        busy.mkdir()
        with pytest.raises(DeepseekV41ConversionError, match=f"belongs to process {live.pid}, which is running"):
            convert_checkpoint(golden / "model_tiny_fp8", dst, progress=False)
        assert busy.is_dir() and not dst.exists()
    finally:
        live.kill()
        live.wait()
    old_format = tmp_path / ".out.partial-0123456789ab"  # an older version's name: no pid, stale
    old_format.mkdir()
    convert_checkpoint(golden / "model_tiny_fp8", dst, progress=False)
    assert _partials(dst) == []
