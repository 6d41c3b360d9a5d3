"""`kvserve.config`, as `vllm.config`: `VllmConfig` is kvserve's one engine configuration,
`EngineConfig` (what a logits processor's constructor receives)."""

from kvserve.engine.config import EngineConfig as VllmConfig

__all__ = ["VllmConfig"]
