"""`kvserve.v1.sample.logits_processor.interface`, as vLLM's: the processor contract."""

from kvserve.engine.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

__all__ = ["BatchUpdate", "LogitsProcessor", "MoveDirectionality"]
