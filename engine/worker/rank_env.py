"""Where this process sits in a replica that spans several hosts (pods), read from the
environment the way LeaderWorkerSet and torchrun set it.

A replica has world = pipeline_parallel_size x tensor_parallel_size ranks on `nodes` hosts, each
host running world / nodes of them (its local ranks): host i holds global ranks
[i * local, (i + 1) * local). Host 0 is the leader: its process is rank 0 (the driver, the API
server), it starts its other local ranks itself and the other hosts' ranks connect to it.

- LeaderWorkerSet: `LWS_GROUP_SIZE` hosts (pods), this one `LWS_WORKER_INDEX` (0: the leader),
  the leader's address `LWS_LEADER_ADDRESS` (MASTER_ADDR, when set, wins).
- torchrun style: `RANK` of `WORLD_SIZE` processes, one rank each, and `MASTER_ADDR`.
- neither: one host, every rank started here.

`MASTER_PORT` (default 29500) is torch.distributed's rendezvous on the leader; the command
channel (engine/worker/remote.py) listens on `KVSERVE_COMMAND_PORT` (default MASTER_PORT + 1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvserve.engine.errors import ConfigError

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class RankEnv:
    """This host's place in the replica (nodes == 1: everything is local)."""

    nodes: int = 1
    node: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    command_port: int = DEFAULT_MASTER_PORT + 1
    source: str = "local"  # "local" | "lws" | "torchrun"

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node == 0

    def local_ranks(self, world: int) -> int:
        """Ranks each host runs; ConfigError when the hosts cannot share `world` evenly."""
        if world % self.nodes:
            raise ConfigError(
                f"{self.nodes} hosts ({self._names()}) cannot each run the same number of the "
                f"replica's {world} ranks (pipeline_parallel_size x tensor_parallel_size); make "
                "the group size divide it")
        return world // self.nodes

    def ranks(self, world: int) -> range:
        """The global ranks this host runs."""
        local = self.local_ranks(world)
        return range(self.node * local, (self.node + 1) * local)

    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def _names(self) -> str:
        return {"lws": "LWS_GROUP_SIZE", "torchrun": "WORLD_SIZE"}.get(self.source, "hosts")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"${name}={env[name]!r} is not an integer") from None


def from_environ(env: Mapping[str, str] | None = None) -> RankEnv:
    """The RankEnv the environment describes (see the module docstring)."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_MASTER_PORT
    command = _int(env, "KVSERVE_COMMAND_PORT") if env.get("KVSERVE_COMMAND_PORT") else port + 1
    if env.get("LWS_GROUP_SIZE"):
        nodes, node = _int(env, "LWS_GROUP_SIZE"), _int(env, "LWS_WORKER_INDEX") \
            if env.get("LWS_WORKER_INDEX") else 0
        addr, source = env.get("MASTER_ADDR") or env.get("LWS_LEADER_ADDRESS"), "lws"
        if not addr:
            raise ConfigError("LWS_GROUP_SIZE is set but neither LWS_LEADER_ADDRESS nor "
                              "MASTER_ADDR names the leader")
    elif env.get("WORLD_SIZE") and env.get("RANK"):
        nodes, node, source = _int(env, "WORLD_SIZE"), _int(env, "RANK"), "torchrun"
        addr = env.get("MASTER_ADDR") or "127.0.0.1"
    else:
        return RankEnv(master_port=port, command_port=command)
    if nodes < 1 or not 0 <= node < nodes:
        raise ConfigError(f"host index {node} is outside a group of {nodes} ({source})")
    return RankEnv(nodes, node, addr, port, command, source)


__all__ = ["DEFAULT_MASTER_PORT", "RankEnv", "from_environ"]
