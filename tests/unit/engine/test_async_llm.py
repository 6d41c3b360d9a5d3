"""vLLM's AsyncLLM on the tiny random Llama: from_engine_args, generate as an async iterator with
RequestOutputKind CUMULATIVE / DELTA / FINAL_ONLY, abort, shutdown; each with the engine stepped in
a thread and with the engine core in its own process (KVSERVE_ENABLE_MULTIPROCESSING=0 / 1),
against the offline LLM stepping in this process."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvserve import LLM, AsyncLLMEngine
from kvserve.engine.arg_utils import AsyncEngineArgs
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.engine_core import MULTIPROCESSING_ENV
from kvserve.engine.engine_core.async_client import AsyncMPEngine
from kvserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The quick brown fox"


def params(kind: RequestOutputKind, n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind)


def make_engine(model_dir) -> AsyncLLM:
    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22,
        enable_prompt_embeds=True))


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request, tiny_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv(MULTIPROCESSING_ENV, "1" if request.param == "process" else "0")
    engine = make_engine(tiny_model_dir)
    mp.undo()
    if request.param == "process":  # vLLM v1's AsyncLLM: the core steps in another process
        assert isinstance(engine.engine, AsyncMPEngine)
        core = engine.engine.client.process
        assert core.is_alive() and core.pid != os.getpid()
    else:
        assert type(engine.engine) is AsyncEngine
    yield engine
    engine.shutdown()
    if request.param == "process":
        assert not core.is_alive()


def test_default_follows_engine_core_auto(tiny_model_dir, monkeypatch):
    """Unset, the mode is `--engine-core auto`'s: the core in its own process, on this CPU as on
    a GPU (vLLM v1's default); a value that is neither 0 nor 1 is refused by name."""
    monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    engine = make_engine(tiny_model_dir)
    try:
        assert isinstance(engine.engine, AsyncMPEngine)
        assert engine.engine.client.process.pid != os.getpid()
    finally:
        engine.shutdown()
    monkeypatch.setenv(MULTIPROCESSING_ENV, "yes")
    with pytest.raises(ValueError, match=MULTIPROCESSING_ENV):
        make_engine(tiny_model_dir)


async def collect(engine: AsyncLLM, kind: RequestOutputKind, rid: str) -> list:
    return [out async for out in engine.generate(PROMPT, params(kind), rid)]


def test_output_kinds_follow_vllm(engine, llm: LLM):
    want = llm.generate(PROMPT, params(RequestOutputKind.CUMULATIVE), use_tqdm=False)[0]
    want_ids, want_text = want.outputs[0].token_ids, want.outputs[0].text
    cumulative = asyncio.run(collect(engine, RequestOutputKind.CUMULATIVE, "c"))
    delta = asyncio.run(collect(engine, RequestOutputKind.DELTA, "d"))
    final = asyncio.run(collect(engine, RequestOutputKind.FINAL_ONLY, "f"))
    assert AsyncLLMEngine is AsyncLLM
    assert cumulative[-1].outputs[0].token_ids == want_ids and cumulative[-1].finished
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids[:len(a.outputs[0].token_ids)]
               for a, b in zip(cumulative, cumulative[1:]))
    # DELTA: the pieces, joined, are the whole answer; none repeats what came before
    assert [t for o in delta for t in o.outputs[0].token_ids] == want_ids
    assert "".join(o.outputs[0].text for o in delta) == want_text
    assert len(delta) > 1 and all(o.outputs[0].token_ids for o in delta)
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == want_ids


def test_prompt_embeds_give_the_token_prompts_output(engine, llm: LLM, tiny_model_dir):
    """vLLM's EmbedsPrompt: HF's embedding rows of the prompt's ids give its output (the
    tensor crosses to the core process too); no prompt token ids come back."""
    import torch
    from transformers import AutoModelForCausalLM

    want = llm.generate(PROMPT, params(RequestOutputKind.CUMULATIVE), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(want.prompt_token_ids))

    async def run() -> list:
        return [out async for out in engine.generate(
            {"prompt_embeds": embeds}, params(RequestOutputKind.CUMULATIVE), "e")]
    outs = asyncio.run(run())
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[-1].outputs[0].text == want.outputs[0].text
    assert outs[-1].prompt_token_ids is None
    assert outs[-1].num_prompt_tokens == len(want.prompt_token_ids)


def test_abort_ends_the_stream(engine):
    async def run() -> list:
        outs = []
        async for out in engine.generate(PROMPT, params(RequestOutputKind.DELTA, 400), "a"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("a")
        return outs

    outs = asyncio.run(run())
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 400
