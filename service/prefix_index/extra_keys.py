"""What a request mixes into its block hashes besides its tokens, computed the same way by the
router (to look the prompt up), the simulated replicas and the engine: the `cache_salt` and the
LoRA adapter, so two adapters (or two salts) never share KV blocks, as vLLM keys them by the
adapter's name (stable across replicas, unlike its per-process integer id)."""

from __future__ import annotations


def block_extra_keys(cache_salt: str | None, lora_name: str | None = None) -> object:
    """The block hash's `extra_keys` of a request: the salt alone without an adapter (the base
    model's hashes are unchanged), else the adapter's name and the salt."""
    if lora_name is None:
        return cache_salt
    return ("lora", lora_name, cache_salt)
