"""`kvserve.distributed`, as `vllm.distributed`: `cleanup_dist_env_and_memory`."""

from kvserve.engine.distributed import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
