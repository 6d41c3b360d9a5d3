"""`kvserve.logger`, as `vllm.logger`: `init_logger`."""

from kvserve.engine.logger import init_logger

__all__ = ["init_logger"]
