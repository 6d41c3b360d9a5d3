"""GGUF files written from a tiny dense Llama, Qwen2 or Qwen3 with the `gguf` package's own writer
and quantisers (llama.cpp's q/k row permutation applied to llama files, as its converter does;
its Qwen2 / Qwen3 converters keep HF's order), with the metadata transformers reads a GGUF's
config from, plus the dense reference whose weights are the `gguf` package's dequantisation of
the same blocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{layer}.{_LAYER[module]}.{leaf}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute of q_proj / k_proj rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def q4_k_blocks(rows: int, cols: int, seed: int, flat_block: bool = True) -> np.ndarray:
    """Random Q4_K super-blocks (uint8 [rows, cols / 256 * 144]) with weights of about +-0.3;
    with `flat_block`, the first one has d = 0 (every weight equals its -dmin * m)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    d = rng.uniform(3e-4, 9e-4, n).astype(np.float16)
    dmin = rng.uniform(2e-3, 6e-3, n).astype(np.float16)
    if flat_block:
        d[0] = 0
    blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def _metadata(writer, config: dict) -> None:
    """The architecture keys llama.cpp's converter writes (transformers reads the config back
    from them)."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    if theta:
        writer.add_rope_freq_base(float(theta))
    writer.add_vocab_size(config["vocab_size"])


def write_gguf(dense: Path, out: Path, types: dict[str, str], reference: Path,
               arch: str = "llama") -> Path:
    """`types`: HF module suffix (e.g. "mlp.down_proj", "embed_tokens") -> ggml type name of
    its weight; tensors not named (and biases, norms) stay F32. `out` gets config.json, the
    tokenizer and model.gguf."""
    import gguf
    from safetensors.torch import load_file, save_file

    config = json.loads((dense / "config.json").read_text())
    state = load_file(dense / "model.safetensors")
    out.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(out / "model.gguf"), arch)
    _metadata(writer, config)
    ref_state = {}
    for i, (name, tensor) in enumerate(sorted(state.items())):
        w = tensor.float().numpy()
        heads = {"q_proj": config["num_attention_heads"],
                 "k_proj": config["num_key_value_heads"]}.get(name.split(".")[-2])
        if arch != "llama" or w.ndim != 2:
            heads = None
        if heads:
            w = llama_cpp_permute(w, heads)
        kind = next((t for k, t in types.items() if name.rsplit(".", 1)[0].endswith(k)), "F32")
        if w.ndim != 2:
            kind = "F32"
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            data = w
        elif kind == "Q4_K":
            data = q4_k_blocks(w.shape[0], w.shape[1], seed=i)
        else:
            data = gguf.quants.quantize(w, qtype)
        writer.add_tensor(gguf_name(name), data, raw_dtype=None if kind == "F32" else qtype)
        deq = data if kind == "F32" else gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if heads:  # transformers' reverse permutation, back to HF's row order
            deq = deq.reshape(heads, deq.shape[0] // heads // 2, 2, *deq.shape[1:]) \
                .swapaxes(2, 1).reshape(deq.shape)
        ref_state[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shutil.copytree(dense, reference)
    save_file(ref_state, reference / "model.safetensors")
    for f in dense.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out
