"""Usage tokens read from a response body as it streams past the EPP."""

from __future__ import annotations

import json

from kvserve.service.epp.usage import UsageReader


def test_json_body_in_pieces():
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7}})
    r = UsageReader(streaming=False)
    r.feed(body[:10].encode(), False)
    assert r.tokens() == (0, 0)
    r.feed(body[10:].encode(), True)
    assert r.tokens() == (12, 7)


def test_sse_usage_chunk_split_across_reads():
    events = [{"choices": [{"delta": {"content": "hi"}}]},
              {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 4}}]
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    r = UsageReader(streaming=True)
    cut = text.index("usage") + 3
    r.feed(text[:cut].encode(), False)
    assert r.tokens() == (0, 0)
    r.feed(text[cut:].encode(), True)
    assert r.tokens() == (30, 4)


def test_no_usage_or_garbage_counts_nothing():
    r = UsageReader(streaming=True)
    r.feed(b"data: {not json\n\ndata: {\"usage\": \"x\"}\n\n", True)
    assert r.tokens() == (0, 0)
