"""vLLM's `llm.start_profile()` / `stop_profile()`: a torch profiler around the engine's steps,
configured as vLLM's `profiler_config` ({"profiler": "torch", "torch_profiler_dir": ...}, a dict,
JSON text or a `ProfilerConfig`), or by $KVSERVE_TORCH_PROFILER_DIR / $VLLM_TORCH_PROFILER_DIR."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.engine.errors import ConfigError

if TYPE_CHECKING:
    import torch

PROFILER_DIR_ENV = ("KVSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's ProfilerConfig, the fields the torch profiler reads (vLLM's defaults). vLLM's
    "cuda" (nsys ranges) and "proton" profilers are refused by name."""

    profiler: str | None = None  # "torch", or None: off
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False

    def __post_init__(self) -> None:
        if self.profiler not in (None, "torch"):
            raise ConfigError(f"profiler_config: profiler {self.profiler!r} is not supported; "
                              "kvserve has the torch profiler (\"torch\") only")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ConfigError("profiler_config: the torch profiler needs torch_profiler_dir, "
                              "the folder for its traces")


def parse_profiler_config(value: Any) -> ProfilerConfig | None:
    """EngineConfig.profiler_config as given (None, a ProfilerConfig, a dict, JSON text, or an
    object with vLLM's attribute names) -> a ProfilerConfig; unknown keys refused by name."""
    if value is None or isinstance(value, ProfilerConfig):
        return value
    if isinstance(value, str):
        value = json.loads(value)
    values = value if isinstance(value, dict) else {
        f.name: getattr(value, f.name) for f in fields(ProfilerConfig) if hasattr(value, f.name)}
    known = {f.name for f in fields(ProfilerConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"profiler_config: {unknown} not supported; known: {sorted(known)}")
    return ProfilerConfig(**values)


def _from_environment() -> ProfilerConfig | None:
    """The environment's trace folder, as before profiler_config (shapes, no stacks, no gzip)."""
    for name in PROFILER_DIR_ENV:
        if os.environ.get(name):
            return ProfilerConfig("torch", os.environ[name], torch_profiler_with_stack=False,
                                  torch_profiler_use_gzip=False,
                                  torch_profiler_record_shapes=True)
    return None


class TorchProfiler:
    """One profiling session at a time, in the driver process (rank 0 with tensor parallelism)."""

    def __init__(self, config: ProfilerConfig | None = None) -> None:
        self.config = config
        self._prof: torch.profiler.profile | None = None

    def start(self, worker_name: str = "kvserve") -> None:
        config = self.config if self.config and self.config.profiler else _from_environment()
        if config is None:
            raise ConfigError("the torch profiler is off: pass profiler_config={'profiler': "
                              "'torch', 'torch_profiler_dir': FOLDER}, or set "
                              "KVSERVE_TORCH_PROFILER_DIR (or VLLM_TORCH_PROFILER_DIR) to a "
                              "folder for the traces before start_profile()")
        if self._prof is not None:
            raise ConfigError("start_profile() called twice; call stop_profile() first")
        self._prof = _profile(config, worker_name)
        self._prof.start()

    def stop(self) -> None:
        """Stop and write the trace (`<worker>.<timestamp>.pt.trace.json`, `.gz` with gzip)."""
        if self._prof is None:
            raise ConfigError("stop_profile() without start_profile()")
        prof, self._prof = self._prof, None
        prof.stop()


def _profile(config: ProfilerConfig, worker_name: str) -> torch.profiler.profile:
    import torch  # here: EngineConfig parses profiler_config in processes that never load torch

    folder = Path(config.torch_profiler_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, record_shapes=config.torch_profiler_record_shapes,
        with_stack=config.torch_profiler_with_stack, with_flops=config.torch_profiler_with_flops,
        profile_memory=config.torch_profiler_with_memory,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            str(folder), worker_name, use_gzip=config.torch_profiler_use_gzip))
