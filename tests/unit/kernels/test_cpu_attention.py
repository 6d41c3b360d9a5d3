"""The CPU backend (fused C++ decode and prefill kernels) against the reference."""

import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings

from kv_batches import FP8, MIXED, Spec, assert_matches_reference, build_batch, specs
from kvserve.kernels.attention import paged_attention
from kvserve.kernels.checks import KernelInputError
from kvserve.kernels.plan import plan_attention
from kvserve.kernels import backend as backend_mod
from kvserve.kernels import cpu_attention
from kvserve.kernels.torch_attention import torch_paged_attention


def test_the_kernel_builds_where_a_compiler_exists():
    """On a machine with a C++ compiler (CI's), "auto" must get the fused kernel, not a fallback."""
    assert shutil.which("c++") or shutil.which("g++"), "no C++ compiler on this machine"
    assert cpu_attention.available()
    assert backend_mod.resolve_backend("auto", torch.device("cpu")) == "cpu"


def test_a_build_killed_mid_way_does_not_block_the_next_start():
    """torch's build lock is a plain file: one left by a killed build made every later process
    wait forever. A fresh process must load the kernel past it (the timeout turns a hang into a
    failure) and leave no stale lock behind."""
    assert cpu_attention.available()
    build = cpu_attention._build_dir()
    (build / "lock").touch()
    code = "from kvserve.kernels import cpu_attention; assert cpu_attention.available()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
    assert not (build / "lock").exists()


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path, monkeypatch):
    """The build's ninja file names the sources by path: two checkouts sharing one cache folder
    rebuilt over each other at every start (one kernel, compiled again and again). Same contents
    at another path must get another folder; the same path the same one."""
    here = cpu_attention._build_dir()
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_attention.CSRC, copy)
    monkeypatch.setattr(cpu_attention, "CSRC", copy)
    monkeypatch.setattr(cpu_attention, "SOURCES", tuple(copy / p.name for p in cpu_attention.SOURCES))
    monkeypatch.setattr(cpu_attention, "HEADERS", tuple(copy / p.name for p in cpu_attention.HEADERS))
    there = cpu_attention._build_dir()
    assert there != here and there == cpu_attention._build_dir()


@settings(max_examples=40, deadline=None)
@given(specs())
def test_cpu_matches_reference(spec):
    batch = build_batch(spec)
    assert_matches_reference(batch.args(), "cpu")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, FP8])
def test_long_decodes_with_outlier_keys(cache_dtype):
    """Many blocks per sequence and a late, large score: the online softmax must rescale."""
    spec = Spec(seqs=tuple((n, 1) for n in (700, 1, 333, 16, 17, 512)), num_kv_heads=3, group=3,
                head_dim=64, block_size=16, cache_dtype=cache_dtype,
                q_dtype=torch.float32 if cache_dtype == FP8 else cache_dtype, shared_blocks=2,
                seed=5)
    batch = build_batch(spec)
    # A key in the last block of sequence 0 that aligns with its query: a late new maximum.
    last_block = int(batch.block_tables[0, (700 - 1) // 16])
    boost = batch.q[0, :3].float().mean(0) * 8 / batch.k_scale
    batch.k_cache[last_block, 5, 0] = boost.to(batch.k_cache.dtype)
    assert_matches_reference(batch.args(), "cpu")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
def test_long_prefills_across_tiles(cache_dtype):
    """Prompts and chunked prefills of many tiles (PREFILL_TILE_ROWS each), one ending inside
    a block, next to decodes, with a late outlier key: tiles must meet, the causal limit must
    move with each row, and the online softmax must rescale."""
    spec = Spec(seqs=((203, 203), (517, 301), (1, 1), (90, 1), (70, 37)), num_kv_heads=3,
                group=3, head_dim=64, block_size=16, cache_dtype=cache_dtype,
                q_dtype=torch.float32 if cache_dtype == FP8 else cache_dtype, shared_blocks=2,
                seed=7)
    assert 301 > 3 * cpu_attention.PREFILL_TILE_ROWS
    batch = build_batch(spec)
    block = int(batch.block_tables[1, 400 // 16])
    boost = batch.q[int(batch.query_start_loc[1]) + 250, :3].float().mean(0) * 8 / batch.k_scale
    batch.k_cache[block, 400 % 16, 0] = boost.to(batch.k_cache.dtype)
    assert_matches_reference(batch.args(), "cpu")


def test_int64_indices_and_one_plan_over_layers():
    batch = build_batch(MIXED)
    tables, lens, qsl = (batch.block_tables.long(), batch.seq_lens.long(),
                         batch.query_start_loc.long())
    plan = plan_attention(tables, lens, qsl, 16)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(batch.q.shape, generator=gen)
        k, v = (torch.randn(batch.k_cache.shape, generator=gen) for _ in range(2))
        args = (q, k, v, tables, lens, qsl, batch.scale)
        assert_matches_reference(args, "cpu", plan=plan)


def test_disabled_kernel_falls_back_to_the_torch_path(monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_KERNEL", "0")
    cpu_attention.available.cache_clear()
    try:
        assert not cpu_attention.available()
        assert backend_mod.resolve_backend("auto", torch.device("cpu")) == "torch"
        spec = Spec(seqs=((33, 1), (20, 20)), num_kv_heads=2, group=2, head_dim=64,
                    block_size=16, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, seed=2)
        batch = build_batch(spec)
        plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc, 16)
        direct = torch_paged_attention(batch.q, batch.k_cache, batch.v_cache, plan, batch.scale)
        assert torch.equal(paged_attention(*batch.args()), direct)
        with pytest.raises(KernelInputError, match="backend"):
            backend_mod.resolve_backend("cpu", torch.device("cpu"))
    finally:
        cpu_attention.available.cache_clear()


PORTABLE_CHECK = """
import sys, torch
sys.path.insert(0, {here!r})
from hypothesis import given, settings
from kv_batches import assert_matches_reference, build_batch, specs
from kvserve.kernels import cpu_attention
assert cpu_attention.available() and "-DKVSERVE_NO_SIMD" in cpu_attention._cflags()

@settings(max_examples=25, deadline=None, database=None)
@given(specs())
def check(spec):
    assert_matches_reference(build_batch(spec).args(), "cpu")

check()
print("portable kernel ok")
"""


def test_portable_loops_without_simd_match_the_reference():
    """The loops a CPU without AVX2 (aarch64, old x86) runs, built apart in a subprocess (one
    process can load only one build of the op)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    env = {**os.environ, "KVSERVE_CPU_KERNEL_SIMD": "0"}
    done = subprocess.run([sys.executable, "-c", PORTABLE_CHECK.format(here=here)], env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "portable kernel ok" in done.stdout
