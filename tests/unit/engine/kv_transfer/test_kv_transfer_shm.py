"""KVServeConnector's shared-memory transport: same host -> shm (bytes counted per transport on
both sides, bit-exact, fp8 and TP shards included), otherwise TCP; `transport` forces either, and
a pair with no common transport, a segment that cannot be mapped, or a producer killed mid-
transfer fall back (to TCP frames where allowed, else to local prefill). Segments are memfds
reused from a bounded pool: nothing appears in /dev/shm, and none stays open after shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import free_port, wait_for

from kvserve.engine.core.sequence import Sequence
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_transfer.config import KVTransferConfig
from kvserve.engine.kv_transfer.factory import EngineInfo, make_connectors
from kvserve.engine.kv_transfer.kvserve_connector import KVServeConnector
from kvserve.engine.kv_transfer.base import KVConnectorRole
from kvserve.engine.kv_transfer.shm import MappingCache, SegmentPool
from kvserve.engine.kv_transfer.wire import KVLayout
from kvserve.engine.sample.sampling_params import SamplingParams

BS, LAYERS, BLOCKS, HEADS, DIM = 4, 3, 32, 2, 8


def layout(dtype: torch.dtype = torch.float32, tp: int = 1) -> KVLayout:
    return KVLayout(model="tiny", architecture="LlamaForCausalLM", num_layers=LAYERS,
                    num_kv_heads=HEADS, head_dim=DIM, block_size=BS, kv_dtype=str(dtype),
                    tp_size=tp)


def engine(role: str, transport: str = "auto", dtype: torch.dtype = torch.float32,
           port: int = 0):
    cfg = KVTransferConfig("KVServeConnector", role, {
        "kv_port": port, "transfer_timeout": 10, "transport": transport})
    info = EngineInfo(layout(dtype), BS, 1, torch.device("cpu"))
    kv = torch.randn(2, LAYERS, BLOCKS, BS, HEADS, DIM).to(dtype)
    sched, worker = make_connectors(cfg, info)
    worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(LAYERS)})
    return sched, worker, kv


def seq(rid: str, n: int, params: dict) -> Sequence:
    return Sequence(hash(rid) % 10_000, rid, 0, list(range(3, 3 + n)),
                    SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}))


def prefill(producer, blocks: list[int], rid: str = "p") -> dict:
    s = seq(rid, len(blocks) * BS, {"do_remote_decode": True})
    s.finish_reason = "length"
    keep, params = producer.request_finished(s, blocks)
    assert keep
    return params


def pulled(consumer, s: Sequence) -> int:
    got: list[int | None] = [None]

    def ready() -> bool:
        got[0] = consumer.get_num_new_matched_tokens(s, 0)[0]
        return got[0] is not None
    wait_for(ready, 30, "the pull")
    return got[0]  # type: ignore[return-value]


def load(c_sched, c_worker, s: Sequence, dst: list[int], n_tokens: int) -> None:
    c_sched.update_state_after_alloc(s, dst, n_tokens)
    c_worker.bind_connector_metadata(c_sched.build_connector_meta(None))
    c_worker.start_load_kv()
    c_worker.wait_for_save()


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


def open_segments() -> int:
    """This process's open descriptors of KV segments (memfds named kvserve-kv)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvserve-kv")
        except OSError:
            pass
    return n


def close(*sides) -> None:
    for side in sides:
        side.shutdown()


@pytest.mark.parametrize("transport", ["auto", "shm", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_each_transport_moves_the_blocks_bit_exactly_and_counts_its_bytes(transport, dtype):
    before = shm_files()
    p_sched, p_worker, p_kv = engine("kv_producer", transport, dtype)
    c_sched, c_worker, c_kv = engine("kv_consumer", transport, dtype)
    try:
        s = seq("d", 4 * BS, prefill(p_sched, [7, 3, 11, 5]))
        assert pulled(c_sched, s) == 3 * BS  # the last block holds the last prompt token
        load(c_sched, c_worker, s, [20, 21, 22], 3 * BS)
        assert torch.equal(c_kv[:, :, [20, 21, 22]].view(torch.uint8),
                           p_kv[:, :, [7, 3, 11]].view(torch.uint8))
        want = "tcp" if transport == "tcp" else "shm"
        f = c_sched.figures
        assert f.bytes_received == 3 * LAYERS * 2 * BS * HEADS * DIM * dtype.itemsize
        assert f.bytes_by_transport == {want: f.bytes_received}  # fails if shm was not used
        assert p_sched.shared.server.bytes_by_transport[want] == f.bytes_received
        wait_for(lambda: (p_worker.get_finished()[0] or set()) == {"p"}, 30, "the release")
        s2 = seq("d2", 2 * BS, prefill(p_sched, [1, 2], "p2"))
        assert pulled(c_sched, s2) == BS
        pool = p_sched.shared.server.pool
        assert pool.num_created == (transport != "tcp")  # the second read reused the segment
    finally:
        close(p_sched, c_sched)
    assert shm_files() <= before
    assert open_segments() == 0  # the producer's pool closed with it


def test_peers_on_other_hosts_use_tcp_and_a_forced_shm_falls_back_to_local_prefill():
    p_sched, p_worker, _ = engine("kv_producer")
    p_sched.shared.server.host_id = "another-host/boot"  # what a remote producer would say
    auto, _, _ = engine("kv_consumer", "auto")
    forced, _, _ = engine("kv_consumer", "shm")
    try:
        s = seq("d", 3 * BS, prefill(p_sched, [1, 2, 3], "p"))
        assert pulled(auto, s) == 2 * BS
        assert auto.figures.bytes_by_transport == {"tcp": auto.figures.bytes_received}
        s2 = seq("d2", 3 * BS, prefill(p_sched, [4, 5, 6], "p2"))
        assert pulled(forced, s2) == 0  # no common transport: computed here
        assert forced.figures.failures == {"transport": 1}
        # the prefill side is told at once that its blocks are not wanted
        released: set[str] = set()
        wait_for(lambda: released.update(p_worker.get_finished()[0] or ()) or
                 released == {"p", "p2"}, 30, "the releases")
    finally:
        close(p_sched, auto, forced)


def test_a_tcp_only_producer_refuses_shm_and_serves_auto_over_tcp():
    p_sched, _, _ = engine("kv_producer", "tcp")
    forced, _, _ = engine("kv_consumer", "shm")
    auto, _, _ = engine("kv_consumer", "auto")
    try:
        assert pulled(forced, seq("d", 3 * BS, prefill(p_sched, [1, 2, 3], "p"))) == 0
        assert forced.figures.failures == {"transport": 1}
        assert pulled(auto, seq("d2", 3 * BS, prefill(p_sched, [4, 5, 6], "p2"))) == 2 * BS
        assert set(auto.figures.bytes_by_transport) == {"tcp"}
    finally:
        close(p_sched, forced, auto)


def test_a_segment_that_cannot_be_mapped_falls_back_to_tcp_frames(monkeypatch):
    def refuse(self, ref, nbytes: int):
        raise PermissionError(f"/proc/{ref.pid}/fd/{ref.fd}: another container's")
    monkeypatch.setattr(MappingCache, "tensor", refuse)
    before = shm_files()
    p_sched, _, p_kv = engine("kv_producer")
    c_sched, c_worker, c_kv = engine("kv_consumer")
    try:
        s = seq("d", 3 * BS + 1, prefill(p_sched, [9, 8, 7]))
        assert pulled(c_sched, s) == 3 * BS
        load(c_sched, c_worker, s, [1, 2, 3], 3 * BS)
        assert torch.equal(c_kv[:, :, [1, 2, 3]], p_kv[:, :, [9, 8, 7]])
        assert set(c_sched.figures.bytes_by_transport) == {"tcp"}
        assert p_sched.shared.server.bytes_by_transport == {
            "tcp": c_sched.figures.bytes_received, "shm": 0}
    finally:
        close(p_sched, c_sched)
    assert shm_files() <= before and open_segments() == 0


_PRODUCER = textwrap.dedent("""
    import json, sys, time, torch
    from kvserve.engine.kv_transfer.config import KVTransferConfig
    from kvserve.engine.kv_transfer.factory import EngineInfo, make_connectors
    from kvserve.engine.kv_transfer.wire import KVLayout
    from kvserve.engine.core.sequence import Sequence
    from kvserve.engine.sample.sampling_params import SamplingParams
    lay = KVLayout(model="tiny", architecture="LlamaForCausalLM", num_layers=%d, num_kv_heads=%d,
                   head_dim=%d, block_size=%d, kv_dtype="torch.float32", tp_size=1)
    cfg = KVTransferConfig("KVServeConnector", "kv_producer",
                           {"kv_port": %d, "transport": "shm"})
    sched, worker = make_connectors(cfg, EngineInfo(lay, lay.block_size, 1, torch.device("cpu")))
    kv = torch.randn(2, lay.num_layers, 32, lay.block_size, lay.num_kv_heads, lay.head_dim)
    worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(lay.num_layers)})
    s = Sequence(1, "p", 0, list(range(3 * lay.block_size)), SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    s.finish_reason = "length"
    print(json.dumps(sched.request_finished(s, [1, 2, 3])[1]), flush=True)
    time.sleep(600)
""")


def test_a_producer_killed_mid_transfer_falls_back_and_leaves_no_file(tmp_path):
    stall = tmp_path / "stalled"
    env = {**os.environ, "KVSERVE_KV_FAULT_STALL_FILE": str(stall)}
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER % (LAYERS, HEADS, DIM, BS,
                                                                  free_port())],
                            stdout=subprocess.PIPE, text=True, env=env)
    before = shm_files()
    c_sched, _, _ = engine("kv_consumer", "shm")
    try:
        params = json.loads(proc.stdout.readline())
        s = seq("d", 3 * BS + 1, params)
        assert c_sched.get_num_new_matched_tokens(s, 0)[0] is None  # pulling
        wait_for(stall.exists, 30, "the producer to stall after half the layers")
        assert len(c_sched.shared.mappings) == 1  # its segment is mapped here
        proc.send_signal(signal.SIGKILL)
        assert pulled(c_sched, s) == 0  # computed here
        assert c_sched.figures.failures == {"transfer": 1}
    finally:
        proc.kill()
        proc.wait()
        close(c_sched)
    assert shm_files() <= before  # a memfd has no name to leave behind


def test_the_pool_reuses_segments_and_keeps_a_bounded_free_list():
    pool = SegmentPool(max_free_bytes=3 << 20)
    a = pool.take(1 << 20)
    pool.give(a)
    assert pool.take(1000 << 10) is a and pool.num_created == 1  # reused
    b = pool.take(2 << 20)  # none free that fits: a new one
    pool.give(a)
    pool.give(b)
    assert pool.free_bytes == 3 << 20 and pool.num_created == 2
    c = pool.take(4 << 20)
    pool.give(c)  # over the bound: the oldest free ones are closed
    assert pool.free_bytes <= 3 << 20
    pool.close()
    assert pool.free_bytes == 0 and open_segments() == 0


def test_tensor_parallel_shards_go_through_shared_memory():
    def side(role: str):
        cfg = KVTransferConfig("KVServeConnector", role, {"kv_port": 0, "transport": "shm"})
        info = EngineInfo(layout(tp=2), BS, 2, torch.device("cpu"))
        sched, rank0 = make_connectors(cfg, info)
        rank1 = KVServeConnector(cfg, KVConnectorRole.WORKER, info, rank=1)
        kvs = [torch.randn(2, LAYERS, BLOCKS, BS, HEADS, DIM) for _ in range(2)]
        for worker, kv in zip((rank0, rank1), kvs):
            worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(LAYERS)})
        if role == "kv_producer":
            rank0.shared.server.rank_ports = [rank0.server_port, rank1.server_port]
        return sched, (rank0, rank1), kvs

    p_sched, p_workers, p_kvs = side("kv_producer")
    c_sched, c_workers, c_kvs = side("kv_consumer")
    try:
        s = seq("d", 2 * BS + 1, prefill(p_sched, [2, 4]))
        assert pulled(c_sched, s) == 2 * BS
        c_sched.update_state_after_alloc(s, [10, 11], 2 * BS)
        meta = c_sched.build_connector_meta(None)
        for worker in c_workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
            worker.wait_for_save()
        for p_kv, c_kv in zip(p_kvs, c_kvs):
            assert torch.equal(c_kv[:, :, [10, 11]], p_kv[:, :, [2, 4]])
        f = c_sched.figures
        assert f.bytes_by_transport == {"shm": f.bytes_received}
        assert f.bytes_received == 2 * 2 * LAYERS * 2 * BS * HEADS * DIM * 4  # both ranks'
        assert p_workers[1].shared.server.bytes_by_transport["shm"] == f.bytes_received // 2
    finally:
        close(p_sched, c_sched, *p_workers, *c_workers)


def test_an_unknown_transport_is_refused():
    with pytest.raises(ConfigError, match="transport must be one of"):
        engine("kv_consumer", "udp")
