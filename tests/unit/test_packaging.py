"""The repository root is the `kvserve` package and each top-level folder one of its components;
run from the repository root (`python -m ...`, `python -c ...`), no folder may shadow a module of
the same name: the standard library's `operator`, HF's `kernels` that transformers imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_python_dash_m_from_the_repo_root_keeps_the_stdlib_operator() -> None:
    out = run("-m", "json.tool", "--help")  # runpy imports collections -> operator first
    assert out.returncode == 0, out.stderr
    probe = run("-c", "import operator, sys; sys.path.insert(0, ''); "
                "import importlib; print(importlib.reload(operator).__file__)")
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).parent != ROOT / "operator"


def test_the_kernels_folder_does_not_shadow_hf_kernels_from_the_repo_root() -> None:
    """transformers >= 5.25 imports the `kernels` package (HF's hub kernels) when it is installed,
    whenever a model config is built; from the repository root our kernels/ folder came first."""
    out = run("-c", "import kvserve.engine.worker.model_loader, importlib.util, transformers;"
              "transformers.AutoConfig.for_model('llama');"
              "spec = importlib.util.find_spec('kernels');"
              "print(spec.origin if spec else 'absent')")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) != ROOT / "kernels" / "__init__.py"


COMPONENTS = ("engine", "kernels", "lora", "service", "operator")


def test_component_packages_map_to_their_folders() -> None:
    out = run("-c", "import kvserve.engine, kvserve.kernels, kvserve.lora, kvserve.service, "
              "kvserve.operator;"
              "print(*(list(getattr(kvserve, c).__path__)[0] for c in "
              f"{COMPONENTS!r}))")
    assert out.returncode == 0, out.stderr
    assert [Path(p) for p in out.stdout.split()] == [ROOT / c for c in COMPONENTS]


@pytest.mark.parametrize("cwd", ["root", "elsewhere"])
def test_transformers_operator_and_kvserve_import_together(cwd: str, tmp_path: Path) -> None:
    """The line a user types first, from the checkout root and from any other folder; importing
    kvserve leaves sys.path as it found it."""
    code = ("import sys; before = list(sys.path);"
            "import transformers, operator; import kvserve.kernels, kvserve.operator;"
            "from kvserve import LLM; transformers.AutoConfig.for_model('llama');"
            "assert sys.path == before, 'sys.path changed';"
            "print(operator.__file__); print(LLM.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT if cwd == "root" else tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    operator_file, llm_module = out.stdout.split()
    assert Path(operator_file).parent != ROOT / "operator"
    assert llm_module == "kvserve.engine.llm"


def test_no_component_folder_wins_over_a_module_of_its_name() -> None:
    """From the checkout root each folder name resolves to the installed module of that name when
    there is one (operator, kernels), else to a bare namespace: never to a regular package here."""
    out = run("-c", "import importlib.util;"
              f"specs = [importlib.util.find_spec(c) for c in {COMPONENTS!r}];"
              "print(*(s.origin if s and s.origin else 'namespace' for s in specs))")
    assert out.returncode == 0, out.stderr
    origins = dict(zip(COMPONENTS, out.stdout.split()))
    assert origins["operator"] != "namespace" and origins["kernels"] != "namespace"
    assert not [c for c, o in origins.items() if o != "namespace" and ROOT / c in Path(o).parents]


def test_api_server_module_runs_from_the_repo_root() -> None:
    out = run("-m", "kvserve.service.api_server", "--help")
    assert out.returncode == 0, out.stderr
    assert "--max-num-seqs" in out.stdout and "--kv-cache-dtype" in out.stdout


def test_no_script_shadows_an_installed_top_level_module() -> None:
    """`python bench/x.py` puts bench/ first on sys.path, so a bench/kernels.py would be imported
    as HF's `kernels` by transformers (it was, until renamed kernels_cpu.py). Every script folder's
    module names must be free among the installed top-level modules, and so must the modules at
    the root (kvserve.paths), which `python -m`/`-c` run there can import as top-level ones."""
    import importlib.util

    clashes = []
    for folder in ("bench", "examples", "scripts", "."):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.stem == "__init__":
                continue
            spec = importlib.util.find_spec(path.stem)
            if spec is not None and spec.origin and Path(spec.origin).parent != path.parent:
                clashes.append(f"{folder}/{path.name} shadows {spec.origin}")
    assert not clashes


def test_a_bench_script_builds_a_model_config() -> None:
    """With bench/ first on sys.path, as `python bench/throughput.py` runs, build a llama config,
    which makes transformers import HF's `kernels`."""
    out = subprocess.run([sys.executable, "-c", "import workload, transformers;"
                          "transformers.AutoConfig.for_model('llama'); print('ok')"],
                         cwd=ROOT / "bench", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_python_folder_of_a_component_is_a_listed_package() -> None:
    """A wheel (the Docker image installs one, not an editable checkout) holds only the packages
    pyproject lists: a subfolder left out imports from the checkout and fails in the image."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folders = {path.parent for c in COMPONENTS for path in (ROOT / c).rglob("*.py")}
    names = {".".join(("kvserve", *f.relative_to(ROOT).parts)) for f in folders}
    assert not sorted(names - listed)


# Import names whose distribution is spelled differently on PyPI.
DISTRIBUTION_OF = {"yaml": "pyyaml", "lz4": "lz4", "compressed_tensors": "compressed-tensors",
                   "zmq": "pyzmq", "envoy": "xds-protos"}
# Imported only to report "not installed": llama-cpp-python compiles llama.cpp at install time.
OPTIONAL_BENCH_IMPORTS = {"llama_cpp"}


def bench_imports() -> set[str]:
    """Top-level module names every bench/*.py imports, at any depth (plots import lazily)."""
    import ast

    local = {p.stem for p in (ROOT / "bench").glob("*.py")}
    local |= {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"kvserve"}
    names: set[str] = set()
    for path in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - local - set(sys.stdlib_module_names) - OPTIONAL_BENCH_IMPORTS


def requirement_names(specs: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=\[; ]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_every_bench_import_is_a_declared_requirement_that_make_bench_installs() -> None:
    """`bench/fleet.py` ended in a traceback because matplotlib was nobody's requirement."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"])
    declared |= requirement_names(project["optional-dependencies"]["bench"])
    wanted = {DISTRIBUTION_OF.get(n, n).lower().replace("_", "-") for n in bench_imports()}
    assert "matplotlib" in wanted  # the scan sees imports inside functions
    assert wanted - declared == set()
    recipe = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert ".[bench]" in recipe
