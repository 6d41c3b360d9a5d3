"""KV offloading (spec.engine.kvOffloading): the engine's host and disk tiers for evicted prefix
blocks, as pod memory, a scratch volume (or claim) and `kvserve serve` flags.

The host tier lives in the engine process's memory, outside the device budget, so its GiB are
added on top of the pod's memory request and limit; on CPU pods the KV budget stays what the
user's limit allows, the tier comes on top of it. The disk tier is a directory the engine caps
itself; an emptyDir's sizeLimit (and ephemeral-storage request) makes the kubelet agree. Pure:
no Kubernetes, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.quantity import GiB, parse_quantity, quantity

DISK_PATH = "/var/cache/kvserve/kv"
VOLUME = "kv-offload"
Obj = dict[str, Any]


@dataclass(frozen=True)
class KVOffloading:
    host_gib: float = 0.0
    disk_gib: float = 0.0
    disk_claim_name: str | None = None  # an existing claim for the disk tier instead of emptyDir

    @property
    def host_bytes(self) -> int:
        return int(self.host_gib * GiB)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gib * GiB)


def parse(o: dict | None, prefix_caching: bool, max_replicas: int) -> KVOffloading | None:
    """spec.engine.kvOffloading, refused where the engine would refuse it at start (the same
    rules as EngineConfig's checks), so the CR shows why instead of a crash-looping pod."""
    if not o:
        return None
    kv = KVOffloading(float(o.get("hostGiB", 0)), float(o.get("diskGiB", 0)),
                      o.get("diskClaimName"))
    where = "spec.engine.kvOffloading"
    if kv.disk_gib and not kv.host_gib:
        raise InvalidSpecError(
            f"{where}.diskGiB {kv.disk_gib:g} needs hostGiB > 0: the disk tier keeps the blocks "
            "the host tier evicts, so there is none without it; set hostGiB or drop diskGiB",
            reason="KVOffloadingWithoutHostTier")
    if kv.disk_claim_name and not kv.disk_gib:
        raise InvalidSpecError(f"{where}.diskClaimName needs diskGiB (the engine's cap of the "
                               "directory on the claim)")
    if kv.host_gib and not prefix_caching:
        raise InvalidSpecError(f"{where}.hostGiB keeps evicted prefix-cache blocks, so it needs "
                               "spec.engine.enablePrefixCaching true")
    if kv.disk_claim_name and max_replicas > 1:
        raise InvalidSpecError(
            f"{where}.diskClaimName is one engine's directory, but up to {max_replicas} engine "
            "replicas may run; drop diskClaimName (each pod then gets an emptyDir) or run one "
            "replica without autoscaling")
    return kv if kv.host_gib or kv.disk_gib else None


def check(kv: KVOffloading | None, bytes_per_block: int, gpus: int) -> None:
    """What only the sizing knows: a host tier must hold a block; the disk tier is one rank's."""
    if kv is None:
        return
    if kv.host_bytes < bytes_per_block:
        raise InvalidSpecError(
            f"spec.engine.kvOffloading.hostGiB {kv.host_gib:g} holds no KV block of "
            f"{bytes_per_block} bytes; raise it", reason="KVOffloadingTooSmall")
    if kv.disk_gib and gpus > 1:
        raise InvalidSpecError(
            f"spec.engine.kvOffloading.diskGiB: the engine's disk tier supports one rank, but the "
            f"sizing needs {gpus} GPUs per replica; drop diskGiB or fit the model on one GPU",
            reason="KVOffloadingDiskNeedsOneRank")


def engine_args(kv: KVOffloading | None) -> list[str]:
    if kv is None:
        return []
    args = ["--kv-offloading-size", f"{kv.host_gib:g}"]
    if kv.disk_gib:
        args += ["--kv-offloading-disk-path", DISK_PATH,
                 "--kv-offloading-disk-size", f"{kv.disk_gib:g}"]
    return args


def _add(res: Obj, name: str, extra: int) -> None:
    """Add `extra` bytes to resource `name` in requests and limits where the user set it; a
    request appears if neither is set, so the scheduler reserves at least the tier."""
    present = [k for k in ("requests", "limits") if name in res.get(k, {})]
    for k in present:
        res[k][name] = quantity(parse_quantity(res[k][name]) + extra)
    if not present:
        res.setdefault("requests", {})[name] = quantity(extra)


def add_resources(kv: KVOffloading | None, res: Obj) -> Obj:
    """The engine container's resources with the host tier's memory (and an emptyDir disk
    tier's ephemeral storage) on top."""
    if kv is None:
        return res
    _add(res, "memory", kv.host_bytes)
    if kv.disk_gib and not kv.disk_claim_name:
        _add(res, "ephemeral-storage", kv.disk_bytes)
    return res


def volume(kv: KVOffloading | None) -> tuple[Obj, Obj] | None:
    """(volume, mount) of the disk tier, or None without one."""
    if kv is None or not kv.disk_gib:
        return None
    source: Obj = {"persistentVolumeClaim": {"claimName": kv.disk_claim_name}} \
        if kv.disk_claim_name else {"emptyDir": {"sizeLimit": quantity(kv.disk_bytes)}}
    return {"name": VOLUME, **source}, {"name": VOLUME, "mountPath": DISK_PATH}


def strategy(kv: KVOffloading | None) -> Obj | None:
    """Recreate for a disk tier on a claim: the engine locks its directory, so a surge pod next
    to the old one would crash-loop and the rollout never finish. None: the usual rolling
    update."""
    if kv is None or not kv.disk_claim_name:
        return None
    return {"type": "Recreate"}


def status(kv: KVOffloading | None, bytes_per_block: int) -> dict:
    """status.sizing.kvOffloading (and `kvserve plan`)."""
    if kv is None:
        return {}
    out = {"hostBytes": kv.host_bytes, "hostBlocks": kv.host_bytes // max(bytes_per_block, 1),
           "diskBytes": kv.disk_bytes}
    if kv.disk_gib:
        out["diskVolume"] = f"pvc/{kv.disk_claim_name}" if kv.disk_claim_name else "emptyDir"
    return out


def words(kv: KVOffloading | None, bytes_per_block: int) -> str:
    """The explanation's tail."""
    if kv is None:
        return ""
    text = (f"; KV offloading: host tier {kv.host_gib:g} GiB = "
            f"{kv.host_bytes // max(bytes_per_block, 1)} blocks (added to the pod's memory)")
    if kv.disk_gib:
        where = f"claim {kv.disk_claim_name}" if kv.disk_claim_name else "an emptyDir"
        text += f", disk tier {kv.disk_gib:g} GiB on {where} at {DISK_PATH}"
    return text
