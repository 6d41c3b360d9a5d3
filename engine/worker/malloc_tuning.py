"""CPU engines keep their activation memory mapped: glibc's malloc is told to serve tensors of
up to 32 MiB from its heap and never to hand freed heap back to the kernel.

torch has no caching allocator on the CPU. With glibc's defaults a step's big activations (a
long prefill's gate/up outputs and MLP products are tens of MB each) are mmap'ed and munmap'ed
call after call, or carved from a heap top that is trimmed on free, so every step page-faults
its activations in again, as freshly zeroed pages, and a prefill step spends much of its time
in the kernel (docs/perf.md). With both settings the pages stay mapped from one step to the
next. The price is that the process keeps its peak activation memory, as a GPU engine keeps its
memory pool. `KVSERVE_CPU_MALLOC_TUNE=0` leaves
glibc's defaults (e.g. when jemalloc or tcmalloc is preloaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger("kvserve.engine")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_NEVER = 2**31 - 1  # mallopt takes an int


@functools.cache
def keep_activation_memory() -> bool:
    """Apply the two mallopt settings once per process; False where glibc is not the allocator
    or the user opted out."""
    if os.environ.get("KVSERVE_CPU_MALLOC_TUNE", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_NEVER))
    if not ok:
        logger.info("mallopt refused the activation-memory settings; glibc defaults kept")
    return ok
