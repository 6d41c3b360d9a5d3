"""A replica over several nodes: one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1,
kubernetes-sigs/lws) group per replica instead of a Deployment pod.

The sizing (sizing.py) chose TP within a node and PP stages across `nodes_per_replica` pods of
`gpus_per_pod` GPUs each. Pod 0 of a group, the leader, runs the API server and the driver
(`kvserve serve ... --pipeline-parallel-size P --tensor-parallel-size T`); pods 1.. run
`kvserve serve --headless ...` (their ranks, no API server). LWS's pod webhook puts
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX first in every container's env; the
engine reads its rank from them (engine/worker/rank_env.py) and MASTER_PORT. The worker index
also comes through the downward API (the pod's worker-index label) so the spec says where it
comes from; the command channel's key (KVSERVE_GROUP_KEY) is the service's registration Secret,
never derived from an address. A dead pod or container recreates the whole group
(RecreateGroupOnPodRestart):
ranks cannot rejoin a running torch.distributed world.

Leaders keep the engine component label, so the Service, router, HPA selector, PDB, network
policy and InferencePool see leaders only; workers are `engine-worker`. Each pod holds whole
pipeline stages (whole TP groups), so no LWS sub-groups are needed; one headless Service
(subdomainPolicy Shared) names the pods.
"""

from __future__ import annotations

import copy
from typing import Any

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
WORKER_COMPONENT = "engine-worker"
MASTER_PORT = 29500  # torch.distributed's rendezvous on the leader (rank_env.DEFAULT_MASTER_PORT)
COMMAND_PORT = MASTER_PORT + 1  # the leader's command channel to worker hosts (remote.py)
Obj = dict[str, Any]


GROUP_KEY_ENV = "KVSERVE_GROUP_KEY"  # the command channel's shared secret (remote.py)


def rank_env(nodes: int, group_key: Obj | None = None) -> list[Obj]:
    """What the engine reads to find its place in the group (LWS sets the same names first),
    and the command channel's key from a Secret (`group_key`: a secretKeyRef env entry)."""
    return [*([group_key] if group_key else []),
        {"name": "LWS_WORKER_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{WORKER_INDEX_LABEL}']"}}},
        {"name": "LWS_GROUP_SIZE", "value": str(nodes)},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
    ]


def group_ports() -> list[Obj]:
    return [{"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"},
            {"name": "command", "containerPort": COMMAND_PORT, "protocol": "TCP"}]


def leader_container(container: Obj, nodes: int, group_key: Obj | None = None) -> Obj:
    """The engine container as the group's leader: the API server plus the rendezvous."""
    c = copy.deepcopy(container)
    c["env"] = [*rank_env(nodes, group_key), *c["env"]]
    c["ports"] = [*c["ports"], *group_ports()]
    return c


def worker_container(container: Obj, nodes: int, group_key: Obj | None = None) -> Obj:
    """The engine container as a worker host: `--headless`, no HTTP port, no HTTP probes (a
    failed rank ends the group; the leader's /health says why and LWS recreates the group)."""
    c = copy.deepcopy(container)
    args = c["args"]
    c["args"] = [args[0], "--headless", *args[1:]]
    c["env"] = [*rank_env(nodes, group_key), *c["env"]]
    c["ports"] = group_ports()
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        c.pop(key, None)
    return c


def leader_worker_set(meta: Obj, replicas: int, nodes: int, leader: Obj, worker: Obj) -> Obj:
    """leader/worker: pod templates ({metadata, spec}) built by resources.py."""
    return {
        "apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxUnavailable": 0, "maxSurge": 1}},  # as the Deployment: no capacity dip
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def group_policy(meta: Obj, instance_selector: dict[str, str], group: str) -> Obj:
    """Ranks of a group reach each other on every port (the rendezvous, the command channel,
    NCCL's own sockets): an ingress rule from the pods of the same LeaderWorkerSet."""
    pods = {**instance_selector, "leaderworkerset.sigs.k8s.io/name": group}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchLabels": pods}}]}]}}
