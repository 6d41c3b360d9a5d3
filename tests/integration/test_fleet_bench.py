"""The fleet benchmark's harness in a small configuration: real redis-server, real `kvserve
router` processes, 8 simulated replicas (service/sim/) in this process."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("fleet_bench", ROOT / "bench" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    path = tmp_path / "tok"
    build_tiny_tokenizer().save_pretrained(path)
    (path / "config.json").write_text('{"model_type": "llama"}')  # a model folder to the router
    return path


@pytest.mark.slow  # two router processes start: ~50 s on a loaded 2-core machine
async def test_prefix_routing_beats_round_robin_on_a_simulated_fleet(tmp_path, tokenizer_dir):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    fleet = load_bench()
    timing = fleet.timing_model("h100-llama3-8b").scaled(2.0, num_blocks=256)
    workload = fleet.Workload(tenants=4, system_tokens=256, users_per_tenant=2, turns=3,
                              user_tokens=32, max_tokens=4)
    cfg = fleet.FleetConfig(8, timing, workload, qps=[12.0],
                            policies=["prefix", "round-robin", "oracle"], duration=3.0,
                            warmup=0.5, tokenizer=str(tokenizer_dir))
    results = {r.policy: r for r in await fleet.run_fleet(cfg, tmp_path, verbose=False)}
    for r in results.values():
        assert r.sent > 10 and r.errors == 0 and r.completed == r.sent, r
        assert r.ttft_p50 > 0
    prefix, rr, oracle = results["prefix"], results["round-robin"], results["oracle"]
    # 4 tenants on 8 replicas: round robin spreads each tenant over every replica, so its later
    # requests mostly miss; prefix routing sends a tenant back to where its prompt is cached.
    assert prefix.hit_rate > rr.hit_rate + 0.2, (prefix.hit_rate, rr.hit_rate)
    assert oracle.hit_rate > rr.hit_rate
    # The router asked Redis once per request, and the index holds the replicas' keys.
    assert prefix.lookups_s > 0 and prefix.index_keys >= 8
    assert prefix.decision_p99_ms > 0
