"""A real Llama checkpoint whose greedy output is a fixed script, for the examples that need a
model to decide something (write `</think>`, call a tool) that a random model never does.

The script's pieces are added tokens of the tiny tokenizer. Attention and MLP outputs are zeroed,
so each position's hidden state is its token's embedding: a one-hot slot per token of the chain
(the chat template's last prompt token, then each piece). The LM head maps each slot to the next
token of the chain (the last piece to EOS), with a logit so large that any temperature picks it.
The engine runs it like any checkpoint; only a grammar's mask can steer it off the script."""

from __future__ import annotations

from pathlib import Path

from conftest import build_tiny_tokenizer

HIDDEN = 64
LOGIT = 40.0  # x sqrt(HIDDEN) after the RMS norm of a one-hot: far beyond any temperature


def build_scripted_llama(path: Path, pieces: list[str], max_position_embeddings: int = 512
                         ) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    if tok.add_tokens(pieces) != len(pieces) or len(pieces) + 1 >= HIDDEN:
        raise ValueError("each piece must be a new token, and fewer than 63 of them")
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}],
                                     add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    chain = [prompt[-1], *tok.convert_tokens_to_ids(pieces), tok.eos_token_id]
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        embed = torch.zeros(len(tok), HIDDEN)
        embed[:, 0] = 1.0  # every token off the chain shares slot 0 (no preferred successor)
        head = torch.zeros(len(tok), HIDDEN)
        for slot, (token, successor) in enumerate(zip(chain, chain[1:]), start=1):
            embed[token] = 0.0
            embed[token, slot] = 1.0
            head[successor, slot] = LOGIT
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
