"""vLLM's AsyncLLM on the tiny random Llama: from_engine_args, generate as an async iterator with
RequestOutputKind CUMULATIVE / DELTA / FINAL_ONLY, abort, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from kvserve import LLM, AsyncLLMEngine
from kvserve.engine.arg_utils import AsyncEngineArgs
from kvserve.engine.async_llm import AsyncLLM
from kvserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The quick brown fox"


def params(kind: RequestOutputKind, n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22))
    yield engine
    engine.shutdown()


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
