"""Grammar matchers over speculative drafts (engine/structured_output/grammar.py): `num_valid`
cuts a draft at the first refused token and leaves the matcher as it was;
`draft_token_bitmask` fills each scored position's row as a matcher that had taken the drafts
before it would, says how far each row's drafts were allowed, and rolls every matcher back.
Both backends (an LLMatcher that consumes a refused token is broken for good, so guidance
must never be handed one)."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_tokenizer

from kvserve.engine.structured_output.grammar import GrammarCompiler
from kvserve.engine.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"enum": ["xy", "z"]}},
          "required": ["a", "b"]}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def compiler(request, tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                           backend=request.param)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def fresh(compiler, tokens: list[int]):
    state = compiler.matcher(compiler.compile(StructuredOutputsParams(json=SCHEMA)))
    state.sync(tokens)
    return state


def row_of(compiler, tokens: list[int]) -> torch.Tensor:
    """The bitmask row of a matcher that has taken `tokens` as its own output."""
    rows, mask = compiler.token_bitmask([fresh(compiler, tokens)])
    return mask[0]


def test_num_valid_cuts_at_the_first_refused_token(compiler, tokenizer):
    out = ids(tokenizer, '{"a": 1')
    state = fresh(compiler, out)
    good = ids(tokenizer, '2, "b": "z"}')
    bad = good[:3] + ids(tokenizer, "q") + good[3:]
    assert state.num_valid(good) == len(good)
    assert state.num_valid(bad) == 3
    assert state.num_valid(ids(tokenizer, "q") + good) == 0
    # the matcher is where it was: the sequence goes on with any allowed token
    state.sync(out + good)
    assert state.tokens == out + good
    eos = tokenizer.eos_token_id
    assert state.num_valid([eos, eos]) == 2  # the grammar may end here; past its end: unchecked
    assert state.num_valid(ids(tokenizer, "q")) == 0
    state.sync(out + good + [eos])
    assert state.is_terminated
    assert state.num_valid(ids(tokenizer, "anything")) == len(ids(tokenizer, "anything"))


def test_each_scored_position_is_masked_after_the_drafts_before_it(compiler, tokenizer):
    out = ids(tokenizer, '{"a": ')
    drafts = ids(tokenizer, '12, "b": "x')
    state = fresh(compiler, out)
    other = fresh(compiler, ids(tokenizer, '{"a": 3, '))  # a second seq, no drafts
    states = [state] * (len(drafts) + 1) + [None, other]
    prefixes = [drafts[:j] for j in range(len(drafts) + 1)] + [[], []]
    bitmask, reached = compiler.draft_token_bitmask(states, prefixes)
    rows, mask = bitmask
    assert rows == [j for j in range(len(drafts) + 1)] + [len(drafts) + 2]
    assert reached == [len(p) for p in prefixes]
    for j in range(len(drafts) + 1):
        assert torch.equal(mask[j], row_of(compiler, out + drafts[:j])), j
    assert torch.equal(mask[len(drafts) + 2], row_of(compiler, ids(tokenizer, '{"a": 3, ')))
    assert state.tokens == out and other.tokens == ids(tokenizer, '{"a": 3, ')
    state.sync(out + drafts)  # rolled back: the drafts are accepted again as output
    assert state.tokens == out + drafts


def test_rows_past_a_refused_draft_are_left_unconstrained(compiler, tokenizer):
    out = ids(tokenizer, '{"a": 5')
    drafts = ids(tokenizer, ', "b') + ids(tokenizer, "q") + ids(tokenizer, '": "z"}')
    refused = len(ids(tokenizer, ', "b'))
    state = fresh(compiler, out)
    prefixes = [drafts[:j] for j in range(len(drafts) + 1)]
    (rows, mask), reached = compiler.draft_token_bitmask([state] * len(prefixes), prefixes)
    assert rows == list(range(refused + 1))  # the row at the refused draft is still masked
    assert torch.equal(mask[refused], row_of(compiler, out + drafts[:refused]))
    assert reached == [min(j, refused) for j in range(len(drafts) + 1)]
    state.sync(out + drafts[:refused] + ids(tokenizer, '": "z"}'))  # the matcher still works
    assert state.num_valid([tokenizer.eos_token_id]) == 1


def test_a_draft_that_ends_the_grammar(compiler, tokenizer):
    """EOS as a draft where the grammar may end is taken; the rows after it are past the
    grammar's end (as an ignore_eos output's tokens): unconstrained."""
    out = ids(tokenizer, '{"a": 5, "b": "z"')
    eos = tokenizer.eos_token_id
    drafts = ids(tokenizer, "}") + [eos] + ids(tokenizer, "ab")
    state = fresh(compiler, out)
    prefixes = [drafts[:j] for j in range(len(drafts) + 1)]
    (rows, mask), reached = compiler.draft_token_bitmask([state] * len(prefixes), prefixes)
    assert rows == [0, 1] and reached == [0, 1, 2, 3, 4][: len(prefixes)]
    assert state.num_valid(drafts) == len(drafts)  # past the end: nothing left to check
    end = row_of(compiler, out + ids(tokenizer, "}"))
    assert torch.equal(mask[1], end)
    assert not state.is_terminated and state.tokens == out
