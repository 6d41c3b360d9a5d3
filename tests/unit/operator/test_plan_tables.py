"""`kvserve plan` by a concurrency target: one layout checked against a hand-written formula,
the plan table of public models at several targets, and the rejected layouts it prints."""

from __future__ import annotations

import json

import pytest

from kvserve.operator.sizing import plan
from kvserve.operator.spec import parse_spec
from kvserve.service.cli import build_parser

MiB = 1 << 20


def sized(model: str, gpu: str, target: int | None = None, max_len: int = 8192):
    spec = {"model": {"name": model}, "gpu": {"type": gpu}, "engine": {"maxModelLen": max_len}}
    if target is not None:
        spec["sizing"] = {"targetConcurrency": target}
    return plan(parse_spec({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}))


def test_405b_on_h100_by_hand() -> None:
    """TP 8 within a node, 2 stages across 2 nodes: each rank holds 1/8 of the larger stage
    (63 of 126 layers, plus the embedding or the lm_head) and 1 of the 8 KV heads of its 63
    layers."""
    usable = int(81559 * MiB * 0.9)
    params = 405_853_388_800
    weights = 2 * params                                   # bf16
    ends = 2 * 128256 * 16384                              # embedding (stage 0) / lm_head (last)
    stage = (weights - 2 * ends) * 63 // 126 + ends
    rank_weights = -(-stage // 8)
    mlp = 8192 * (3 * 53248 // 8 + 4 * 16384 + 3 * 128 // 8 * 128) * 2
    logits = 256 * 128256 * 4 * 2
    per_block = 2 * 63 * 1 * 128 * 2 * 16                  # K+V, layers, KV heads, dim, bf16
    blocks = (usable - rank_weights - mlp - logits) // per_block
    s = sized("llama-3.1-405b", "H100-80GB", 32)
    assert (s.tensor_parallel_size, s.pipeline_parallel_size) == (8, 2)
    assert (s.nodes_per_replica, s.gpus_per_pod, s.gpus_per_replica) == (2, 8, 16)
    assert s.num_blocks == blocks == 47419
    assert s.max_concurrency == blocks * 16 // 8192 == 92
    assert s.replicas_for_target == 1 and s.weight_bytes == weights


def test_70b_default_target_by_hand() -> None:
    """32 requests of 8192 tokens: TP 2 holds 3 (11 replicas, 22 GPUs), TP 4 holds 60 (4 GPUs)."""
    usable = int(81559 * MiB * 0.9)
    weights = 2 * 70_553_706_496
    held = {}
    for tp in (2, 4):
        mlp = 8192 * (3 * 28672 // tp + 4 * 8192 + 3 * 64 // tp * 128) * 2
        act = mlp + 256 * 128256 * 4 * 2
        per_block = 2 * 80 * (8 // tp) * 128 * 2 * 16
        held[tp] = (usable - -(-weights // tp) - act) // per_block // 512
    assert held == {2: 3, 4: 60}
    s = sized("llama-3-70b", "H100-80GB")
    assert (s.target_concurrency, s.tensor_parallel_size, s.max_concurrency) == (32, 4, 60)
    tp2 = next(a for a in s.alternatives if a["tensorParallelSize"] == 2
               and a["pipelineParallelSize"] == 1)
    assert (tp2["maxConcurrency"], tp2["replicas"], tp2["totalGpus"]) == (3, 11, 22)
    assert tp2["verdict"] == "more GPUs"


# (model, GPU, target) -> (TP, PP, nodes per replica, replicas, requests per replica), 8192 tokens
TABLE = [
    ("llama-3-8b", "H100-80GB", 8, (1, 1, 1, 1, 55)),
    ("llama-3-8b", "H100-80GB", 128, (1, 1, 1, 3, 55)),
    ("llama-3-8b", "H200-141GB", 128, (1, 1, 1, 2, 110)),
    ("llama-3-70b", "H100-80GB", 32, (4, 1, 1, 1, 60)),
    ("llama-3-70b", "H100-80GB", 128, (8, 1, 1, 1, 173)),
    ("llama-3-70b", "H200-141GB", 32, (2, 1, 1, 1, 47)),
    ("llama-3.1-405b", "H100-80GB", 8, (8, 2, 2, 1, 92)),
    ("llama-3.1-405b", "H100-80GB", 128, (8, 3, 3, 1, 233)),
    ("llama-3.1-405b", "H200-141GB", 32, (8, 1, 1, 1, 61)),
    ("llama-3.1-405b", "H200-141GB", 128, (8, 2, 2, 1, 256)),
    ("qwen3-235b-a22b", "H100-80GB", 32, (8, 1, 1, 1, 44)),
    ("qwen3-235b-a22b", "H100-80GB", 128, (8, 2, 2, 1, 237)),
    ("qwen3-235b-a22b", "H200-141GB", 32, (4, 1, 1, 1, 43)),
]


@pytest.mark.parametrize(("model", "gpu", "target", "layout"), TABLE)
def test_plan_table(model: str, gpu: str, target: int, layout: tuple) -> None:
    s = sized(model, gpu, target)
    got = (s.tensor_parallel_size, s.pipeline_parallel_size, s.nodes_per_replica,
           s.replicas_for_target, min(s.max_concurrency, s.max_num_seqs))
    assert got == layout
    assert got[3] * got[4] >= target  # the replicas hold the target
    chosen = got[0] * got[1] * got[3]
    for alt in s.alternatives:  # nothing cheaper was passed over
        if alt["verdict"] in ("more GPUs", "tie-break"):
            assert alt["totalGpus"] > chosen if alt["verdict"] == "more GPUs" else \
                alt["totalGpus"] == chosen
    assert bool(s.warnings) == (got[2] > 1)  # multi-node replicas are warned about


def test_plan_cli_prints_the_layouts_it_rejected_and_why(capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["plan", "--model", "llama-3.1-405b", "--gpu", "H100-80GB",
                                      "--max-model-len", "8192", "--target-concurrency", "64"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "layouts for 64 concurrent requests:" in out
    table = out.split("layouts for 64 concurrent requests:\n")[1].split("\nwarning")[0]
    header, chosen, *rejected = table.splitlines()
    assert header.split() == ["TP", "PP", "nodes", "GPUs/replica", "concurrency", "replicas",
                              "GPUs", "verdict"]
    assert chosen.split() == ["8", "2", "2", "16", "92", "1", "16", "chosen"]
    for verdict in ("more GPUs", "too little KV", "cross-node TP"):
        assert any(f"  {verdict}" in row for row in rejected), verdict
    assert "warning: pipeline across 2 nodes" in out


def test_plan_json_default_target_and_a_local_checkpoint_dtype(capsys) -> None:
    args = build_parser().parse_args(["plan", "--model", "llama-3-8b", "--gpu", "L40S",
                                      "--max-model-len", "8192", "--output", "json"])
    assert args.func(args) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["targetConcurrency"] == 32
    # 21 requests per L40S: 2 replicas of 1 GPU (as cheap as TP 2, and no collective traffic)
    assert (status["tensorParallelSize"], status["replicasForTarget"]) == (1, 2)
    tp2 = next(a for a in status["alternatives"] if a["tensorParallelSize"] == 2)
    assert (tp2["verdict"], tp2["replicas"], tp2["totalGpus"]) == ("tie-break", 1, 2)
    fp8 = build_parser().parse_args(["plan", "--model", "llama-3-8b", "--gpu", "L40S",
                                     "--max-model-len", "8192", "--kv-cache-dtype", "fp8",
                                     "--output", "json"])
    assert fp8.func(fp8) == 0
    assert json.loads(capsys.readouterr().out)["replicasForTarget"] == 1  # dtype-aware


def test_bandwidth_poor_layouts_are_warned() -> None:
    """70B on L4s: 141 GB of weights over TP 8 at 0.3 TB/s is >= 59 ms per token."""
    s = sized("llama-3-70b", "L4", 8, max_len=4096)
    assert s.tensor_parallel_size == 8
    assert any(w.startswith("bandwidth-poor: >= 58.8 ms per token") for w in s.warnings)


def test_a_local_folder_is_sized_from_its_files_for_a_target(tiny_model_dir, capsys) -> None:
    """The target works on a model read from its own files (config.json, safetensors headers)
    as on a catalog entry: GPUs of 51 MiB (1 GiB x 0.05) cannot hold 400 requests in one
    replica."""
    args = build_parser().parse_args(["plan", "--model", str(tiny_model_dir),
                                      "--gpu-memory-gib", "1", "--gpu-memory-utilization", "0.05",
                                      "--max-model-len", "256", "--target-concurrency", "400",
                                      "--output", "json"])
    assert args.func(args) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["modelSource"].startswith("files:")
    per_replica = min(status["maxConcurrency"], status["maxNumSeqs"])
    assert status["replicasForTarget"] == -(-400 // per_replica) > 1
    assert status["targetConcurrency"] == 400
