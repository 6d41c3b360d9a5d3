"""The engine core in its own process (engine/engine_core/), against the same engine stepped in
this process: the same tokens, text, stop strings, logprobs and refusals; engine methods called
across as utilities; a request's extra keywords and objects carried generically."""

from __future__ import annotations

import asyncio
import os

import pytest
from conftest import make_llm

from kvserve import SamplingParams
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.engine_core.async_client import AsyncMPEngine
from kvserve.engine.engine_core.core_client import CoreClient, EngineCoreDiedError
from kvserve.engine.engine_core.mp_engine import MPLLMEngine
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.llm import MULTIPROCESSING_ENV

PROMPTS = ["The quick brown fox", "Once upon a time", "KV caches store", "Hello"]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, max_tokens=12, n=2, best_of=3, seed=7),
            SamplingParams(temperature=0.9, max_tokens=16, n=2, seed=3, ignore_eos=True)]


def _summary(outs) -> list:
    return [[(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [{t: round(v.logprob, 4) for t, v in e.items()}
                                               for e in c.logprobs])
             for c in o.outputs] + [o.prompt_token_ids, o.finished] for o in outs]


@pytest.fixture(scope="module")
def both(tiny_model_dir):
    """(the LLM stepping in this process, the LLM over an engine core process)."""
    local = make_llm(tiny_model_dir)
    mp = pytest.MonkeyPatch()
    mp.setenv(MULTIPROCESSING_ENV, "1")
    remote = make_llm(tiny_model_dir)
    mp.undo()
    assert isinstance(remote.llm_engine, MPLLMEngine)
    yield local, remote
    remote.shutdown()


def test_same_outputs_as_the_engine_in_this_process(both):
    local, remote = both
    assert _summary(remote.generate(PROMPTS, _params(), use_tqdm=False)) == \
        _summary(local.generate(PROMPTS, _params(), use_tqdm=False))


def test_stop_strings_checked_by_the_client_match_the_engine(both):
    local, remote = both
    free = local.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24,
                                                      ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a stop string the output is sure to hold
    assert stop.strip()
    for include in (False, True):
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                           include_stop_str_in_output=include)
        got, want = (llm.generate(PROMPTS[:1], p, use_tqdm=False) for llm in (remote, local))
        assert _summary(got) == _summary(want)
        assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].stop_reason == stop
        assert len(got[0].outputs[0].token_ids) < 24
    # n > 1 with a stop string: the core makes the text (one sample cannot be aborted alone)
    p = SamplingParams(temperature=0.9, max_tokens=16, n=2, seed=5, stop=[" "])
    assert _summary(remote.generate(PROMPTS[:2], p, use_tqdm=False)) == \
        _summary(local.generate(PROMPTS[:2], p, use_tqdm=False))
    # the core freed the stopped requests' blocks: nothing is left running there
    assert remote.llm_engine.get_stats().num_running == 0


def test_refusals_raise_as_in_process(both):
    _, remote = both
    with pytest.raises(InvalidRequestError) as err:  # a token id past the vocabulary
        remote.generate([[1, 10_000_000]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert err.value.param == "prompt"
    assert remote.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_engine_methods_run_in_the_core(both):
    local, remote = both
    remote.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    engine = remote.llm_engine
    assert engine.get_stats().prompt_tokens > 0
    assert engine.cached_block_hashes()  # the prompts' blocks, hashed in the core
    assert remote.reset_prefix_cache() is True
    assert engine.cached_block_hashes() == []
    assert {m.name for m in remote.get_metrics()} == {m.name for m in local.get_metrics()}
    assert engine.client.call_utility("get_num_unfinished_requests") == 0
    with pytest.raises(AttributeError):
        engine.client.call_utility("no_such_method")
    with pytest.raises(TypeError):  # the core's exception, raised here
        engine.client.call_utility("abort_request")


def test_add_request_keywords_reach_the_core(both):
    """Keywords of add_request travel as they are (how lora_request and the like cross)."""
    _, remote = both
    engine = remote.llm_engine
    engine.add_request("kw-1", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True),
                       priority=3)
    with pytest.raises(InvalidRequestError) as err:  # the core's own check of the keyword
        engine.confirm_added(["kw-1"])
    assert err.value.param == "priority"


def test_async_engine_streams_and_core_death(tiny_model_dir):
    """The server's engine over a core process: a stream, then the core killed: the open stream
    gets EngineDeadError, new requests are refused, and `error` says why."""
    from kvserve.engine.config import EngineConfig

    client = CoreClient(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                     kv_cache_memory=1 << 22, max_model_len=256))
    engine = AsyncMPEngine(client)
    dead: list[BaseException] = []
    engine.on_dead.append(dead.append)

    async def run() -> None:
        engine.start()
        stream = await engine.add_request("a", "The quick", SamplingParams(
            temperature=0, max_tokens=5, ignore_eos=True))
        outs = [o async for o in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        assert outs[-1].outputs[0].text  # detokenised here, in the client
        with pytest.raises(InvalidRequestError):
            await engine.add_request("b", [1, 10_000_000], SamplingParams(max_tokens=2))
        long = await engine.add_request("c", "The quick", SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True))
        it = aiter(long)
        await anext(it)
        client.process.kill()
        with pytest.raises(EngineDeadError):
            async for _ in it:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("d", "x", SamplingParams(max_tokens=2))
        await engine.shutdown(1)

    try:
        asyncio.run(run())
    finally:
        client.close()
    assert dead and "exit code -9" in str(engine.error)
    with pytest.raises(EngineCoreDiedError):
        engine.engine.check_health()


def test_only_engine_methods_are_calls_into_the_core(both):
    """`getattr(engine, name, None)` probes (the metrics and publisher observers use them) stay
    None for what the engine does not have, instead of becoming an RPC per step."""
    _, remote = both
    proxy = remote.llm_engine.client.engine
    assert getattr(proxy, "lora", None) is None and getattr(proxy, "no_such_method", None) is None
    assert callable(getattr(proxy, "reset_prefix_cache", None))
    assert proxy.block_size == remote.llm_engine.client.info.block_size


def test_a_script_that_never_shuts_down_exits(tiny_model_dir, tmp_path):
    """An offline script over the core process that ends without `shutdown()` exits promptly:
    the core is stopped before multiprocessing's exit hook waits for it."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "from kvserve import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_model_dir)!r}, dtype='float32', kv_cache_memory=1 << 22)\n"
        "    out = llm.generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True),\n"
        "                       use_tqdm=False)\n"
        "    print('tokens', len(out[0].outputs[0].token_ids))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={**__import__("os").environ, MULTIPROCESSING_ENV: "1"})
    assert proc.returncode == 0 and "tokens 3" in proc.stdout, proc.stderr[-2000:]


def test_lora_requests_and_adapter_calls_cross_the_split(tiny_model_dir, tmp_path):
    """A LoRARequest travels with its request and add_lora / resident_loras run in the core: the
    adapter's tokens equal the in-process engine's, and each output names its LoRARequest."""
    from lora_checks import build_adapter

    from kvserve.lora.request import LoRARequest

    adapter = build_adapter(tiny_model_dir, tmp_path / "a0", seed=10)
    kw = dict(enable_lora=True, max_loras=1, max_lora_rank=8)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    req = LoRARequest("a0", 1, str(adapter))
    local = make_llm(tiny_model_dir, **kw)
    want = [o.outputs[0].token_ids for o in
            local.generate(PROMPTS[:2], p, lora_request=req, use_tqdm=False)]
    base = [o.outputs[0].token_ids for o in local.generate(PROMPTS[:2], p, use_tqdm=False)]
    local.shutdown()
    mp = pytest.MonkeyPatch()
    mp.setenv(MULTIPROCESSING_ENV, "1")
    remote = make_llm(tiny_model_dir, **kw)
    mp.undo()
    try:
        outs = remote.generate(PROMPTS[:2], p, lora_request=req, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == want and got != base
        assert [o.lora_request for o in outs] == [req, req]  # vLLM's RequestOutput.lora_request
        assert remote.llm_engine.client.call_utility("resident_loras") == ["a0"]
    finally:
        remote.shutdown()


def test_nothing_sent_to_a_dead_core_blocks(tiny_model_dir):
    """A PUSH socket without a peer waits for one forever: an abort (a client hanging up) or a
    shutdown sent after the core died must return at once, not freeze the event loop."""
    import threading

    from kvserve.engine.config import EngineConfig
    from kvserve.engine.engine_core.messages import AbortRequests

    client = CoreClient(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                     kv_cache_memory=1 << 22, max_model_len=256))
    client.process.kill()
    client.process.join(30)
    sender = threading.Thread(target=lambda: [client.send(AbortRequests([str(i)]))
                                              for i in range(2000)], daemon=True)
    sender.start()
    sender.join(30)
    assert not sender.is_alive(), "send() blocked on a dead core"
    assert "exit code -9" in (client.death or "")
    client.close()
    assert client.closed


def test_the_core_process_starts_with_libgomps_short_spin(tiny_model_dir, monkeypatch):
    """The core runs one OpenMP team as wide as the machine, which keeps libgomp's long spin
    (engine/cpu_threads.py): its environment asks for the short one, this process's is unchanged."""
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.cpu_threads import SPIN_DEFAULT, SPIN_ENV

    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    client = CoreClient(EngineConfig(model=str(tiny_model_dir), dtype="float32",
                                     kv_cache_memory=1 << 22, max_model_len=256))
    try:
        with open(f"/proc/{client.process.pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env.get(SPIN_ENV.encode()) == SPIN_DEFAULT.encode()
        assert SPIN_ENV not in os.environ
    finally:
        client.close()
