"""`kvserve.v1.sample.logits_processor`, as `vllm.v1.sample.logits_processor`: the batch-level
`LogitsProcessor` contract and the adapter for request-level ones."""

from kvserve.engine.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate,
                                                    LogitsProcessor, LogitsProcessors,
                                                    MoveDirectionality, RequestLogitsProcessor,
                                                    process_dict_updates)

__all__ = ["AdapterLogitsProcessor", "BatchUpdate", "LogitsProcessor", "LogitsProcessors",
           "MoveDirectionality", "RequestLogitsProcessor", "process_dict_updates"]
