"""`kvserve.renderers`, as `vllm.renderers`."""
