"""bench/gpu_serve.sh --smoke: the lent-GPU server benchmark's whole path (model build, offline
peer, a server with the engine core in a thread and one with it in its own process) on the CPU."""

import pytest
from conftest import bench_smoke_run


@pytest.mark.timeout(1500)  # a model build, the offline peer and two server start-ups
def test_gpu_serve_script_smoke():
    out = bench_smoke_run("gpu_serve.sh", timeout=1400)
    for run in ("offline LLM.generate", "server (thread), 4 clients",
                "server (process), 4 clients"):
        assert f"| {run} |" in out, out
