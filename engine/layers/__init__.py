"""Shared model layers: norms, rotary embeddings, the attention wrapper, MLPs, parallel and packed
linears, and the linears' quantisation methods (quantization/)."""
