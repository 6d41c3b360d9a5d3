"""GGUF files served quantised: Q8_0 / Q4_0 / Q4_1 / Q4_K blocks decode exactly as the `gguf`
package dequantises them; a GGUF written from a tiny Llama gives the greedy tokens and logprobs
of the dense model holding the package's dequantised weights; the default model's own Q4_1 GGUF
matches its float expansion; sizing reads the GGUF's bytes; unsupported types are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama, make_llm
from gguf_writer import q4_k_blocks, write_gguf
from quant_checkpoints import hf_model
from test_compressed_tensors import assert_matches_reference

from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization import QuantLinear
from kvserve.engine.layers.quantization.gguf import decode_blocks
from kvserve.engine.sizing.weights_size import local_checkpoint

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_blocks_decode_as_the_gguf_package_dequantises_them(kind):
    rows, cols = 16, 512
    if kind == "Q4_K":
        raw = q4_k_blocks(rows, cols, seed=1)
    else:
        w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        w[0, :32] = 0.25  # a constant block: Q4_1's scale is 0 there
        raw = gguf.quants.quantize(w, Q[kind])
    want = gguf.quants.dequantize(raw, Q[kind]).reshape(rows, cols)
    got = decode_blocks(torch.from_numpy(raw), int(Q[kind]), rows, cols)
    assert got.bits == (8 if kind == "Q8_0" else 4) and got.group_size == 32
    lo, hi = (-128, 127) if kind == "Q8_0" else (-8, 7)
    assert got.values.dtype == torch.int8
    assert lo <= int(got.values.min()) and int(got.values.max()) <= hi
    np.testing.assert_allclose(got.dequantize().numpy(), want, rtol=1e-6,
                               atol=1e-6 * np.abs(want).max())


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("gguf") / "dense", seed=7,
                            intermediate_size=256)


TYPES = {"layers.0.self_attn.q_proj": "Q4_0", "layers.0.self_attn.k_proj": "Q4_0",
         "layers.0.self_attn.v_proj": "Q4_0", "layers.1.self_attn.q_proj": "Q8_0",
         "layers.1.self_attn.k_proj": "Q8_0", "layers.1.self_attn.v_proj": "Q8_0",
         "o_proj": "Q4_1", "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q4_K",
         "embed_tokens": "Q8_0"}


def test_a_gguf_serves_quantised_as_its_dequantised_dense_model(dense_dir, tmp_path):
    folder = write_gguf(dense_dir, tmp_path / "q", TYPES, tmp_path / "ref")
    assert not list(folder.glob("*.safetensors"))  # the .gguf is found without the flag
    llm = make_llm(folder)
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 8
    assert {type(m.kernel).__name__ for m in linears} == {"Int4WeightLinear", "DequantLinear"}
    for lin in linears:  # kept quantised: fewer bytes than a 16-bit dense weight
        held = sum(b.numel() * b.element_size() for b in lin.kernel.buffers())
        assert held < 2 * lin.in_features * lin.out_features
    assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)


def test_sizing_reads_the_gguf_bytes(dense_dir, tmp_path):
    """The torch-free header reader (the operator's and `kvserve plan`'s) sizes a GGUF-only
    folder from its tensor table: each tensor at its stored bytes, named by its ggml type."""
    folder = write_gguf(dense_dir, tmp_path / "q", TYPES, tmp_path / "ref")
    reader = gguf.GGUFReader(str(folder / "model.gguf"))
    weights = local_checkpoint(folder).weights
    assert weights.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert weights.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert weights.bytes_by_dtype["Q4_K"] == sum(int(t.n_bytes) for t in reader.tensors
                                                 if t.tensor_type == Q.Q4_K)
    dense = local_checkpoint(tmp_path / "ref").weights
    assert weights.total_bytes < dense.total_bytes / 2


def test_unsupported_gguf_types_are_refused_by_name(dense_dir, tmp_path):
    folder = write_gguf(dense_dir, tmp_path / "q", {"down_proj": "Q5_0"}, tmp_path / "ref")
    with pytest.raises(QuantizationError, match=r"blk\.0\.ffn_down\.weight is Q5_0.*Q4_K"):
        make_llm(folder)


@pytest.mark.slow
def test_the_default_models_gguf_matches_its_float_expansion(default_model_dir):
    """The wheel's Q4_1 GGUF (Q8_0 embedding) served quantised gives the greedy tokens of the
    fp32 folder that transformers expanded from the same file, teacher-forced logprobs close."""
    llm = make_llm(default_model_dir, quantization="gguf", kv_cache_memory=1 << 24)
    kinds = {m.method.description for m in llm.llm_engine.runner.model.modules()
             if isinstance(m, QuantLinear)}
    assert kinds == {"GGUF Q4_1"}
    assert_matches_reference(llm, hf_model(default_model_dir), atol=2e-3)


def test_tensor_parallel_ranks_keep_their_rows_and_groups_of_a_gguf(dense_dir, tmp_path):
    """Over 2 ranks each keeps its heads' rows of q/k/v (after llama.cpp's row order is undone)
    and its 32-column groups of o_proj / down_proj, with their scales and offsets."""
    folder = write_gguf(dense_dir, tmp_path / "q", TYPES, tmp_path / "ref")
    llm = make_llm(folder, tensor_parallel_size=2)
    try:
        assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)
    finally:
        llm.llm_engine.shutdown()


QWEN_TYPES = {"q_proj": "Q8_0", "k_proj": "Q8_0", "v_proj": "Q8_0", "o_proj": "Q4_0",
              "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q4_K"}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_ggufs_serve_quantised_as_transformers_reads_them(arch, tmp_path):
    """qwen2 (q/k/v biases) and qwen3 (q/k norms) files keep HF's q/k row order; served
    quantised they give the greedy tokens and logprobs of the package-dequantised dense model
    and (qwen2) of transformers' own GGUF loader on the same file."""
    from family_checks import build_family
    from transformers import AutoModelForCausalLM

    hf_arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    dense = build_family(tmp_path / "dense", hf_arch, seed=4, intermediate_size=256)
    folder = write_gguf(dense, tmp_path / "q", QWEN_TYPES, tmp_path / "ref", arch=arch)
    llm = make_llm(folder)
    linears = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 3 * 4
    assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)
    if arch == "qwen3":  # transformers' GGUF config reader leaves qwen3's head_dim at 128
        return
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf",
                                                  dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    assert_matches_reference(llm, theirs, atol=2e-4)


def test_other_gguf_architectures_are_refused_naming_the_supported(tmp_path):
    folder = tmp_path / "q"
    folder.mkdir()
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from kvserve.engine.worker.gguf_loader import GGUFFile

    with pytest.raises(QuantizationError, match=r"'gemma2' is not supported; supported: llama, "
                                                r"qwen2, qwen3"):
        GGUFFile(folder / "model.gguf")


def test_a_gguf_whose_config_json_is_another_family_is_refused(dense_dir, tmp_path):
    folder = write_gguf(dense_dir, tmp_path / "q", TYPES, tmp_path / "ref", arch="qwen2")
    with pytest.raises(QuantizationError, match=r"GGUF 'qwen2' model but config.json's "
                                                r"model_type is 'llama'"):
        make_llm(folder)
