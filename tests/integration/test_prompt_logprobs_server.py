"""prompt_logprobs and echo with logprobs through the real openai client against a real uvicorn
server on the tiny random Llama; values checked against HF transformers' log_softmax."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from server_thread import ServerThread
from test_api_server import start_server
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "Paged attention stores the KV cache in fixed-size blocks, like virtual memory pages."


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    # 32-token steps: the prompt's logprobs are gathered over several prefill chunks
    srv = start_server(tiny_model_dir, engine_kw={"max_num_batched_tokens": 32})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """text -> (prompt ids, HF's log_softmax at every position)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return tok, run


def check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        entry = {int(t): e for t, e in entries[j].items()}  # JSON keys are strings
        assert set(entry[ids[j]]) == {"logprob", "rank", "decoded_token"}
        assert entry[ids[j]]["logprob"] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
        top = sorted((e for e in entry.values() if e["rank"] <= k), key=lambda e: e["rank"])
        assert [e["logprob"] for e in top] == pytest.approx(ref[j - 1].topk(k).values.tolist(),
                                                            abs=1e-4)


def test_completions_prompt_logprobs_on_the_choice(client, hf):
    tok, run = hf
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    ids = tok.encode(PROMPT)
    assert out.usage.prompt_tokens == len(ids)
    check_prompt_logprobs(out.choices[0].model_extra["prompt_logprobs"], ids, run(ids), 2)


def test_chat_prompt_logprobs_on_the_response(client, hf):
    tok, run = hf
    messages = [{"role": "user", "content": PROMPT}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                         temperature=0, extra_body={"prompt_logprobs": 1})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    check_prompt_logprobs(out.model_extra["prompt_logprobs"], list(ids), run(list(ids)), 1)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           temperature=0)
    assert plain.model_extra.get("prompt_logprobs") is None


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(client, hf):
    tok, run = hf
    ids = tok.encode(PROMPT)
    ref = run(ids)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                      logprobs=2)
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                     logprobs=2, echo=True)
    c, p = echo.choices[0], plain.choices[0]
    assert c.text == PROMPT + p.text
    lp = c.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + len(p.logprobs.tokens)
    assert "".join(lp.tokens[:n]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, n):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
        assert len(lp.top_logprobs[j]) >= 1
    assert lp.text_offset[0] == 0
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:j])) for j in range(n)]
    # the completion's part is the plain request's, its offsets moved past the prompt
    assert lp.tokens[n:] == p.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(p.logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[n:] == [len(PROMPT) + o for o in p.logprobs.text_offset]


def test_echo_with_max_tokens_zero_scores_the_prompt(client, hf):
    tok, run = hf
    ids = tok.encode(PROMPT)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=0, temperature=0)
    c = out.choices[0]
    assert c.text == PROMPT
    assert len(c.logprobs.tokens) == len(ids)
    total = sum(c.logprobs.token_logprobs[1:])
    assert total == pytest.approx(float(sum(run(ids)[j - 1, ids[j]] for j in range(1, len(ids)))),
                                  abs=1e-3)


def test_streamed_echo_with_logprobs_matches_the_whole_answer(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, lps, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    n = len(tokens) - 6  # the prompt's tokens come first, in the first chunk
    assert offsets[:n + 1] == whole.logprobs.text_offset[:n + 1]
    assert offsets[n] == len(PROMPT)  # the completion's offsets continue after the prompt
    assert lps[0] is None and lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:],
                                                       abs=1e-5)
