"""A prefill engine in its own process and a decode engine here, paired through shared memory
(`transport: shm`): the decode engine maps the other process's segments, its greedy answer equals
the prefill process's local one (fp32 and fp8 KV), every pulled byte came through shared memory
(counted on both sides), and nothing is left in /dev/shm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import make_llm

from kvserve import SamplingParams

_PREFILL = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, %r)
    from conftest import make_llm
    from kvserve import SamplingParams
    llm = make_llm(%r, kv_cache_dtype=%r, enable_prefix_caching=True, kv_transfer_config={
        "kv_connector": "KVServeConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"kv_port": 0, "transport": "shm"}})
    prompt = list(range(5, 5 + 70))
    local = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0),
                         use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={
        "kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)[0]
    print(json.dumps({"prompt": prompt, "local": list(local),
                      "params": out.kv_transfer_params}), flush=True)
    sys.stdin.readline()  # the decode side is done
    server = llm.llm_engine.core.kv_connector[0].shared.server
    print(json.dumps(server.bytes_by_transport), flush=True)
""")


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_decode_engine_pulls_another_process_blocks_through_shared_memory(tiny_model_dir,
                                                                            kv_dtype):
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, "-c", _PREFILL % (tests_dir, str(tiny_model_dir),
                                                                kv_dtype)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    decode = make_llm(tiny_model_dir, kv_cache_dtype=kv_dtype, enable_prefix_caching=True,
                      kv_transfer_config={
                          "kv_connector": "KVServeConnector", "kv_role": "kv_consumer",
                          "kv_connector_extra_config": {"transport": "shm"}})
    try:
        first = json.loads(proc.stdout.readline())
        out = decode.generate([first["prompt"]], SamplingParams(
            max_tokens=8, temperature=0,
            extra_args={"kv_transfer_params": first["params"]}), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == first["local"]
        figures = decode.llm_engine.core.kv_connector[0].figures
        assert figures.blocks_received == 4 and not figures.failures  # 70 tokens: 4 full
        assert figures.bytes_by_transport == {"shm": figures.bytes_received}
        proc.stdin.write("\n")
        proc.stdin.flush()
        sent = json.loads(proc.stdout.readline())
        assert sent == {"tcp": 0, "shm": figures.bytes_received}
    finally:
        proc.kill()
        proc.wait()
        decode.llm_engine.core.shutdown()
    assert set(os.listdir("/dev/shm")) <= before
