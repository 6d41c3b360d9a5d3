"""Real Redis high-availability topologies for tests, on ephemeral ports: a Sentinel set (a primary,
a replica, three sentinels) and a Redis Cluster (`redis-cli --cluster create`), each of whose
nodes a test can kill -9. The recipes are in /work/shared/NOTES.md; both are tuned to fail over in
a few seconds (down-after 1 s, cluster-node-timeout 1 s) instead of Redis's defaults (30 s, 15 s).

`KVSERVE_REQUIRE_REDIS=1` turns a missing redis-server or redis-cli into a failure, not a skip.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from conftest import free_port
from conftest import require_redis_binary as require_binary

MASTER_NAME = "mymaster"


def wait_until(check: Callable[[], object], timeout: float, what: str) -> object:
    """check()'s first truthy result within `timeout` s (exceptions count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
            if value:
                return value
        except Exception:  # noqa: BLE001 - a node still starting or failing over
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


class Node:
    """One redis-server process (a data node or, with `sentinel`, a sentinel)."""

    def __init__(self, binary: str, workdir: Path, args: list[str], port: int,
                 config: str | None = None) -> None:
        self.binary, self.port, self.args = binary, port, args
        self.dir = workdir / f"node-{port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.proc: subprocess.Popen | None = None

    def start(self) -> Node:
        cmd = [self.binary]
        if self.config is not None:
            conf = self.dir / "redis.conf"
            conf.write_text(self.config)
            cmd.append(str(conf))
        # No diskless-sync delay: a replica is in sync in milliseconds instead of 5 s.
        cmd += ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--repl-diskless-sync-delay", "0",
                *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """kill -9: no shutdown, no goodbye to the replicas."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True,
                           socket_timeout=2)


class SentinelSet:
    """A primary, one replica of it and three sentinels (quorum 2) watching MASTER_NAME."""

    def __init__(self, workdir: Path, password: str | None = None,
                 sentinel_auth: bool = True) -> None:
        binary = require_binary("redis-server")
        auth = ["--requirepass", password, "--masterauth", password] if password else []
        self.password = password
        self.primary = Node(binary, workdir, auth, free_port())
        self.replica = Node(binary, workdir, [*auth, "--replicaof", "127.0.0.1",
                                              str(self.primary.port)], free_port())
        self.sentinels = []
        for _ in range(3):
            port = free_port()
            # `known-replica` spares the 10 s a sentinel needs to find the replica by itself.
            conf = (f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.primary.port} 2\n"
                    f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
                    f"sentinel failover-timeout {MASTER_NAME} 5000\n"
                    f"sentinel known-replica {MASTER_NAME} 127.0.0.1 {self.replica.port}\n")
            if password:  # the sentinels log in to the data nodes; clients to the sentinels
                conf += f"sentinel auth-pass {MASTER_NAME} {password}\n"
                conf += f"requirepass {password}\n" if sentinel_auth else ""
            self.sentinels.append(Node(binary, workdir, ["--sentinel"], port, conf))

    def url(self, with_password: bool = False) -> str:
        auth = f":{self.password}@" if with_password and self.password else ""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{auth}{hosts}/{MASTER_NAME}"

    def start(self) -> SentinelSet:
        self.primary.start()
        self.replica.start()
        self.wait_replica_in_sync(self.replica)
        for s in self.sentinels:
            s.start()
        return self

    def wait_replica_in_sync(self, node: Node, timeout: float = 10) -> None:
        def synced() -> bool:
            info = self._client(node).info("replication")
            return info.get("role") == "slave" and info.get("master_link_status") == "up"
        wait_until(synced, timeout, f"replica :{node.port} in sync")

    def master_port(self) -> int:
        """The primary's port as the (live) sentinels agree on it."""
        for s in self.sentinels:
            if s.proc is not None:
                _, port = self._client(s).sentinel_get_master_addr_by_name(MASTER_NAME)
                return int(port)
        raise RuntimeError("no sentinel running")

    def _client(self, node: Node) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password,
                           decode_responses=True, socket_timeout=2)

    def stop(self) -> None:
        for node in (*self.sentinels, self.replica, self.primary):
            node.kill()


class RedisClusterSet:
    """`masters` cluster nodes, each with `replicas_per_master` replicas, slots spread by
    `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, masters: int = 3, replicas_per_master: int = 0) -> None:
        binary = require_binary("redis-server")
        self.cli = require_binary("redis-cli")
        self.replicas_per_master = replicas_per_master
        self.nodes = []
        for _ in range(masters * (1 + replicas_per_master)):
            port = free_port()
            # An explicit bus port: the default (port + 10000) overflows for high ephemeral ports.
            self.nodes.append(Node(binary, workdir, [
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-port", str(free_port()), "--cluster-node-timeout", "1000"], port))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def start(self) -> RedisClusterSet:
        for node in self.nodes:
            node.start()
        subprocess.run([self.cli, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        wait_until(self.healthy, 20, "cluster_state:ok on every node")
        # A replica that never finished its first sync cannot take over: wait for all of them.
        wait_until(self.replicas_in_sync, 20, "every replica in sync")
        return self

    def replicas_in_sync(self) -> bool:
        infos = [n.client().info("replication") for n in self.nodes]
        replicas = [i for i in infos if i["role"] == "slave"]
        return len(replicas) == len(self.nodes) - len(self.nodes) // (
            1 + self.replicas_per_master) and all(
            i.get("master_link_status") == "up" for i in replicas)

    def healthy(self) -> bool:
        return all(n.client().cluster("info")["cluster_state"] == "ok"
                   for n in self.nodes if n.proc is not None)

    def owner_of(self, key: str) -> Node:
        """The live master serving `key`'s slot."""
        live = next(n for n in self.nodes if n.proc is not None)
        slot = live.client().cluster("keyslot", key)
        for shard in live.client().execute_command("CLUSTER", "SLOTS"):
            start, end, master = shard[0], shard[1], shard[2]
            if start <= slot <= end:
                return next(n for n in self.nodes if n.port == int(master[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
