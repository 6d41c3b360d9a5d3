"""The repository root is the `kvserve` package; its `operator/` folder must never shadow the
standard library's `operator` when a user runs `python -m ...` from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    out = run("-c", "import kvserve.engine.model_loader, importlib.util, transformers;"
              "transformers.AutoConfig.for_model('llama');"
              "spec = importlib.util.find_spec('kernels');"
              "print(spec.origin if spec else 'absent')")
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) != ROOT / "kernels" / "__init__.py"


def test_component_packages_map_to_their_folders() -> None:
    out = run("-c", "import kvserve.engine, kvserve.kernels, kvserve.service, kvserve.operator;"
              "print(kvserve.engine.__file__); print(list(kvserve.operator.__path__)[0])")
    assert out.returncode == 0, out.stderr
    engine_init, operator_dir = out.stdout.split()
    assert Path(engine_init) == ROOT / "engine" / "__init__.py"
    assert Path(operator_dir) == ROOT / "operator"


def test_api_server_module_runs_from_the_repo_root() -> None:
    out = run("-m", "kvserve.service.api_server", "--help")
    assert out.returncode == 0, out.stderr
    assert "--max-num-seqs" in out.stdout and "--kv-cache-dtype" in out.stdout


def test_no_script_shadows_an_installed_top_level_module() -> None:
    """`python bench/x.py` puts bench/ first on sys.path, so a bench/kernels.py would be imported
    as HF's `kernels` by transformers (it was, until renamed kernels_cpu.py). Every script folder's
    module names must be free among the installed top-level modules."""
    import importlib.util

    clashes = []
    for folder in ("bench", "examples", "scripts"):
        for path in sorted((ROOT / folder).glob("*.py")):
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
