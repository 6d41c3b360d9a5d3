"""`kvserve.inputs`, as `vllm.inputs`: the prompt dicts `LLM.generate` takes."""

from kvserve.engine.prompt_parse import (EmbedsPrompt, PromptType, SingletonPrompt, TextPrompt,
                                         TokensPrompt)

__all__ = ["EmbedsPrompt", "PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
