"""The Prometheus queries that wire autoscaling and dashboards, run against a real replica's
/metrics text: prometheus-adapter rules (series query, name mapping, metrics query), the KEDA
triggers the operator writes, and the Grafana dashboard. A renamed metric fails here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.operator.children import build_children
from kvserve.operator.pd_roles import TTFT_METRIC
from kvserve.operator.resources import CACHE_USAGE_METRIC, WAITING_METRIC
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from prometheus_client.parser import text_string_to_metric_families
from server_thread import ServerThread

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvserve"
NS, POD = "ml", "chat-engine-7d9f8b6c5d-x2k4q"  # what a PodMonitor scrape labels a replica with
# A metric name has a colon in every series we query (vllm:*, kvserve:*); PromQL functions and
# keywords have none, so this finds every vector selector of an expression.
SELECTOR = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
Series = tuple[str, dict[str, str]]


@pytest.fixture(scope="module")
def series(tiny_model_dir: Path) -> Iterator[list[Series]]:
    """Every sample line of a real replica (after one request), with the scrape's labels."""
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=128,
                                                kv_cache_memory=2 << 20, dtype="float32"))
    server = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()
    try:
        done = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert done.status_code == 200, done.text
        text = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    yield [(s.name, {**s.labels, "namespace": NS, "pod": POD})
           for family in text_string_to_metric_families(text) for s in family.samples]


def matches(matchers: str, labels: dict[str, str]) -> bool:
    for name, op, value in MATCHER.findall(matchers):
        have = labels.get(name, "")
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def unmatched(expr: str, series: list[Series]) -> list[str]:
    """Selectors of expr that select no series of the replica (expected to be [])."""
    found = SELECTOR.findall(expr)
    assert found, f"no metric selector in {expr!r}"
    return [name + matchers for name, matchers in found
            if not any(n == name and matches(matchers, labels) for n, labels in series)]


def grafana(expr: str) -> str:
    return expr.replace("$namespace", NS).replace("$service", "chat")


def adapter_rules() -> list[dict]:
    text = (CHART / "templates" / "prometheus-adapter-rules.yaml").read_text()
    body = text.split("config.yaml: |", 1)[1].rsplit("{{- end }}", 1)[0]
    return yaml.safe_load(body.replace("\n    ", "\n"))["rules"]


def test_adapter_rules_find_the_series_and_name_what_the_hpa_reads(series) -> None:
    names = set()
    for rule in adapter_rules():
        assert unmatched(rule["seriesQuery"].strip("'"), series) == []
        # The adapter renames each discovered series with matches/as; the HPA asks for `as`.
        discovered = {n for n, labels in series
                      if not unmatched(rule["seriesQuery"], [(n, labels)])}
        renamed = {re.sub(rule["name"]["matches"], rule["name"]["as"], n) for n in discovered
                   if re.search(rule["name"]["matches"], n)}
        assert renamed == {rule["name"]["as"]}
        query = (rule["metricsQuery"].replace("<<.Series>>", discovered.pop())
                 .replace("<<.LabelMatchers>>", f'namespace="{NS}",pod=~"{POD}"')
                 .replace("<<.GroupBy>>", "pod"))
        assert unmatched(query, series) == []
        names.add(rule["name"]["as"])
    # the two of every HPA, and the prefill pool's TTFT (spec.disaggregation, pd_roles.py)
    assert names == {CACHE_USAGE_METRIC, WAITING_METRIC, TTFT_METRIC}


def test_keda_triggers_select_the_replica(series) -> None:
    body = {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "chat", "namespace": NS},
            "spec": {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"},
                     "autoscaling": {"maxReplicas": 3, "engine": "keda"}}}
    scaled = next(o for o in build_children(body).objects if o["kind"] == "ScaledObject")
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert len(queries) == 2
    for query in queries:
        assert unmatched(query, series) == []


def test_dashboard_queries_select_the_replica(series) -> None:
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"].removeprefix("label_values(").rsplit(",", 1)[0]
              for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 8
    for expr in exprs:
        assert unmatched(grafana(expr), series) == [], expr


def test_a_drifted_name_or_label_is_caught(series) -> None:
    """The check above can fail: a renamed metric, or a selector for another service."""
    assert unmatched('vllm:kv_cache_usage_percent{namespace="ml"}', series)
    assert unmatched('vllm:kv_cache_usage_perc{pod=~"other-engine-.*"}', series)
    assert unmatched("vllm:time_to_first_token_bucket", series)
