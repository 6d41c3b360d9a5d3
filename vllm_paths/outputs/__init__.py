"""`kvserve.outputs`, as `vllm.outputs`: what `LLM.generate` returns."""

from kvserve.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["RequestOutput", "CompletionOutput"]
