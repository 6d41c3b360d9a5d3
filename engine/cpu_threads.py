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
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

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
