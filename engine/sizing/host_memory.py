"""One memory plan per host: what every rank of one server takes from the machine's RAM, summed
and checked against the memory actually available before any rank allocates.

On the CPU the N tensor-parallel ranks share one machine, so the KV cache (by default, or as
`kv_cache_memory`), the swap pool (`swap_space`) and the host tier (`kv_offloading_size`) are
budgets for the whole server, split across the ranks; each rank also holds 1/N of the weights and
its activation peak. On CUDA the weights, KV cache and activations live on the GPUs and only the
swap pool and the host tier are charged to the host.

    per rank  = weights / N + activations + kv / N + min(swap / N, kv / N) + host_tier / N
    host      = N x per rank                 (CPU; CUDA: N x (swap + host tier) per rank)
    available = min(MemAvailable, cgroup limit - cgroup usage)   (v2 memory.max, v1 limit_in_bytes)

The swap pool never holds more blocks than the device cache (a swapped sequence came from there).
Pure arithmetic plus two file readers whose roots are parameters; the operator's CPU sizing calls
`cpu_kv_bytes` with the pod's memory limit as the available figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.engine.errors import ConfigError

GiB = 1 << 30
CPU_KV_DEFAULT_CAP = 4 * GiB  # the default CPU KV budget (whole server): min(25% available, this)
UNLIMITED = 1 << 60  # cgroup "max" / v1's page-rounded 2**63


class HostMemoryError(ConfigError):
    """The server's memory plan does not fit in the memory available on this host."""


@dataclass(frozen=True)
class Available:
    """Memory this server may still take, and where the figure came from (for messages)."""

    bytes: int
    source: str


@dataclass(frozen=True)
class HostPlan:
    """Bytes each of `ranks` ranks takes from host RAM (the terms a rank holds on the host)."""

    ranks: int
    on_cpu: bool  # weights, activations and KV in host RAM (else on the GPUs)
    weight_bytes: int  # per rank
    activation_bytes: int  # per rank
    kv_bytes: int  # per rank
    swap_bytes: int  # per rank (capped at kv_bytes on the CPU)
    host_tier_bytes: int  # per rank

    @property
    def rank_host_bytes(self) -> int:
        """One rank's host RAM: on CUDA only its swap pool and host tier."""
        device = self.weight_bytes + self.activation_bytes + self.kv_bytes if self.on_cpu else 0
        return device + self.swap_bytes + self.host_tier_bytes

    @property
    def host_bytes(self) -> int:
        return self.ranks * self.rank_host_bytes

    def terms(self) -> list[tuple[str, int, str]]:
        """(name, bytes per rank, the flag that sets it) of each term charged to the host."""
        out = [("weights", self.weight_bytes, "--model / --dtype / --quantization"),
               ("activations", self.activation_bytes, "--max-num-batched-tokens / --max-num-seqs"),
               ("KV cache", self.kv_bytes, "--kv-cache-memory")] if self.on_cpu else []
        return out + [("swap", self.swap_bytes, "--swap-space"),
                      ("host tier", self.host_tier_bytes, "--kv-offloading-size")]

    def describe(self) -> str:
        """The arithmetic: `3 ranks x (weights 0.06 + ... ) GiB = 1.23 GiB`."""
        parts = " + ".join(f"{name} {b / GiB:.2f}" for name, b, _ in self.terms())
        return (f"{self.ranks} rank{'s' if self.ranks > 1 else ''} x ({parts}) GiB = "
                f"{self.host_bytes / GiB:.2f} GiB of host memory")

    def check(self, available: Available) -> None:
        """HostMemoryError with the arithmetic and the flag to change when the plan does not fit."""
        if self.host_bytes <= available.bytes:
            return
        name, biggest, flag = max(self.terms(), key=lambda t: t[1])
        over = self.host_bytes - available.bytes
        raise HostMemoryError(
            f"the memory plan does not fit this host: {self.describe()}, but only "
            f"{available.bytes / GiB:.2f} GiB is available ({available.source}); "
            f"{over / GiB:.2f} GiB over. The largest term is {name} "
            f"({biggest / GiB:.2f} GiB per rank): lower {flag} (a budget for the whole server, "
            f"split across the ranks), or use fewer --tensor-parallel-size ranks")


def split(total_bytes: int, ranks: int) -> int:
    """A whole-server budget's share on each of `ranks` ranks."""
    return max(total_bytes, 0) // max(ranks, 1)


def default_cpu_kv_bytes(available_bytes: int) -> int:
    """The CPU KV cache when the user sets none, for the whole server: a quarter of what is
    available, at most CPU_KV_DEFAULT_CAP."""
    return min(max(available_bytes, 0) // 4, CPU_KV_DEFAULT_CAP)


def plan_host(*, ranks: int, on_cpu: bool, weight_bytes: int, activation_bytes: int,
              kv_bytes: int, swap_bytes: int, host_tier_bytes: int) -> HostPlan:
    """The plan of one server. `weight_bytes` is the whole model's, `activation_bytes` one rank's
    peak, `kv_bytes` one rank's cache (CPU: the whole server's budget / ranks; 0 on CUDA, where
    it is not host memory), `swap_bytes` and `host_tier_bytes` whole-server budgets."""
    kv = max(kv_bytes, 0)
    swap = split(swap_bytes, ranks)
    return HostPlan(ranks=ranks, on_cpu=on_cpu, weight_bytes=-(-weight_bytes // max(ranks, 1)),
                    activation_bytes=activation_bytes, kv_bytes=kv,
                    swap_bytes=min(swap, kv) if on_cpu else swap,
                    host_tier_bytes=split(host_tier_bytes, ranks))


def cpu_kv_bytes(*, available_bytes: int, ranks: int, weight_bytes: int, activation_bytes: int,
                 swap_bytes: int, host_tier_bytes: int) -> int:
    """The largest whole-server KV cache whose plan fits in `available_bytes` (the operator's
    CPU pod: its memory limit x utilisation). Swap is capped at the KV cache, so it is charged
    in full only when the KV cache is at least as large."""
    rest = available_bytes - ranks * (-(-weight_bytes // ranks) + activation_bytes) \
        - host_tier_bytes
    if rest <= 0:
        return 0
    return max(rest - swap_bytes, rest // 2)  # the largest kv with kv + min(swap, kv) <= rest


# ---------------------------------------------------------------------------- what is available


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def mem_available(proc: Path = Path("/proc")) -> int | None:
    """MemAvailable from `proc`/meminfo, in bytes (None when unreadable)."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder and its ancestors up to the mount, those that exist (inside a
    container the process's path may not exist under the namespace's mount: its root is it)."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def cgroup_headroom(proc: Path = Path("/proc"),
                    cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """(limit - usage, words) of the tightest memory limit over this process's cgroup and its
    ancestors, v2 (memory.max / memory.current) or v1 (memory.limit_in_bytes / usage_in_bytes);
    None when no level sets a limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified
            mounts = [(cgroup, "memory.max", "memory.current", "cgroup v2"),
                      (cgroup / "unified", "memory.max", "memory.current", "cgroup v2")]
        elif "memory" in controllers.split(","):
            mounts = [(cgroup / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                       "cgroup v1")]
        else:
            continue
        for mount, limit_file, usage_file, kind in mounts:
            for d in cgroup_dirs(mount, path):
                limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
                if limit is None or limit >= UNLIMITED or usage is None:
                    continue
                room = limit - usage
                if best is None or room < best[0]:
                    best = (room, f"{kind} limit {limit / GiB:.2f} GiB - {usage / GiB:.2f} GiB "
                                  f"used at {d}")
    return best


def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup"),
                     override: int | None = None) -> Available:
    """What this server may still take: `override` (KVSERVE_HOST_MEMORY) when given, else the
    smaller of MemAvailable and the cgroup's headroom."""
    if override is not None:
        return Available(override, "KVSERVE_HOST_MEMORY")
    figures: list[tuple[int, str]] = []
    avail = mem_available(proc)
    if avail is not None:
        figures.append((avail, "MemAvailable"))
    room = cgroup_headroom(proc, cgroup)
    if room is not None:
        figures.append(room)
    if not figures:
        return Available(UNLIMITED, "unknown: no /proc/meminfo and no cgroup limit")
    return Available(*min(figures))
