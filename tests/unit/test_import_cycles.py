"""No import cycle inside operator/ or service/ (engine/'s own check is
tests/unit/engine/test_layout.py): the spec's types stand below what reads them, the CLI above
the server it starts. Function-level and TYPE_CHECKING imports count: a loop hidden in a function
is still a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules(folder: str, root: Path = ROOT) -> dict[str, Path]:
    names = {}
    for path in sorted((root / folder).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        names[".".join(["kvserve", *parts[:-1 if parts[-1] == "__init__" else None]])] = path
    return names


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One path that returns to its start, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
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

    return next((c for start in sorted(graph) if start not in state
                 and (c := visit(start))), None)


def graph_of(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(folder, root)
    return {name: imported(name, path, known) for name, path in known.items()}


@pytest.mark.parametrize("folder", ["operator", "service"])
def test_no_import_cycle(folder: str) -> None:
    graph = graph_of(folder)
    assert sum(map(len, graph.values())) > len(graph) / 2, "the import graph came out empty"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_walk_finds_the_old_circles(tmp_path: Path) -> None:
    """The check cannot pass vacuously: spec.py reading adapters.py at module level while
    adapters.py names spec's types under TYPE_CHECKING, and a server whose main() imports the
    CLI, are both reported."""
    (tmp_path / "operator").mkdir()
    (tmp_path / "operator" / "spec.py").write_text(
        "from kvserve.operator.adapters import AdapterSpec\n")
    (tmp_path / "operator" / "adapters.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from kvserve.operator.spec import ServiceSpec\n")
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "api_server.py").write_text(
        "def main():\n    from kvserve.service import cli\n")
    (tmp_path / "service" / "cli.py").write_text(
        "def run_serve():\n    from kvserve.service.api_server import run_server\n")
    assert find_cycle(graph_of("operator", tmp_path)) == [
        "kvserve.operator.adapters", "kvserve.operator.spec", "kvserve.operator.adapters"]
    assert find_cycle(graph_of("service", tmp_path)) == [
        "kvserve.service.api_server", "kvserve.service.cli", "kvserve.service.api_server"]
