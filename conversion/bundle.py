"""Copy this project's model code into a model folder as transformers remote code.

``bundle_remote_code(dst)`` makes `dst` loadable with ``trust_remote_code=True``:

1. It starts from the modules that ``auto_map`` names (:data:`AUTO_MAP`; an entry is written only
   when its module exists and defines the class) and follows their relative imports to the
   closure (the model's own modules include the load-time transform of ``--link`` folders).
2. Each module of the closure is copied FLAT into `dst` (``dst/<module>.py``). Module names must be
   unique across the source folders ``modeling_deepseek_v41_vl/``, ``processing/``, ``triton_ops/``
   and ``conversion/``.
3. Imports are rewritten by one rule: ``from ..<folder>.<module> import`` (folder one of
   ``modeling``, ``processing``, ``triton_ops``, ``conversion``) becomes
   ``from .<module> import``; sibling imports ``from .<module> import`` stay as they are. Any other
   parent-relative import, or an absolute import of ``deepseek_v41_vl``, is refused: the folder
   could not be imported on its own.
4. ``auto_map`` is written into ``dst/config.json`` (required) and, when present, into
   ``preprocessor_config.json`` and ``processor_config.json`` (top level and its nested
   ``image_processor``), which is where transformers' ``AutoImageProcessor`` / ``AutoProcessor``
   look first. Without a vision tower (``vision_config.num_hidden_layers == 0``) the processor
   entries are left out: a text-only folder is used with its tokenizer.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

from ..modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError

# The package folders the bundle draws from: import name under `deepseek_v41_vl` -> subpackage.
FOLDERS = ("modeling", "processing", "triton_ops", "conversion")

# transformers Auto class -> "module.Class" inside the bundled folder.
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek_v41_vl.DeepseekV41Config",
    "AutoModel": "modeling_deepseek_v41_vl.DeepseekV41Model",
    "AutoModelForCausalLM": "modeling_deepseek_v41_vl.DeepseekV41ForCausalLM",
    "AutoModelForImageTextToText": "modeling_deepseek_v41_vl.DeepseekV41ForConditionalGeneration",
    "AutoProcessor": "processing_deepseek_v41_vl.DeepseekV41Processor",
    "AutoImageProcessor": "image_processing_deepseek_v41_vl.DeepseekV41ImageProcessor",
}
_PROCESSOR_AUTO = ("AutoProcessor", "AutoImageProcessor", "AutoModelForImageTextToText")
_PROCESSOR_FILES = {
    "preprocessor_config.json": ("AutoImageProcessor", "AutoProcessor"),
    "processor_config.json": ("AutoProcessor", "AutoImageProcessor"),
}
_PARENT_IMPORT = re.compile(r"^(\s*)from \.\.(" + "|".join(FOLDERS) + r")\.(\w+) import ", re.MULTILINE)


class DeepseekV41BundleError(DeepseekV41ConversionError):
    """The remote code cannot be bundled (a missing module, a clashing name, an unsupported import)."""


def source_folders() -> dict[str, Path]:
    """Folder of each bundled subpackage (`modeling` -> .../modeling_deepseek_v41_vl, ...)."""
    base = __package__.rsplit(".", 1)[0]
    return {key: Path(importlib.import_module(f"{base}.{key}").__file__).parent for key in FOLDERS}


def _module_index(folders: dict[str, Path]) -> dict[tuple[str, str], Path]:
    return {(key, p.stem): p for key, folder in folders.items() for p in sorted(folder.glob("*.py")) if p.stem != "__init__"}


def _defines(path: Path, class_name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == class_name for t in node.targets):
            return True
    return False


def _imports(path: Path, key: str, modules: dict[tuple[str, str], Path]) -> list[tuple[str, str]]:
    """(folder, module) pairs `path` imports relatively; refuses the forms the flat copy cannot keep."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepseek_v41_vl":
                    raise DeepseekV41BundleError(f"{path}:{node.lineno}: absolute import of {alias.name} in remote code")
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if (node.module or "").split(".")[0] == "deepseek_v41_vl":
                raise DeepseekV41BundleError(f"{path}:{node.lineno}: absolute import from {node.module} in remote code")
            continue
        parts = (node.module or "").split(".") if node.module else []
        if node.level == 1 and len(parts) == 1:
            found.append((key, parts[0]))
        elif node.level == 1 and not parts:
            found.extend((key, alias.name) for alias in node.names)
        elif node.level == 2 and len(parts) == 2 and parts[0] in FOLDERS:
            found.append((parts[0], parts[1]))
        else:
            dots = "." * node.level
            raise DeepseekV41BundleError(
                f"{path}:{node.lineno}: unsupported import 'from {dots}{node.module or ''} import ...' "
                f"(use 'from .module import' or 'from ..<folder>.module import')"
            )
    for ref in found:
        if ref not in modules:
            raise DeepseekV41BundleError(f"{path}: imports {ref[1]} from {ref[0]}, which does not exist")
    return found


def rewrite_imports(text: str) -> str:
    """Apply the flat-import rule: ``from ..<folder>.<module> import`` -> ``from .<module> import``."""
    return _PARENT_IMPORT.sub(r"\1from .\3 import ", text)


def _closure(roots: list[tuple[str, str]], modules: dict[tuple[str, str], Path]) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    stack = list(roots)
    while stack:
        ref = stack.pop()
        if ref in seen:
            continue
        seen.append(ref)
        stack.extend(_imports(modules[ref], ref[0], modules))
    return sorted(seen, key=lambda r: r[1])


def _entry_points(modules: dict[tuple[str, str], Path]) -> dict[str, tuple[tuple[str, str], str]]:
    by_name = {name: key for (key, name) in modules}
    entries = {}
    for auto, target in AUTO_MAP.items():
        module, cls = target.rsplit(".", 1)
        if module in by_name and _defines(modules[(by_name[module], module)], cls):
            entries[auto] = ((by_name[module], module), target)
    return entries


def bundle_remote_code(dst: str | Path, folders: dict[str, Path] | None = None) -> dict:
    """Copy the remote-code modules into `dst` (flat) and write ``auto_map``.

    Args:
        dst: a model folder holding ``config.json``.
        folders: override of :func:`source_folders` (tests).

    Returns:
        ``{"files": [...copied file names...], "auto_map": {...}}``.

    Raises:
        DeepseekV41BundleError: no config.json in `dst`, two bundled modules with one name, an
            import that cannot be made flat, or a module importing one that does not exist.
    """
    dst = Path(dst)
    config_path = dst / "config.json"
    if not config_path.is_file():
        raise DeepseekV41BundleError(f"{dst}: no config.json to write auto_map into")
    modules = _module_index(folders or source_folders())
    entries = _entry_points(modules)
    vision = json.loads(config_path.read_text(encoding="utf-8")).get("vision_config") or {}
    if vision.get("num_hidden_layers", 1) == 0:
        for auto in _PROCESSOR_AUTO:
            entries.pop(auto, None)
    if "AutoConfig" not in entries:
        raise DeepseekV41BundleError("the configuration module (configuration_deepseek_v41_vl.DeepseekV41Config) is missing")
    files = _copy_flat(dst, [ref for ref, _ in entries.values()], modules)
    auto_map = {auto: target for auto, (_, target) in entries.items()}
    _add_auto_map(config_path, auto_map)
    _add_processor_auto_map(dst, auto_map)
    return {"files": files, "auto_map": auto_map}


def bundle_processor_code(
    dst: str | Path, auto_classes: tuple[str, ...] = ("AutoProcessor", "AutoImageProcessor"), folders: dict[str, Path] | None = None
) -> dict:
    """The processor's part of :func:`bundle_remote_code`, for a folder a processor or image
    processor was saved to (``config.json`` not needed): copies the modules of `auto_classes`
    (some of ``AutoProcessor``, ``AutoImageProcessor``) and their closure flat, and writes their
    ``auto_map`` into the processor files present. Returns and raises as :func:`bundle_remote_code`
    (also for an auto class that is not a processor's)."""
    unknown = sorted(set(auto_classes) - {"AutoProcessor", "AutoImageProcessor"})
    if unknown:
        raise DeepseekV41BundleError(f"not processor auto classes: {unknown}")
    dst = Path(dst)
    modules = _module_index(folders or source_folders())
    entries = {auto: entry for auto, entry in _entry_points(modules).items() if auto in auto_classes}
    files = _copy_flat(dst, [ref for ref, _ in entries.values()], modules)
    auto_map = {auto: target for auto, (_, target) in entries.items()}
    _add_processor_auto_map(dst, auto_map)
    return {"files": files, "auto_map": auto_map}


def _copy_flat(dst: Path, roots: list[tuple[str, str]], modules: dict[tuple[str, str], Path]) -> list[str]:
    closure = _closure(roots, modules)
    names = [name for _, name in closure]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise DeepseekV41BundleError(f"modules with the same name in several folders cannot be bundled flat: {clashes}")
    files = []
    for ref in closure:
        text = rewrite_imports(modules[ref].read_text(encoding="utf-8"))
        left = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom) and n.level > 1]
        if left:
            raise DeepseekV41BundleError(f"{modules[ref]}:{left[0].lineno}: a parent-relative import the rewrite rule does not cover")
        (dst / f"{ref[1]}.py").write_text(text, encoding="utf-8")
        files.append(f"{ref[1]}.py")
    return files


def _add_processor_auto_map(dst: Path, auto_map: dict) -> None:
    for file, keys in _PROCESSOR_FILES.items():
        if (dst / file).is_file():
            _add_auto_map(dst / file, {k: auto_map[k] for k in keys if k in auto_map})


def _add_auto_map(path: Path, auto_map: dict) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data["auto_map"] = auto_map
    # transformers 5 reads the image processor from the dict nested in processor_config.json
    if isinstance(data.get("image_processor"), dict):
        data["image_processor"]["auto_map"] = auto_map
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = ["AUTO_MAP", "DeepseekV41BundleError", "bundle_processor_code", "bundle_remote_code", "rewrite_imports", "source_folders"]
