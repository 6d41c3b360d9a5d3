"""`kvserve.model_executor.model_loader`, as vLLM's: `ShardedStateLoader` (its file patterns)."""

from kvserve.engine.worker.sharded_state import ShardedStateLoader

__all__ = ["ShardedStateLoader"]
