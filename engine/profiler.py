"""vLLM's `llm.start_profile()` / `stop_profile()`: a torch profiler around the engine's steps,
its trace written to $KVSERVE_TORCH_PROFILER_DIR (or vLLM's $VLLM_TORCH_PROFILER_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvserve.engine.errors import ConfigError

PROFILER_DIR_ENV = ("KVSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


def profiler_dir() -> Path | None:
    for name in PROFILER_DIR_ENV:
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return None


class TorchProfiler:
    """One profiling session at a time, in the driver process (rank 0 with tensor parallelism)."""

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None

    def start(self, worker_name: str = "kvserve") -> None:
        folder = profiler_dir()
        if folder is None:
            raise ConfigError("the torch profiler is off: set KVSERVE_TORCH_PROFILER_DIR (or "
                              "VLLM_TORCH_PROFILER_DIR) to a folder for the traces before "
                              "start_profile()")
        if self._prof is not None:
            raise ConfigError("start_profile() called twice; call stop_profile() first")
        folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=True, with_stack=False,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder), worker_name))
        self._prof.start()

    def stop(self) -> None:
        """Stop and write the trace (`<worker>.<timestamp>.pt.trace.json` in the folder)."""
        if self._prof is None:
            raise ConfigError("stop_profile() without start_profile()")
        prof, self._prof = self._prof, None
        prof.stop()
