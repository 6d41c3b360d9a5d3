"""`kvserve.v1.metrics`, as `vllm.v1.metrics`."""
