"""Smoke runs of `benchmarks/decoder_layers.py --quick --device cpu` in a subprocess: the script
builds every whole decoder layer kind of ours and transformers' DeepseekV4DecoderLayer at tiny
widths, measures both side by side and writes the markdown report; a spent budget stops it
gracefully with a complete report; the targets table applies issue 7's thresholds."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

from conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "decoder_layers.py"
ROLES = ["0: window-only (ratio 0)", "2: ratio-2 kv+index source", "20: ratio-1 candidate source",
         "21: ratio-1 reuse (KV + indices of 20)"]
NUMBER = r"[0-9]+(\.[0-9]+)?"


def _run(tmp_path, *args: str) -> tuple[str, str]:
    out = tmp_path / "report.md"
    env = dict(os.environ)
    # the CPU runs the torch fallbacks; the Triton interpreter would only slow the smoke run down
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out.read_text()
    assert report.strip() == proc.stdout.strip()
    return report, proc.stderr


def _rows(report: str, title: str) -> dict[str, list[str]]:
    """The table under `### title`: layer label -> its cells."""
    section = report.split(f"### {title}\n", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| layer |") and not line.startswith("| target |"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells
    return rows


def test_quick_run_measures_ours_and_v4_side_by_side(tmp_path):
    report, _ = _run(tmp_path, "--lengths", "32", "--decode-prefill", "32", "--decode-steps", "1", "--reps", "1")
    assert report.startswith("## Whole decoder layers")
    assert "transformers 5." in report and "- widths (both): dim 256," in report  # tiny widths in the header
    prefill = _rows(report, "Prefill time (ms)")
    memory = _rows(report, "Prefill peak activation memory (GiB)")
    decode = _rows(report, "Decode after a 32 prefill (ms/token, 1 steps)")
    targets = report.split("### Targets (issue 7)\n", 1)[1].split("\n### ", 1)[0]
    for role in ROLES:
        # layer, V4 layer, ours, V4, V4 / ours
        assert re.fullmatch(NUMBER, prefill[role][2]), prefill[role]
        assert re.fullmatch(NUMBER, prefill[role][3]), prefill[role]
        assert re.fullmatch(NUMBER + "x", prefill[role][4]), prefill[role]
        assert memory[role][2] == "n/a"  # peak memory is a CUDA measurement
        # layer, V4 layer, ours eager, V4, V4 / ours eager
        assert re.fullmatch(NUMBER, decode[role][2]) and re.fullmatch(NUMBER, decode[role][3]), decode[role]
        assert re.fullmatch(NUMBER + "x", decode[role][4]), decode[role]
        assert f"| {role} |" in targets
    assert _rows(report, "Prefill time (ms)")[ROLES[0]][1] == "sliding_attention"
    assert {prefill[r][1] for r in ROLES[2:]} == {"CSA, compress rate 1"}


def test_spent_budget_stops_gracefully(tmp_path):
    report, stderr = _run(tmp_path, "--lengths", "32", "--budget-s", "0")
    prefill = _rows(report, "Prefill time (ms)")
    decode = _rows(report, "Decode after a 64 prefill (ms/token, 3 steps)")  # the --quick defaults
    for role in ROLES:
        assert prefill[role][2:4] == ["skipped (budget)"] * 2, prefill[role]
        assert decode[role][2:4] == ["skipped (budget)"] * 2, decode[role]
    assert "prefill" not in stderr  # nothing was measured


def test_targets_table_judges_the_issue_7_thresholds():
    spec = importlib.util.spec_from_file_location("decoder_layers_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gib = 2**30
    res = bench.Results([4096, 16384])
    oom = bench.OutOfMemory("OOM (> 100 GiB)")
    oom.needs_more_than = 100 * gib
    res.ms[16384] = [100.0, 100.0, 100.0, 100.0]
    res.v4_ms[16384] = [350.0, 250.0, oom, oom]  # 3.5x met, 2.5x missed, V4 cannot run
    res.mem[16384] = [1 * gib, 1 * gib, 5 * gib, 20 * gib]
    res.v4_mem[16384] = [12 * gib, 8 * gib, oom, oom]  # 12x met, 8x missed, > 20x met, > 5x undecided
    res.dec = [0.5, 1.5, "n/a (CUDA only)", 1.0]
    table = bench.targets_table(res).splitlines()
    rows = [line.split(" | ") for line in table if line.startswith("| ") and not line.startswith("| target |")]
    status = [row[-1].rstrip(" |") for row in rows]
    assert status == [
        "met", "met", "met",
        "MISSED", "MISSED", "MISSED",
        "V4 cannot run it (OOM)", "met (V4 OOM)", "not measured",
        "V4 cannot run it (OOM)", "not decided (V4 OOM)", "met",
    ]
    assert "(> 20.0x)" in rows[7][2] and "(3.5x)" in rows[0][2]
