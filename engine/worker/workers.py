"""Tensor-parallel worker processes: the engine's process is rank 0 (the driver); it spawns ranks
1..N-1, each loading its shard of the weights and, once the driver has sized the cache, its own KV
cache for its KV heads. Then each worker replays what the driver broadcasts (a step's inputs,
block moves, fp8 calibration, LoRA slots, the decode-graph capture) and takes part in the model's
collectives; only the driver samples.

The command channel is one pipe per worker, not a collective, so an idle worker waits without a
timeout and sees EOF the moment the driver goes away. A worker that dies is noticed by the driver
before the next broadcast (its process is gone), and inside a collective by the collective itself
(gloo: the peer's socket closes; NCCL: a watchdog thread aborts the communicators), so the engine
fails with WorkerDiedError instead of hanging. Workers are daemonic and also exit when their parent
does, so no process outlives the engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from kvserve.engine.core.kv_cache_groups import KVCacheGroups
from kvserve.engine.cpu_threads import rank_threads, spin_default_for_children
from kvserve.engine.distributed import TPGroup
from kvserve.engine.errors import WorkerDiedError

logger = logging.getLogger("kvserve.engine")

# A collective waits this long for a live but stuck peer (a dead one fails it at once).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
STARTUP_TIMEOUT_S = 600.0  # spawn + imports + rendezvous + loading a shard


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: where the model is and how to join the group."""

    model_path: str
    revision: str | None
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    size: int
    init_method: str
    threads: int  # torch intra-op threads per rank on the CPU
    max_model_len: int | None = None  # the engine's, when the user set one
    quantization: str | None = None  # online quantisation of a dense checkpoint (int8 | fp8)
    hf_overrides: Any = None  # vLLM's: a dict or callable over the HF config (every rank)
    lora: Any = None  # a LoRAConfig: wrap the linears for adapters (enable_lora)
    load_format: str = "auto"  # "sharded_state": each rank reads its own shard files


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache every rank allocates (same block count on all: one block manager)."""

    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    num_cpu_blocks: int
    attention_backend: str
    num_host_blocks: int = 0
    kv_groups: KVCacheGroups | None = None  # None: one group of every layer


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_group(rank: int, spec: WorkerSpec) -> TPGroup:
    """Join the N-rank group (every rank calls this once) and pin this rank's device."""
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(spec.threads)
    torch.distributed.init_process_group(
        backend_for(spec.device_type), init_method=spec.init_method, rank=rank,
        world_size=spec.size, timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank, spec.size)


def rank_device(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------- worker side


def worker_main(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of worker process `rank` (spawned)."""
    _exit_with_parent(os.getppid())
    try:
        conn.send(("joining", None))
        tp = init_group(rank, spec)
        from kvserve.engine.worker.model_loader import load_model

        model, _ = load_model(spec.model_path, spec.dtype, rank_device(rank, spec.device_type),
                              revision=spec.revision, tp=tp, max_model_len=spec.max_model_len,
                              quantization=spec.quantization,
                              hf_overrides=spec.hf_overrides, load_format=spec.load_format)
        if spec.lora is not None:
            from kvserve.lora.model import attach_lora

            attach_lora(model, spec.lora)
        conn.send(("ready", None))
        _serve(rank, model, spec, conn)
    except BaseException:  # noqa: BLE001 - tell the driver why, then die
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def _serve(rank: int, model: torch.nn.Module, spec: WorkerSpec, conn: Connection) -> None:
    from kvserve.engine.worker.model_runner import ModelRunner

    runner: ModelRunner | None = None
    while True:
        try:
            cmd, arg = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone
            return
        if cmd == "stop":
            torch.distributed.destroy_process_group()
            conn.send(("stopped", None))
            return
        if cmd == "init_cache":
            runner = _make_runner(model, arg, rank_device(rank, spec.device_type))
            conn.send(("ok", None))
        elif cmd == "step":
            runner.run_step(arg)  # type: ignore[union-attr]
        elif cmd == "move":
            runner.apply_moves(arg)  # type: ignore[union-attr]
        elif cmd == "calibrate":
            runner.calibrate_kv_scales(*arg)  # type: ignore[union-attr]
        elif cmd == "lora":
            runner.apply_lora(*arg)  # type: ignore[union-attr]
        elif cmd == "capture":  # every rank together; the driver keeps graphs only if all did
            conn.send(("captured", runner.try_capture(*arg)))  # type: ignore[union-attr]
        elif cmd == "save_sharded":  # LLM.save_sharded_state: every rank its own files
            from kvserve.engine.worker.sharded_state import ShardedStateLoader

            conn.send(("saved", ShardedStateLoader.save_model(model, *arg, rank=rank)))
        elif cmd == "drop_graphs":  # another rank's capture failed: every rank runs eagerly
            runner.graphs = None  # type: ignore[union-attr]
        else:
            raise RuntimeError(f"unknown command {cmd!r}")


def _make_runner(model: torch.nn.Module, c: CacheSpec, device: torch.device):
    from kvserve.engine.worker.model_runner import ModelRunner

    return ModelRunner(model, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, num_blocks=c.num_blocks, block_size=c.block_size,
                       kv_dtype=c.kv_dtype, device=device, num_cpu_blocks=c.num_cpu_blocks,
                       attention_backend=c.attention_backend, num_host_blocks=c.num_host_blocks,
                       kv_groups=c.kv_groups)


def _exit_with_parent(parent: int) -> None:
    """Exit when the driver dies, even by SIGKILL (nothing else would tell an idle worker)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kvserve-parent-watch", daemon=True).start()


# ---------------------------------------------------------------------------- driver side

METHOD_ENV = ("KVSERVE_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD")


def start_method() -> str:
    """How workers start, as vLLM's multiprocessing executor: fork while this process has no
    CUDA context (a script needs no `__main__` guard), spawn once it has one (a forked child
    cannot use it); $KVSERVE_WORKER_MULTIPROC_METHOD (or vLLM's name) decides when set."""
    for name in METHOD_ENV:
        if os.environ.get(name) in ("fork", "spawn", "forkserver"):
            return os.environ[name]
    return "spawn" if torch.cuda.is_initialized() else "fork"


class WorkerGroup:
    """The driver's handle on ranks 1..N-1: start them, broadcast to them, stop them."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        ctx = torch.multiprocessing.get_context(start_method())
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.failure: str | None = None
        self._closed = threading.Event()
        for rank in range(1, spec.size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(rank, spec, child), daemon=True,
                               name=f"kvserve-tp{rank}")
            with spin_default_for_children():
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        # Stops the workers if the engine is dropped without shutdown() (and at exit).
        self._finalizer = weakref.finalize(self, _stop_procs, list(self.procs),
                                           list(self.conns))
        threading.Thread(target=_watch, args=(weakref.ref(self), [p.sentinel for p in self.procs]),
                         name="kvserve-tp-watch", daemon=True).start()

    @classmethod
    def start(cls, model_path: str, revision: str | None, dtype: torch.dtype,
              device_type: str, size: int,
              max_model_len: int | None = None,
              quantization: str | None = None,
              hf_overrides: Any = None, lora: Any = None,
              load_format: str = "auto") -> tuple["WorkerGroup", TPGroup]:
        """Spawn the workers and join the group as rank 0 (returns once all ranks joined)."""
        if torch.distributed.is_initialized():
            raise WorkerDiedError(
                "another tensor-parallel engine is still running in this process; call "
                "shutdown() on it before starting a new one")
        store = os.path.join(tempfile.mkdtemp(prefix="kvserve-tp-"), "rendezvous")
        threads = rank_threads(size)[0]  # each rank's share of the CPUs this host lets us use
        spec = WorkerSpec(str(model_path), revision, dtype, device_type, size,
                          f"file://{store}", threads, max_model_len, quantization,
                          hf_overrides, lora, load_format)
        group = cls(spec)
        try:
            try:
                group.wait_for("joining")
            except WorkerDiedError as exc:  # before any of our code ran in the worker
                if start_method() == "fork":
                    raise
                raise WorkerDiedError(
                    f"{exc}\nWorkers are spawned (this process holds a CUDA context): a script "
                    "that starts tensor_parallel_size > 1 then needs an `if __name__ == "
                    "\"__main__\":` guard around its code") from None
            tp = init_group(0, spec)
        except BaseException:
            group.close()
            raise
        return group, tp

    def wait_for(self, expected: str) -> list[Any]:
        """Each worker's next message must be `expected`; a death or error raises. Returns
        their payloads in rank order (rank 1 first)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = dict(enumerate(self.conns))
        payloads: list[Any] = [None] * len(self.conns)
        while pending:
            ready = wait(list(pending.values()) + [self.procs[i].sentinel for i in pending],
                         timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise WorkerDiedError(f"tensor-parallel workers did not report {expected!r} "
                                      f"within {STARTUP_TIMEOUT_S:.0f} s")
            for i, conn in list(pending.items()):
                if conn in ready or self.procs[i].sentinel in ready:
                    payloads[i] = self._expect(i, expected)
                    del pending[i]
        return payloads

    def _expect(self, i: int, expected: str) -> Any:
        try:
            kind, payload = self.conns[i].recv()
        except (EOFError, OSError):
            raise WorkerDiedError(self._death(i)) from None
        if kind == "error":
            self.failure = payload
            raise WorkerDiedError(f"tensor-parallel worker failed:\n{payload}")
        if kind != expected:
            raise WorkerDiedError(f"worker rank {i + 1} said {kind!r}, expected {expected!r}")
        return payload

    def broadcast(self, cmd: str, arg: Any) -> None:
        """Send one command to every worker (serialised once); WorkerDiedError if one is gone."""
        self.check_alive()
        data = pickle.dumps((cmd, arg), protocol=pickle.HIGHEST_PROTOCOL)
        for i, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                raise WorkerDiedError(self._death(i)) from None

    def init_cache(self, cache: CacheSpec) -> None:
        self.broadcast("init_cache", cache)
        self.wait_for("ok")

    def check_alive(self) -> None:
        if self.failure is not None and not self._closed.is_set():
            raise WorkerDiedError(self.failure)
        for i, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                raise WorkerDiedError(self._death(i))

    def _death(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(timeout=1.0)
        message = f"tensor-parallel worker rank {i + 1} (pid {proc.pid}) died"
        if proc.exitcode is not None:
            message += f" with exit code {proc.exitcode}"
        detail = self._last_error(i)
        message += f":\n{detail}" if detail else "; the engine cannot continue, restart it"
        self.failure = self.failure or message
        return message

    def _last_error(self, i: int) -> str | None:
        conn = self.conns[i]
        try:
            while conn.poll(0):
                kind, payload = conn.recv()
                if kind == "error":
                    return payload
        except (EOFError, OSError):
            pass
        return None

    def failed(self, exc: BaseException) -> WorkerDiedError:
        """The error for a collective that raised: the dead worker's story when one died (its
        death may take a moment to be visible), else the collective's own message."""
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.procs):
                if proc.exitcode is not None:
                    return WorkerDiedError(self._death(i))
            time.sleep(0.05)
        self.failure = self.failure or f"a tensor-parallel collective failed: {exc}"
        return WorkerDiedError(self.failure)

    def on_death(self) -> None:
        """Watchdog: record the first worker death at once; on NCCL also abort the
        communicators, as a collective waiting on a dead GPU peer would block until its
        timeout."""
        if self._closed.is_set():
            return
        dead = next((i for i, p in enumerate(self.procs) if p.exitcode is not None), 0)
        logger.error("%s", self._death(dead))
        if self.spec.device_type == "cuda":
            abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker (politely, then by force) and leave the group; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        data = pickle.dumps(("stop", None))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass
        self._finalizer.detach()
        _stop_procs(self.procs, self.conns, timeout)


def _watch(ref: "weakref.ref[WorkerGroup]", sentinels: list[int]) -> None:
    wait(sentinels)  # returns when the first worker process ends
    group = ref()
    if group is not None:
        group.on_death()


def _stop_procs(procs: list[Any], conns: list[Connection], timeout: float = 10.0) -> None:
    """Join the workers (kill what does not stop in time) and leave the group."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(timeout=max(deadline - time.monotonic(), 0.1))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    if torch.distributed.is_initialized():  # a failed group too, so that a new one can start
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group: nothing left to release
            pass
