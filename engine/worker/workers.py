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

With pipeline_parallel_size P > 1 the world is P x N ranks (engine/worker/pipeline.py): each
stage's N ranks form their own tensor-parallel subgroup, each rank holds its stage's layers and
their KV cache, a stage hands (hidden states, residual) to the next, and the last stage's first
rank returns the step's outputs (its sampled tokens and logprobs, or the sampled rows' logits;
prompt logprobs) to the driver on its command connection. Ranks on other hosts (engine/worker/rank_env.py) are connected through
engine/worker/remote.py and stand in the same lists as local processes.
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
from kvserve.engine.worker.pipeline import Layout, PPStage, StageLink
from kvserve.engine.worker.rank_env import RankEnv

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
    pp: int = 1  # pipeline stages; `size` = pp x tensor-parallel ranks
    layer_counts: tuple[int, ...] = ()  # layers per stage (the driver's partition)
    local_ranks: int = 0  # ranks per host (0: all on this one); picks each rank's GPU
    microbatches: int = 1  # pipeline micro-batches per step (the driver's choice)
    # $KVSERVE_RANK_DEVICES: each local rank's GPU (e.g. "0,0": two stages on one GPU, for
    # measuring; NCCL refuses two ranks on one device, so such a group runs over gloo)
    rank_devices: tuple[int, ...] = ()

    @property
    def backend(self) -> str:
        shared = len(set(self.rank_devices)) < len(self.rank_devices)
        return "gloo" if shared else backend_for(self.device_type)

    def device_index(self, rank: int) -> int:
        local = self.local_rank(rank)
        return self.rank_devices[local] if self.rank_devices else local

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.size // self.pp, pp=self.pp)

    def stage(self, rank: int) -> PPStage | None:
        """Rank `rank`'s pipeline stage (None without pipeline parallelism)."""
        if self.pp == 1:
            return None
        s = self.layout.stage_of(rank)
        start = sum(self.layer_counts[:s])
        return PPStage(s, self.pp, start, start + self.layer_counts[s])

    def local_rank(self, rank: int) -> int:
        return rank % (self.local_ranks or self.size)


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


def init_group(rank: int, spec: WorkerSpec) -> TPGroup | None:
    """Join the world (every rank calls this once) and pin this rank's device; this rank's
    tensor-parallel group (None when its stage has one rank). With pipeline stages every rank
    creates every stage's subgroup, in stage order, as torch.distributed requires."""
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.device_index(rank))
    else:
        torch.set_num_threads(spec.threads)
    torch.distributed.init_process_group(
        spec.backend, init_method=spec.init_method, rank=rank,
        world_size=spec.size, timeout=COLLECTIVE_TIMEOUT)
    layout = spec.layout
    if layout.pp == 1:
        return TPGroup(rank, spec.size)
    if layout.tp == 1:
        return None
    groups = [torch.distributed.new_group(layout.tp_ranks(s), timeout=COLLECTIVE_TIMEOUT)
              for s in range(layout.pp)]
    stage = layout.stage_of(rank)
    return TPGroup(layout.tp_rank_of(rank), layout.tp, groups[stage], first=stage * layout.tp)


def stage_link(rank: int, spec: WorkerSpec, model: torch.nn.Module,
               device: torch.device) -> StageLink | None:
    """Rank `rank`'s link to its neighbouring stages (None without pipeline stages)."""
    if spec.pp == 1:
        return None
    return StageLink.of(rank, spec.layout, model.dims.hidden, model.dtype, device,
                        spec.microbatches, via_host=spec.backend == "gloo")


def rank_devices(device_type: str, local: int) -> tuple[int, ...]:
    """$KVSERVE_RANK_DEVICES as each local rank's GPU index (() when unset or on the CPU)."""
    value = os.environ.get("KVSERVE_RANK_DEVICES")
    if not value or device_type != "cuda":
        return ()
    devices = tuple(int(x) for x in value.split(","))
    if len(devices) != local:
        from kvserve.engine.errors import ConfigError

        raise ConfigError(f"KVSERVE_RANK_DEVICES={value!r} names {len(devices)} GPU(s) for "
                          f"{local} local rank(s)")
    return devices


def rank_device(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------- worker side


def worker_main(rank: int, spec: WorkerSpec, conn: Connection, remote: bool = False) -> None:
    """Entry point of worker process `rank` (spawned here, or on another host: `remote`, which
    exits nonzero when the driver goes away without stopping it)."""
    _exit_with_parent(os.getppid())
    try:
        conn.send(("joining", None))
        tp = init_group(rank, spec)
        from kvserve.engine.worker.model_loader import load_model

        device = rank_device(spec.device_index(rank), spec.device_type)
        model, _ = load_model(spec.model_path, spec.dtype, device,
                              revision=spec.revision, tp=tp, max_model_len=spec.max_model_len,
                              quantization=spec.quantization,
                              hf_overrides=spec.hf_overrides, load_format=spec.load_format,
                              pp=spec.stage(rank))
        if spec.lora is not None:
            from kvserve.lora.model import attach_lora

            attach_lora(model, spec.lora)
        conn.send(("ready", None))
        stopped = _serve(rank, model, spec, conn, device)
    except BaseException:  # noqa: BLE001 - tell the driver why, then die
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except OSError:
            pass
        os._exit(1)
    os._exit(0 if stopped or not remote else 1)


def _serve(rank: int, model: torch.nn.Module, spec: WorkerSpec, conn: Connection,
           device: torch.device) -> bool:
    """The command loop; True once told to stop, False when the driver went away."""
    from kvserve.engine.worker.model_runner import ModelRunner

    runner: ModelRunner | None = None
    returns = spec.pp > 1 and rank == spec.layout.last_stage_driver()
    while True:
        try:
            cmd, arg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone
            return False
        if cmd == "stop":
            torch.distributed.destroy_process_group()
            conn.send(("stopped", None))
            return True
        if cmd == "init_cache":
            runner = _make_runner(model, arg, device, stage_link(rank, spec, model, device))
            conn.send(("ok", None))
        elif cmd == "step":
            out = runner.run_step(arg)  # type: ignore[union-attr]
            if returns:  # by value (plain pickle): no shared memory, another host may read it
                conn.send_bytes(pickle.dumps(("out", out), protocol=pickle.HIGHEST_PROTOCOL))
        elif cmd == "link_figures":
            conn.send(("link_figures", runner.link.figures if runner.link else None))
        elif cmd == "move":
            runner.apply_moves(arg)  # type: ignore[union-attr]
        elif cmd == "kv_connector":  # this rank's side of a KV connector (engine/kv_transfer/)
            from kvserve.engine.kv_transfer.factory import attach_worker_connector

            conn.send(("kv_connector", attach_worker_connector(runner, rank, *arg)))
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


def _make_runner(model: torch.nn.Module, c: CacheSpec, device: torch.device,
                 link: StageLink | None = None):
    """This rank's runner: with pipeline stages, a KV cache for its own stage's layers only."""
    from kvserve.engine.worker.model_runner import ModelRunner

    stage = model.model.pp if link is not None else None
    return ModelRunner(model, num_layers=stage.num_layers if stage else c.num_layers,
                       num_kv_heads=c.num_kv_heads,
                       head_dim=c.head_dim, num_blocks=c.num_blocks, block_size=c.block_size,
                       kv_dtype=c.kv_dtype, device=device, num_cpu_blocks=c.num_cpu_blocks,
                       attention_backend=c.attention_backend, num_host_blocks=c.num_host_blocks,
                       kv_groups=None if stage else c.kv_groups, link=link)


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

    def __init__(self, spec: WorkerSpec, env: RankEnv | None = None) -> None:
        self.spec = spec
        ctx = torch.multiprocessing.get_context(start_method())
        self.procs: list[Any] = []  # rank i + 1: a local Process, or a RemoteRank
        self.conns: list[Connection] = []
        self.failure: str | None = None
        self._closed = threading.Event()
        local = spec.local_ranks or spec.size
        for rank in range(1, local):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(rank, spec, child), daemon=True,
                               name=f"kvserve-tp{rank}")
            with spin_default_for_children():
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        if local < spec.size:  # the other hosts' ranks connect to us
            from kvserve.engine.worker.remote import accept_ranks

            try:
                conns, remote = accept_ranks(env or RankEnv(), list(range(local, spec.size)),
                                             spec)
            except BaseException:
                _stop_procs(self.procs, self.conns)
                raise
            self.conns += conns
            self.procs += remote
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
              load_format: str = "auto", pp: int = 1,
              layer_counts: tuple[int, ...] = (),
              env: RankEnv | None = None, microbatches: int = 1
              ) -> tuple["WorkerGroup", TPGroup | None]:
        """Spawn the local workers, accept the other hosts' (`env`), and join the group as
        rank 0 (returns once all ranks joined). `size`: every rank, pp x tensor-parallel."""
        if torch.distributed.is_initialized():
            raise WorkerDiedError(
                "another tensor-parallel engine is still running in this process; call "
                "shutdown() on it before starting a new one")
        env = env or RankEnv()
        local = env.local_ranks(size)
        if env.multi_node:
            init = env.init_method()
        else:
            init = "file://" + os.path.join(tempfile.mkdtemp(prefix="kvserve-tp-"), "rendezvous")
        threads = rank_threads(local)[0]  # each rank's share of the CPUs this host lets us use
        spec = WorkerSpec(str(model_path), revision, dtype, device_type, size,
                          init, threads, max_model_len, quantization,
                          hf_overrides, lora, load_format, pp, tuple(layer_counts),
                          local if env.multi_node else 0, microbatches,
                          rank_devices(device_type, local))
        group = cls(spec, env)
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

    def receive_output(self) -> Any:
        """The step's outputs from the last stage's first rank (pipeline stages): waits for
        them or for any rank's end, so a death anywhere is an error, not a hang."""
        i = self.spec.layout.last_stage_driver() - 1
        ready = wait([self.conns[i]] + [p.sentinel for p in self.procs])
        if self.conns[i] not in ready:
            dead = next(j for j, p in enumerate(self.procs) if p.sentinel in ready)
            raise WorkerDiedError(self._death(dead))
        return self._expect(i, "out")

    def link_figures(self) -> list[Any]:
        """Every worker's stage-link figures (pipeline.LinkFigures; None for a rank without)."""
        self.broadcast("link_figures", None)
        return self.wait_for("link_figures")

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
        if hasattr(proc, "describe"):  # a rank on another host
            message = f"worker {proc.describe()}"
        else:
            message = f"worker rank {i + 1} (pid {proc.pid}) died"
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
        self._finalizer.detach()
        _stop_procs(self.procs, self.conns, timeout)


def _watch(ref: "weakref.ref[WorkerGroup]", sentinels: list[int]) -> None:
    wait(sentinels)  # returns when the first worker process ends
    group = ref()
    if group is not None:
        group.on_death()


def _stop_procs(procs: list[Any], conns: list[Connection], timeout: float = 10.0) -> None:
    """Tell the workers to stop, join them (kill what does not stop in time) and leave the
    group. Also a dropped engine's finalizer: its workers, told nothing, would wait on their
    command pipes until killed at the timeout."""
    data = pickle.dumps(("stop", None))
    for conn in conns:
        try:
            conn.send_bytes(data)
        except OSError:
            pass
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
