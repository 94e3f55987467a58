"""A converted folder is self-contained transformers remote code.

A fresh virtual environment gets this project's runtime dependencies (the `dependencies` of
pyproject.toml, pinned by tests/constraints.txt) but NOT the project; the golden fp8 checkpoint is
converted here, and a subprocess of that environment loads the folder with
`AutoModelForImageTextToText` / `AutoModel` / `AutoModelForCausalLM` / `AutoProcessor`
(`trust_remote_code=True`) and the ``image-text-to-text`` pipeline, and must reproduce the golden
greedy tokens.

Cost: about 1-3 minutes (making the environment; pip's cache and the local torch wheel keep it
short after the first run). It runs in CI on purpose: it is the only test of what a user without
this package gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from golden_bits import TOKENS_PREFIX, assert_golden

REPO_ROOT = Path(__file__).resolve().parent.parent

_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    model_dir, golden = sys.argv[1], sys.argv[2]
    try:
        import deepseek_v41_vl  # noqa: F401
        raise SystemExit("the project is importable in the fresh environment")
    except ModuleNotFoundError:
        pass
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, pipeline

    model = AutoModelForImageTextToText.from_pretrained(model_dir, trust_remote_code=True, numerics="exact")
    processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=True)
    meta = json.load(open(f"{golden}/model_tiny_fp8/meta.json"))["vl_run"]
    images = [f"{golden}/{im['file']}" for im in meta["images"]]
    inputs = processor(images=images, text=meta["prompt"], return_tensors="pt")
    generated = model.generate(**inputs, do_sample=False, max_new_tokens=13)
    pipe = pipeline("image-text-to-text", model=model_dir, trust_remote_code=True)
    chat = [{"role": "user", "content": [{"type": "image", "url": images[0]}, {"type": "text", "text": "What is it?"}]}]
    answer = pipe(text=chat, max_new_tokens=4, return_full_text=False, generate_kwargs={"do_sample": False})
    result = {
        "classes": {
            name: f"{type(obj).__module__}.{type(obj).__name__}"
            for name, obj in (
                ("model", model),
                ("processor", processor),
                ("pipeline_model", pipe.model),
                ("base", AutoModel.from_pretrained(model_dir, trust_remote_code=True)),
                ("causal_lm", AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)),
            )
        },
        "numerics": model.config.text_config.numerics,
        "tokens": generated[:, inputs["input_ids"].shape[1]:].tolist(),
        "answer": answer[0]["generated_text"],
    }
    print("RESULT " + json.dumps(result))
    """
)


def _runtime_requirements() -> list[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return list(project["dependencies"])


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd[:4]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def test_converted_folder_loads_as_remote_code_in_a_fresh_environment(golden, converted_tiny_fp8, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    _run(
        [str(python), "-m", "pip", "install", "-q", "-c", str(REPO_ROOT / "tests" / "constraints.txt"), *_runtime_requirements()],
        env=env, timeout=1500,
    )

    model_dir = converted_tiny_fp8
    work = tmp_path / "cwd"  # not the repository: nothing of the project on sys.path
    work.mkdir()
    child_env = dict(env, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRITON_INTERPRET="1")
    result = _run([str(python), "-c", _CHILD, str(model_dir), str(golden)], cwd=work, env=child_env, timeout=900)
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))

    classes = found["classes"]
    assert all(path.startswith("transformers_modules.") for path in classes.values()), classes
    assert classes["model"].endswith(".modeling_deepseek_v41_vl.DeepseekV41ForConditionalGeneration")
    assert classes["pipeline_model"].endswith(".DeepseekV41ForConditionalGeneration")
    assert classes["processor"].endswith(".processing_deepseek_v41_vl.DeepseekV41Processor")
    assert classes["base"].endswith(".DeepseekV41Model") and classes["causal_lm"].endswith(".DeepseekV41ForCausalLM")
    assert found["numerics"] == "exact"
    meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())["vl_run"]
    assert_golden(found["tokens"], meta["generated_tokens"], "greedy tokens (remote code)", prefix=TOKENS_PREFIX)
    assert found["answer"].strip()
