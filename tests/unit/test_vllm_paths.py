"""vLLM's module paths (docs/gen/vllm_paths.yaml): every row's `vllm.` path read as `kvserve.`
is the very object the row names; vllm_paths/ only re-exports (one implementation per name) and
is packaged the way the components are (package-dir, no sys.path change)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TABLE = yaml.safe_load((ROOT / "docs" / "gen" / "vllm_paths.yaml").read_text())["paths"]
FOLDER = ROOT / "vllm_paths"


def resolve(dotted: str) -> Any:
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def kvserve_path(vllm_path: str) -> str:
    assert vllm_path.startswith("vllm."), vllm_path
    return "kvserve" + vllm_path.removeprefix("vllm")


@pytest.mark.parametrize("row", TABLE, ids=[r["vllm"] for r in TABLE])
def test_each_vllm_path_is_the_named_kvserve_object(row: dict[str, str]) -> None:
    assert resolve(kvserve_path(row["vllm"])) is resolve(row["kvserve"])


def test_the_named_objects_live_outside_vllm_paths() -> None:
    """The right-hand column names where each object is defined, never a re-export."""
    mapped = {f"kvserve.{p.name}" for p in FOLDER.iterdir() if p.is_dir()}
    assert not [r["kvserve"] for r in TABLE
                if any(r["kvserve"].startswith(m + ".") for m in mapped)]


def vllm_path_modules() -> list[Path]:
    return sorted(p for p in FOLDER.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(FOLDER).with_suffix("").parts
    return ".".join(("kvserve", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_every_module_in_vllm_paths_is_in_the_table() -> None:
    """A path nobody tests could drift: each module holds at least one row's name (packages
    that only hold subpackages are exempt), and each row's module exists."""
    rows_modules = {kvserve_path(r["vllm"]).rpartition(".")[0] for r in TABLE}
    untested = [module_name(p) for p in vllm_path_modules()
                if module_name(p) not in rows_modules and _defines_names(p)]
    assert not untested


def _defines_names(path: Path) -> bool:
    return any(isinstance(n, ast.ImportFrom) for n in ast.parse(path.read_text()).body)


@pytest.mark.parametrize("path", vllm_path_modules(), ids=lambda p: module_name(p))
def test_vllm_path_modules_only_re_export(path: Path) -> None:
    """One implementation per name: a docstring, imports from kvserve and `__all__`, nothing
    defined here; `__all__` lists exactly what is imported."""
    body = ast.parse(path.read_text()).body
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    imported: set[str] = set()
    exported: set[str] = set()
    for node in body[1:]:
        if isinstance(node, ast.ImportFrom):
            assert node.module and node.module.startswith("kvserve."), ast.dump(node)
            assert not any(node.module.startswith(m) for m in _mapped_roots()), node.module
            imported |= {a.asname or a.name for a in node.names}
        else:
            assert isinstance(node, ast.Assign) and node.targets[0].id == "__all__", \
                ast.unparse(node)
            exported = set(ast.literal_eval(node.value))
    assert imported == exported


def _mapped_roots() -> list[str]:
    return [f"kvserve.{p.name}" for p in FOLDER.iterdir() if p.is_dir()]


def test_pyproject_maps_each_vllm_path_package_and_lists_it() -> None:
    """package-dir maps each top folder of vllm_paths/ (as it maps the components), and
    `packages` lists every package below (a wheel holds only those)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {p.name for p in FOLDER.iterdir() if (p / "__init__.py").is_file()}
    assert tops and all(tool["package-dir"][f"kvserve.{t}"] == f"vllm_paths/{t}" for t in tops)
    packages = {module_name(p) for p in FOLDER.rglob("__init__.py")}
    assert packages <= set(tool["packages"]), sorted(packages - set(tool["packages"]))
    assert not (FOLDER / "__init__.py").exists()  # vllm_paths/ is a folder, not a package


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_vllm_paths_import_from_the_checkout_root_and_elsewhere(where: str, tmp_path: Path) -> None:
    """`kvserve.utils` is a package whatever the working folder, nothing at the root shadows
    a top-level module named like a vLLM path, and sys.path is left as it was."""
    code = ("import sys, importlib.util; before = list(sys.path);"
            "import kvserve.utils.argparse_utils, kvserve.v1.engine.async_llm, kvserve.config;"
            "assert sys.path == before;"
            "print(kvserve.utils.__path__[0]);"
            "print(importlib.util.find_spec('utils') is None, importlib.util.find_spec('v1') is None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT if where == "root" else tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    folder, free = out.stdout.splitlines()
    assert Path(folder) == FOLDER / "utils" and free == "True True"
