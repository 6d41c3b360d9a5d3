"""`kvserve.v1.metrics.reader`, as `vllm.v1.metrics.reader`: what `LLM.get_metrics()` returns."""

from kvserve.engine.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
