"""Sizing edges the mutation run found untested (docs/mutation.md): tensor-parallel totals, GQA
GPU counts, and the figures the explanation and the refusal quote."""

from __future__ import annotations

import pytest

from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.sizing import (InsufficientGPUMemoryError, budget_per_gpu, gpu_candidates,
                                     plan)
from kvserve.operator.spec import parse_spec

GiB = 1 << 30


def spec_of(**spec: object):
    return parse_spec({"metadata": {"name": "s", "namespace": "ns", "uid": "u"}, "spec": spec})


def custom_model(heads: int, kv_heads: int) -> dict:
    return {"name": "custom", "architecture": {
        "layers": 4, "heads": heads, "kvHeads": kv_heads, "headDim": 64,
        "intermediateSize": 1024, "parameters": 50_000_000}}


def test_more_gpus_than_kv_heads_are_allowed_when_they_divide_evenly() -> None:
    # 2 KV heads over 4 or 8 GPUs: each rank repeats a KV head (engine/distributed.py's rule).
    spec = spec_of(model=custom_model(heads=8, kv_heads=2), gpu={"type": "L4", "maxPerReplica": 8})
    assert gpu_candidates(spec) == [1, 2, 4, 8]
    spec = spec_of(model=custom_model(heads=12, kv_heads=3), gpu={"type": "L4", "maxPerReplica": 8})
    assert gpu_candidates(spec) == [1]  # 2 and 4 divide 12 heads but neither side of 3 KV heads


def test_a_tensor_parallel_replica_totals_its_gpus_shares() -> None:
    spec = spec_of(model={"name": "llama-3-70b"}, gpu={"type": "H100-80GB"},
                   engine={"kvOffloading": {"hostGiB": 4}}, sizing={"targetConcurrency": 1})
    s, rank = plan(spec), budget_per_gpu(spec, 2)
    assert s.gpus_per_replica == 2
    assert (s.kv_bytes, s.bytes_per_block) == (2 * rank.kv_bytes, 2 * rank.bytes_per_block)
    # The host tier holds whole blocks (every rank's share of one): as many as 4 GiB hold.
    host_blocks = 4 * GiB // (2 * rank.bytes_per_block)
    assert s.as_status()["kvOffloading"]["hostBlocks"] == host_blocks
    assert f"host tier 4 GiB = {host_blocks} blocks" in s.explanation
    assert "tensor parallel over 2 GPUs" in s.explanation and "4 of 8 KV heads" in s.explanation
    one = plan(spec_of(model={"name": "llama-2-7b"}, gpu={"type": "A100-80GB"},
                       engine={"maxModelLen": 4096}))
    assert "tensor parallel" not in one.explanation


def test_a_host_tier_smaller_than_a_whole_tensor_parallel_block_is_refused() -> None:
    spec = spec_of(model={"name": "llama-3-70b"}, gpu={"type": "H100-80GB"})
    rank_block = budget_per_gpu(spec, 2).bytes_per_block
    gib = 1.5 * rank_block / GiB  # one rank's share fits, the replica's whole block does not
    with pytest.raises(InvalidSpecError, match="holds no KV block"):
        plan(spec_of(model={"name": "llama-3-70b"}, gpu={"type": "H100-80GB"},
                     engine={"kvOffloading": {"hostGiB": gib}}))


def test_the_explanation_quotes_the_sizing_figures() -> None:
    spec = spec_of(model={"name": "llama-2-7b"}, gpu={"type": "A100-80GB"},
                   engine={"maxModelLen": 4096, "gpuMemoryUtilization": 0.9})
    s, b = plan(spec), budget_per_gpu(spec, 1)
    for words in (f"per GPU: {80 * 0.9:.2f} GiB - weights {s.weight_bytes / GiB:.2f} GiB",
                  "(6.74B params x 2 B bfloat16 / 1)",
                  f"activations {s.activation_peak_bytes / GiB:.2f} GiB",
                  f"KV {s.kv_bytes / GiB:.2f} GiB", "8192 KiB per block of 16 tokens",
                  f"{s.num_blocks} blocks = {s.num_blocks * 16} tokens"):
        assert words in s.explanation
    assert b.kv_bytes == s.kv_bytes
    cpu = plan(spec_of(model={"name": "smollm2-135m"}, device="cpu",
                       resources={"limits": {"memory": "4Gi"}}, engine={"maxModelLen": 2048}))
    assert "per pod:" in cpu.explanation and "per GPU" not in cpu.explanation


def test_the_refusal_quotes_the_per_gpu_budget() -> None:
    spec = spec_of(model={"name": "llama-3-70b"}, gpu={"type": "L4", "maxPerReplica": 2},
                   engine={"maxNumSeqs": 3, "maxModelLen": 4096})
    b = budget_per_gpu(spec, 2)
    with pytest.raises(InsufficientGPUMemoryError) as err:
        plan(spec)
    msg = str(err.value)
    for words in (f"per GPU {b.total_bytes * b.gpu_memory_utilization / GiB:.2f} GiB - weights",
                  f"activations {b.activation_peak_bytes / GiB:.2f} GiB",
                  f"leaves {b.kv_bytes / GiB:.2f} GiB for KV",
                  "3 x 4096 tokens need 768 blocks",
                  f"({768 * b.bytes_per_block / GiB:.2f} GiB)"):
        assert words in msg


def test_a_budget_of_exactly_the_blocks_needed_fits() -> None:
    def cpu_spec(limit: int):
        return spec_of(model={"name": "smollm2-135m"}, device="cpu",
                       resources={"limits": {"memory": str(limit)}},
                       engine={"maxModelLen": 2048, "maxNumSeqs": 2})
    need = 2 * 2048 // 16
    lo, hi = 1 << 20, 64 * GiB  # the smallest pod limit whose budget holds `need` blocks
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if budget_per_gpu(cpu_spec(mid), 1).num_blocks >= need else (mid + 1, hi)
    assert budget_per_gpu(cpu_spec(lo), 1).num_blocks == need
    assert plan(cpu_spec(lo)).num_blocks == need
    with pytest.raises(InsufficientGPUMemoryError):
        plan(cpu_spec(lo - 1))


def test_the_refusal_counts_one_request_when_max_num_seqs_is_unset() -> None:
    with pytest.raises(InsufficientGPUMemoryError, match="1 x 8192 tokens need 512 blocks"):
        plan(spec_of(model={"name": "llama-3-70b"}, gpu={"type": "L4", "maxPerReplica": 2}))


def test_more_gpus_than_one_node_hold_become_pipeline_stages_across_nodes() -> None:
    """Llama 3 70B on L4s (maxPerReplica 16): 8 sequences of 8192 tokens fit on 8 GPUs, one
    node; 16 sequences need 16, two nodes' worth: TP 8 within each node, two pipeline stages
    across them (a LeaderWorkerSet of 2 pods), never TP 16 over the node link."""
    def sized(seqs: int, most: int = 16):
        return plan(spec_of(model={"name": "llama-3-70b"},
                            gpu={"type": "L4", "maxPerReplica": most},
                            engine={"maxNumSeqs": seqs}))

    one = sized(8)
    assert (one.gpus_per_replica, one.nodes_per_replica, one.pipeline_parallel_size) == (8, 1, 1)
    two = sized(16)
    assert (two.tensor_parallel_size, two.pipeline_parallel_size) == (8, 2)
    assert (two.gpus_per_replica, two.nodes_per_replica, two.gpus_per_pod) == (16, 2, 8)
    assert {"verdict": "cross-node TP"}.items() <= two.alternatives[-1].items()
    assert two.warnings and "pipeline across 2 nodes" in two.warnings[0]
    with pytest.raises(InsufficientGPUMemoryError):  # capped at one node: simply too small
        sized(16, most=8)
