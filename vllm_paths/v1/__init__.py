"""`kvserve.v1`, as `vllm.v1`: vLLM's engine paths (`v1.engine.async_llm`, `v1.metrics.reader`,
`v1.sample.logits_processor`) over kvserve's engine, which has one version."""
