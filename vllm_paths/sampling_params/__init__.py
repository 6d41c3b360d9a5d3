"""`kvserve.sampling_params`, where vLLM users import `SamplingParams` from (`vllm.sampling_params`)."""

from kvserve.engine.sample.beam_search import BeamSearchParams
from kvserve.engine.sample.sampling_params import RequestOutputKind, SamplingParams
from kvserve.engine.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams",
           "BeamSearchParams"]
