"""GGUF (llama.cpp) checkpoints: find the file in a model folder, map its tensor names to the HF
names our model classes load, and stream its tensors: quantised linears as their raw blocks (the
quantisation method decodes them), everything else dequantised to fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvserve.engine.errors import ModelNotFoundError, QuantizationError
from kvserve.engine.layers.quantization.gguf import GGML_DENSE_TYPES, GGML_QUANT_TYPES, \
    GGUFConfig, dequantize_gguf
from kvserve.engine.sizing.gguf_table import ggml_type_name

# general.architecture -> the config.json model_type(s) it is served as. llama.cpp interleaves
# q_proj's and k_proj's rows for its rotary kernel in llama files only (its converter's
# LlamaModel.permute); qwen2 / qwen3 files keep HF's order, as transformers reads them.
SUPPORTED_ARCHITECTURES = {"llama": ("llama", "mistral"), "qwen2": ("qwen2",),
                           "qwen3": ("qwen3",)}
_PERMUTED_QK = ("llama",)
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # qwen3's
_NOT_LINEAR = ("model.embed_tokens", "lm_head")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (HF's names)."""
    base, _, leaf = gguf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{leaf}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{leaf}"
    raise ModelNotFoundError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")


class GGUFFile:
    """One GGUF file, memory-mapped by the `gguf` package's reader."""

    def __init__(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError as exc:
            raise ModelNotFoundError("reading GGUF files needs the `gguf` package "
                                     "(pip install gguf)") from exc
        self.path = path
        self.reader = GGUFReader(str(path))
        self.arch = arch = self.field("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise QuantizationError(f"{path.name}: GGUF architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def field(self, key: str) -> Any:
        f = self.reader.fields.get(key)
        return None if f is None else f.contents()

    def quant_config(self) -> GGUFConfig:
        """Which linears are stored quantised (by HF projection name), and with which type."""
        quantized = {}
        for t in self.reader.tensors:
            name = hf_name(t.name, self.arch).rpartition(".")[0]
            if int(t.tensor_type) in GGML_QUANT_TYPES and name not in _NOT_LINEAR:
                quantized[name] = int(t.tensor_type)
            elif int(t.tensor_type) not in GGML_DENSE_TYPES and int(t.tensor_type) not in \
                    GGML_QUANT_TYPES:
                raise QuantizationError(
                    f"GGUF tensor {t.name} is {ggml_type_name(int(t.tensor_type))}; supported: "
                    f"{', '.join(n for n, _, _ in GGML_QUANT_TYPES.values())}, F32, F16, BF16")
        return GGUFConfig(quantized)

    def weights(self, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor): quantised linears as `<proj>.qweight` (uint8 blocks, one row per
        output feature) and `<proj>.qweight_type`; the rest as fp32. llama.cpp stores a llama
        file's q_proj and k_proj rows interleaved for its rotary kernel: they are put back in
        HF's order."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES[self.arch]:
            raise QuantizationError(
                f"{self.path.name} holds a GGUF {self.arch!r} model but config.json's model_type "
                f"is {model_type!r}; put the config.json of the same model next to the file")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        permuted = self.arch in _PERMUTED_QK
        for t in self.reader.tensors:
            name = hf_name(t.name, self.arch)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml's ne is reversed
            type_id = int(t.tensor_type)
            raw = torch.from_numpy(np.array(t.data))  # a copy: the map is read-only
            base = name.rpartition(".")[0]
            if type_id in GGML_QUANT_TYPES and base not in _NOT_LINEAR:
                raw = raw.reshape(shape[0], -1)
                if permuted and base.endswith(("q_proj", "k_proj")):
                    raw = _unpermute(raw, kv_heads if base.endswith("k_proj") else heads)
                yield f"{base}.qweight", raw
                yield f"{base}.qweight_type", torch.tensor(type_id)
                continue
            dense = dequantize_gguf(raw, type_id, shape)
            if permuted and base.endswith(("q_proj", "k_proj")) and dense.dim() == 2:
                dense = _unpermute(dense, kv_heads if base.endswith("k_proj") else heads)
            yield name, dense



def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (each head's rows as (half, pair) -> (pair, half)); rows
    are whole output features, so quantised blocks move intact."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)
