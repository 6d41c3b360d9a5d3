"""A random-weight model for bench/serve.py where the default model cannot be fetched (a lent
GPU has no network): the default model's shape (Llama, 30 layers, hidden 576, 9 heads, 3 KV
heads) or, with KV_BENCH_SMOKE=1, two layers of width 64; a byte-level BPE tokenizer trained on
the benchmark's own text, with SmolLM2's chat template and special tokens.

    python bench/serve_model.py FOLDER
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def build(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).parent))
    from serve import SYSTEM_PROMPT, TOPICS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([SYSTEM_PROMPT, *TOPICS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    smoke = os.environ.get("KV_BENCH_SMOKE") == "1"
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2) if smoke else dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **shape)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
