"""The KV host tier end to end through the HTTP server: a uvicorn server built from the
`kvserve serve` command line with --kv-offloading-size (the CLI's own parser and config builders,
in this process: one torch import less on 2 busy cores) serves tenants whose prefixes do not fit
its device pool together; their second turns report every prefix block in usage's cached_tokens
(restored from host memory) and answer token-identically to a server without the tier."""

from __future__ import annotations

import random

import httpx
from server_thread import ServerThread
from test_api_server import metrics, start_server

from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.cli import build_serve_parser, engine_config_from_args, server_config_from_args
from kvserve.service.server.app import create_app

BLOCK, PREFIX_BLOCKS, DEVICE_BLOCKS = 16, 5, 12


def tenant_turns(tenants: int = 3) -> list[list[int]]:
    """Two rounds of tenants with a 5-block prefix each: 15 prefix blocks against a 12-block
    device pool, so each prefix is evicted before its tenant's second turn."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 380) for _ in range(PREFIX_BLOCKS * BLOCK)]
                for _ in range(tenants)]
    return [prefixes[t] + [rng.randrange(3, 380) for _ in range(5)]
            for _ in range(2) for t in range(tenants)]


def serve_turns(url: str) -> tuple[list[list[str]], list[int]]:
    """One completion at a time: each turn's greedy tokens (as logprob entries) and its
    usage.prompt_tokens_details.cached_tokens."""
    toks, cached = [], []
    for ids in tenant_turns():
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        toks.append(body["choices"][0]["logprobs"]["tokens"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return toks, cached


def test_evicted_prefixes_come_back_from_host_memory_through_the_server(tiny_model_dir,
                                                                         tmp_path):
    reference = start_server(tiny_model_dir, enable_prompt_tokens_details=True,
                             engine_kw={"num_gpu_blocks_override": DEVICE_BLOCKS,
                                        "enable_prefix_caching": False})
    try:
        want, none_cached = serve_turns(reference.url)
    finally:
        reference.stop()
    assert none_cached == [0] * 6
    args = build_serve_parser().parse_args([
        str(tiny_model_dir), "--served-model-name", "tiny", "--dtype", "float32",
        "--device", "cpu", "--kv-cache-memory", "4MiB",
        "--num-gpu-blocks-override", str(DEVICE_BLOCKS), "--kv-offloading-size", "0.01",
        "--enable-prompt-tokens-details"])
    tiered = ServerThread(create_app(LLMEngine.from_config(engine_config_from_args(args)),
                                     server_config_from_args(args))).start()
    try:
        got, cached = serve_turns(tiered.url)
        stats = metrics(tiered.url)
    finally:
        tiered.stop()
    assert got == want
    assert cached == [0, 0, 0] + [PREFIX_BLOCKS * BLOCK] * 3  # every prefix block, from a tier
    restored = sum(v for k, v in stats.items()
                   if k.startswith("kvserve:offload_blocks_restored_total"))
    assert restored == 3 * (PREFIX_BLOCKS - 1)  # each prefix's first block stayed on the device
