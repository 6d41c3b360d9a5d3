"""`kvserve.v1.sample.logits_processor.builtin`, as vLLM's: `process_dict_updates`."""

from kvserve.engine.sample.logits_processor import process_dict_updates

__all__ = ["process_dict_updates"]
