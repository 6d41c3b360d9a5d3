"""Shared model layers: norms, rotary embeddings, the attention wrapper, MLPs, parallel and packed
linears."""
