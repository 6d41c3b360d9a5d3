"""malloc_tuning: activation-sized CPU tensors come from glibc's heap, which is never trimmed,
so a step does not page-fault its activations in again (each case in a fresh process, since
mallopt settings are process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = r"""
import sys, torch
from kvserve.engine.worker.malloc_tuning import keep_activation_memory
tuned = keep_activation_memory() if sys.argv[1] == "1" else False

def heap():
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                return lo, hi
    return 0, 0

x = torch.ones(2048, 3072)  # 25 MB: a 2,048-token prefill's gate/up output
lo, hi = heap()
inside = lo <= x.data_ptr() < hi
size_with = hi - lo
del x
lo, hi = heap()
print(tuned, inside, size_with >= 25 << 20 and hi - lo >= 25 << 20)
"""


def _run(tune: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, tune], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_activations_come_from_a_heap_that_is_kept():
    tuned, inside, kept = _run("1")
    assert tuned == "True"
    assert inside == "True"  # served from the heap, not a fresh mmap
    assert kept == "True"  # and the heap still holds it after the tensor is freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_glibc_default_maps_such_tensors_apart():
    # The contrast that makes the test above mean something: untuned, the same tensor is an
    # mmap of its own (unmapped again on free).
    tuned, inside, _ = _run("0")
    assert (tuned, inside) == ("False", "False")


def test_opt_out(monkeypatch):
    from kvserve.engine.worker import malloc_tuning

    monkeypatch.setenv("KVSERVE_CPU_MALLOC_TUNE", "0")
    malloc_tuning.keep_activation_memory.cache_clear()
    try:
        assert malloc_tuning.keep_activation_memory() is False
    finally:
        malloc_tuning.keep_activation_memory.cache_clear()
