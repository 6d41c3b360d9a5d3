"""The swap pool is allocated as blocks are swapped (engine/kv_offload/swap_pool.py): no bytes and
no resident memory before the first swap-out, a chunk while blocks are out, none once they are
back; blocks come back bit for bit (fp8 too); an engine swapping under preemption holds swap memory
only while a sequence is swapped."""

from __future__ import annotations

import psutil
import pytest
import torch
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.engine.kv_offload.swap_pool import CHUNK_BYTES, SwapPool
from kvserve.kernels.fp8 import FP8_DTYPE

MiB = 1 << 20


def test_a_1_gib_pool_costs_nothing_until_blocks_are_swapped():
    block = (2, 30, 16, 8, 64)  # 240 KiB of fp32: 4,369 blocks make ~1 GiB
    rss = psutil.Process().memory_info().rss
    pool = SwapPool(4369, block, torch.float32)
    assert pool.allocated_bytes == 0
    assert psutil.Process().memory_info().rss - rss < 64 * MiB  # an eager pool: +1,024 MiB
    blocks = torch.randn(2, 30, 3, 16, 8, 64)
    pool.write([0, 1, 2], blocks)
    assert pool.allocated_bytes == pool.chunk_blocks * pool.block_bytes <= CHUNK_BYTES
    assert torch.equal(pool.read([2, 0], torch.device("cpu")), blocks[:, :, [2, 0]])
    assert pool.allocated_bytes > 0  # slot 1 is still out
    assert torch.equal(pool.read([1], torch.device("cpu")), blocks[:, :, [1]])
    assert pool.allocated_bytes == 0


def test_slots_across_chunks_and_fp8_bits_round_trip():
    pool = SwapPool(10, (2, 1, 4, 1, 2), FP8_DTYPE)
    pool.chunk_blocks = 3  # force several chunks on a small pool
    blocks = torch.randn(2, 1, 4, 4, 1, 2).to(FP8_DTYPE)
    slots = [9, 0, 4, 5]
    pool.write(slots, blocks)
    assert sorted(pool.chunks) == [0, 1, 3]
    assert pool.chunks[3].shape[2] == 1  # the last chunk holds the pool's remainder
    back = pool.read(slots, torch.device("cpu"))
    assert torch.equal(back.view(torch.uint8), blocks.view(torch.uint8))
    assert pool.allocated_bytes == 0
    with pytest.raises(IndexError, match="outside the pool of 10 blocks"):
        pool.write([10], blocks[:, :, :1])


def test_engine_holds_swap_memory_only_while_a_sequence_is_swapped(tiny_model_dir):
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=10, preemption_mode="swap",
                   swap_space=0.01, enable_prefix_caching=False)
    engine = llm.llm_engine
    pool = engine.runner.swap
    assert pool is not None and pool.allocated_bytes == 0
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), "the quick brown fox jumps over the lazy dog " * 2, params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append((bool(engine.kv.swapped), pool.allocated_bytes))
    assert any(swapped for swapped, _ in seen)
    assert all(nbytes > 0 for swapped, nbytes in seen if swapped)
    assert pool.allocated_bytes == 0
