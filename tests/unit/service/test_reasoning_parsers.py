"""The reasoning parsers on text: the split of a whole output, vLLM's rules for each parser, and
the streamed split at every token boundary joining to the whole one."""

from __future__ import annotations

import pytest

from kvserve.engine.errors import ConfigError
from kvserve.service.reasoning import REASONING_PARSERS, reasoning_parser

R1 = REASONING_PARSERS["deepseek_r1"]
QWEN3 = REASONING_PARSERS["qwen3"]

# (parser, text, reasoning, content) as a whole output splits
CASES = [
    (R1, "<think>9.8 is larger</think>\n\n9.8 is greater.", "9.8 is larger", "\n\n9.8 is greater."),
    (R1, "9.8 is larger</think>9.8", "9.8 is larger", "9.8"),  # the template opened <think>
    (R1, "still thinking, cut short", "still thinking, cut short", None),
    (R1, "<think>a</think>", "a", None),
    (R1, "</think>only content", None, "only content"),
    (R1, "a</think>b</think>c<think>d", "a", "b</think>c<think>d"),  # the first end tag only
    (QWEN3, "<think>a < b</think>so b", "a < b", "so b"),
    (QWEN3, "no tags: all content </think>", None, "no tags: all content </think>"),
    (QWEN3, "<think>cut short", "cut short", None),
    (QWEN3, "x <thin", None, "x <thin"),  # a tail that only looked like a tag
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_whole_output_splits_as_vllm(parser, text, reasoning, content):
    assert parser.split(text) == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streamed_split_at_every_boundary_joins_to_the_whole(parser, text, reasoning, content):
    """Cut into two deltas at every position, and one character at a time: the deltas joined
    are the whole split (so no piece of a tag went out as text)."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        splitter = parser.splitter()
        got = [splitter.feed(p) for p in pieces] + [splitter.finish()]
        joined_r = "".join(r for r, _ in got)
        joined_c = "".join(c for _, c in got)
        assert (joined_r or None, joined_c or None) == (reasoning, content), pieces


def test_the_stream_sends_reasoning_before_the_end_tag_arrives():
    splitter = R1.splitter()
    assert splitter.feed("<think>step one") == ("step one", "")
    assert splitter.feed(" and two</thi") == (" and two", "")  # "</thi" held back
    assert splitter.feed("nk>An") == ("", "An")
    assert splitter.feed("swer") == ("", "swer")
    assert splitter.finish() == ("", "")


@pytest.mark.parametrize("parser", [R1, QWEN3])
def test_under_a_grammar_only_a_leading_think_opens_reasoning(parser):
    """A grammar writes the whole output: deepseek_r1's implied <think> is off, and tags inside
    (say) a JSON string stay content, whole and streamed one character at a time."""
    for text, split in [('{"a": "x<think>y</think>z"}', (None, '{"a": "x<think>y</think>z"}')),
                        ("no end</think>", (None, "no end</think>")),
                        (" <think>r</think>c", ("r", " c")),
                        ("<thinking", (None, "<thinking"))]:
        assert parser.split(text, constrained=True) == split
        splitter = parser.splitter(constrained=True)
        got = [splitter.feed(ch) for ch in text] + [splitter.finish()]
        assert ("".join(r for r, _ in got) or None, "".join(c for _, c in got) or None) == split


def test_qwen3_enable_thinking_false_is_all_content():
    text = "<think>x</think>y"
    assert QWEN3.split(text, template_kwargs={"enable_thinking": False}) == (None, text)
    assert QWEN3.splitter(template_kwargs={"enable_thinking": False}) is None
    assert QWEN3.split(text, template_kwargs={"enable_thinking": True}) == ("x", "y")


def test_qwen3_prompt_that_opens_think_starts_in_reasoning():
    tail = "<|im_start|>assistant\n<think>\n"
    assert QWEN3.split("because</think>answer", prompt_tail=tail) == ("because", "answer")
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False's prompt
    assert QWEN3.split("answer", prompt_tail=closed) == (None, "answer")


def test_unknown_parser_is_refused_with_the_list():
    assert reasoning_parser(None) is None
    assert reasoning_parser("qwen3") is QWEN3
    with pytest.raises(ConfigError, match="'granite'.*deepseek_r1, qwen3"):
        reasoning_parser("granite")
