"""KVServeConnector without a model: two connectors over real KV tensors and a real TCP
listener. The scheduler side keeps a decode request waiting while its pull runs, then admits it
with the pulled blocks as external prefix hits (allocated, hashed, counted), the worker side
writes them bit-exactly (fp32 and fp8), the prefill side holds a finished request's blocks until
the pull confirms or the abort timeout passes, and every failure (bad params, other TP, other
layout, a peer that is gone) falls back to computing the prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import free_port, wait_for

from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from kvserve.engine.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config
from kvserve.engine.kv_transfer.factory import EngineInfo, connector_class, make_connectors
from kvserve.engine.kv_transfer.wire import KVLayout, layout_mismatch
from kvserve.engine.sample.sampling_params import SamplingParams

BS, LAYERS, BLOCKS, HEADS, DIM = 4, 3, 32, 2, 8


def layout(dtype: torch.dtype = torch.float32, **kw) -> KVLayout:
    fields = dict(model="tiny", architecture="LlamaForCausalLM", num_layers=LAYERS,
                  num_kv_heads=HEADS, head_dim=DIM, block_size=BS, kv_dtype=str(dtype),
                  tp_size=1)
    return KVLayout(**{**fields, **kw})


def engine(role: str, dtype: torch.dtype = torch.float32, timeout: float = 60.0, **kw):
    """(scheduler side, worker side, the KV cache [2, layers, blocks, bs, heads, dim])."""
    cfg = KVTransferConfig("KVServeConnector", role, {
        "kv_port": 0, "abort_request_timeout": timeout, "transfer_timeout": 10})
    lay = layout(dtype, **kw)
    info = EngineInfo(lay, lay.block_size, 1, torch.device("cpu"))
    kv = torch.randn(2, LAYERS, BLOCKS, lay.block_size, HEADS, DIM).to(dtype)
    sched, worker = make_connectors(cfg, info)
    worker.register_kv_caches({f"layers.{i}": kv[:, i] for i in range(LAYERS)})
    return sched, worker, kv


def seq(rid: str, n: int, params: dict | None, max_tokens: int = 4, first: int = 3
        ) -> Sequence:
    extra = None if params is None else {"kv_transfer_params": params}
    return Sequence(hash(rid) % 10_000, rid, 0, list(range(first, first + n)),
                    SamplingParams(max_tokens=max_tokens, extra_args=extra))


def prefill(producer, blocks: list[int], rid: str = "p") -> dict:
    s = seq(rid, len(blocks) * BS, {"do_remote_decode": True})
    s.finish_reason = "length"
    keep, params = producer.request_finished(s, blocks)
    assert keep
    return params


def pulled(consumer, s: Sequence, computed: int = 0) -> int:
    """The tokens the consumer supplies once its pull has finished."""
    got: list[int | None] = [None]

    def ready() -> bool:
        got[0] = consumer.get_num_new_matched_tokens(s, computed)[0]
        return got[0] is not None
    wait_for(ready, 30, "the pull")
    return got[0]  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_pulled_blocks_land_bit_exactly_in_the_allocated_blocks(dtype):
    p_sched, p_worker, p_kv = engine("kv_producer", dtype)
    c_sched, c_worker, c_kv = engine("kv_consumer", dtype)
    try:
        params = prefill(p_sched, [7, 3, 11, 5])
        assert params["remote_block_ids"] == [7, 3, 11, 5] and params["tp_size"] == 1
        s = seq("d", 4 * BS, params)
        assert c_sched.get_num_new_matched_tokens(s, 0) == (None, False)  # pulling
        # 4 full blocks, but the last token is always computed: 3 blocks
        assert pulled(c_sched, s) == 3 * BS
        c_sched.update_state_after_alloc(s, [20, 21, 22], 3 * BS)
        c_worker.bind_connector_metadata(c_sched.build_connector_meta(None))
        c_worker.start_load_kv()
        raw = (lambda t: t.view(torch.uint8))
        assert torch.equal(raw(c_kv[:, :, [20, 21, 22]]), raw(p_kv[:, :, [7, 3, 11]]))
        # the pull confirmed: the prefill side may free the request's blocks
        wait_for(lambda: (p_worker.get_finished()[0] or set()) == {"p"}, 30, "the release")
        assert c_sched.figures.blocks_received == 3
    finally:
        for side in (p_sched, c_sched):
            side.shutdown()


def test_blocks_the_decode_side_caches_already_are_not_pulled_again():
    p_sched, _, p_kv = engine("kv_producer")
    c_sched, c_worker, c_kv = engine("kv_consumer")
    try:
        params = prefill(p_sched, [1, 2, 3, 4, 5])
        s = seq("d", 5 * BS + 1, params)
        assert pulled(c_sched, s, computed=2 * BS) == 3 * BS  # blocks 2, 3, 4 only
        c_sched.update_state_after_alloc(s, [9, 10, 11], 3 * BS)
        c_worker.bind_connector_metadata(c_sched.build_connector_meta(None))
        c_worker.start_load_kv()
        assert torch.equal(c_kv[:, :, [9, 10, 11]], p_kv[:, :, [3, 4, 5]])
    finally:
        p_sched.shutdown()
        c_sched.shutdown()


def test_the_prefill_side_frees_unpulled_blocks_after_the_abort_timeout():
    p_sched, p_worker, _ = engine("kv_producer", timeout=0.0)
    try:
        prefill(p_sched, [1, 2])
        assert p_worker.get_finished()[0] == {"p"}
        assert p_sched.shared.registry.num_expired == 1
    finally:
        p_sched.shutdown()


def test_only_finished_single_sample_prefill_requests_are_held():
    p_sched, _, _ = engine("kv_producer")
    c_sched, _, _ = engine("kv_consumer")
    try:
        aborted = seq("a", 8, {"do_remote_decode": True})  # finish_reason None: aborted
        assert p_sched.request_finished(aborted, [1, 2]) == (False, None)
        plain = seq("b", 8, None)
        plain.finish_reason = "length"
        assert p_sched.request_finished(plain, [1, 2]) == (False, None)
        sent = seq("c", 8, {"do_remote_decode": True})
        sent.finish_reason = "stop"
        assert c_sched.request_finished(sent, [1, 2]) == (False, None)  # a consumer sends none
        assert len(p_sched.shared.registry) == 0
    finally:
        p_sched.shutdown()
        c_sched.shutdown()


def test_failures_fall_back_to_computing_the_prompt():
    p_sched, _, _ = engine("kv_producer", block_size=8)
    c_sched, _, _ = engine("kv_consumer")
    try:
        params = prefill(p_sched, [1, 2, 3])
        other_layout = seq("x", 12, params)
        assert pulled(c_sched, other_layout) == 0
        bad = seq("y", 12, {"do_remote_prefill": True, "remote_host": "127.0.0.1"})
        assert c_sched.get_num_new_matched_tokens(bad, 0) == (0, False)
        gone = seq("z", 12, {**params, "remote_port": free_port()})
        assert pulled(c_sched, gone) == 0
        other_tp = seq("w", 12, {**params, "tp_size": 2})
        assert c_sched.get_num_new_matched_tokens(other_tp, 0) == (0, False)
        assert c_sched.figures.failures == {"handshake": 2, "params": 1, "connect": 1}
    finally:
        p_sched.shutdown()
        c_sched.shutdown()


def test_layout_mismatch_names_each_difference_from_this_side():
    here = layout()
    there = layout(torch.bfloat16, model="other", block_size=16).to_json()
    why = layout_mismatch(here, there)
    assert why is not None
    for part in ("model 'other' there, 'tiny' here", "block_size 16 there, 4 here",
                 "kv_dtype 'torch.bfloat16' there, 'torch.float32' here"):
        assert part in why
    assert layout_mismatch(here, here.to_json()) is None


def test_the_scheduler_waits_for_a_pull_then_admits_with_external_hits():
    """The real Scheduler and KVCacheManager: the request waits (others go ahead) while its
    pull runs, is admitted with the pulled blocks hashed into the prefix cache and counted as
    external hits, and the prefill side's finished request keeps its blocks until sent."""
    p_sched, _, _ = engine("kv_producer")
    c_sched, _, _ = engine("kv_consumer")
    kv = KVCacheManager(BLOCKS, BS)
    sch = Scheduler(SchedulerConfig(8, 64, 1024), kv)
    sch.connector = c_sched
    try:
        params = prefill(p_sched, [1, 2, 3])
        remote, local = seq("d", 3 * BS + 2, params), seq("l", 5, None, first=100)
        for s in (remote, local):
            sch.add(s)
        out = sch.schedule()  # the pull has just started: only the other request runs
        assert [s.request_id for s in out.seqs] == ["l"] and remote in sch.waiting
        wait_for(lambda: c_sched._recv["d"].future is None or c_sched._recv["d"].future.done(),
                 30, "the pull")
        out = sch.schedule()
        i = out.seqs.index(remote)
        assert out.num_tokens[i] == 2 and remote.num_computed_tokens == 3 * BS
        assert len(out.kv_connector_metadata.loads[0][1]) == 3
        assert out.kv_connector_metadata.loads[0][1] == kv.block_ids(remote)[:3]
        assert len(kv.pool.cached) == 3  # hashed: a later request of the prompt hits them
        stats = kv.make_stats()
        assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == \
            (5 + 3 * BS + 2, 3 * BS)
        assert stats.prefix_cache_hits == 0
    finally:
        p_sched.shutdown()
        c_sched.shutdown()


def test_a_finished_producer_request_keeps_its_blocks_until_sent():
    p_sched, _, _ = engine("kv_producer")
    kv = KVCacheManager(BLOCKS, BS)
    sch = Scheduler(SchedulerConfig(8, 64, 1024), kv)
    sch.connector = p_sched
    try:
        s = seq("p", 2 * BS + 1, {"do_remote_decode": True}, max_tokens=1)
        sch.add(s)
        sch.schedule()
        kv_ids = kv.block_ids(s)
        assert len(kv_ids) == 3
        s.finish_reason = "length"
        sch.finish(s)
        assert s.kv_transfer_params["remote_block_ids"] == kv_ids
        assert kv.pool.num_free_blocks == BLOCKS - 3
        sch.free_sent({"p"})
        assert kv.pool.num_free_blocks == BLOCKS
    finally:
        p_sched.shutdown()


def test_config_and_factory():
    cfg = parse_kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert cfg.is_kv_producer and cfg.is_kv_consumer and cfg.engine_id
    assert connector_class(cfg).__name__ == "KVServeConnector"
    with pytest.raises(ConfigError, match="kv_role"):
        KVTransferConfig("KVServeConnector", "producer")
    with pytest.raises(ConfigError, match="unknown field"):
        parse_kv_transfer_config({"kv_connector": "KVServeConnector", "role": "x"})
    with pytest.raises(ConfigError, match="unknown kv_connector"):
        connector_class(KVTransferConfig("SomethingElse"))
    custom = KVTransferConfig("KVServeConnector", kv_connector_module_path=__name__)
    with pytest.raises(ConfigError, match="not found"):
        connector_class(custom)
    mine = KVTransferConfig("Custom", kv_connector_module_path=__name__)
    sched, worker = make_connectors(mine, None)
    assert (sched.role, worker.role) == (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    assert sched.get_num_new_matched_tokens(seq("q", 4, None), 0) == (0, False)


class Custom(KVConnectorBase_V1):
    """A connector loaded by module path: the base's defaults, nothing to move."""

    def start_load_kv(self, forward_context=None, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return None



def test_kv_transfer_params_cross_the_engine_core_process_boundary():
    """The core's step deltas carry a finished output's kv_transfer_params to the client's
    output processor (the server's default, `--engine-core process`)."""
    from kvserve.engine.engine_core.client_outputs import ClientOutputProcessor
    from kvserve.engine.engine_core.deltas import DeltaTracker
    from kvserve.engine.outputs import CompletionOutput, RequestOutput

    client = ClientOutputProcessor(tokenizer=None)
    client.add("r", [5, 6, 7], SamplingParams(max_tokens=1))
    params = {"do_remote_prefill": True, "remote_block_ids": [4]}
    out = RequestOutput("r", None, [5, 6, 7], [CompletionOutput(0, "", [9], None, None,
                                                                "length")],
                        finished=True, kv_transfer_params=params)
    outputs, _ = client.process(DeltaTracker().deltas([out], whole={"r"}))
    assert outputs[0].kv_transfer_params == params


def test_tensor_parallel_shards_move_rank_to_rank():
    """tp_size 2 on both sides: rank 0's server names rank 1's at the handshake; each decode
    rank loads its own shard from the same metadata, and rank 0 is told once both arrived."""
    from kvserve.engine.kv_transfer.kvserve_connector import KVServeConnector

    def side(role: str):
        cfg = KVTransferConfig("KVServeConnector", role, {"kv_port": 0})
        lay = layout(tp_size=2)
        info = EngineInfo(lay, BS, 2, torch.device("cpu"))
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
        params = prefill(p_sched, [2, 4, 6])
        assert params["tp_size"] == 2
        s = seq("d", 3 * BS + 1, params)
        assert pulled(c_sched, s) == 3 * BS
        c_sched.update_state_after_alloc(s, [10, 11, 12], 3 * BS)
        meta = c_sched.build_connector_meta(None)
        for worker in c_workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv()
        for p_kv, c_kv in zip(p_kvs, c_kvs):
            assert torch.equal(c_kv[:, :, [10, 11, 12]], p_kv[:, :, [2, 4, 6]])
        wait_for(lambda: (p_workers[0].get_finished()[0] or set()) == {"p"}, 30, "the release")
    finally:
        p_sched.shutdown()
        c_sched.shutdown()
        for w in (*p_workers, *c_workers):
            w.shutdown()
