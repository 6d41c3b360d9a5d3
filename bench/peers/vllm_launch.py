"""How vLLM's CPU build is started as a peer: its environment (threads bound to every CPU this
process may use, its own libiomp5 preloaded, its KV cache size) and its command lines.

Standard library only: the driver (kvserve's venv), the offline worker (vLLM's venv) and the unit
tests (no vLLM venv) all import it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

# kvserve sets GOMP_SPINCOUNT for its own processes at import (engine/cpu_threads.py); vLLM is run
# as its docs advise, so the driver's additions to the environment are not handed to it.
KVSERVE_ONLY_ENV = ("GOMP_SPINCOUNT",)


def cpu_list(cpus: Iterable[int]) -> str:
    """An OpenMP-style CPU list: {0, 1} -> "0-1", {0, 2, 3, 5} -> "0,2-3,5"."""
    ordered = sorted(set(cpus))
    if not ordered:
        raise ValueError("no CPU to bind to")
    runs: list[list[int]] = []
    for c in ordered:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def vllm_env(venv: Path, base: Mapping[str, str], cpus: Iterable[int] | None = None,
             kv_cache_gib: float = 2) -> dict[str, str]:
    """The environment vLLM's CPU build runs under: OMP threads bound to all `cpus` (vLLM
    otherwise keeps one of two cores for its front end), Intel OpenMP from its venv preloaded,
    `kv_cache_gib` of KV cache."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    env = {k: v for k, v in base.items() if k not in KVSERVE_ONLY_ENV}
    env.update(VLLM_CPU_OMP_THREADS_BIND=cpu_list(cpus),
               LD_PRELOAD=str(venv / "lib" / "libiomp5.so"),
               VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}")
    return env


def vllm_serve_cmd(venv: Path, model: Path, port: int, dtype: str,
                   max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port`, from its own venv. It is the server `vllm serve`
    runs, started through its module: vllm-cpu's `vllm` command exits at once, as it asks for the
    version of a distribution named `vllm` (this one is `vllm-cpu`)."""
    return [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0"]


def vllm_offline_cmd(venv: Path, model: Path, prompts_file: Path, dtype: str,
                     max_model_len: int, max_tokens: int) -> list[str]:
    """bench/peers/vllm_offline.py under the vLLM venv's Python."""
    script = Path(__file__).resolve().parent / "vllm_offline.py"
    return [str(venv / "bin" / "python"), str(script), "--model", str(model),
            "--prompts", str(prompts_file), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-tokens", str(max_tokens)]
