"""vLLM's prompt_embeds in /v1/completions on a real server, through the openai client as
vLLM's examples/online_serving/prompt_embed_inference_with_openai_client.py sends them
(extra_body={"prompt_embeds": tensor2base64(embeds)}), HF transformers fed the same
`inputs_embeds` as the reference; `kvserve serve --enable-prompt-embeds` with its engine core in
its own process (slow); vLLM's 400s (not enabled, wrong hidden size, no prompt at all, echo)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from server_thread import ServerThread
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from kvserve.utils.serial_utils import tensor2base64

TOKENS = 6
GREEDY = dict(max_tokens=TOKENS, temperature=0.0, logprobs=1)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def thread_server(model_dir, enable: bool) -> ServerThread:
    engine = LLMEngine.from_config(EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory=2 << 20,
        enable_prompt_embeds=enable))
    return ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()


def openai_client(url: str) -> openai.Client:
    return openai.Client(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(tiny_model_dir) -> Iterator[openai.Client]:
    srv = thread_server(tiny_model_dir, enable=True)
    try:
        yield openai_client(srv.url)
    finally:
        srv.stop()


def random_embeds(hf, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = hf.get_input_embeddings().weight.std().item()
    return torch.randn(n, hf.config.hidden_size, generator=gen) * scale


def hf_greedy(hf, embeds: torch.Tensor) -> tuple[list[int], list[float]]:
    """HF's greedy tokens from `inputs_embeds` and each one's logprob."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        for _ in range(TOKENS):
            rest = hf.get_input_embeddings()(torch.tensor(tokens, dtype=torch.long))
            logits = hf(inputs_embeds=torch.cat([embeds, rest])[None]).logits[0, -1]
            lp = logits.float().log_softmax(-1)
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp.max()))
    return tokens, logprobs


def check_against_hf(client: openai.Client, hf, tokenizer) -> None:
    embeds = random_embeds(hf, 11, seed=1)
    out = client.completions.create(model="tiny", prompt="", **GREEDY,
                                    extra_body={"prompt_embeds": tensor2base64(embeds),
                                                "ignore_eos": True})
    tokens, logprobs = hf_greedy(hf, embeds)
    (choice,) = out.choices
    assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs),
                               torch.tensor(logprobs), atol=2e-4, rtol=0)
    assert out.usage.prompt_tokens == 11 and out.usage.completion_tokens == TOKENS


def test_openai_client_embeds_match_hf(client, hf, tokenizer):
    check_against_hf(client, hf, tokenizer)


@pytest.mark.slow
def test_kvserve_serve_flag_with_the_engine_core_in_a_process(tiny_model_dir, tmp_path, hf,
                                                               tokenizer):
    """`--enable-prompt-embeds` on the command line, the tensors pickled to the core process
    and the outputs made by its client in the API process."""
    from server_process import api_server_process

    with api_server_process(tiny_model_dir, tmp_path / "log", "--enable-prompt-embeds",
                            engine_core="process") as (_, url):
        check_against_hf(openai_client(url), hf, tokenizer)


def test_embeds_come_before_prompts_and_stream_alike(client, hf, tokenizer):
    """A list of embeddings beside a text prompt: the embeddings' choices first (vLLM's
    order); bf16 embeddings and the [1, seq, hidden] shape are taken too; streamed the same."""
    a, b = random_embeds(hf, 7, seed=2), random_embeds(hf, 20, seed=3)
    body = {"prompt_embeds": [tensor2base64(a), tensor2base64(b.to(torch.bfloat16)[None])],
            "ignore_eos": True}
    out = client.completions.create(model="tiny", prompt="Hello there", **GREEDY,
                                    extra_body=body)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    alone = client.completions.create(model="tiny", prompt="Hello there", **GREEDY,
                                      extra_body={"ignore_eos": True})
    assert texts[2] == alone.choices[0].text
    single = client.completions.create(model="tiny", prompt="", **GREEDY,
                                       extra_body={"prompt_embeds": body["prompt_embeds"][0],
                                                   "ignore_eos": True})
    assert texts[0] == single.choices[0].text
    ref, _ = hf_greedy(hf, b.to(torch.bfloat16).float())  # the server's dtype is float32
    assert texts[1] == tokenizer.decode(ref, skip_special_tokens=True)
    assert out.usage.prompt_tokens == 7 + 20 + alone.usage.prompt_tokens
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", prompt="Hello there", stream=True,
                                           **GREEDY, extra_body=body):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt="", extra_body={"prompt_embeds": []}),
     "Either prompt or prompt_embeds must be provided and non-empty."),
    (dict(prompt=[], extra_body={}), "prompt must not be empty"),
    (dict(prompt="", extra_body={"prompt_embeds": tensor2base64(torch.zeros(3, 10))}),
     "hidden size 10"),
    (dict(prompt="", echo=True, extra_body={"prompt_embeds": tensor2base64(torch.zeros(3, 64))}),
     "Echo is unsupported with prompt embeds."),
    (dict(prompt="", extra_body={"prompt_embeds": "not base64 at all!"}), "torch.save"),
])
def test_bad_requests_are_400(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="tiny", max_tokens=2, **kwargs)


def test_refused_unless_enabled(tiny_model_dir):
    srv = thread_server(tiny_model_dir, enable=False)
    try:
        client = openai_client(srv.url)
        with pytest.raises(openai.BadRequestError,
                           match="You must set `--enable-prompt-embeds` to input `prompt_embeds`"):
            client.completions.create(model="tiny", prompt="", max_tokens=2, extra_body={
                "prompt_embeds": tensor2base64(torch.zeros(3, 64))})
    finally:
        srv.stop()
