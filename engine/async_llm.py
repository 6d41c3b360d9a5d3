"""vLLM's AsyncLLM (`vllm.v1.engine.async_llm.AsyncLLM`, also `vllm.AsyncLLMEngine`): `generate`
as an async iterator with vLLM's RequestOutputKind, `abort`, `shutdown`, and vLLM's
`pause_generation` / `resume_generation` / `is_paused`. As vLLM v1's, the engine
core runs in its own process (AsyncMPEngine over a CoreClient) by default (`--engine-core auto`'s
rule, on a GPU and a CPU alike) or with `KVSERVE_ENABLE_MULTIPROCESSING=1`; with `=0` it steps
in a thread of this process (AsyncEngine)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.sample.sampling_params import RequestOutputKind, SamplingParams


class AsyncLLM:
    """An engine for asyncio callers, as vLLM's v1 AsyncLLM.

    >>> engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="smollm2-135m-instruct"))
    >>> async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-0"): ...
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._streams: dict[str, Any] = {}  # request id -> its RequestStream, while it runs
        # Made by pause_generation in the caller's loop (a module-wide AsyncLLM may serve several
        # loops one after the other): set at resume; None while not paused.
        self._resumed: asyncio.Event | None = None
        self._drained: asyncio.Event | None = None  # pause mode "wait": set when none runs
        self._frozen = False  # paused in "keep" mode: the engine's scheduler is paused
        engine.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> AsyncLLM:
        return cls.from_vllm_config(engine_args.create_engine_config())

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AsyncLLM:
        """From an EngineConfig (kvserve's counterpart of vLLM's VllmConfig); the engine core in
        its own process or in a thread as `KVSERVE_ENABLE_MULTIPROCESSING` (unset: auto) says."""
        from kvserve.engine.engine_core import engine_core_mode, env_engine_core

        if engine_core_mode(env_engine_core()) == "process":
            from kvserve.engine.engine_core.async_client import AsyncMPEngine
            from kvserve.engine.engine_core.core_client import CoreClient

            return cls(AsyncMPEngine(CoreClient(vllm_config)))
        return cls(AsyncEngine.from_config(vllm_config))

    async def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def add_lora(self, lora_request: Any) -> bool:
        return await self.engine.add_lora(lora_request)

    async def remove_lora(self, name_or_id: str | int) -> bool:
        return await self.engine.remove_lora(name_or_id)

    async def list_loras(self) -> list[Any]:
        return await self.engine.list_loras()

    async def generate(self, prompt: str | list[int] | dict[str, Any],
                       sampling_params: SamplingParams, request_id: str,
                       *, priority: int = 0, lora_request: Any = None,
                       **_: Any) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, shaped by `sampling_params.output_kind`:
        CUMULATIVE (everything so far), DELTA (only the new tokens and text), FINAL_ONLY (one
        output, when it finishes). Leaving the loop early aborts the request."""
        if isinstance(prompt, dict) and "prompt_embeds" not in prompt:  # TextPrompt/TokensPrompt
            prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
        if self._resumed is not None:  # paused: the request starts at resume_generation()
            await self._resumed.wait()
        stream = await self.engine.add_request(request_id, prompt, sampling_params,
                                               priority=priority, lora_request=lora_request)
        kind = sampling_params.output_kind
        sent: dict[int, tuple[int, int, int]] = {}  # index -> tokens, chars, logprobs sent
        last: RequestOutput | None = None
        self._streams[request_id] = stream
        try:
            async for out in stream:
                last = out
                if kind is RequestOutputKind.FINAL_ONLY and not out.finished:
                    continue
                yield _delta(out, sent) if kind is RequestOutputKind.DELTA else out
        except _Aborted:  # abort(): one last output that says so, as vLLM's
            if last is not None:
                final = _aborted(last)
                yield _delta(final, sent) if kind is RequestOutputKind.DELTA else final
        finally:
            self._streams.pop(request_id, None)
            if not self._streams and self._drained is not None:
                self._drained.set()

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests; each one's generate() yields a last output, finish_reason "abort"."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine.abort(ids)
        for rid in ids:
            if rid in self._streams:
                self._streams[rid].put(_Aborted(rid))

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause (to update weights, say): new requests wait for resume_generation();
        in-flight ones are aborted ("abort"), finished ("wait") or frozen where they are
        ("keep": the engine's scheduler pauses, they go on at resume). `clear_cache` then
        forgets the prefix cache (not in "keep" mode, whose requests still hold their blocks)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if self._resumed is None:
            self._resumed = asyncio.Event()
        if mode == "abort":
            await self.abort(list(self._streams))
        elif mode == "wait":
            if self._streams:
                self._drained = asyncio.Event()
                await self._drained.wait()
                self._drained = None
        else:
            await self.engine._call("pause_scheduler")
            self._frozen = True
            await self._delivered()
        if clear_cache and mode != "keep":
            await self.reset_prefix_cache()

    async def _delivered(self, rounds: int = 1000) -> None:
        """Let every reader take the outputs of the steps run before the pause (they reach
        this loop before the pause's answer): once it returns, a frozen request shows no new
        token until resume_generation()."""
        for _ in range(rounds):
            if all(s._queue.empty() for s in self._streams.values()):
                return
            await asyncio.sleep(0)

    async def resume_generation(self) -> None:
        """Frozen requests go on and waiting generate() calls start."""
        if self._frozen:
            await self.engine._call("resume_scheduler")
            self._frozen = False
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            resumed.set()

    async def is_paused(self) -> bool:
        return self._resumed is not None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget the cached prefix blocks; False while running requests hold blocks."""
        return await self.engine._call("reset_prefix_cache", reset_running_requests)

    def shutdown(self) -> None:
        """Abort what runs and stop the engine thread or core process (and its tensor-parallel
        workers)."""
        self.engine.stop()
        self.engine.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self.engine.is_running


PAUSE_MODES = ("abort", "wait", "keep")
AsyncLLMEngine = AsyncLLM  # vLLM v1's `from vllm import AsyncLLMEngine` is AsyncLLM


class _Aborted(Exception):
    """Handed to a request's stream by abort()."""


def _aborted(out: RequestOutput) -> RequestOutput:
    final = copy.copy(out)
    final.finished = True
    final.outputs = [dataclasses.replace(o, finish_reason=o.finish_reason or "abort")
                     for o in out.outputs]
    return final


def _delta(out: RequestOutput, sent: dict[int, tuple[int, int, int]]) -> RequestOutput:
    """`out` (cumulative) cut to what the reader has not seen yet (vLLM's DELTA)."""
    delta = copy.copy(out)
    delta.outputs = []
    if sent:
        delta.prompt_logprobs = None  # only with the first output, as vLLM
    for o in out.outputs:
        tokens, chars, logprobs = sent.get(o.index, (0, 0, 0))
        delta.outputs.append(CompletionOutput(
            o.index, o.text[chars:], o.token_ids[tokens:], o.cumulative_logprob,
            None if o.logprobs is None else o.logprobs[logprobs:], o.finish_reason,
            o.stop_reason))
        sent[o.index] = (len(o.token_ids), len(o.text),
                         len(o.logprobs) if o.logprobs is not None else 0)
    return delta
