"""`kvserve plan` (the sizing the operator would choose), `kvserve render` (render.py: the
objects it would apply) and `kvserve operator` (runs kopf)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.engine.defaults import BLOCK_SIZE, GPU_MEMORY_UTILIZATION, GPUS_PER_NODE
from kvserve.engine.sizing.parallel_layout import DEFAULT_TARGET_CONCURRENCY
from kvserve.operator.catalog import GPUS, MODELS
from kvserve.operator.spec import InvalidSpecError, parse_spec

ARCH_FLAGS = {"layers": "layers", "kv_heads": "kvHeads", "head_dim": "headDim",
              "parameters": "parameters", "heads": "heads", "hidden_size": "hiddenSize",
              "intermediate_size": "intermediateSize", "vocab_size": "vocabSize"}


def _add_plan(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="print the sizing the operator would choose for a model on a GPU",
        description="GPUs per replica, KV blocks and max concurrency from the engine's memory "
                    "budget; the JSON keys match a KVInferenceService's status.sizing.")
    p.add_argument("--model", required=True,
                   help=f"a local model folder, a hub id ORG/NAME (read through HF_ENDPOINT with "
                        f"HF_TOKEN: config.json and safetensors headers only), a catalog name "
                        f"({', '.join(sorted(MODELS))}) or any name with --layers ...")
    p.add_argument("--revision", help="hub revision of --model (default main)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="GPU type")
    p.add_argument("--gpu-memory-gib", type=float, help="memory per GPU for other GPU types")
    p.add_argument("--max-gpus-per-replica", type=int,
                   help="most GPUs one replica may use, TP x PP (spec.gpu.maxPerReplica; "
                        "default: as many as the target needs)")
    p.add_argument("--gpus-per-node", type=int,
                   help=f"GPUs per node (spec.gpu.perNode; default: the GPU type's, "
                        f"{GPUS_PER_NODE}): TP stays within a node, PP spans nodes")
    p.add_argument("--target-concurrency", type=int, metavar="N",
                   help="concurrent requests of --max-model-len tokens to hold "
                        "(spec.sizing.targetConcurrency): picks TP, PP and the replicas at the "
                        f"fewest GPUs; default {DEFAULT_TARGET_CONCURRENCY}, or --max-num-seqs "
                        "on one replica")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--memory", help="pod memory limit for --device cpu (e.g. 4Gi)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                   help="host tier (spec.engine.kvOffloading.hostGiB)")
    p.add_argument("--kv-offloading-disk-size", type=float, metavar="GIB",
                   help="disk tier (spec.engine.kvOffloading.diskGiB)")
    for flag in ARCH_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int,
                       help="architecture of a model outside the catalog" if flag == "layers"
                       else argparse.SUPPRESS)
    p.add_argument("--output", choices=["table", "json"], default="table")
    p.set_defaults(func=run_plan)


def _add_operator(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "operator", help="run the KVInferenceService operator (kopf)",
        description="Reconcile KVInferenceService objects into Deployments, Services and HPAs.")
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", action="append", help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch the whole cluster")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="kopf liveness endpoint for the pod's probe")
    p.add_argument("--status-interval", type=float, default=30.0,
                   help="seconds between readiness refreshes of each service's status")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run_operator)


def register(subparsers: Any) -> None:
    """Add `plan`, `render` and `operator` to the top-level `kvserve` CLI."""
    from kvserve.operator import render

    _add_plan(subparsers)
    render.register(subparsers)
    _add_operator(subparsers)


def plan_body(args: argparse.Namespace) -> dict:
    """A KVInferenceService object equivalent to the plan flags."""
    model: dict = {"name": args.model}
    if Path(args.model).expanduser().is_dir():  # a local checkpoint: sized from its files
        model = {"name": Path(args.model).name, "uri": str(Path(args.model).expanduser().resolve())}
    if args.revision:
        model["revision"] = args.revision
    if args.layers is not None:
        model["architecture"] = {key: getattr(args, flag) for flag, key in ARCH_FLAGS.items()
                                 if getattr(args, flag) is not None}
    engine = {"blockSize": args.block_size, "gpuMemoryUtilization": args.gpu_memory_utilization,
              "kvCacheDtype": args.kv_cache_dtype, "dtype": args.dtype}
    for flag, key in (("max_model_len", "maxModelLen"), ("max_num_seqs", "maxNumSeqs")):
        if getattr(args, flag) is not None:
            engine[key] = getattr(args, flag)
    tiers = {key: getattr(args, flag) for flag, key in (("kv_offloading_size", "hostGiB"),
                                                         ("kv_offloading_disk_size", "diskGiB"))
             if getattr(args, flag) is not None}
    if tiers:
        engine["kvOffloading"] = tiers
    gpu: dict = {}
    if args.max_gpus_per_replica:
        gpu["maxPerReplica"] = args.max_gpus_per_replica
    if args.gpus_per_node:
        gpu["perNode"] = args.gpus_per_node
    if args.gpu:
        gpu["type"] = args.gpu
    if args.gpu_memory_gib:
        gpu["memoryGiB"] = args.gpu_memory_gib
    spec = {"model": model, "engine": engine, "gpu": gpu, "device": args.device}
    if args.target_concurrency:
        spec["sizing"] = {"targetConcurrency": args.target_concurrency}
    if args.memory:
        spec["resources"] = {"limits": {"memory": args.memory}}
    return {"metadata": {"name": "plan", "namespace": "default"}, "spec": spec}


def _cell(key: str, value: object) -> str:
    if isinstance(value, dict):  # kvOffloading: the tiers
        return ", ".join(f"{k} {_cell(k, v)}" for k, v in value.items())
    if isinstance(value, int) and key.endswith("Bytes"):
        return f"{value:,} ({value / (1 << 30):.2f} GiB)"
    return f"{value:,}" if isinstance(value, int) else str(value)


LAYOUT_COLUMNS = (("TP", "tensorParallelSize"), ("PP", "pipelineParallelSize"),
                  ("nodes", "nodesPerReplica"), ("GPUs/replica", "gpusPerReplica"),
                  ("concurrency", "maxConcurrency"), ("replicas", "replicas"),
                  ("GPUs", "totalGpus"))
SECTIONS = ("explanation", "alternatives", "warnings")


def layout_table(status: dict) -> list[str]:
    """The chosen layout and the rejected ones, one row each, with why."""
    chosen = {"tensorParallelSize": status["tensorParallelSize"],
              "pipelineParallelSize": status["pipelineParallelSize"],
              "nodesPerReplica": status["nodesPerReplica"],
              "gpusPerReplica": status["gpusPerReplica"],
              "maxConcurrency": min(status["maxConcurrency"], status["maxNumSeqs"]),
              "replicas": status["replicasForTarget"],
              "totalGpus": status["gpusPerReplica"] * status["replicasForTarget"],
              "verdict": "chosen"}
    rows = [[str(r[key]) if r["verdict"] in ("chosen", "more GPUs", "tie-break") or key in (
        "tensorParallelSize", "pipelineParallelSize", "nodesPerReplica", "gpusPerReplica")
             else "-" for _, key in LAYOUT_COLUMNS]
            + [r["verdict"] + (f" ({r['detail']})" if r.get("detail") else "")]
            for r in [chosen, *status["alternatives"]]]
    head = [name for name, _ in LAYOUT_COLUMNS] + ["verdict"]
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head) - 1)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths) + "  {}"
    return [f"layouts for {status['targetConcurrency']} concurrent requests:", fmt.format(*head),
            *(fmt.format(*row) for row in rows)]


def format_table(status: dict) -> str:
    rows = [(key, _cell(key, value)) for key, value in status.items() if key not in SECTIONS]
    width = max(len(key) for key, _ in rows)
    lines = [f"{key:<{width}}  {value}" for key, value in rows]
    if status.get("gpusPerReplica"):
        lines += ["", *layout_table(status)]
    lines += [f"warning: {w}" for w in status.get("warnings", [])]
    return "\n".join(lines + ["", status["explanation"]])


def run_plan(args: argparse.Namespace) -> int:
    from kvserve.operator.model_files import ModelReader
    from kvserve.operator.sizing import plan

    try:
        status = plan(parse_spec(plan_body(args), ModelReader(use_hf_cache=True))).as_status()
    except InvalidSpecError as exc:
        print(f"error ({exc.reason}): {exc}", file=sys.stderr)
        return 2
    print(json.dumps(status, indent=2) if args.output == "json" else format_table(status))
    return 0


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from kvserve.operator.handlers import build_registry
    from kvserve.operator.trust import install_log_redaction

    kopf.configure(verbose=args.verbose)
    install_log_redaction()
    kopf.run(registry=build_registry(status_interval=args.status_interval), standalone=True,
             clusterwide=args.all_namespaces, namespaces=args.namespace or (),
             liveness_endpoint=args.liveness)
    return 0
