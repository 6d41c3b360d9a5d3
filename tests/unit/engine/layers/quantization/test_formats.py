"""GPTQ (v1 zeros, act order, 4 and 8 bits), AWQ (gemm nibble order) and native block-FP8
checkpoints, written in their own layouts from a tiny dense model, give the dequantised dense
model's greedy tokens and logprobs; unsupported schemes and misfit scales are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build_tiny_llama, make_llm
from format_writers import set_quant_config, write_awq, write_fp8_block, write_gptq
from kvserve.engine.errors import QuantizationError
from kvserve.engine.layers.quantization import QuantLinear
from kvserve.engine.layers.quantization.weight_only import Int4WeightLinear
from quant_checkpoints import hf_model, write_quantized
from test_compressed_tensors import assert_matches_reference


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("formats") / "dense", seed=5)


def kernels(llm) -> set[str]:
    return {type(m.kernel).__name__ for m in llm.llm_engine.runner.model.modules()
            if isinstance(m, QuantLinear)}


# int4 groups under 32 and int8 groups have no packed CPU kernel: dequantised per call
@pytest.mark.parametrize("bits,group,desc_act,sym,kernel", [
    (4, 32, True, False, "Int4WeightLinear"), (4, 16, False, True, "DequantLinear"),
    (8, 32, True, True, "DequantLinear"), (8, -1, False, True, "Int8WeightLinear")])
def test_gptq_matches_the_dequantised_model(dense_dir, tmp_path, bits, group, desc_act, sym,
                                            kernel):
    quant = write_gptq(dense_dir, tmp_path / "q", bits, group, desc_act, sym, tmp_path / "ref")
    llm = make_llm(quant)
    assert kernels(llm) == {kernel}
    assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)


def test_awq_matches_the_dequantised_model(dense_dir, tmp_path):
    quant = write_awq(dense_dir, tmp_path / "q", 32, tmp_path / "ref")
    llm = make_llm(quant)
    assert kernels(llm) == {"Int4WeightLinear"}
    assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)


def test_block_fp8_matches_the_dequantised_model(dense_dir, tmp_path):
    quant = write_fp8_block(dense_dir, tmp_path / "q", 32, tmp_path / "ref")
    llm = make_llm(quant)
    assert kernels(llm) == {"DequantLinear"}
    assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)


def test_tensor_parallel_shards_act_order_scales_with_their_columns(dense_dir, tmp_path):
    """GPTQ with g_idx over 2 ranks: o_proj / down_proj are split by input columns whose groups
    are shuffled, so each rank keeps the columns' g_idx entries and every group's scales."""
    quant = write_gptq(dense_dir, tmp_path / "q", 4, 32, True, False, tmp_path / "ref")
    llm = make_llm(quant, tensor_parallel_size=2)
    try:
        assert_matches_reference(llm, hf_model(tmp_path / "ref"), atol=2e-4)
    finally:
        llm.llm_engine.shutdown()


def test_unsupported_schemes_are_refused_naming_the_scheme(dense_dir, tmp_path):
    quant = write_gptq(dense_dir, tmp_path / "g", 4, 32, False, True, tmp_path / "ref")
    set_quant_config(quant, bits=3)
    with pytest.raises(QuantizationError, match="GPTQ with 3-bit.*supported: 4 and 8 bits"):
        make_llm(quant)
    ct = write_quantized(dense_dir, tmp_path / "ct", "W4A16")
    raw = json.loads((ct / "config.json").read_text())["quantization_config"]
    raw["format"] = "nvfp4-pack-quantized"
    raw["config_groups"]["group_0"]["weights"].update(type="float", num_bits=4)
    set_quant_config(ct, **raw)
    with pytest.raises(QuantizationError, match="'nvfp4-pack-quantized'.*Supported: pack-quant"):
        make_llm(ct)
    set_quant_config(ct, quant_method="bitsandbytes")
    with pytest.raises(QuantizationError, match="'bitsandbytes' is not supported; supported: "
                                                "compressed-tensors, gptq, awq, fp8"):
        make_llm(ct)


def test_scales_that_do_not_fit_their_weight_name_the_tensor(dense_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    quant = write_quantized(dense_dir, tmp_path / "ct", "W4A16")
    state = load_file(str(quant / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    state[name] = state[name][:, :2].contiguous()  # 4 groups of 32 expected
    save_file(state, str(quant / "model.safetensors"))
    with pytest.raises(QuantizationError, match=f"{name}.*shape \\(64, 2\\).*needs \\(64, 4\\)"):
        make_llm(quant)


def test_a_dense_checkpoint_is_quantised_online_and_a_quantised_one_not_again(dense_dir, tmp_path):
    llm = make_llm(dense_dir, quantization="int8")
    assert kernels(llm) == {"Int8W8A8Linear"}
    quant = write_awq(dense_dir, tmp_path / "q", 32, tmp_path / "ref")
    with pytest.raises(QuantizationError, match=r"already quantised \(awq\)"):
        make_llm(quant, quantization="int8")
    assert Int4WeightLinear  # the AWQ checkpoint itself is served by the int4 kernel (above)
