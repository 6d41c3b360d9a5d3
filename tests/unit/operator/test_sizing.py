"""Sizing against hand-computed memory budgets."""

from __future__ import annotations

import pytest

from kvserve.engine.config import EngineConfig
from kvserve.operator.sizing import DEFAULT_MAX_NUM_SEQS, InsufficientGPUMemoryError, plan
from kvserve.operator.spec import parse_spec

MiB, GiB = 1 << 20, 1 << 30


def service(**spec: object) -> dict:
    return {"metadata": {"name": "s", "namespace": "ns", "uid": "u"}, "spec": spec}


def sized(**spec: object):
    return plan(parse_spec(service(**spec)))


def test_llama2_7b_fp16_on_a100_80gb_by_hand() -> None:
    s = sized(model={"name": "llama-2-7b"}, gpu={"type": "A100-80GB"},
              engine={"maxModelLen": 4096, "gpuMemoryUtilization": 0.9, "dtype": "float16"})
    usable = int(81920 * MiB * 0.9)                      # 77,309,411,328
    weights = 6_738_415_616 * 2                           # fp16
    mlp = 4096 * (3 * 11008 + 4 * 4096 + 3 * 32 * 128) * 2  # 4096 batched tokens, fp16
    logits = 256 * 32000 * 4 * 2                          # default max_num_seqs, fp32, x2
    kv = usable - weights - mlp - logits
    per_block = 2 * 32 * 32 * 128 * 2 * 16                # K+V, layers, heads, dim, fp16, 16 tok
    assert (s.gpus_per_replica, s.weight_bytes, s.kv_bytes) == (1, weights, kv)
    assert s.bytes_per_block == per_block == 8 * MiB
    assert s.num_blocks == kv // per_block == 7541
    assert s.max_concurrency == 7541 * 16 // 4096 == 29
    assert "7541 blocks" in s.explanation and "max concurrency 29" in s.explanation


def test_llama3_70b_needs_more_than_one_gpu() -> None:
    s = sized(model={"name": "llama-3-70b"}, gpu={"type": "H100-80GB"},
              sizing={"targetConcurrency": 1})
    # 141 GB of bf16 weights cannot fit one 80 GB GPU; two hold them plus one 8192-token request.
    assert s.gpus_per_replica == 2
    # The default target (32 requests) needs TP 4: TP 2 holds 3, so 11 replicas, 22 GPUs.
    default = sized(model={"name": "llama-3-70b"}, gpu={"type": "H100-80GB"})
    assert (default.tensor_parallel_size, default.replicas_for_target) == (4, 1)
    assert default.target_concurrency == 32 and default.max_concurrency >= 32
    assert s.weight_bytes == 70_553_706_496 * 2
    per_gpu_block = 2 * 80 * (8 // 2) * 128 * 2 * 16      # KV heads split across the 2 GPUs
    assert s.bytes_per_block == 2 * per_gpu_block
    assert s.num_blocks * 16 >= 8192


def test_concurrency_target_sets_the_gpu_count_and_fp8_halves_it() -> None:
    base = {"model": {"name": "llama-3-70b"}, "gpu": {"type": "H100-80GB"}}
    bf16 = sized(**base, engine={"maxNumSeqs": 64})
    fp8 = sized(**base, engine={"maxNumSeqs": 64, "kvCacheDtype": "fp8"})
    assert (bf16.gpus_per_replica, fp8.gpus_per_replica) == (8, 4)
    assert bf16.num_blocks >= 64 * 8192 // 16 and fp8.num_blocks >= 64 * 8192 // 16


def test_fp8_kv_doubles_the_blocks() -> None:
    base = {"model": {"name": "llama-2-7b"}, "gpu": {"type": "A100-80GB"},
            "engine": {"maxModelLen": 4096}}
    fp16 = sized(**base)
    fp8 = sized(**{**base, "engine": {"maxModelLen": 4096, "kvCacheDtype": "fp8"}})
    assert fp8.bytes_per_block * 2 == fp16.bytes_per_block
    assert fp8.kv_bytes == fp16.kv_bytes
    assert fp8.num_blocks in (2 * fp16.num_blocks, 2 * fp16.num_blocks + 1)
    assert fp8.kv_cache_dtype == "fp8" and fp16.kv_cache_dtype == "bfloat16"  # auto on GPUs


def test_impossible_spec_is_refused_with_the_numbers() -> None:
    with pytest.raises(InsufficientGPUMemoryError) as err:
        sized(model={"name": "llama-3-70b"}, gpu={"type": "L4", "maxPerReplica": 2})
    msg = str(err.value)
    assert err.value.reason == "InsufficientGPUMemory"
    # 2 x L4: 22.49 GiB each; 141 GB of weights / 2 = 65.71 GiB per GPU; 512 blocks needed.
    for figure in ("2 x L4", "22.49 GiB", "65.71 GiB", "512 blocks", "maxPerReplica"):
        assert figure in msg


def test_gpu_counts_divide_the_heads() -> None:
    # qwen2.5-7b has 28 attention heads: 8 GPUs cannot split them, so TP 4 is the most tried
    # (then two pipeline stages of 4 within maxPerReplica 8).
    with pytest.raises(InsufficientGPUMemoryError) as err:
        sized(model={"name": "qwen2.5-7b"}, gpu={"type": "L4", "maxPerReplica": 8},
              engine={"maxModelLen": 32768, "maxNumSeqs": 256})
    assert "8 x L4" in str(err.value) and "(2 pipeline stages of 4)" in str(err.value)


def test_memory_gib_overrides_the_catalog_and_cpu_uses_the_pod_limit() -> None:
    custom = sized(model={"name": "llama-2-7b"}, gpu={"memoryGiB": 48},
                   engine={"maxModelLen": 4096}, sizing={"targetConcurrency": 8})
    assert custom.device_memory_bytes == 48 * GiB and custom.gpus_per_replica == 1
    cpu = sized(model={"name": "smollm2-135m"}, device="cpu",
                resources={"limits": {"memory": "4Gi"}}, engine={"maxModelLen": 2048})
    assert cpu.gpus_per_replica == 0 and cpu.device_memory_bytes == 4 * GiB
    assert cpu.weight_dtype == "float32"  # the engine's `auto` on CPU
    assert cpu.bytes_per_block == 2 * 30 * 3 * 64 * 4 * 16


def test_default_concurrency_matches_the_engine() -> None:
    assert DEFAULT_MAX_NUM_SEQS == EngineConfig().max_num_seqs


def test_long_context_batches_at_most_8192_tokens_like_the_engine() -> None:
    s = sized(model={"name": "qwen2.5-7b"}, gpu={"type": "H100-80GB"},
              engine={"maxModelLen": 32768})
    mlp = 8192 * (3 * 18944 + 4 * 3584 + 3 * 28 * 128) * 2
    logits = 256 * 152064 * 4 * 2
    assert s.activation_peak_bytes == mlp + logits


def test_cpu_pod_plan_is_the_engines_host_plan_with_the_swap_pool_in_it() -> None:
    """A CPU pod's RAM holds the swap pool too: swapSpaceGiB comes out of the KV cache, and the
    engine's host plan (engine/sizing/host_memory.py) over the operator's figures fills the pod."""
    from kvserve.engine.sizing.host_memory import plan_host

    base = {"model": {"name": "smollm2-135m"}, "device": "cpu",
            "resources": {"limits": {"memory": "4Gi"}}}
    no_swap = sized(**base, engine={"maxModelLen": 2048, "swapSpaceGiB": 0})
    swap = sized(**base, engine={"maxModelLen": 2048, "swapSpaceGiB": 0.5})
    assert no_swap.kv_bytes - swap.kv_bytes == GiB // 2
    assert "- swap 0.50 GiB (swapSpaceGiB" in swap.explanation
    usable = int(4 * GiB * 0.9)
    for s, gib in ((no_swap, 0), (swap, 0.5)):
        host = plan_host(ranks=1, on_cpu=True, weight_bytes=s.weight_bytes,
                         activation_bytes=s.activation_peak_bytes, kv_bytes=s.kv_bytes,
                         swap_bytes=int(gib * GiB), host_tier_bytes=0)
        assert usable - 1 <= host.host_bytes <= usable
