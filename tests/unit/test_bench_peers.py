"""bench/peers/ (vLLM's CPU build as a same-run peer): the pure parts, without the vLLM venv that
CI does not build: the environment and command lines vLLM is started with, the per-round ratios
and their spread, the tables, and the worker's line protocol over a stand-in process."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"
sys.path.insert(0, str(PEERS))

from offline_rounds import VllmOfflineWorker  # noqa: E402
from peer_report import offline_table, server_table  # noqa: E402
from peer_spread import order_of_round, ratio_spread, spread  # noqa: E402
from vllm_launch import cpu_list, vllm_env, vllm_offline_cmd, vllm_serve_cmd  # noqa: E402


@pytest.mark.parametrize("cpus, text", [({0, 1}, "0-1"), ([3], "3"), ({0, 2, 3, 5}, "0,2-3,5"),
                                        ([7, 6, 5, 9], "5-7,9")])
def test_cpu_list_is_openmp_ranges(cpus, text) -> None:
    assert cpu_list(cpus) == text


def test_cpu_list_refuses_no_cpu() -> None:
    with pytest.raises(ValueError):
        cpu_list([])


def test_vllm_env_binds_every_allowed_cpu_and_preloads_its_own_iomp() -> None:
    base = {"PATH": "/usr/bin", "GOMP_SPINCOUNT": "1000", "HOME": "/root"}
    env = vllm_env(Path("/v"), base, kv_cache_gib=1.5)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(os.sched_getaffinity(0))
    assert env["LD_PRELOAD"] == "/v/lib/libiomp5.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1.5"
    assert "GOMP_SPINCOUNT" not in env  # kvserve's own setting is not handed to vLLM
    assert env["PATH"] == "/usr/bin" and base["GOMP_SPINCOUNT"] == "1000"  # base left as it was
    assert vllm_env(Path("/v"), base, cpus=[0, 1, 2, 3])["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_vllm_command_lines() -> None:
    cmd = vllm_serve_cmd(Path("/v"), Path("/m"), 8123, "bfloat16", 2048)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags == {"--model": "/m", "--host": "127.0.0.1", "--port": "8123", "--dtype": "bfloat16",
                     "--max-model-len": "2048", "--seed": "0"}
    off = vllm_offline_cmd(Path("/v"), Path("/m"), Path("/p.json"), "bfloat16", 2048, 64)
    assert off[0] == "/v/bin/python" and Path(off[1]) == PEERS / "vllm_offline.py"
    assert dict(zip(off[2::2], off[3::2]))["--max-tokens"] == "64"


def test_ratios_are_taken_round_by_round() -> None:
    # Round by round 2.0, 1.5, 3.0: the median of the ratios, not the ratio of the medians (500/250).
    s = ratio_spread([500.0, 450.0, 600.0], [250.0, 300.0, 200.0])
    assert (s.median, s.lo, s.hi, s.rounds) == (2.0, 1.5, 3.0, 3)
    assert s.text() == "2.00x (1.50-3.00, 3 rounds)"
    assert spread([1.234]).text() == "1.23x (1 round)"
    with pytest.raises(ValueError):
        ratio_spread([1.0, 2.0], [1.0])  # a round missing on one side
    with pytest.raises(ValueError):
        spread([])


def test_rounds_alternate_who_goes_first() -> None:
    assert [order_of_round(i) for i in range(3)] == [
        ("kvserve", "vllm"), ("vllm", "kvserve"), ("kvserve", "vllm")]


def test_tables_show_medians_ranges_and_per_round_ratios() -> None:
    offline = {"kvserve": [{"tokens": 4096, "seconds": 8.0}, {"tokens": 4096, "seconds": 10.24}],
               "vllm": [{"tokens": 4096, "seconds": 16.0}, {"tokens": 4096, "seconds": 10.24}]}
    text = offline_table(offline)
    assert "| kvserve | 456.0 (400.0-512.0) | 2 |" in text
    assert "| kvserve / vLLM, per round | 1.50x (1.00-2.00, 2 rounds) | 2 |" in text
    run = {"tok_s": 300.0, "ttft_p50": 0.5, "ttft_p99": 1.0, "itl_p50": 0.1, "itl_p99": 0.2}
    slow = {k: v * 2 for k, v in run.items()}
    text = server_table({"kvserve": [run], "vllm": [slow]})
    assert "| kvserve serve | 300.0 | 500 | 1000 | 100 | 200 | 1 |" in text
    assert text.splitlines()[-1].count("0.50x (1 round)") == 5


STAND_IN = textwrap.dedent("""
    import sys
    print("INFO vLLM log line", flush=True)
    print('PEER READY {"vllm": "0.0"}', flush=True)
    for n, line in enumerate(sys.stdin):
        print("INFO another log line", flush=True)
        print('PEER RESULT {"tokens": %d, "seconds": 1.0}' % (n + 10), flush=True)
""")


def test_worker_protocol_skips_log_lines_and_answers_each_run(tmp_path) -> None:
    log = (tmp_path / "log").open("w+")
    worker = VllmOfflineWorker([sys.executable, "-c", STAND_IN], dict(os.environ), log)
    try:
        assert worker.wait_ready() == {"vllm": "0.0"}
        assert [worker.run()["tokens"] for _ in range(2)] == [10, 11]
    finally:
        worker.close()
    assert worker.proc.returncode == 0  # EOF on stdin ends the worker
    log.seek(0)
    assert log.read().count("log line") == 3


def test_worker_that_dies_names_its_log(tmp_path) -> None:
    log = (tmp_path / "vllm-peer.log").open("w+")
    worker = VllmOfflineWorker([sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                               dict(os.environ), log)
    with pytest.raises(RuntimeError, match=r"code 3\) before READY; see its log .*vllm-peer.log"):
        worker.wait_ready()
    worker.close()
    log.seek(0)
    assert "boom" in log.read()
