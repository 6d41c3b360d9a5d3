"""`kvserve.renderers.inputs`, as `vllm.renderers.inputs`."""
