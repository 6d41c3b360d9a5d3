"""`kvserve.config`, as `vllm.config`: `VllmConfig` is kvserve's one engine configuration,
`EngineConfig` (what a logits processor's constructor receives); `ProfilerConfig`."""

from kvserve.engine.config import EngineConfig as VllmConfig
from kvserve.engine.profiler import ProfilerConfig

__all__ = ["ProfilerConfig", "VllmConfig"]
