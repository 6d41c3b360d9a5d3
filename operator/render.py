"""`kvserve render -f cr.yaml`: every child object the operator would apply for a
KVInferenceService, as YAML, without a cluster (a dry run for GitOps pipelines and reviews).

It calls children.build_children, the handlers' own path; the sizing goes to a header comment,
and so does the registration Secret, which the operator creates once with a random token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from kvserve.operator.crd import KIND


def _add_render(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "render", help="print the objects the operator would create for a KVInferenceService",
        description="Print, as YAML, every child object the operator applies for the "
                    "KVInferenceService(s) in FILE (its sizing in a comment); no cluster needed.")
    p.add_argument("-f", "--filename", required=True,
                   help="YAML file with one or more KVInferenceService objects ('-': stdin)")
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace for objects that name none (default: default)")
    p.set_defaults(func=run_render)


def register(subparsers: Any) -> None:
    _add_render(subparsers)


def load_services(text: str, namespace: str | None) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(text) if d]
    services = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if not services:
        raise ValueError(f"no {KIND} object in the file")
    for body in services:
        meta = body.setdefault("metadata", {})
        if namespace or "namespace" not in meta:
            meta["namespace"] = namespace or "default"
    return services


def render(text: str, namespace: str | None = None) -> str:
    """The YAML stream; InvalidSpecError (with the operator's own message) for a bad spec."""
    from kvserve.operator.children import build_children
    from kvserve.operator.model_files import ModelReader

    out = []
    for body in load_services(text, namespace):
        built = build_children(body, ModelReader())
        s = built.sizing.as_status()
        docs = [yaml.safe_dump(obj, sort_keys=False, width=100) for obj in built.objects]
        once = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in built.create_once)
        docs[0] = (f"# {body['metadata']['name']}: {s['gpusPerReplica']} GPU(s)/replica, "
                   f"{s['numBlocks']} KV blocks, max concurrency {s['maxConcurrency']}\n"
                   + (_pools_comment(built.spec) if built.spec.disaggregation else
                      _layout_comment(s))
                   + f"# not shown: {once} (created once by the operator, random token)\n"
                   + docs[0])
        out += docs
    return "---\n".join(out)


def _pools_comment(spec: Any) -> str:
    """spec.disaggregation: the two pools (the figures above are a decode replica's)."""
    dis = spec.disaggregation
    return (f"# prefill/decode pools ({dis.workload}): {dis.prefill.replicas} prefill + "
            f"{dis.decode.replicas} decode replica(s); the figures above are a decode "
            "replica's, both pools' arithmetic is in the ConfigMap's sizing.json\n")


def _layout_comment(s: dict) -> str:
    """The parallel layout, and the LeaderWorkerSet when a replica spans nodes."""
    if not s.get("gpusPerReplica"):
        return ""
    nodes = s["nodesPerReplica"]
    where = (f"{nodes} nodes of {s['gpusPerNode']} GPUs: a LeaderWorkerSet group per replica"
             if nodes > 1 else "one node: a Deployment pod per replica")
    return (f"# TP {s['tensorParallelSize']} x PP {s['pipelineParallelSize']} on {where}; "
            f"{s['replicasForTarget']} replica(s) hold {s['targetConcurrency']} requests\n"
            + "".join(f"# warning: {w}\n" for w in s.get("warnings", [])))


def run_render(args: argparse.Namespace) -> int:
    from kvserve.operator.spec import InvalidSpecError

    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
        sys.stdout.write(render(text, args.namespace))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        reason = getattr(exc, "reason", "error") if isinstance(exc, InvalidSpecError) else "error"
        print(f"kvserve render: {reason}: {exc}", file=sys.stderr)
        return 2
    return 0
