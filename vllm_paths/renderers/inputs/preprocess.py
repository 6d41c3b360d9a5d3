"""`kvserve.renderers.inputs.preprocess`, as vLLM's: `parse_model_prompt`."""

from kvserve.engine.prompt_parse import parse_model_prompt

__all__ = ["parse_model_prompt"]
