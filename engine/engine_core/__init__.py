"""The engine core in its own process (vLLM v1's EngineCore / client split): the core steps the
engine and sends one message per step; the client, in the API or `LLM` process, turns those
messages into `RequestOutput`s (detokenising there) and calls engine methods as RPCs."""

from __future__ import annotations

import os

# vLLM's VLLM_ENABLE_V1_MULTIPROCESSING: 1 runs the engine core in its own process, 0 in this one
MULTIPROCESSING_ENV = "KVSERVE_ENABLE_MULTIPROCESSING"
ENGINE_CORE_MODES = ("thread", "process", "auto")


def engine_core_mode(asked: str) -> str:
    """"thread" or "process" for `--engine-core` `asked`: auto is the process, on a GPU and on a
    CPU alike (vLLM v1's default). With kvserve's short OpenMP spin the split measured level with
    or ahead of the thread on every CPU class (docs/perf/server.md); "thread" stays for tests and
    debugging (one process, one traceback)."""
    if asked not in ENGINE_CORE_MODES:
        raise ValueError(f"engine core mode {asked!r}: use one of {', '.join(ENGINE_CORE_MODES)}")
    return "process" if asked == "auto" else asked


def env_engine_core(default: str = "auto") -> str:
    """The mode `KVSERVE_ENABLE_MULTIPROCESSING` asks for: 1 process, 0 thread, unset `default`."""
    value = os.environ.get(MULTIPROCESSING_ENV, "").strip()
    if not value:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{MULTIPROCESSING_ENV}={value!r}: use 1 (the engine core in its own "
                         "process) or 0 (in this process)")
    return "process" if value == "1" else "thread"
