"""Server processes for tests, forked from a zygote that has already imported kvserve.

`python -m kvserve.service.cli serve ...` spends most of its start-up importing torch,
transformers, triton and kvserve (about 5 s of CPU, 20-30 s on two loaded cores); a test that
kills replicas and starts them again pays that every time. `fork_module` runs a module's `main`
in a child of multiprocessing's forkserver, which imports `PRELOAD` once per test process: a
replica then answers /health about a second after it is asked for. The child is a real process
of its own (its own pid, port and engine; SIGKILL and SIGTERM reach it as they would a
`subprocess.Popen` child); only the interpreter start and the imports are shared.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from multiprocessing import forkserver
from multiprocessing.connection import wait as wait_ready
from pathlib import Path

# What `kvserve serve` and the router import by the time they serve (imported lazily at start:
# the CLI's subcommands, the engine, the model classes, uvicorn's loop and protocols). A name
# missing here costs a child its import time, nothing else (the forkserver skips ImportErrors).
PRELOAD = [
    "kvserve.service.cli", "kvserve.service.api_server", "kvserve.service.router.cli",
    "kvserve.service.epp.cli", "kvserve.operator.cli", "kvserve.operator.render",
    "kvserve.engine.llm_engine", "kvserve.engine.async_engine", "kvserve.engine.models",
    "kvserve.engine.kv_events_zmq", "kvserve.engine.worker.gguf_loader",
    "kvserve.engine.layers.packed_linear", "kvserve.kernels.cpu_attention",
    "kvserve.service.server.multi_model", "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto", "transformers.integrations.accelerate",
    "transformers.integrations.hub_kernels", "transformers.models.llama.configuration_llama",
    "transformers.tokenization_utils_tokenizers", "torch._dynamo", "torch.distributed",
    "torch.utils.cpp_extension", "redis.asyncio", "triton", "httpx", "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl", "uvicorn.lifespan.on", "jinja2",
    "safetensors.torch", "accelerate",
]

_live: set[ForkedProc] = set()
_lock = threading.Lock()


def _child_main(module: str, argv: list[str], log: str, env: dict[str, str]) -> None:
    """In the forked child: the caller's environment, stdout and stderr into `log`, then
    `module.main(argv)` as `python -m module *argv` would run it (its atexit handlers too)."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(module).main(argv)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit
    sys.exit(code)


class ForkedProc:
    """The part of `subprocess.Popen` the tests use, for a forked child."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self._poll_lock = threading.Lock()  # reading the exit status twice would block

    @property
    def pid(self) -> int:
        return self.process.pid  # type: ignore[return-value]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._poll_lock:
            code = self.process.exitcode
        if code is not None:
            with _lock:
                _live.discard(self)
        return code

    def wait(self, timeout: float | None = None) -> int:
        wait_ready([self.process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_module(module: str, argv: Sequence[str], log: Path,
                env: dict[str, str] | None = None) -> ForkedProc:
    """`python -m module *argv` (stdout and stderr into `log`, this process's environment plus
    `env`) as a child of the preloaded forkserver; returns at once, as Popen does."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: the first call
    process = ctx.Process(target=_child_main, name=f"forked {module}",
                          args=(module, list(argv), str(log), {**os.environ, **(env or {})}))
    process.start()
    proc = ForkedProc(process)
    with _lock:
        _live.add(proc)
    return proc


def stop_forkserver() -> None:
    """End the forkserver (it holds a torch's worth of memory) once a module's children are
    gone; the next fork_module starts it again."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)  # its own exit takes seconds
    server._stop()


@atexit.register
def _kill_leftovers() -> None:
    """A child a test left running would keep multiprocessing's exit hook waiting for it."""
    with _lock:
        leftovers = list(_live)
    for proc in leftovers:
        proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
