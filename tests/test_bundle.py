"""The remote-code bundler: flat copies, the import rewrite rule, auto_map, importability."""

from __future__ import annotations

import os


import ast
import importlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepseek_v41_vl.conversion.bundle import (
    AUTO_MAP,
    DeepseekV41BundleError,
    bundle_remote_code,
    rewrite_imports,
    source_folders,
)
from deepseek_v41_vl.modeling.configuration_deepseek_v41_vl import DeepseekV41Config

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_rewrite_rule():
    text = textwrap.dedent(
        """\
        from ..triton_ops.moe_routing import route_topk, router_scores
        from .quantization_deepseek_v41_vl import DeepseekV41Linear
        def f():
            from ..processing.tokenizer_deepseek_v41_vl import load_deepseek_v41_tokenizer
        from ..modeling.quantization_deepseek_v41_vl import unpack_fp4
        from ..conversion.checkpoint_names import RULES
        x = "from ..triton_ops.moe_routing import is only rewritten at a line start"
        """
    )
    assert rewrite_imports(text) == textwrap.dedent(
        """\
        from .moe_routing import route_topk, router_scores
        from .quantization_deepseek_v41_vl import DeepseekV41Linear
        def f():
            from .tokenizer_deepseek_v41_vl import load_deepseek_v41_tokenizer
        from .quantization_deepseek_v41_vl import unpack_fp4
        from .checkpoint_names import RULES
        x = "from ..triton_ops.moe_routing import is only rewritten at a line start"
        """
    )


def _config_folder(tmp_path: Path, golden: Path, vision_layers: int = 2) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
    data = config.to_dict()
    data["vision_config"]["num_hidden_layers"] = vision_layers
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _parent_imports(path: Path) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 1]


def test_bundle_copies_the_closure_flat_and_writes_auto_map(golden, tmp_path):
    folder = _config_folder(tmp_path, golden)
    result = bundle_remote_code(folder)
    files = set(result["files"])
    for required in (
        "configuration_deepseek_v41_vl.py",
        "image_processing_deepseek_v41_vl.py",
        "processing_deepseek_v41_vl.py",
        "errors_deepseek_v41_vl.py",
        "encoding_deepseek_v41_vl.py",
        "tokenizer_deepseek_v41_vl.py",
        "state_dict_adapter_deepseek_v41_vl.py",
        "checkpoint_names_deepseek_v41_vl.py",
        "remote_code_deepseek_v41_vl.py",
        "quantization_deepseek_v41_vl.py",
    ):
        assert required in files
    assert not any(name in files for name in ("bundle.py", "convert.py", "__init__.py", "make_tiny.py"))
    assert {f for f in files if _parent_imports(folder / f)} == set()
    assert (folder / "image_processing_deepseek_v41_vl.py").read_text().count("from .image_spans_deepseek_v41_vl import") == 1
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == result["auto_map"]
    modeling = importlib.import_module("deepseek_v41_vl.modeling.modeling_deepseek_v41_vl") if (
        source_folders()["modeling"] / "modeling_deepseek_v41_vl.py"
    ).is_file() else None
    expected = {
        auto: target
        for auto, target in AUTO_MAP.items()
        if not target.startswith("modeling_") or (modeling is not None and hasattr(modeling, target.split(".")[1]))
    }
    assert result["auto_map"] == expected


def test_text_only_folders_get_no_processor_entries(golden, tmp_path):
    folder = _config_folder(tmp_path, golden, vision_layers=0)
    auto_map = bundle_remote_code(folder)["auto_map"]
    assert "AutoConfig" in auto_map and not {"AutoProcessor", "AutoImageProcessor", "AutoModelForImageTextToText"} & set(auto_map)


def test_bundled_files_import_as_a_flat_package(golden, tmp_path):
    folder = _config_folder(tmp_path, golden)
    files = bundle_remote_code(folder)["files"]
    package = tmp_path / "pkgroot" / "bundled_dsv41"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name in files:
        shutil.copyfile(folder / name, package / name)
    sys.path.insert(0, str(package.parent))
    try:
        configuration = importlib.import_module("bundled_dsv41.configuration_deepseek_v41_vl")
        image_processing = importlib.import_module("bundled_dsv41.image_processing_deepseek_v41_vl")
        processing = importlib.import_module("bundled_dsv41.processing_deepseek_v41_vl")
        names = importlib.import_module("bundled_dsv41.checkpoint_names_deepseek_v41_vl")
        load_time = importlib.import_module("bundled_dsv41.state_dict_adapter_deepseek_v41_vl")
        assert configuration.DeepseekV41Config.__module__ == "bundled_dsv41.configuration_deepseek_v41_vl"
        config = configuration.DeepseekV41Config.from_reference_args(golden / "model_tiny_fp8" / "config.json")
        meta = json.loads((golden / "model_tiny_fp8" / "meta.json").read_text())
        assert names.official_inventory(config) == {n: (tuple(s), d) for n, d, s in meta["checkpoint"]["inventory"]}
        processor = image_processing.DeepseekV41ImageProcessor.from_vision_config(config.vision_config)
        assert processor.num_image_tokens(451, 300) == 62  # chelsea.png under the `small` setting
        assert processing.DeepseekV41Processor.__name__ == "DeepseekV41Processor"
        tensors = load_file(golden / "model_tiny_fp8" / "model.safetensors")
        name, wo_a = load_time.convert_tensor("layers.0.attn.wo_a.weight", tensors["layers.0.attn.wo_a.weight"], config, tensors.__getitem__)
        assert name == "model.layers.0.attn.wo_a.weight" and wo_a.dtype == torch.bfloat16
        if "modeling_deepseek_v41_vl.py" in files:
            importlib.import_module("bundled_dsv41.modeling_deepseek_v41_vl")
    finally:
        sys.path.remove(str(package.parent))
        for module in [m for m in sys.modules if m == "bundled_dsv41" or m.startswith("bundled_dsv41.")]:
            del sys.modules[module]


def test_triton_ops_imports_are_rewritten_and_importable(golden, tmp_path):
    """A modeling entry module that pulls in the MoE and vision modules (which import
    `..triton_ops`): the bundle holds the kernels flat and imports as a package."""
    folders = {}
    for key, folder in source_folders().items():
        folders[key] = tmp_path / "src" / key
        shutil.copytree(folder, folders[key], ignore=shutil.ignore_patterns("__pycache__"))
    (folders["modeling"] / "modeling_deepseek_v41_vl.py").write_text(
        "from .moe_deepseek_v41_vl import DeepseekV41MoE\n"
        "from .vision_deepseek_v41_vl import DeepseekV41VisionTransformer\n"
        "DeepseekV41Model = DeepseekV41MoE\n"
    )
    dst = _config_folder(tmp_path, golden)
    result = bundle_remote_code(dst, folders=folders)
    assert result["auto_map"]["AutoModel"] == "modeling_deepseek_v41_vl.DeepseekV41Model"
    assert {"moe_routing.py", "vision_rope.py", "moe_deepseek_v41_vl.py"} <= set(result["files"])
    assert "from .moe_routing import" in (dst / "moe_deepseek_v41_vl.py").read_text()
    package = tmp_path / "pkgroot" / "bundled_dsv41_kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name in result["files"]:
        shutil.copyfile(dst / name, package / name)
    sys.path.insert(0, str(package.parent))
    try:
        modeling = importlib.import_module("bundled_dsv41_kernels.modeling_deepseek_v41_vl")
        assert modeling.DeepseekV41Model.__module__ == "bundled_dsv41_kernels.moe_deepseek_v41_vl"
    finally:
        sys.path.remove(str(package.parent))
        for module in [m for m in sys.modules if m.startswith("bundled_dsv41_kernels")]:
            del sys.modules[module]


def _synthetic(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    folders = {key: tmp_path / "syn" / key for key in ("modeling", "processing", "triton_ops", "conversion")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    # the configuration module imports `modeling/adapter.py`, so the cases below sit in the closure
    (folders["modeling"] / "configuration_deepseek_v41_vl.py").write_text(
        "from .adapter import *\nclass DeepseekV41Config:\n    pass\n"
    )
    for path, text in files.items():
        key, name = path.split("/")
        (folders[key] / name).write_text(text)
    return folders


@pytest.mark.parametrize(
    "files, message",
    [
        ({"modeling/adapter.py": "from ..elsewhere.thing import x\n"}, "unsupported import 'from ..elsewhere.thing import"),
        ({"modeling/adapter.py": "from ... import x\n"}, "unsupported import"),
        ({"modeling/adapter.py": "from deepseek_v41_vl.modeling import x\n"}, "absolute import from deepseek_v41_vl.modeling"),
        ({"modeling/adapter.py": "import deepseek_v41_vl.conversion\n"}, "absolute import of deepseek_v41_vl.conversion"),
        ({"modeling/adapter.py": "from .nowhere_module import x\n"}, "imports nowhere_module from modeling, which does not exist"),
        (
            {"modeling/adapter.py": "from .shared_name import x\nfrom ..triton_ops.shared_name import y\n",
             "modeling/shared_name.py": "x = 1\n", "triton_ops/shared_name.py": "y = 2\n"},
            r"same name in several folders cannot be bundled flat: \['shared_name'\]",
        ),
    ],
)
def test_bundle_refuses_what_cannot_be_flat(tmp_path, files, message):
    folders = _synthetic(tmp_path, files)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    with pytest.raises(DeepseekV41BundleError, match=message):
        bundle_remote_code(dst, folders=folders)


def test_bundle_needs_a_config(tmp_path):
    with pytest.raises(DeepseekV41BundleError, match="no config.json"):
        bundle_remote_code(tmp_path)


def test_transformers_loads_the_converted_folder_with_remote_code(golden, converted_tiny_fp8, tmp_path):
    dst = converted_tiny_fp8
    probe = textwrap.dedent(
        """
        import sys
        from transformers import AutoConfig, AutoImageProcessor, AutoProcessor
        path = sys.argv[1]
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=True)
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
        print(type(config).__module__.startswith("transformers_modules"), config.text_config.weight_dtype,
              type(image_processor).__name__, image_processor.max_image_tokens,
              type(processor).__name__, processor.image_token_id, processor.chat_template is not None)
        """
    )
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", probe, str(dst)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "fp8", "DeepseekV41ImageProcessor", "64", "DeepseekV41Processor", "500", "True"]
