"""Pulled blocks land layer by layer inside the forward: the LayerLoader's order and errors, the
connector's start_load_kv / wait_for_layer_load / wait_for_save, and two in-process engines (a
prefill and a decode LLM on the tiny model) whose greedy answers through a transfer equal local
prefill, fp32 and fp8 KV, over shared memory and over TCP, with the load run layer by layer."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.engine.kv_transfer.layer_loader import LayerLoader


def _layers(n: int = 4) -> list[torch.Tensor]:
    return [torch.zeros(2, 8, 4, 2, 16, dtype=torch.uint8) for _ in range(n)]


def test_layer_loader_lands_each_layer_before_wait_returns():
    layers = _layers()
    payload = torch.randint(0, 255, (4, 2, 3, 4 * 2 * 16), dtype=torch.uint8)
    loader = LayerLoader([([payload], [5, 1, 6])], layers, 0)
    for i in range(4):
        loader.wait(i)
        assert torch.equal(layers[i][:, [5, 1, 6]].reshape(2, 3, -1), payload[i])
    loader.finish()
    for layer in layers:
        assert not layer[:, [0, 2, 3, 4, 7]].any()  # nothing else written


def test_layer_loader_reraises_on_the_waiting_thread():
    layers = _layers(2)
    bad = torch.zeros(2, 2, 1, 7, dtype=torch.uint8)  # a payload of the wrong size
    loader = LayerLoader([([bad], [3])], layers, 0)
    with pytest.raises(RuntimeError, match="loading pulled KV blocks failed"):
        loader.wait(0)
    with pytest.raises(RuntimeError):
        loader.finish()


def _pair(tiny_model_dir, transport: str, kv_cache_dtype: str = "auto"):
    def one(role: str):
        cfg = {"kv_connector": "KVServeConnector", "kv_role": role,
               "kv_connector_extra_config": {"kv_port": 0, "transport": transport}}
        return make_llm(tiny_model_dir, kv_transfer_config=cfg, kv_cache_dtype=kv_cache_dtype,
                        enable_prefix_caching=True)
    return one("kv_producer"), one("kv_consumer")


def _core(llm):
    return llm.llm_engine.core


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("transport,kv_dtype", [("shm", "auto"), ("tcp", "auto"),
                                                 ("auto", "fp8")])
def test_decode_through_a_transfer_equals_local_prefill(tiny_model_dir, transport, kv_dtype):
    before = _shm_files()
    prefill, decode = _pair(tiny_model_dir, transport, kv_dtype)
    try:
        prompt = list(range(5, 5 + 57))  # 3 full blocks of 16 pulled, 9 tokens computed here
        local = prefill.generate([prompt], SamplingParams(max_tokens=8, temperature=0),
                                 use_tqdm=False)[0].outputs[0].token_ids
        first = prefill.generate([prompt], SamplingParams(
            max_tokens=1, temperature=0,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)[0]
        params = first.kv_transfer_params
        assert params and params["do_remote_prefill"]
        conn = _core(decode).kv_connector[1]
        waited: list[tuple[str, bool]] = []  # (layer, whether a load was pending then)
        wait = conn.wait_for_layer_load

        def record(name: str) -> None:
            waited.append((name, conn._loader is not None))
            wait(name)
        conn.wait_for_layer_load = record
        out = decode.generate([prompt], SamplingParams(
            max_tokens=8, temperature=0, extra_args={"kv_transfer_params": params}),
            use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == list(local)
        figures = conn.figures
        assert figures.blocks_received == 3 and not figures.failures
        want = "shm" if transport in ("shm", "auto") else "tcp"
        assert figures.bytes_by_transport == {want: figures.bytes_received}
        assert conn.layerwise and figures.layerwise_loads == 1  # loaded inside the forward
        # the admitting step's forward waited for each layer, in order, while its load ran
        assert [n for n, pending in waited if pending] == ["layers.0", "layers.1"]
        stats = _core(decode).get_stats()
        assert getattr(stats, f"kv_transfer_bytes_{want}") == stats.kv_transfer_bytes_received
        server = _core(prefill).kv_connector[0].shared.server
        assert server.bytes_by_transport[want] == figures.bytes_received
    finally:
        for llm in (prefill, decode):
            _core(llm).shutdown()
    assert _shm_files() <= before  # no segment left behind
