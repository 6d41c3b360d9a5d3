"""kvserve: a paged KV-cache LLM engine, an OpenAI-compatible server, a prefix-aware router and
a Kubernetes operator. `from kvserve import LLM, SamplingParams` is the offline API (as vLLM's).

Names are imported lazily so that `kvserve.operator` (and its image) never pulls in torch.
"""

from importlib import import_module
from typing import Any

from kvserve.engine.cpu_threads import set_spin_default

set_spin_default()  # before torch loads libgomp: see engine/cpu_threads.py

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "StructuredOutputsParams", "GuidedDecodingParams", "AsyncLLMEngine", "EngineArgs",
           "AsyncEngineArgs", "RequestOutputKind", "LLMEngine", "__version__"]

_LAZY = {
    "LLM": "kvserve.engine.llm",
    "SamplingParams": "kvserve.engine.sample.sampling_params",
    "RequestOutput": "kvserve.engine.outputs",
    "CompletionOutput": "kvserve.engine.outputs",
    "Logprob": "kvserve.engine.outputs",
    "StructuredOutputsParams": "kvserve.engine.structured_output.params",
    "GuidedDecodingParams": "kvserve.engine.structured_output.params",
    "AsyncLLMEngine": "kvserve.engine.async_llm",
    "EngineArgs": "kvserve.engine.arg_utils",
    "AsyncEngineArgs": "kvserve.engine.arg_utils",
    "RequestOutputKind": "kvserve.engine.sample.sampling_params",
    "LLMEngine": "kvserve.engine.llm_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
