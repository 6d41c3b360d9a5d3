"""kvserve: a paged KV-cache LLM engine, an OpenAI-compatible server, a prefix-aware router and
a Kubernetes operator. `from kvserve import LLM, SamplingParams` is the offline API (as vLLM's).

Names are imported lazily so that `kvserve.operator` (and its image) never pulls in torch.
"""

import os
import sys
from importlib import import_module
from pathlib import Path
from typing import Any


def _unshadow_top_level_folders() -> None:
    """Drop the checkout root from sys.path.

    The checkout's folders (kernels/, operator/, service/, engine/) are kvserve's subpackages
    (pyproject's package-dir), yet with the root on sys.path - `python -m ...` or `-c` run from
    it, where Python puts the working directory first - they also shadow top-level packages of
    the same names: transformers >= 5.25 imports HF's `kernels` package and would get ours. kvserve
    itself is found through its installed mapping, so nothing needs that entry.
    """
    root = Path(__file__).resolve().parent

    def is_root(entry: str) -> bool:
        try:
            return Path(entry or os.getcwd()).resolve() == root
        except OSError:
            return False

    sys.path[:] = [entry for entry in sys.path if not is_root(entry)]


_unshadow_top_level_folders()

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

_LAZY = {
    "LLM": "kvserve.engine.llm",
    "SamplingParams": "kvserve.engine.sampling_params",
    "RequestOutput": "kvserve.engine.outputs",
    "CompletionOutput": "kvserve.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
