"""The operator (and the sizing it shares with the engine, engine/sizing/) runs without torch: a
fresh interpreter whose import system refuses torch imports every operator and sizing module and
renders a service, and no kvserve module they reach through any import, function-level ones
included, imports torch. Its image installs no torch, so a lazy torch import would fail there."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COMPONENTS = ("engine", "operator", "service", "lora", "kernels")

# A meta-path finder first in line: `import torch` (or any torch.*) raises before it is looked up.
BLOCK_TORCH = """
import importlib, json, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked: {name}")
        return None

sys.meta_path.insert(0, NoTorch())
"""

IMPORT_ALL = BLOCK_TORCH + """
names = json.loads(sys.argv[1])
for name in names:
    importlib.import_module(name)
import yaml
from kvserve.operator.render import render
spec = {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"}}
body = {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
        "metadata": {"name": "chat", "namespace": "ml"}, "spec": spec}
out = render(yaml.safe_dump(body))
print(json.dumps({"imported": len(names), "rendered": "kind: Deployment" in out,
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def module_names(folder: str, package: str) -> list[str]:
    return [f"{package}.{p.stem}" if p.stem != "__init__" else package
            for p in sorted((ROOT / folder).glob("*.py")) if p.stem != "__main__"]


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)


def test_the_operator_and_sizing_import_and_render_with_torch_blocked() -> None:
    names = module_names("operator", "kvserve.operator") \
        + module_names("engine/sizing", "kvserve.engine.sizing")
    assert {"kvserve.operator.handlers", "kvserve.operator.render", "kvserve.operator.resources",
            "kvserve.operator.sizing", "kvserve.engine.sizing.memory"} <= set(names)
    done = run(IMPORT_ALL, json.dumps(names))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"imported": len(names), "rendered": True,
                                                        "torch": []}


def test_the_block_refuses_a_module_that_needs_torch() -> None:
    """The check above cannot pass vacuously: the same block fails the loader's GGUF reader."""
    done = run(BLOCK_TORCH + "import kvserve.engine.worker.gguf_loader\n")
    assert done.returncode != 0
    assert "torch is blocked: torch" in done.stderr


def kvserve_modules() -> dict[str, Path]:
    paths = [p for c in COMPONENTS for p in (ROOT / c).rglob("*.py")] + list(ROOT.glob("*.py"))
    names = {}
    for p in paths:
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        names[".".join(["kvserve", *parts[:-1 if parts[-1] == "__init__" else None]])] = p
    return names


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name `name` imports anywhere in its body (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}" if base else anchor
            found.update([base, *(f"{base}.{alias.name}" for alias in node.names)])
    return found


def parents(name: str) -> list[str]:
    """The packages Python imports before `name` (kvserve's own __init__ among them)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reached_from(roots: list[str], graph: dict[str, set[str]]) -> dict[str, str]:
    """Every kvserve module the roots import, directly or not: module -> who imported it."""
    reached = {n: n for n in roots}
    todo = list(roots)
    while todo:
        name = todo.pop()
        for dep in [*graph[name], *parents(name)]:
            if dep in graph and dep not in reached:
                reached[dep] = name
                todo.append(dep)
    return reached


def torch_users(names: dict[str, str], graph: dict[str, set[str]]) -> dict[str, str]:
    return {n: by for n, by in names.items() if any(d.split(".")[0] == "torch" for d in graph[n])}


def test_nothing_the_operator_reaches_imports_torch_even_lazily() -> None:
    modules = kvserve_modules()
    graph = {name: imported_names(name, path) for name, path in modules.items()}
    roots = [n for n in modules if n.startswith(("kvserve.operator", "kvserve.engine.sizing"))]
    reached = reached_from(roots, graph)
    assert {"kvserve", "kvserve.engine.cpu_threads", "kvserve.engine.sizing.weights_size"} \
        <= set(reached)
    users = torch_users(reached, graph)
    assert not users, f"imports torch (module: imported by): {users}"


def test_the_walk_sees_a_torch_import_inside_a_function(tmp_path: Path) -> None:
    """The check above cannot pass vacuously: a function-level import is found and followed."""
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from kvserve.engine.worker import gguf_loader\n")
    graph = {"kvserve.operator.lazy": imported_names("kvserve.operator.lazy", lazy),
             "kvserve.engine.worker.gguf_loader": {"torch"}}
    reached = reached_from(["kvserve.operator.lazy"], graph)
    assert torch_users(reached, graph) == {
        "kvserve.engine.worker.gguf_loader": "kvserve.operator.lazy"}


def test_a_gguf_folder_is_sized_with_torch_blocked(tmp_path: Path) -> None:
    """`kvserve plan` and the operator size a GGUF-only folder (the default model's form) from
    its tensor table without torch: the bytes equal what the gguf reader lists."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float16))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file):
        step()
    writer.close()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    done = run(BLOCK_TORCH + "from kvserve.engine.sizing.weights_size import local_checkpoint\n"
               "w = local_checkpoint(sys.argv[1]).weights\n"
               "print(json.dumps([w.total_bytes, w.bytes_by_dtype]))\n", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [64 * 32 * 4 + 32 * 32 * 2, {"F32": 64 * 32 * 4,
                                                                   "F16": 32 * 32 * 2}]
