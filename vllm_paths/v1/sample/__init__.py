"""`kvserve.v1.sample`, as `vllm.v1.sample`."""
