"""Beam search through a real server with the `openai` client (vLLM's extra parameters
`use_beam_search`, `n`, `length_penalty`): the n beams come back best first, as
`LLM.beam_search` finds them, streamed or not, for completions and chat completions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import make_llm
from kvserve.engine.sample.beam_search import BeamSearchParams
from server_thread import ServerThread
from test_api_server import start_server

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    srv = start_server(tiny_model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """`LLM.beam_search`'s beams of PROMPT (width 3, 6 tokens), as the server shows them: the
    output's text without a final EOS."""
    llm = make_llm(tiny_model_dir)
    try:
        tok = llm.get_tokenizer()
        prompt = tok.encode(PROMPT)
        seqs = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6,
                                                          length_penalty=0.5))[0].sequences
        return [tok.decode(s.tokens[len(prompt):-1] if s.finish_reason == "stop"
                           else s.tokens[len(prompt):], skip_special_tokens=True)
                for s in seqs], [s.finish_reason for s in seqs]
    finally:
        llm.shutdown()


BEAM = {"use_beam_search": True, "length_penalty": 0.5}


def test_completions_return_n_beams_best_first(client, expected):
    texts, reasons = expected
    out = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=6,
                                    temperature=0, extra_body=BEAM)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == texts
    assert [c.finish_reason for c in out.choices] == reasons
    assert len(set(texts)) == 3  # three different beams


def test_a_streamed_beam_search_comes_whole_at_its_end(client, expected):
    texts, _ = expected
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=6,
                                            temperature=0, stream=True, extra_body=BEAM))
    got = ["", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == texts


def test_chat_beam_search_returns_n_choices(client):
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
          "temperature": 0}
    beams = client.chat.completions.create(n=4, extra_body={"use_beam_search": True}, **kw)
    assert len(beams.choices) == 4
    assert len({c.message.content for c in beams.choices}) == 4
    # width 1 with no length penalty's effect on one beam: greedy decoding's answer
    one = client.chat.completions.create(n=1, extra_body={"use_beam_search": True,
                                                          "length_penalty": 0.0}, **kw)
    greedy = client.chat.completions.create(**kw)
    assert one.choices[0].message.content == greedy.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"length_penalty": 2.0}, "length_penalty"),
])
def test_what_beam_search_cannot_do_is_a_400_naming_the_field(client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                  extra_body=extra)
    assert param in str(info.value)


@pytest.mark.slow
def test_kvserve_serve_with_the_engine_core_in_a_process(tiny_model_dir, tmp_path, expected):
    """`kvserve serve` as a process, its engine core in another: the core ranks the beams and
    sends them whole to the API process."""
    import openai
    from server_process import api_server_process

    texts, reasons = expected
    with api_server_process(tiny_model_dir, tmp_path / "log", engine_core="process") as (_, url):
        client = openai.Client(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=6,
                                        temperature=0, extra_body=BEAM)
    assert [c.text for c in out.choices] == texts
    assert [c.finish_reason for c in out.choices] == reasons
