"""The CPU backend: decode and prefill rows through fused C++ kernels that read the block table.

Decode is memory-bound. The torch path copies each sequence's blocks into a workspace before
two batched matmuls read them (about 3x the bytes contiguous SDPA moves); the decode kernel
(csrc/cpu_decode_attention.cpp) reads K and V once, in place, with an online softmax. The
prefill kernel (csrc/cpu_prefill_attention.cpp) serves every row of a sequence with more than one
new token: tiles of PREFILL_TILE_ROWS tokens x one KV head, each key block a small GEMM, with the
causal limit per row, where the torch path runs a Python loop of small bmm's per sequence. On
CPUs with AVX512-BF16 both kernels multiply bf16 K/V without widening them.

The kernels are compiled on first use with torch's own extension builder (ninja + the system C++
compiler, -O3 -march=native -fno-trapping-math) into `$KVSERVE_CACHE/torch_extensions/<cpu>`,
once per machine and source version, so only the first engine start pays the build. When that
is impossible (no compiler, KVSERVE_CPU_KERNEL=0) `available()` is False, the reason is logged
once, and "auto" falls back to the torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path

import torch

from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.plan import AttentionPlan
from kvserve.paths import cache_root

logger = logging.getLogger("kvserve.kernels")
CSRC = Path(__file__).parent / "csrc"
# One extension: the decode and prefill kernels and the fused elementwise ops (csrc/cpu_ops.cpp,
# used through kernels/cpu_ops.py) are built and loaded together.
SOURCES = (CSRC / "cpu_decode_attention.cpp", CSRC / "cpu_prefill_attention.cpp",
           CSRC / "cpu_ops.cpp", CSRC / "cpu_quant.cpp", CSRC / "cpu_lora.cpp")
HEADERS = (CSRC / "fast_exp.h", CSRC / "bf16.h", CSRC / "cpu_attention_common.h")
# -fno-trapping-math lets GCC if-convert (and so vectorise) loops with a select or a clamp in
# them, such as silu's sigmoid: no result changes, we never read the FP exception flags.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]


def _cflags() -> list[str]:
    """KVSERVE_CPU_KERNEL_SIMD=0 builds the portable loops only (what a CPU without AVX2 runs)."""
    no_simd = os.environ.get("KVSERVE_CPU_KERNEL_SIMD", "1") == "0"
    return CFLAGS + (["-DKVSERVE_NO_SIMD"] if no_simd else [])


def _build_dir() -> Path:
    """One build per source, flags, CPU model (-march=native code is CPU-specific) and torch
    install, and where the sources lie: the build points at its torch's headers and libraries
    and at the source files by path, so two virtual environments or two checkouts sharing one
    folder would rebuild over each other at every start."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) +
                         " ".join(_cflags()).encode() + cpu.encode() +
                         torch.__version__.encode() + torch.__file__.encode() +
                         str(CSRC.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "torch_extensions" / f"cpu_decode_{key}"


@functools.cache
def available() -> bool:
    """Build (once per machine) and load the kernel; False, with the reason logged, if it cannot."""
    if os.environ.get("KVSERVE_CPU_KERNEL", "1") == "0":
        logger.info("CPU decode kernel disabled (KVSERVE_CPU_KERNEL=0): torch path")
        return False
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        if not (build / "kvserve_cpu_decode.so").exists():
            logger.info("building the CPU paged-attention kernel into %s (once per machine)", build)
        with build_lock(build):
            cpp_extension.load(name="kvserve_cpu_decode", sources=[str(p) for p in SOURCES],
                               extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                               build_directory=str(build), is_python_module=False,
                               verbose=False)
        return hasattr(torch.ops.kvserve_cpu, "paged_decode") and \
            hasattr(torch.ops.kvserve_cpu, "paged_prefill") and \
            hasattr(torch.ops.kvserve_ops, "rms_norm")
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("CPU paged-attention kernel unavailable (%s: %s); using the torch path",
                       type(exc).__name__, " | ".join(str(exc).strip().splitlines()[-3:]))
        return False


@contextlib.contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Serialise builds of one build folder with an flock, and clear a stale torch baton.

    torch's own build lock is a plain `lock` file (a FileBaton): a build killed mid-way (a test
    timeout, an OOM kill, a pod stopped during its first start) leaves it behind, and every later
    process waits on it forever. An flock dies with its process, so whoever holds it knows no
    other kvserve build is running and any `lock` file left there is stale.
    """
    with open(build / "kvserve.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = build / "lock"
            if baton.exists():
                logger.warning("removing a stale build lock %s (a build was killed)", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ninja_on_path() -> None:
    """torch calls `ninja` from PATH; the PyPI wheel's binary is not there unless the venv is
    activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def _fp8_table() -> torch.Tensor:
    """float32 value of each e4m3 byte (NaN codes included)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()


_NO_TABLE = torch.empty(0)
# New tokens per prefill task: each key block the kernel reads serves rows x group query vectors
# (32 x 3 for the default model); larger tiles also mean fewer, longer tasks to balance.
PREFILL_TILE_ROWS = 32


def cpu_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        plan: AttentionPlan, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0, *, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference_paged_attention. The decode kernel takes a sliding window
    (it starts at the window's first block); the prefill kernel does not, so a windowed layer's
    prefill rows, and every row of a layer with a soft cap or sinks, run the torch path (same
    results)."""
    if logits_soft_cap is not None or sinks is not None:
        from kvserve.kernels.torch_attention import torch_paged_attention

        return torch_paged_attention(q, k_cache, v_cache, plan, scale, k_scale, v_scale,
                                     sliding_window=sliding_window,
                                     logits_soft_cap=logits_soft_cap, sinks=sinks)
    parts = _parts(plan)
    if k_cache.dtype == FP8_DTYPE:
        kc, vc, table = k_cache.view(torch.uint8), v_cache.view(torch.uint8), _fp8_table()
        qk_scale, out_scale = scale * k_scale, v_scale
    else:  # scales describe fp8 storage only
        kc, vc, table, qk_scale, out_scale = k_cache, v_cache, _NO_TABLE, scale, 1.0
    # The kernels read and write float32 or bfloat16 rows; float16 goes through float32.
    native = q.dtype in (torch.float32, torch.bfloat16)
    qk = q.contiguous() if native else q.float()
    out = torch.empty_like(qk)
    if parts["seq_ids"].numel():
        torch.ops.kvserve_cpu.paged_decode(qk, kc, vc, parts["block_tables"], parts["seq_lens"],
                                           parts["seq_ids"], parts["rows"], table, qk_scale,
                                           out_scale, sliding_window or 0, out)
    if sliding_window is not None and parts["tiles"].numel():
        from kvserve.kernels.torch_attention import torch_paged_attention

        torch_paged_attention(qk, k_cache, v_cache, plan, scale, k_scale, v_scale, out=out,
                              decode=False, sliding_window=sliding_window)
    elif parts["tiles"].numel():
        torch.ops.kvserve_cpu.paged_prefill(qk, kc, vc, parts["block_tables"], parts["tiles"],
                                            table, qk_scale, out_scale, out)
    return out if native else out.to(q.dtype)


def _parts(plan: AttentionPlan) -> dict:
    """Decode sequence ids and their q rows, prefill tiles, int32 tables, once per plan."""
    if "cpu" not in plan.parts:
        seqs = [s for s in range(plan.num_seqs) if plan.query_lens[s] == 1]
        device = plan.block_tables.device
        starts = plan.query_start_loc.tolist()
        plan.parts["cpu"] = {
            "seq_ids": torch.tensor(seqs, dtype=torch.long, device=device),
            "rows": torch.tensor([starts[s] for s in seqs], dtype=torch.long, device=device),
            "tiles": _prefill_tiles(plan, starts),
            "block_tables": plan.block_tables.to(torch.int32).contiguous(),
            "seq_lens": plan.seq_lens_t.to(torch.int32).contiguous(),
        }
    return plan.parts["cpu"]  # type: ignore[return-value]


def _prefill_tiles(plan: AttentionPlan, starts: list[int]) -> torch.Tensor:
    """int64 [n, 4] (sequence, first q row, rows, position of that row) for the sequences with
    more than one new token, cut into tiles of PREFILL_TILE_ROWS, the costliest first (the
    kernel hands them out in this order)."""
    tiles = []
    for s in range(plan.num_seqs):
        n = plan.query_lens[s]
        if n < 2:
            continue
        context = plan.seq_lens[s] - n
        for r in range(0, n, PREFILL_TILE_ROWS):
            rows = min(PREFILL_TILE_ROWS, n - r)
            tiles.append((s, starts[s] + r, rows, context + r))
    tiles.sort(key=lambda t: -t[2] * (t[3] + t[2]))  # ~ rows x keys seen
    return torch.tensor(tiles, dtype=torch.long).reshape(-1, 4)
