"""Builders and checks shared by the model-family tests: a tiny random checkpoint from
transformers' own config class (norms and biases perturbed off their 1/0 init, the tiny
tokenizer saved beside it), and the engine's greedy tokens and per-token logprobs compared with
HF transformers (fp32, eager attention) teacher-forced on the same sequences."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from conftest import build_tiny_tokenizer, make_llm
from kvserve import LLM, SamplingParams

# Prompt token ids (not text: the windows must be shorter than the prompts, whatever the BPE
# merges): lengths around and well past the 11-token windows the configs use.
PROMPT_LENS = (5, 19, 37)
TOKENS = 8


def build_family(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A random `arch` checkpoint (3 layers, 4 heads / 2 KV heads, head_dim 16) + tokenizer."""
    tokenizer = build_tiny_tokenizer()
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, rms_norm_eps=1e-6,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    cfg.update(overrides)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config").replace(
        "Gemma3Config", "Gemma3TextConfig"))(**cfg)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = perturb(getattr(transformers, arch)(config).eval())
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Random biases and norms moved off their init, so a dropped bias or a mistaken norm
    formula shows in the logits (HF initialises them to 0 and to 1 or 0)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:  # 1 (Llama-style) or 0 (Gemma's 1 + w): move off either
                p.add_(0.3 * torch.randn_like(p))
    return model



def copy_with(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of checkpoint `src` at `dst` with `config_changes` set in its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config_changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def prompts(vocab: int, lens=PROMPT_LENS, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logprobs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log p(generated[i] | prompt + generated[:i]) under HF, [len(generated), vocab]."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1)


def run(llm: LLM, token_prompts: list[list[int]], **params):
    sp = SamplingParams(temperature=params.pop("temperature", 0.0),
                        max_tokens=params.pop("max_tokens", TOKENS), logprobs=1, ignore_eos=True,
                        **params)
    return llm.generate([{"prompt_token_ids": p} for p in token_prompts], sp, use_tqdm=False)


def assert_matches_hf(hf, token_prompts: list[list[int]], outputs, greedy: bool = True,
                      atol: float = 2e-4) -> None:
    """Every completion's tokens are HF's argmax (greedy) and each token's logprob is HF's."""
    for prompt, out in zip(token_prompts, outputs, strict=True):
        for completion in out.outputs:
            ref = hf_logprobs(hf, prompt, completion.token_ids)
            if greedy:
                assert completion.token_ids == ref.argmax(-1).tolist()
            # vLLM's Logprob objects (engine/outputs.py) or plain floats
            ours = torch.tensor([getattr(lp[t], "logprob", lp[t]) for t, lp in
                                 zip(completion.token_ids, completion.logprobs)])
            theirs = ref.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


def check_family(folder: Path, lens=PROMPT_LENS, max_tokens: int = TOKENS, **llm_kw) -> None:
    """Cold then warm prefix cache, chunked prefill in small steps (across every window), greedy
    and n = 2 sampled, all against HF."""
    hf = hf_model(folder)
    token_prompts = prompts(hf.config.vocab_size, lens)
    llm = make_llm(folder, block_size=8, max_num_batched_tokens=16, **llm_kw)
    try:
        cold = run(llm, token_prompts, max_tokens=max_tokens)
        assert_matches_hf(hf, token_prompts, cold)
        warm = run(llm, token_prompts, max_tokens=max_tokens)
        assert sum(o.num_cached_tokens for o in warm) > 0
        assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
        assert_matches_hf(hf, token_prompts, warm)
        sampled = run(llm, token_prompts[1:], n=2, temperature=1.0, seed=7,
                      max_tokens=max_tokens)
        assert all(len(o.outputs) == 2 for o in sampled)
        assert_matches_hf(hf, token_prompts[1:], sampled, greedy=False)
    finally:
        llm.shutdown()
