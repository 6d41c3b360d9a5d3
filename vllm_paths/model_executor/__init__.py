"""`kvserve.model_executor`, as `vllm.model_executor`."""
