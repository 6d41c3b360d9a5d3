"""`kvserve.logprobs`, as `vllm.logprobs`: one token's `Logprob`."""

from kvserve.engine.outputs import Logprob

__all__ = ["Logprob"]
