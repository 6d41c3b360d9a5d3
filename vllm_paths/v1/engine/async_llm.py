"""`kvserve.v1.engine.async_llm`, as `vllm.v1.engine.async_llm`: `AsyncLLM`."""

from kvserve.engine.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
