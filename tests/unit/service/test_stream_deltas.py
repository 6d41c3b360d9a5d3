"""StreamTracker: each chunk's text and the token ids that made it, a possible stop string's
characters held back together with their tokens."""

from __future__ import annotations

from kvserve.engine.outputs import CompletionOutput
from kvserve.service.server.stream_deltas import StreamTracker


def out(text: str, n: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, list(range(10, 10 + n)), None,
                            [{10 + i: float(i)} for i in range(n)], finish, None)


def deltas(tracker: StreamTracker, outputs: list[CompletionOutput]) -> list:
    got = []
    for o in outputs:
        d = tracker.delta(0, o)
        if d is not None:
            got.append((d.text, d.token_ids, [list(e) for e in d.logprobs]))
    return got


def test_without_a_hold_every_output_goes_out_whole():
    got = deltas(StreamTracker(), [out("ab", 1), out("abcd", 2), out("abcd", 3, "length")])
    assert got == [("ab", [10], [[10]]), ("cd", [11], [[11]]), ("", [12], [[12]])]


def test_held_text_keeps_its_tokens():
    """hold 3: a chunk ends at the latest output whose text is out of the held tail, with that
    output's tokens, never at a character count between two outputs."""
    outputs = [out("ab", 1), out("abcd", 2), out("abcdef", 3), out("abcdefg", 4),
               out("abcdefgh", 5, "stop")]
    got = deltas(StreamTracker(hold=3), outputs)
    assert got == [("ab", [10], [[10]]), ("cd", [11], [[11]]),
                   ("efgh", [12, 13, 14], [[12], [13], [14]])]


def test_tokens_without_text_wait_for_the_text_they_make():
    # two tokens of one character: the first makes no text yet
    got = deltas(StreamTracker(), [out("a", 1), out("a", 2), out("aé", 3), out("aé", 3, "stop")])
    assert got == [("a", [10], [[10]]), ("é", [11, 12], [[11], [12]]), ("", [], [])]
