"""`kvserve serve <a Qwen3 folder>` as a real process: the OpenAI client gets HF's greedy
completion and its logprobs back over HTTP."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import torch
from transformers import AutoTokenizer

from conftest import free_port, wait_for
from family_checks import build_family, hf_logprobs, hf_model

PROMPT = [7, 42, 99, 150, 3, 18, 240, 77, 5, 61, 130, 12, 200, 33, 90, 4]


def health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def test_kvserve_serve_a_qwen3_folder(tmp_path):
    folder = build_family(tmp_path / "qwen3", "Qwen3ForCausalLM", use_sliding_window=True,
                          sliding_window=11, max_window_layers=1)
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.service.cli", "serve", str(folder),
             "--served-model-name", "qwen3-tiny", "--host", "127.0.0.1", "--port", str(port),
             "--kv-cache-memory", "4MiB", "--dtype", "float32", "--engine-core", "thread"],
            stdout=out,
            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or health(url) == 200, 180, "the server")
        assert proc.poll() is None, log.read_text()[-3000:]
        client = openai.Client(base_url=url + "/v1", api_key="none")
        resp = client.completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=6,
                                         temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True})
        hf = hf_model(folder)
        tokens = hf_greedy(hf, PROMPT, 6)
        choice = resp.choices[0]
        assert choice.text == AutoTokenizer.from_pretrained(folder).decode(tokens)
        ref = hf_logprobs(hf, PROMPT, tokens).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), ref,
                                   atol=2e-4, rtol=0)
    finally:
        proc.terminate()
        proc.wait(60)
