"""ServerMetrics: vLLM's metric names, counters from cumulative engine figures, latencies."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.stats import EngineStats
from kvserve.service.server.metrics import ServerMetrics


def _stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0, block_size=16,
                num_total_blocks=100, num_free_blocks=100, num_cached_blocks=0,
                num_shared_blocks=0, num_cpu_blocks=0, num_free_cpu_blocks=0,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, num_evictions=0,
                kv_slots_used=0, kv_slots_allocated=0, prompt_tokens=0, generation_tokens=0)
    base.update(kw)
    return EngineStats(**base)


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(m: ServerMetrics, name: str, **labels) -> float:
    labels.setdefault("model_name", "m")
    return _samples(m)[(name, tuple(sorted(labels.items())))]


def test_vllm_names_are_exposed():
    m = ServerMetrics("m")
    m.set_cache_config(16, 100)
    m.observe_stats(_stats())
    names = {name for name, _ in _samples(m)}
    for expected in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
                     "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                     "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hit_rate",
                     "vllm:time_to_first_token_seconds_count",
                     "vllm:time_per_output_token_seconds_count",
                     "vllm:inter_token_latency_seconds_count",
                     "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                     "vllm:generation_tokens_total", "vllm:cache_config_info",
                     "kvserve:free_blocks", "kvserve:cached_blocks", "kvserve:shared_blocks",
                     "kvserve:block_allocation_seconds_count"):
        assert expected in names, expected
    assert _value(m, "vllm:cache_config_info", block_size="16", num_gpu_blocks="100") == 1


def test_gauges_follow_stats_and_counters_add_deltas():
    m = ServerMetrics("m")
    m.observe_stats(_stats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_free_blocks=75,
                           num_cached_blocks=9, num_shared_blocks=4, num_preemptions=1,
                           prefix_cache_queries=100, prefix_cache_hits=40))
    m.observe_stats(_stats(num_running=1, kv_cache_usage=0.5, num_preemptions=3,
                           prefix_cache_queries=200, prefix_cache_hits=120))
    assert _value(m, "vllm:num_requests_running") == 1
    assert _value(m, "vllm:num_requests_waiting") == 0
    assert _value(m, "vllm:gpu_cache_usage_perc") == _value(m, "vllm:kv_cache_usage_perc") == 0.5
    assert _value(m, "vllm:num_preemptions_total") == 3
    assert _value(m, "vllm:prefix_cache_queries_total") == 200
    assert _value(m, "vllm:prefix_cache_hits_total") == 120
    assert _value(m, "vllm:prefix_cache_hit_rate") == 0.6


def test_two_instances_do_not_share_a_registry():
    a, b = ServerMetrics("m"), ServerMetrics("m")
    a.observe_stats(_stats(num_running=5))
    assert _value(a, "vllm:num_requests_running") == 5
    assert _value(b, "vllm:num_requests_running") == 0


def _output(rid: str, ntok: int, finish: str | None = None, prompt_len: int = 4) -> RequestOutput:
    comp = CompletionOutput(index=0, text="x" * ntok, token_ids=list(range(ntok)),
                            finish_reason=finish)
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=list(range(prompt_len)),
                         outputs=[comp], finished=finish is not None)


def test_request_latencies_and_token_counts():
    m = ServerMetrics("m")
    m.request_added("r", arrival=10.0)
    m.observe_outputs([_output("r", 1)], now=10.5)  # first token after 0.5 s
    m.observe_outputs([_output("r", 3)], now=10.7)  # two more tokens in 0.2 s
    m.observe_outputs([_output("r", 4, "length")], now=11.0)
    assert _value(m, "vllm:time_to_first_token_seconds_count") == 1
    assert _value(m, "vllm:time_to_first_token_seconds_sum") == 0.5
    assert _value(m, "vllm:inter_token_latency_seconds_count") == 2
    assert abs(_value(m, "vllm:time_per_output_token_seconds_sum") - 0.4) < 1e-9
    assert _value(m, "vllm:prompt_tokens_total") == 4
    assert _value(m, "vllm:generation_tokens_total") == 4
    assert _value(m, "vllm:e2e_request_latency_seconds_sum") == 1.0
    assert _value(m, "vllm:request_success_total", finished_reason="length") == 1


def test_aborted_request_counts_as_abort_once():
    m = ServerMetrics("m")
    m.request_added("r", arrival=0.0)
    m.request_aborted("r")
    m.request_aborted("r")
    assert _value(m, "vllm:request_success_total", finished_reason="abort") == 1


def test_kv_tier_metrics():
    """vllm:cpu_cache_usage_perc, kvserve:offload_* from the cumulative tier figures, the prefix
    hits split device/host/disk, and the restore histogram fed by the engine's drain."""
    m = ServerMetrics("m")
    tier = dict(num_cpu_blocks=10, num_free_cpu_blocks=6, num_host_blocks=30,
                num_host_cached_blocks=12, prefix_cache_queries=200, prefix_cache_hits=120,
                prefix_cache_host_hits=80, host_blocks_stored=20, host_blocks_restored=5,
                host_blocks_evicted=2, offload_bytes_to_host=2048, offload_bytes_to_device=512,
                prefix_cache_disk_hits=16, num_disk_blocks=100, num_disk_cached_blocks=40,
                disk_blocks_stored=9, disk_blocks_restored=1, disk_blocks_evicted=3,
                disk_blocks_dropped=4, disk_bad_files=1, offload_bytes_to_disk=900,
                offload_bytes_from_disk=100)
    m.observe_stats(_stats(**tier))
    assert _value(m, "vllm:cpu_cache_usage_perc") == (4 + 12) / 40
    assert _value(m, "kvserve:offload_blocks_stored_total", tier="host") == 20
    assert _value(m, "kvserve:offload_blocks_restored_total", tier="host") == 5
    assert _value(m, "kvserve:offload_blocks_evicted_total", tier="host") == 2
    assert _value(m, "kvserve:offload_bytes_total", direction="to_device") == 512
    assert _value(m, "kvserve:offload_host_blocks", state="free") == 18
    assert _value(m, "kvserve:prefix_cache_hits_by_tier_total", tier="device") == 24
    assert _value(m, "kvserve:prefix_cache_hits_by_tier_total", tier="disk") == 16
    assert _value(m, "kvserve:offload_blocks_stored_total", tier="disk") == 9
    assert _value(m, "kvserve:offload_blocks_restored_total", tier="disk") == 1
    assert _value(m, "kvserve:offload_blocks_evicted_total", tier="disk") == 3
    assert _value(m, "kvserve:offload_disk_blocks", state="free") == 60
    assert _value(m, "kvserve:offload_disk_failures_total", reason="dropped") == 4
    assert _value(m, "kvserve:offload_disk_failures_total", reason="bad_file") == 1
    assert _value(m, "kvserve:offload_bytes_total", direction="to_disk") == 900
    assert _value(m, "kvserve:offload_bytes_total", direction="from_disk") == 100
    assert _value(m, "kvserve:prefix_cache_hit_rate_by_tier", tier="host") == 0.4
    m.observe_stats(_stats(**dict(tier, host_blocks_stored=25, offload_bytes_to_host=4096)))
    assert _value(m, "kvserve:offload_blocks_stored_total", tier="host") == 25
    assert _value(m, "kvserve:offload_bytes_total", direction="to_host") == 4096

    class Engine:
        def drain_restore_seconds(self):
            return [0.002, 0.003]

    m.after_step([], _stats(), [], Engine())
    assert _value(m, "kvserve:offload_restore_seconds_count") == 2
    assert _value(m, "kvserve:offload_restore_seconds_sum") == 0.005
