"""`kvserve.v1.engine`, as `vllm.v1.engine`."""
