"""Prompt embeddings in place of token ids (vLLM's `enable_prompt_embeds`): the `EmbedsPrompt`
dict `LLM.generate` and `add_request` take, the server's base64 loader (a `torch.save`d tensor,
as vLLM's `safe_load_prompt_embeds`) and the checks every front applies before the core."""

from __future__ import annotations

import base64
import io
from typing import Any, TypedDict

import torch

from kvserve.engine.errors import InvalidRequestError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DISABLED = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."


class EmbedsPrompt(TypedDict):
    """vLLM's `EmbedsPrompt`: a [seq_len, hidden_size] tensor standing for the prompt's tokens."""

    prompt_embeds: torch.Tensor


def embeds_of(prompt: Any) -> torch.Tensor | None:
    """The embeddings of an `{"prompt_embeds": tensor}` prompt; None for text or token ids."""
    if isinstance(prompt, dict) and "prompt_embeds" in prompt:
        return prompt["prompt_embeds"]
    return None


def prompt_len(prompt: Any) -> int:
    """How many positions a prompt fills: its embeddings' rows, else its token ids."""
    embeds = embeds_of(prompt)
    if embeds is None:
        return len(prompt)
    shape = getattr(embeds, "shape", ())  # [seq, hidden], or [1, seq, hidden]
    return int(shape[-2]) if len(shape) >= 2 else len(shape)


def load_prompt_embeds(encoded: str | bytes, enabled: bool) -> torch.Tensor:
    """One base64 `torch.save`d tensor from a request, as vLLM loads it: refused unless
    enabled, unpickled with `weights_only` (no code runs), on the CPU, sparse layouts checked
    and made dense, a leading batch dimension of 1 dropped. InvalidRequestError (400) else."""
    if not enabled:
        raise InvalidRequestError(DISABLED, "prompt_embeds")
    try:
        raw = base64.b64decode(encoded, validate=True)
        # Sparse tensors are checked on load: a crafted one could index out of bounds.
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            if isinstance(tensor, torch.Tensor):
                tensor = tensor.to_dense()
    except Exception as exc:  # torch.load raises many types on bad bytes
        raise InvalidRequestError(
            "prompt_embeds must be base64 of a tensor saved with torch.save; could not load it "
            f"({type(exc).__name__})", "prompt_embeds") from exc
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(
            f"prompt_embeds must hold a tensor, got {type(tensor).__name__}", "prompt_embeds")
    return tensor.squeeze(0) if tensor.dim() > 2 else tensor


def check_prompt_embeds(tensor: Any, enabled: bool, hidden_size: int) -> torch.Tensor:
    """The embeddings as the core keeps them: a dense [seq_len, hidden_size] float tensor on
    the CPU (a leading dimension of 1 dropped); InvalidRequestError naming what is wrong."""
    if not enabled:
        raise InvalidRequestError(DISABLED, "prompt_embeds")
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(
            f"prompt_embeds must be a torch.Tensor, got {type(tensor).__name__}", "prompt_embeds")
    if tensor.dtype not in FLOAT_DTYPES:
        raise InvalidRequestError(
            f"prompt_embeds must be float32, bfloat16 or float16, got {tensor.dtype}",
            "prompt_embeds")
    if tensor.dim() > 2:
        tensor = tensor.squeeze(0)
    if tensor.dim() != 2:
        raise InvalidRequestError(
            f"prompt_embeds must have shape [seq_len, hidden_size], got {list(tensor.shape)}",
            "prompt_embeds")
    if tensor.shape[1] != hidden_size:
        raise InvalidRequestError(
            f"prompt_embeds has hidden size {tensor.shape[1]} but this model's is "
            f"{hidden_size}", "prompt_embeds")
    if tensor.shape[0] == 0:
        raise InvalidRequestError("The decoder prompt cannot be empty", "prompt_embeds")
    return tensor.detach().to("cpu").contiguous()
