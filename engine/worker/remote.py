"""The command channel to ranks on other hosts: the leader listens on the command port, each
remote rank connects twice (authenticated with the group key, as multiprocessing's Listener and
Client do): a command connection that carries what a local worker's pipe carries, and a life
connection on which nothing is sent, so that its end (the process died: the kernel closes the
socket; the host vanished: TCP keepalive gives up within ~15 s) wakes the leader's watchdog at
once. RemoteRank stands in for a local worker's multiprocessing.Process in the WorkerGroup.

`kvserve serve --headless` (headless.py: run_headless) starts this host's local ranks as child processes,
each connecting to the leader, receiving the WorkerSpec and running the same worker loop as a
local worker; it exits nonzero as soon as one of them fails, and its ranks exit when the leader
goes away, so a LeaderWorkerSet restarts the whole group.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

from kvserve.engine.errors import WorkerDiedError
from kvserve.engine.worker.rank_env import RankEnv

logger = logging.getLogger("kvserve.engine")
KEY_ENV = "KVSERVE_GROUP_KEY"
CONNECT_TIMEOUT_S = float(os.environ.get("KVSERVE_CONNECT_TIMEOUT_S", "600"))
LIFE: list[Connection] = []  # this process's life connection, open until it exits


def group_key(env: RankEnv) -> bytes:
    """The shared secret of the command channel: $KVSERVE_GROUP_KEY (a Kubernetes Secret), else
    one derived from the rendezvous address, which keeps strays out but not an attacker: keep
    the command port reachable by the group's pods only (a NetworkPolicy) or set the key."""
    key = os.environ.get(KEY_ENV)
    if key:
        return key.encode()
    return f"kvserve-group:{env.master_addr}:{env.master_port}".encode()


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _connection(sock: socket.socket) -> Connection:
    sock.setblocking(True)
    _keepalive(sock)
    return Connection(sock.detach())


@dataclass
class RemoteRank:
    """A rank on another host, as the WorkerGroup sees a process: a sentinel that becomes ready
    when it ends, its exit code (1 once its connection closed: the real one is on its host)."""

    rank: int
    host: str
    pid: int
    life: Connection
    code: int | None = None
    name: str = ""

    @property
    def sentinel(self) -> Connection:
        return self.life

    @property
    def exitcode(self) -> int | None:
        if self.code is None:
            try:
                if self.life.poll(0):
                    self.life.recv_bytes()
            except (EOFError, OSError):
                self.code = 1
        return self.code

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is None:
            try:
                wait([self.life], timeout)
            except OSError:  # closed by kill()
                pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        """Close its life connection (the WorkerGroup closes the command one: it sees EOF)."""
        if self.code is None:
            self.code = -9
        self.life.close()

    def describe(self) -> str:
        return f"rank {self.rank} on {self.host} (pid {self.pid}) closed its connection"


def accept_ranks(env: RankEnv, ranks: list[int], spec: Any,
                 timeout: float = CONNECT_TIMEOUT_S) -> tuple[list[Connection], list[RemoteRank]]:
    """Listen on the command port until every rank in `ranks` has connected (both
    connections), send each its WorkerSpec; their (command connection, RemoteRank) in rank
    order. WorkerDiedError naming the missing ranks after `timeout` seconds."""
    key = group_key(env)
    server = socket.create_server(("", env.command_port), reuse_port=False)
    server.settimeout(1.0)
    cmds: dict[int, Connection] = {}
    lives: dict[int, tuple[Connection, str, int]] = {}
    deadline = time.monotonic() + timeout
    logger.info("waiting for %d rank(s) from other hosts on port %d", len(ranks),
                env.command_port)
    try:
        while len(cmds) < len(ranks) or len(lives) < len(ranks):
            if time.monotonic() > deadline:
                missing = [r for r in ranks if r not in cmds or r not in lives]
                raise WorkerDiedError(
                    f"ranks {missing} did not connect to the leader's command port "
                    f"{env.command_port} within {timeout:.0f} s: are their pods running "
                    "`kvserve serve --headless` with the same parallel sizes?")
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            _greet(_connection(sock), key, ranks, spec, cmds, lives)
    finally:
        server.close()
    peers = [RemoteRank(r, lives[r][1], lives[r][2], lives[r][0], name=f"kvserve-rank{r}")
             for r in ranks]
    return [cmds[r] for r in ranks], peers


def _greet(conn: Connection, key: bytes, ranks: list[int], spec: Any,
           cmds: dict[int, Connection], lives: dict[int, tuple[Connection, str, int]]) -> None:
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
        kind, (rank, role, host, pid) = conn.recv()
    except Exception as exc:  # noqa: BLE001 - a stray or a wrong key: ignore it
        logger.warning("refused a command-channel connection: %s", exc)
        conn.close()
        return
    if kind != "hello" or rank not in ranks or rank in (cmds if role == "cmd" else lives):
        logger.warning("refused a command-channel connection from rank %r (%s)", rank, role)
        conn.close()
        return
    if role == "cmd":
        cmds[rank] = conn
        conn.send(("spec", spec))
    else:
        lives[rank] = (conn, host, pid)
    logger.info("rank %d connected from %s (%s)", rank, host, role)


def connect(env: RankEnv, rank: int, role: str, timeout: float = CONNECT_TIMEOUT_S
            ) -> Connection:
    """This rank's `role` ("cmd" | "life") connection to the leader, retried until it listens."""
    key = group_key(env)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((env.master_addr, env.command_port), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise WorkerDiedError(
                    f"rank {rank}: the leader {env.master_addr}:{env.command_port} did not "
                    f"answer within {timeout:.0f} s ({exc})") from None
            time.sleep(0.5)
    conn = _connection(sock)
    answer_challenge(conn, key)
    deliver_challenge(conn, key)
    conn.send(("hello", (rank, role, socket.gethostname(), os.getpid())))
    return conn


__all__ = ["KEY_ENV", "RemoteRank", "accept_ranks", "connect", "group_key"]
