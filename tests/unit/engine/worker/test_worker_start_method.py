"""Tensor parallelism started as vLLM starts it: a top-level script with tensor_parallel_size=2 and
no `if __name__ == "__main__":` guard runs (workers fork while no CUDA context exists)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvserve.engine.worker.workers import start_method

SCRIPT = """
from kvserve import LLM, SamplingParams
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
kw = dict(dtype="float32", device="cpu", kv_cache_memory=1 << 22)
one = LLM({model!r}, **kw).generate("Hello there", greedy, use_tqdm=False)[0].outputs[0]
tp = LLM({model!r}, tensor_parallel_size=2, **kw)
two = tp.generate("Hello there", greedy, use_tqdm=False)[0].outputs[0]
print("TOKENS", one.token_ids == two.token_ids, len(two.token_ids))
tp.shutdown()
"""


def test_a_script_without_a_main_guard_runs_tensor_parallel(tiny_model_dir, tmp_path: Path):
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(model=str(tiny_model_dir))))
    env = {k: v for k, v in os.environ.items() if not k.endswith("WORKER_MULTIPROC_METHOD")}
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TOKENS True 6" in out.stdout


def test_start_method_follows_vllm(monkeypatch):
    for name in ("KVSERVE_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)
    import torch

    assert start_method() == ("spawn" if torch.cuda.is_initialized() else "fork")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert start_method() == "spawn"
