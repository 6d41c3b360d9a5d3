"""OpenMP's spin-wait on a CPU, set for kvserve's processes before torch loads libgomp.

torch's CPU ops run on libgomp's thread team. Between two parallel regions a team thread spins
before it sleeps: 300,000 iterations by default (GOMP_SPINCOUNT), cut to 1,000 only when a process
runs more OpenMP threads than it has CPUs. A process with one team as wide as the machine (the
offline `LLM`, the engine core in its own process) keeps the long spin. Alone on the machine that
costs nothing, but beside any other busy process (a server's API process, clients, a neighbour
pod) every spinning thread holds a CPU the thread it waits for needs: a decode step took 8-15x
the CPU time and throughput fell 20x (docs/perf/server.md). The short count costs a fifth to a
third of the throughput on an idle machine, so kvserve asks for it unless the user set one
(`GOMP_SPINCOUNT=10000` on exclusive cores): at `import kvserve` while torch is not loaded
yet, and in the environment its spawned children (the engine core, tensor-parallel ranks) start
with. Intel's OpenMP runtime (KMP_BLOCKTIME) is not touched.

And how many threads: the container's CPU quota, not the node's CPUs (rank_threads, below;
worker/startup.py's size_torch_threads applies it). Torch-free: `import kvserve` loads it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("kvserve.engine")

SPIN_ENV = "GOMP_SPINCOUNT"
SPIN_DEFAULT = "1000"  # libgomp's throttled count (the one it picks itself when oversubscribed)
OPT_OUT_ENV = "KVSERVE_OMP_SPIN_DEFAULT"  # "0": leave libgomp's defaults alone


def _wanted() -> bool:
    return os.environ.get(OPT_OUT_ENV, "1") != "0" and SPIN_ENV not in os.environ \
        and "OMP_WAIT_POLICY" not in os.environ


def set_spin_default() -> bool:
    """Set GOMP_SPINCOUNT for this process if torch (and so libgomp) is not loaded yet and the
    user chose nothing; True if set."""
    if not _wanted() or "torch" in sys.modules:
        return False
    os.environ[SPIN_ENV] = SPIN_DEFAULT
    return True


def warn_if_long_spin() -> bool:
    """On a CPU engine's start: say so when libgomp keeps its long spin because torch was loaded
    before kvserve (a script importing torch first) and the user chose nothing; True if said."""
    if not _wanted():
        return False
    logger.warning("OpenMP keeps libgomp's long spin-wait (torch was imported before kvserve): "
                   "beside any other busy process this engine can slow 10x or more. Set %s=%s "
                   "in the environment, or import kvserve before torch (%s=0 silences this)",
                   SPIN_ENV, SPIN_DEFAULT, OPT_OUT_ENV)
    return True


@contextlib.contextmanager
def spin_default_for_children() -> Iterator[None]:
    """While a child process is spawned: the short spin in the environment it starts with (a
    forked child shares this process's libgomp settings instead)."""
    if not _wanted():
        yield
        return
    os.environ[SPIN_ENV] = SPIN_DEFAULT
    try:
        yield
    finally:
        if os.environ.get(SPIN_ENV) == SPIN_DEFAULT:
            del os.environ[SPIN_ENV]


# ---------------------------------------------------------------------------- thread count
# torch starts one intra-op thread per CPU it can see: the affinity mask, not a container's CPU
# quota. A pod limited to 2 CPUs on a 64-core node would run 32-64 OpenMP threads on 2 CPUs'
# worth of time, and a parallel region waits for its slowest, throttled thread. So on the CPU the
# engine takes the smaller of the affinity mask and the cgroup quota (as vLLM's CPU backend asks
# its users to bind threads), split across tensor-parallel ranks; OMP_NUM_THREADS wins when set.


def cpu_quota(proc: Path = Path("/proc"),
              cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[float, str] | None:
    """(CPUs, words) of the tightest CPU quota over this process's cgroup and its ancestors:
    v2 `cpu.max` ("quota period"), v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None without."""
    from kvserve.engine.sizing.host_memory import cgroup_dirs

    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best: tuple[float, str] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mounts = [(cgroup, "v2"), (cgroup / "unified", "v2")]
        elif "cpu" in controllers.split(","):
            mounts = [(cgroup / controllers, "v1"), (cgroup / "cpu", "v1")]
        else:
            continue
        for mount, kind in mounts:
            for d in cgroup_dirs(mount, path):
                cpus = _quota_v2(d) if kind == "v2" else _quota_v1(d)
                if cpus is not None and (best is None or cpus < best[0]):
                    best = (cpus, f"cgroup {kind} CPU quota {cpus:g} at {d}")
    return best


def _quota_v2(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cpus(proc: Path = Path("/proc"),
                cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """(CPUs this process may keep busy, why): the affinity mask, lowered to a CPU quota's whole
    CPUs (at least 1)."""
    try:
        mask = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mask = os.cpu_count() or 1
    quota = cpu_quota(proc, cgroup)
    if quota is not None and max(1, math.floor(quota[0])) < mask:
        return max(1, math.floor(quota[0])), quota[1]
    return mask, f"{mask} CPU(s) in the affinity mask"


def rank_threads(ranks: int = 1, usable: tuple[int, str] | None = None) -> tuple[int, str]:
    """torch threads for each of `ranks` processes sharing this host's usable CPUs:
    OMP_NUM_THREADS when set, else the CPUs split evenly (at least 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cpus, why = usable if usable is not None else usable_cpus()
    return max(1, cpus // ranks), why + (f", split over {ranks} ranks" if ranks > 1 else "")
