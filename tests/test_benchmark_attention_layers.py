"""Smoke run of `benchmarks/attention_layers.py --quick` on the CPU: the script builds every layer
kind, measures ours and transformers' DeepseekV4 side by side and writes the markdown report."""

from __future__ import annotations

import importlib.util
import re

from conftest import REPO_ROOT


def _load_script():
    spec = importlib.util.spec_from_file_location("attention_layers_bench", REPO_ROOT / "benchmarks" / "attention_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_a_complete_report(tmp_path, capsys):
    bench = _load_script()
    out = tmp_path / "report.md"
    args = ["--quick", "--device", "cpu", "--lengths", "24", "--decode-prefill", "24", "--decode-steps", "3"]
    assert bench.main([*args, "--out", str(out)]) == 0
    report = out.read_text()
    assert report.strip() == capsys.readouterr().out.strip()
    for title in ("Prefill time (ms)", "Prefill peak memory (GiB)", "Decode after a 24 prefill (3 steps)"):
        assert f"### {title}" in report
    for role in bench.ROLES:
        rows = [line for line in report.splitlines() if line.startswith(f"| {role} |")]
        assert len(rows) == 3, role
        prefill, decode = rows[0].split(" | "), rows[2].split(" | ")
        # ours measured (a number), transformers V4 measured or explained, never a crash
        assert re.fullmatch(r"[0-9.]+", prefill[1]) and re.fullmatch(r"[0-9.]+", decode[1]), rows
        assert prefill[2] and decode[2]
