"""One memory plan per host (engine/sizing/host_memory.py): the arithmetic over N ranks, the memory
available read from /proc and cgroup files (fake roots written here), and a start refused with
the arithmetic before any rank allocates (the available figure passed as KVSERVE_HOST_MEMORY)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
from conftest import make_llm

from kvserve.engine.sizing.host_memory import (
    GiB, Available, HostMemoryError, available_memory, cpu_kv_bytes, default_cpu_kv_bytes,
    plan_host,
)

MiB = 1 << 20


def test_plan_splits_the_server_budgets_across_ranks_and_sums_them():
    plan = plan_host(ranks=3, on_cpu=True, weight_bytes=600 * MiB, activation_bytes=50 * MiB,
                     kv_bytes=4 * GiB // 3, swap_bytes=4 * GiB, host_tier_bytes=3 * GiB)
    assert plan.weight_bytes == 200 * MiB
    assert plan.kv_bytes == 4 * GiB // 3
    assert plan.swap_bytes == 4 * GiB // 3  # 4/3 GiB each, at most each rank's KV cache
    assert plan.host_tier_bytes == GiB
    per_rank = 200 * MiB + 50 * MiB + 2 * (4 * GiB // 3) + GiB
    assert plan.rank_host_bytes == per_rank and plan.host_bytes == 3 * per_rank
    assert plan.describe().startswith("3 ranks x (weights 0.20 + activations 0.05 + KV cache "
                                      "1.33 + swap 1.33 + host tier 1.00) GiB")


def test_swap_is_capped_at_the_kv_cache_on_cpu_but_not_on_cuda():
    cpu = plan_host(ranks=2, on_cpu=True, weight_bytes=0, activation_bytes=0,
                    kv_bytes=GiB // 4, swap_bytes=4 * GiB, host_tier_bytes=0)
    assert cpu.swap_bytes == GiB // 4
    cuda = plan_host(ranks=2, on_cpu=False, weight_bytes=8 * GiB, activation_bytes=GiB,
                     kv_bytes=0, swap_bytes=4 * GiB, host_tier_bytes=2 * GiB)
    assert cuda.swap_bytes == 2 * GiB and cuda.rank_host_bytes == 3 * GiB  # GPU terms not host's
    assert [t[0] for t in cuda.terms()] == ["swap", "host tier"]


def test_refusal_names_the_arithmetic_and_the_largest_terms_flag():
    plan = plan_host(ranks=3, on_cpu=True, weight_bytes=3 * GiB, activation_bytes=0,
                     kv_bytes=2 * GiB, swap_bytes=0, host_tier_bytes=0)
    plan.check(Available(9 * GiB, "MemAvailable"))  # exactly 9 GiB: fits
    with pytest.raises(HostMemoryError) as err:
        plan.check(Available(8 * GiB, "cgroup v2 limit 8.00 GiB - 0.00 GiB used"))
    msg = str(err.value)
    assert "3 ranks x (weights 1.00 + activations 0.00 + KV cache 2.00 + swap 0.00 + host tier " \
           "0.00) GiB = 9.00 GiB" in msg
    assert "only 8.00 GiB is available (cgroup v2 limit" in msg and "1.00 GiB over" in msg
    assert "lower --kv-cache-memory" in msg and "--tensor-parallel-size" in msg


def test_default_kv_is_a_quarter_of_what_is_available_capped_at_4_gib():
    assert default_cpu_kv_bytes(8 * GiB) == 2 * GiB
    assert default_cpu_kv_bytes(64 * GiB) == 4 * GiB


@pytest.mark.parametrize("swap", [0, GiB // 2, 3 * GiB, 10 * GiB])
def test_operator_kv_is_the_largest_that_the_plan_fits(swap):
    """cpu_kv_bytes (the operator's CPU sizing) against plan_host: it fits, one byte more not."""
    kw = dict(ranks=1, weight_bytes=GiB, activation_bytes=GiB // 8, host_tier_bytes=GiB)
    kv = cpu_kv_bytes(available_bytes=8 * GiB, swap_bytes=swap, **kw)
    fits = plan_host(on_cpu=True, kv_bytes=kv, swap_bytes=swap, **kw)
    over = plan_host(on_cpu=True, kv_bytes=kv + 1, swap_bytes=swap, **kw)
    assert fits.host_bytes <= 8 * GiB < over.host_bytes


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_available_is_the_tightest_of_meminfo_and_the_cgroup_limits(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal: 25165824 kB\nMemAvailable: 20971520 kB\n")  # 20 GiB
    _write(proc / "self" / "cgroup", "0::/kubepods/pod1/ctr\n")
    assert available_memory(proc, cg) == Available(20 * GiB, "MemAvailable")
    _write(cg / "kubepods" / "pod1" / "memory.max", f"{6 * GiB}\n")  # the pod's limit
    _write(cg / "kubepods" / "pod1" / "memory.current", f"{GiB}\n")
    _write(cg / "kubepods" / "pod1" / "ctr" / "memory.max", "max\n")  # the container: none
    _write(cg / "kubepods" / "pod1" / "ctr" / "memory.current", f"{GiB}\n")
    got = available_memory(proc, cg)
    assert got.bytes == 5 * GiB and got.source.startswith("cgroup v2 limit 6.00 GiB - 1.00 GiB")


def test_cgroup_v1_limit_and_a_namespace_root(tmp_path):
    """v1 (memory.limit_in_bytes); the process's path is not under the mount (a container's
    cgroup namespace): its mount root is the process's cgroup."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemAvailable: 20971520 kB\n")
    _write(proc / "self" / "cgroup", "5:devices:/\n4:memory:/process_api/abc\n0::/\n")
    _write(cg / "memory" / "memory.limit_in_bytes", f"{3 * GiB}\n")
    _write(cg / "memory" / "memory.usage_in_bytes", f"{GiB // 2}\n")
    got = available_memory(proc, cg)
    assert got.bytes == 3 * GiB - GiB // 2 and "cgroup v1" in got.source
    _write(cg / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert available_memory(proc, cg) == Available(20 * GiB, "MemAvailable")


def test_an_engine_that_does_not_fit_is_refused_before_any_rank_starts(tiny_model_dir,
                                                                      monkeypatch):
    monkeypatch.setenv("KVSERVE_HOST_MEMORY", str(96 * MiB))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(HostMemoryError) as err:
        make_llm(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory=128 * MiB)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == before
    msg = str(err.value)
    assert "2 ranks x (weights 0.00 + activations" in msg and "KV cache 0.06" in msg
    assert "only 0.09 GiB is available (KVSERVE_HOST_MEMORY)" in msg
    assert "lower --kv-cache-memory" in msg


def test_the_engine_sizes_its_cache_and_swap_pool_from_the_plan(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOST_MEMORY", str(GiB))
    llm = make_llm(tiny_model_dir, kv_cache_memory=2 * MiB, swap_space=1 / 1024,
                   preemption_mode="swap")
    engine = llm.llm_engine
    plan = engine.host_plan
    assert plan.kv_bytes == engine.memory_budget.kv_bytes == 2 * MiB
    assert plan.swap_bytes == MiB
    assert engine.kv.num_cpu_blocks == MiB // engine.memory_budget.bytes_per_block


def test_tensor_parallel_ranks_split_the_servers_budgets(tiny_model_dir, monkeypatch):
    """kv_cache_memory and swap_space are the whole server's: each of 2 ranks gets half."""
    monkeypatch.setenv("KVSERVE_HOST_MEMORY", str(GiB))
    llm = make_llm(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory=4 * MiB,
                   swap_space=2 / 1024, preemption_mode="swap")
    try:
        engine = llm.llm_engine
        plan = engine.host_plan
        assert plan.ranks == 2 and plan.kv_bytes == engine.memory_budget.kv_bytes == 2 * MiB
        assert plan.swap_bytes == MiB
        assert engine.kv.num_cpu_blocks == MiB // engine.memory_budget.bytes_per_block
        assert plan.host_bytes == 2 * plan.rank_host_bytes
    finally:
        llm.shutdown()
