"""The spec_decode counters and vLLM's "SpecDecoding metrics" log line over an interval."""

from __future__ import annotations

from kvserve.engine.spec_decode.metrics import SpecCounters, SpecLogger, log_line


def test_counters_and_line():
    c = SpecCounters()
    c.record(3, 3)
    c.record(3, 1)
    c.record(0, 0)  # no drafts: not a draft
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (2, 6, 4)
    assert c.accepted_per_pos == [2, 1, 1]
    line = log_line(c, SpecCounters(), 2.0)
    assert "Mean acceptance length: 3.00" in line  # 1 + 4 accepted / 2 drafts
    assert "Avg Draft acceptance rate: 66.7%" in line
    assert "Per-position acceptance rate: 1.000, 0.500, 0.500" in line
    before = c.copy()
    c.record(2, 0)
    assert "Mean acceptance length: 1.00" in log_line(c, before, 1.0)


def test_logger_logs_only_new_drafts(caplog):
    c = SpecCounters()
    log = SpecLogger(interval_s=0.0)
    assert log.maybe_log(c) is None
    c.record(2, 1)
    with caplog.at_level("INFO", logger="kvserve.engine"):
        assert "Accepted: 1 tokens" in log.maybe_log(c)
    assert "SpecDecoding metrics" in caplog.text
    assert log.maybe_log(c) is None
