"""`kvserve serve --headless`: a worker host of a multi-host replica runs its local ranks as
child processes (each connects to the leader through remote.py, then runs the worker loop) until
they end. Apart from remote.py so that the worker loop and the leader's side import no circle."""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import wait
from typing import Any

from kvserve.engine.errors import WorkerDiedError
from kvserve.engine.worker import remote
from kvserve.engine.worker.rank_env import RankEnv
from kvserve.engine.worker.workers import worker_main

logger = logging.getLogger(__name__)


def remote_rank_main(rank: int, env: RankEnv) -> None:
    """A child of `kvserve serve --headless`: connect, take the spec, run the worker loop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(message)s")
    try:
        cmd = remote.connect(env, rank, "cmd")
        remote.LIFE.append(remote.connect(env, rank, "life"))
        kind, spec = cmd.recv()
    except (WorkerDiedError, EOFError, OSError) as exc:
        logger.error("%s", exc)
        os._exit(1)
    if kind != "spec":
        logger.error("rank %d: the leader sent %r, expected its spec", rank, kind)
        os._exit(1)
    worker_main(rank, spec, cmd, remote=True)


def run_headless(world: int, env: RankEnv) -> int:
    """`kvserve serve --headless`: this host's ranks as child processes until they end; 1 as
    soon as one fails (the others are stopped), 0 once all stopped cleanly."""
    import multiprocessing

    if env.is_leader:
        from kvserve.engine.errors import ConfigError

        raise ConfigError(f"--headless runs a worker host, and this is the leader (host 0 of "
                          f"{env.nodes}, {env.source}); run `kvserve serve` without --headless")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=remote_rank_main, args=(r, env), name=f"kvserve-rank{r}")
             for r in env.ranks(world)]
    for p in procs:
        p.start()
    logger.info("headless: ranks %s of %d, leader %s:%d", list(env.ranks(world)), world,
                env.master_addr, env.command_port)
    signal.signal(signal.SIGTERM, lambda *_: _stop(procs))
    code = 0
    pending = list(procs)
    while pending:
        wait([p.sentinel for p in pending])
        for p in [p for p in pending if p.exitcode is not None]:
            pending.remove(p)
            if p.exitcode != 0 and code == 0:
                code = 1
                logger.error("%s exited with code %s: stopping this host's ranks", p.name,
                             p.exitcode)
                _stop(pending)
    return code


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()


__all__ = ["remote_rank_main", "run_headless"]
