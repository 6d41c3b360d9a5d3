"""Execution: the model runner, tensor-parallel workers, the platform (memory budget, device),
model loading."""
