"""The engine core in its own process (vLLM v1's EngineCore / client split): the core steps the
engine and sends one message per step; the client, in the API or `LLM` process, turns those
messages into `RequestOutput`s (detokenising there) and calls engine methods as RPCs."""

from __future__ import annotations

import os
from typing import Any

# vLLM's VLLM_ENABLE_V1_MULTIPROCESSING: 1 runs the engine core in its own process, 0 in this one
MULTIPROCESSING_ENV = "KVSERVE_ENABLE_MULTIPROCESSING"
ENGINE_CORE_MODES = ("thread", "process", "auto")


def engine_core_mode(asked: str, engine_config: Any) -> str:
    """"thread" or "process" for `--engine-core` `asked`: auto is the process on a GPU and the
    thread on a CPU, where the split measures slower (docs/perf/server.md: on a 2-core CPU the
    core's compute threads and the API process compete for the same cores)."""
    if asked not in ENGINE_CORE_MODES:
        raise ValueError(f"engine core mode {asked!r}: use one of {', '.join(ENGINE_CORE_MODES)}")
    if asked != "auto":
        return asked
    import torch

    gpu = engine_config.device != "cpu" and torch.cuda.is_available()
    return "process" if gpu else "thread"


def env_engine_core(default: str = "auto") -> str:
    """The mode `KVSERVE_ENABLE_MULTIPROCESSING` asks for: 1 process, 0 thread, unset `default`."""
    value = os.environ.get(MULTIPROCESSING_ENV, "").strip()
    if not value:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{MULTIPROCESSING_ENV}={value!r}: use 1 (the engine core in its own "
                         "process) or 0 (in this process)")
    return "process" if value == "1" else "thread"
