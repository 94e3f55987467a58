"""The shape of the package: imports run one way, no import cycle, small modeling files.

Read from the source with `ast` (every import, also those inside functions), so a violation fails
here whether or not the import runs at import time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO_ROOT

# import name under `deepseek_v41_vl` -> folder of the repository
FOLDERS = {
    "modeling": "modeling_deepseek_v41_vl",
    "processing": "processing",
    "triton_ops": "triton_ops",
    "conversion": "conversion",
}
# folder -> the folders it may import (anything not listed is refused)
ALLOWED = {
    "triton_ops": set(),
    "modeling": {"triton_ops"},
    "processing": {"modeling", "triton_ops"},
    "conversion": {"modeling", "processing", "triton_ops"},
}
MAX_MODELING_LINES = 800


def _modules() -> dict[tuple[str, str], Path]:
    return {
        (key, path.stem): path
        for key, folder in FOLDERS.items()
        for path in sorted((REPO_ROOT / folder).glob("*.py"))
    }


def _imports(key: str, path: Path) -> list[tuple[str, str]]:
    """(folder, module) of every project module `path` imports (relative or absolute)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") if node.module else []
            if node.level == 1:
                found += [(key, parts[0])] if parts else [(key, alias.name) for alias in node.names]
            elif node.level == 2 and parts:
                found.append((parts[0], parts[1] if len(parts) > 1 else "__init__"))
            elif node.level == 0 and parts[0] == "deepseek_v41_vl" and len(parts) > 1:
                found.append((parts[1], parts[2] if len(parts) > 2 else "__init__"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "deepseek_v41_vl" and len(parts) > 1:
                    found.append((parts[1], parts[2] if len(parts) > 2 else "__init__"))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[tuple[str, str], list[tuple[str, str]]]:
    return {ref: _imports(ref[0], path) for ref, path in _modules().items()}


def _wrong_direction(graph) -> list[str]:
    return sorted(
        f"{FOLDERS[src[0]]}/{src[1]}.py imports {dst[0]}.{dst[1]}"
        for src, targets in graph.items()
        for dst in targets
        if dst[0] != src[0] and dst[0] not in ALLOWED[src[0]]
    )


def _a_cycle(graph) -> list[tuple[str, str]] | None:
    """One import cycle of `graph` (its modules in order, the first repeated last), or None."""
    state: dict[tuple[str, str], int] = {}  # 1 on the DFS stack, 2 done
    stack: list[tuple[str, str]] = []

    def visit(ref):
        state[ref] = 1
        stack.append(ref)
        for dst in graph.get(ref, []):
            if dst not in graph:
                continue  # a package __init__ or a name that is not a module
            if state.get(dst) == 1:
                return stack[stack.index(dst) :] + [dst]
            if dst not in state and (found := visit(dst)):
                return found
        stack.pop()
        state[ref] = 2
        return None

    for ref in graph:
        if ref not in state and (found := visit(ref)):
            return found
    return None


def test_folders_import_only_downstream(graph):
    assert _wrong_direction(graph) == []


def test_no_modeling_file_imports_conversion_or_processing(graph):
    wrong = [src for src, targets in graph.items() if src[0] == "modeling" and {t[0] for t in targets} & {"conversion", "processing"}]
    assert not wrong, wrong


def test_no_module_import_cycle(graph):
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(f"{k}.{m}" for k, m in cycle)


def test_the_layout_checks_find_a_planted_cycle_and_an_upstream_import(tmp_path):
    folder = tmp_path / "modeling_deepseek_v41_vl"
    folder.mkdir()
    (folder / "a.py").write_text("from .b import x\nfrom ..conversion.convert import y\n")
    (folder / "b.py").write_text("def f():\n    from .a import z\n")  # inside a function: found too
    planted = {("modeling", name): _imports("modeling", folder / f"{name}.py") for name in ("a", "b")}
    assert _wrong_direction(planted) == ["modeling_deepseek_v41_vl/a.py imports conversion.convert"]
    assert _a_cycle(planted) == [("modeling", "a"), ("modeling", "b"), ("modeling", "a")]


def test_modeling_files_stay_small():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in (REPO_ROOT / FOLDERS["modeling"]).glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_MODELING_LINES} == {}
