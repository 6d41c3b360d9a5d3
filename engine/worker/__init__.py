"""Execution: the model runner, tensor-parallel workers, start-up (device, dtypes) and KV sizing,
model loading."""
