"""vLLM-format KV events: the config as vLLM's, the batches as vLLM's consumers decode them (a
decoder written from vLLM's definition), and the real PUB + replay sockets."""

from __future__ import annotations

import argparse

import pytest
from conftest import free_port
from vllm_kv_events import decode_batch, receive, replay, subscribe

from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.config import EngineConfig
from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.errors import ConfigError
from kvserve.engine.kv_events_zmq import (KVEventsConfig, ZmqKVEventPublisher, encode_batch,
                                          parse_kv_events_config)

TOKENS = list(range(1, 49))  # three blocks of 16
A, B, C = block_hashes(TOKENS, 16)
LINEAGE = ((A, None, tuple(TOKENS[:16])), (B, A, tuple(TOKENS[16:32])),
           (C, B, tuple(TOKENS[32:])))


def test_the_config_takes_vllms_fields_and_defaults():
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg == KVEventsConfig(True, "zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert cfg.publishes
    assert parse_kv_events_config({"enable_kv_cache_events": False}).publisher == "null"
    assert not parse_kv_events_config({"enable_kv_cache_events": True,
                                       "publisher": "null"}).publishes
    with pytest.raises(ConfigError, match="unknown field"):
        parse_kv_events_config({"enable_kv_cache_events": True, "port": 1})
    with pytest.raises(ConfigError, match="'zmq' or 'null'"):
        parse_kv_events_config({"publisher": "kafka"})
    # EngineConfig (and so LLM(...), EngineArgs and --kv-events-config) takes it as JSON text
    engine = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert engine.kv_events_config.topic == "kv"
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert EngineArgs.from_cli_args(args).create_engine_config().kv_events_config == \
        KVEventsConfig(True)


def test_a_stored_chain_is_one_blockstored_with_its_parent_and_tokens():
    event = KVEvent("stored", (B, C), lineage=LINEAGE[1:])
    batch = encode_batch(12.5, [event], 16)
    assert batch == {"ts": 12.5, "data_parallel_rank": 0, "events": [{
        "type": "BlockStored", "block_hashes": [bytes.fromhex(B), bytes.fromhex(C)],
        "parent_block_hash": bytes.fromhex(A), "token_ids": TOKENS[16:], "block_size": 16,
        "lora_id": None, "medium": "GPU", "lora_name": None}]}


def test_blocks_of_two_prompts_batched_together_become_two_chains():
    other = block_hashes([7] * 16, 16)[0]
    event = KVEvent("stored", (A, other, B), lineage=(LINEAGE[0], (other, None, (7,) * 16),
                                                        LINEAGE[1]))
    events = encode_batch(0.0, [event], 16)["events"]
    assert [(len(e["block_hashes"]), e["parent_block_hash"]) for e in events] == \
        [(1, None), (1, None), (1, bytes.fromhex(A))]


def test_removed_and_cleared_and_the_tiers_mediums():
    events = encode_batch(1.0, [KVEvent("removed", (A,)), KVEvent("stored", (B,), "host"),
                                KVEvent("cleared"), KVEvent("cleared", medium="host")], 16)
    assert events["events"] == [
        {"type": "BlockRemoved", "block_hashes": [bytes.fromhex(A)], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [bytes.fromhex(B)], "parent_block_hash": None,
         "token_ids": [], "block_size": 16, "lora_id": None, "medium": "CPU",
         "lora_name": None},
        {"type": "AllBlocksCleared"}]  # the tiers reset together: one clear
    assert encode_batch(1.0, [], 16) is None


def test_the_publisher_sends_numbered_batches_and_replays_them():
    port, replay_port = free_port(), free_port()
    pub = ZmqKVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}",
                                             replay_endpoint=f"tcp://*:{replay_port}",
                                             topic="kv"), 16)
    sub = subscribe(f"tcp://127.0.0.1:{port}", b"kv")
    try:
        got = None
        while got is None:  # a SUB socket misses what is sent before it is connected
            pub.publish([KVEvent("stored", (A,), lineage=LINEAGE[:1])])
            got = receive(sub, 200)
        pub.publish([])  # an empty step sends nothing
        pub.publish([KVEvent("removed", (A,)), KVEvent("cleared")])
        last = None
        while last is None or decode_batch(last[2])["events"][0]["type"] != "BlockRemoved":
            last = receive(sub, 10_000)
            assert last is not None
        assert got[0] == b"kv" and last[1] > got[1]
        assert decode_batch(last[2])["events"][1] == {"type": "AllBlocksCleared"}
        buffered = replay(f"tcp://127.0.0.1:{replay_port}", 0)
        assert [seq for seq, _ in buffered] == list(range(last[1] + 1))
        assert buffered[got[1]][1] == got[2] and buffered[-1][1] == last[2]
        assert [s for s, _ in replay(f"tcp://127.0.0.1:{replay_port}", last[1])] == [last[1]]
    finally:
        sub.close(linger=0)
        pub.close()


def test_the_offline_llm_publishes_its_blocks_and_the_reset(tiny_model_dir):
    from conftest import make_llm

    from kvserve import SamplingParams

    port = free_port()
    llm = make_llm(tiny_model_dir, num_gpu_blocks_override=32,
                   kv_events_config={"enable_kv_cache_events": True,
                                     "endpoint": f"tcp://*:{port}"})
    sub = subscribe(f"tcp://127.0.0.1:{port}")
    params = SamplingParams(max_tokens=1, temperature=0)
    try:
        got, k = None, 0
        while got is None:  # until the SUB socket has joined
            llm.generate({"prompt_token_ids": [k + 1] * 32}, params, use_tqdm=False)
            got = receive(sub, 1000)
            k += 1
        (stored,) = decode_batch(got[2])["events"]
        assert stored["type"] == "BlockStored" and stored["token_ids"] == [k] * 32
        assert stored["block_hashes"] == [bytes.fromhex(h) for h in block_hashes([k] * 32, 16)]
        assert llm.reset_prefix_cache()
        cleared = receive(sub, 10_000)
        assert cleared is not None and cleared[1] == got[1] + 1
        assert decode_batch(cleared[2])["events"] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(linger=0)
        llm.shutdown()


def test_the_offline_llm_refuses_events_with_its_engine_in_another_process(monkeypatch):
    from kvserve import LLM

    monkeypatch.setenv("KVSERVE_ENABLE_MULTIPROCESSING", "1")
    with pytest.raises(ConfigError, match="KVSERVE_ENABLE_MULTIPROCESSING"):
        LLM("no-such-model", kv_events_config={"enable_kv_cache_events": True})


def test_blocks_stored_without_lineage_travel_one_per_event():
    events = encode_batch(0.0, [KVEvent("stored", (A, B), "host")], 16)["events"]
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in events] == \
        [([bytes.fromhex(A)], None, []), ([bytes.fromhex(B)], None, [])]
