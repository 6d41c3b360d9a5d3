"""The issue's client snippet, verbatim, against the real default model (slow: loads SmolLM2)."""

from __future__ import annotations

import contextlib
import io

import openai
import pytest
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig


@pytest.fixture(scope="module")
def default_server(default_model_dir):
    # float32 as the HF reference below: on a CPU with bf16 units "auto" is bfloat16, and the
    # greedy question's first token wins by 0.08 nats ("The" over "L"), within bf16's noise
    engine = LLMEngine.from_config(EngineConfig(model="smollm2-135m-instruct", dtype="float32",
                                                kv_cache_memory=256 << 20, max_model_len=2048))
    srv = ServerThread(create_app(engine, ServerConfig())).start()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_issue_snippet_verbatim(default_server):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # ---- the snippet from the issue (only the port differs) ----
        client = openai.Client(base_url=f"{default_server.url}/v1", api_key="dummy")
        response = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "Explain how the KV cache works"}],
            temperature=0.7, max_tokens=512, stream=True,
        )
        for chunk in response:
            if chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="")
    text = out.getvalue()
    assert len(text.split()) >= 20, text  # a real answer, streamed piece by piece


@pytest.mark.slow
def test_default_model_answers_greedily_as_hf_does(default_server, default_model_dir):
    """Through the OpenAI chat API (template, detokenizer, EOS as "stop"): HF's fp32 greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([list(ids)]), max_new_tokens=20, do_sample=False)[0, len(ids):]
    ref = ref.tolist()
    assert ref[-1] == tok.eos_token_id  # an answer that ends: finish_reason must say "stop"
    client = openai.Client(base_url=f"{default_server.url}/v1", api_key="dummy")
    r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0,
                                       max_tokens=20, messages=messages)
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(ref)
