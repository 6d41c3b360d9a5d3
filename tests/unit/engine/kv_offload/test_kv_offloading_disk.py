"""KV disk tier on the tiny random Llama: prefixes evicted from the device pool and then from a
small host tier come back from block files with the same tokens as no cache at all; damaged or
missing files are recomputed, not read; a restarted engine reuses the directory; bad settings are
refused before anything starts."""

from __future__ import annotations

import os
import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_offload import disk_block_file as fmt

from test_kv_offloading import run_turns  # noqa: E402 (this folder's helper: one turn at a time)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # K/V, layers, tokens, KV heads, head_dim, fp32
HOST_GIB = 5 * BLOCK_BYTES / (1 << 30)  # a host tier of 5 blocks: the disk takes the rest
DISK_GIB = 64 * (BLOCK_BYTES + fmt.HEADER_SIZE) / (1 << 30)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(path), dtype="float32", device="cpu", num_gpu_blocks_override=12, **kw)


def disk_llm(path, disk_dir) -> LLM:
    return make_llm(path, kv_offloading_size=HOST_GIB, kv_offloading_disk_path=str(disk_dir),
                    kv_offloading_disk_size=DISK_GIB)


def tenant_prompts(tenants: int = 4) -> list[list[int]]:
    """Two rounds of tenants with a 5-block prefix each: 20 prefix blocks against a 12-block
    device pool and a 5-block host tier, so most of each prefix must come back from disk."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 380) for _ in range(5 * BLOCK)] for _ in range(tenants)]
    return [prefixes[t] + [rng.randrange(3, 380) for _ in range(5)]
            for _ in range(2) for t in range(tenants)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    return run_turns(llm, tenant_prompts())[0]


def test_prefixes_come_back_from_disk_with_identical_outputs(tiny_model_dir, tmp_path, reference):
    llm = disk_llm(tiny_model_dir, tmp_path)
    toks, cached = run_turns(llm, tenant_prompts())
    assert toks == reference
    assert cached == [0] * 4 + [5 * BLOCK] * 4  # every prefix block, from some tier
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 4 * 5 * BLOCK
    assert stats.prefix_cache_disk_hits > 0 and stats.prefix_cache_host_hits > 0
    assert stats.disk_blocks_restored * BLOCK == stats.prefix_cache_disk_hits
    assert stats.offload_bytes_from_disk == stats.disk_blocks_restored * BLOCK_BYTES
    assert stats.disk_bad_files == 0 and stats.num_disk_cached_blocks > 0
    files = [f for f in os.listdir(tmp_path) if f.endswith(fmt.SUFFIX)]
    assert len(files) == stats.num_disk_cached_blocks
    kinds = {e.medium for e in llm.llm_engine.drain_kv_events(("device", "host", "disk"))}
    assert kinds == {"device", "host", "disk"}
    assert sorted(llm.llm_engine.cached_block_hashes("disk")) == sorted(
        f[: -len(fmt.SUFFIX)] for f in files)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("damage", ["flip_byte", "delete"])
def test_damaged_or_missing_block_files_are_recomputed(tiny_model_dir, tmp_path, reference,
                                                       damage):
    prompts = tenant_prompts()
    llm = disk_llm(tiny_model_dir, tmp_path)
    engine = llm.llm_engine
    first_toks, _ = run_turns(llm, prompts[:4])
    files = sorted(tmp_path / f for f in os.listdir(tmp_path) if f.endswith(fmt.SUFFIX))
    assert files
    for f in files:
        if damage == "delete":
            f.unlink()
        else:  # one exponent byte of a KV value, the header still right
            data = bytearray(f.read_bytes())
            data[fmt.HEADER_SIZE + 1003] ^= 0x40
            f.write_bytes(bytes(data))
    toks, cached = run_turns(llm, prompts[4:])
    assert first_toks + toks == reference
    stats = engine.get_stats()
    assert stats.disk_bad_files >= 1
    # Tenant 0's prefix: its first block on the host, the rest on disk, damaged: recomputed.
    assert cached[0] == BLOCK
    engine.shutdown()


def test_a_restarted_engine_reuses_the_directory(tiny_model_dir, tmp_path, reference):
    prompts = tenant_prompts()
    first = disk_llm(tiny_model_dir, tmp_path)
    first_toks, _ = run_turns(first, prompts[:4])
    first.llm_engine.shutdown()  # releases the directory
    again = disk_llm(tiny_model_dir, tmp_path)
    toks, cached = run_turns(again, prompts[4:])
    assert first_toks + toks == reference
    # Shutdown put the host tier's and the device pool's blocks on disk too: whole prefixes.
    assert cached == [5 * BLOCK] * 4
    assert again.llm_engine.get_stats().prefix_cache_disk_hits == 4 * 5 * BLOCK
    again.llm_engine.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_offloading_disk_path="/tmp/x", kv_offloading_disk_size=1.0), "kv_offloading_size"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x"), "both"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_size=1.0), "both"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x",
          kv_offloading_disk_size=-1.0), ">= 0"),
    (dict(kv_offloading_size=1.0, kv_offloading_disk_path="/tmp/x", kv_offloading_disk_size=1.0,
          tensor_parallel_size=2), "one rank only"),
])
def test_bad_disk_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_a_disk_size_holding_no_block_or_an_unwritable_path_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="holds no KV block file"):
        make_llm(tiny_model_dir, kv_offloading_size=HOST_GIB,
                 kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=1e-9)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a writable directory"):
        make_llm(tiny_model_dir, kv_offloading_size=HOST_GIB,
                 kv_offloading_disk_path=str(tmp_path / "file" / "kv"),
                 kv_offloading_disk_size=DISK_GIB)
