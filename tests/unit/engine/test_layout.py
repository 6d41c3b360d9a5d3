"""The engine's layout holds: every engine module imports, no import cycle among them
(function-level and TYPE_CHECKING imports count: a loop hidden in a function is still a loop), and
every engine sub-package is listed in pyproject.toml so a built wheel carries it."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "engine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvserve", *parts])


MODULES = {module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def imported_engine_modules(name: str, path: Path) -> set[str]:
    """The engine modules `name` imports anywhere in its body (`from pkg import mod` included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a path that returns to its start), or None: depth-first search."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_engine_module_imports(name: str) -> None:
    assert importlib.import_module(name).__name__ == name


def test_no_import_cycle_among_engine_modules() -> None:
    graph = {name: imported_engine_modules(name, path) for name, path in MODULES.items()}
    assert sum(map(len, graph.values())) > len(graph), "the import graph came out empty"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_loop_through_a_function_level_import(tmp_path: Path) -> None:
    """The check above cannot pass vacuously: the same walk reports a loop hidden in a function."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from kvserve.engine.core import scheduler\n")
    b.write_text("def f():\n    from kvserve.engine.worker.model_runner import ModelRunner\n")
    graph = {"kvserve.engine.worker.model_runner": {"kvserve.engine.core.scheduler"},
             "kvserve.engine.core.scheduler": imported_engine_modules("x.b", b)}
    assert imported_engine_modules("x.a", a) == {"kvserve.engine.core",
                                                 "kvserve.engine.core.scheduler"}
    assert find_cycle(graph) == ["kvserve.engine.core.scheduler",
                                 "kvserve.engine.worker.model_runner",
                                 "kvserve.engine.core.scheduler"]


def test_every_engine_subpackage_is_packaged() -> None:
    """pyproject.toml lists packages explicitly: a sub-package missing there is missing from the
    wheel, though an editable install would still find it."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    subpackages = {module_name(p) for p in ENGINE.rglob("__init__.py")}
    assert subpackages, "engine has no sub-package"
    assert subpackages <= listed, sorted(subpackages - listed)
    assert not (ENGINE / "__init__.py").exists(), "engine/ must stay a namespace portion"
