"""The README's Python examples run as written, each in a fresh interpreter (no import of this
package beforehand, no test fixtures in scope), on the converted golden tiny folder.

An example is the ```python block right after an HTML comment marker (`<!-- transformers-example -->`,
`<!-- finetune-example -->`). It runs as a script in a temporary folder with one line put before it,
``DIR = "<the converted folder>"``, and the bundled photo copied there as ``cat.png``: the two names
the README says the examples take. Nothing in the example itself is replaced.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import REPO_ROOT
from deepseek_v41_vl.cli import bundled_photo


def readme_example(marker: str) -> str:
    """The ```python block that follows ``<!-- marker -->`` in README.md."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    head = f"<!-- {marker} -->\n```python\n"
    assert readme.count(head) == 1, f"README.md must mark exactly one example with <!-- {marker} -->"
    return readme.split(head, 1)[1].split("```", 1)[0]


def run_example(code: str, model_dir, folder, check: str = "") -> subprocess.CompletedProcess:
    """`code` as a script in `folder` (with DIR and cat.png), then `check`, in a fresh interpreter."""
    shutil.copyfile(bundled_photo(), folder / "cat.png")
    script = folder / "example.py"
    script.write_text(f"DIR = {str(model_dir)!r}\n" + code + "\n" + check, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the tiny model gains nothing from more (conftest)
    return subprocess.run(
        [sys.executable, str(script)], cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=900,
    )


def _assert_ran(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_transformers_example_runs_as_written_in_a_fresh_interpreter(converted_tiny_fp8, tmp_path):
    code = readme_example("transformers-example")
    # what the example promises: greedy new tokens after the prompt, and a pipeline
    check = (
        "assert out.shape[0] == 1 and out.shape[1] > inputs['input_ids'].shape[1], out.shape\n"
        "assert type(pipe).__name__ == 'ImageTextToTextPipeline', type(pipe)\n"
        "print('EXAMPLE OK')\n"
    )
    result = run_example(code, converted_tiny_fp8, tmp_path, check)
    _assert_ran(result)
    assert "EXAMPLE OK" in result.stdout


def test_the_fine_tuning_example_runs_as_written_in_a_fresh_interpreter(converted_tiny_fp8, tmp_path):
    code = readme_example("finetune-example")
    check = "assert lora.peft_config and __import__('os').path.isdir('out')\nprint('EXAMPLE OK')\n"
    result = run_example(code, converted_tiny_fp8, tmp_path, check)
    _assert_ran(result)
    assert "EXAMPLE OK" in result.stdout


def test_an_example_that_fails_is_reported(converted_tiny_fp8, tmp_path):
    # the harness itself: an example raising in the fresh interpreter fails the run
    result = run_example("raise SystemExit(DIR + ' seen')", converted_tiny_fp8, tmp_path)
    assert result.returncode != 0 and str(converted_tiny_fp8) + " seen" in result.stderr
