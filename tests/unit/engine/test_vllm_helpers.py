"""The vLLM helpers behind vllm_paths/: init_logger's once-methods, parse_model_prompt,
the serial_utils codecs and cleanup_dist_env_and_memory, through vLLM's import paths."""

from __future__ import annotations

import base64
import io
import logging

import numpy as np
import pytest
import torch


def test_init_logger_is_the_named_logger_and_logs_a_once_message_once(caplog):
    from kvserve.logger import init_logger

    logger = init_logger("kvserve.test.once")
    assert logger is logging.getLogger("kvserve.test.once")
    with caplog.at_level(logging.INFO, logger="kvserve.test.once"):
        for _ in range(3):
            logger.info_once("loaded %d", 7)
        logger.info_once("loaded %d", 8)
        logger.warning_once("careful")
    assert [r.getMessage() for r in caplog.records] == ["loaded 7", "loaded 8", "careful"]


def test_parse_model_prompt_normalises_as_vllm_does():
    from kvserve.renderers.inputs.preprocess import parse_model_prompt

    assert parse_model_prompt(None, "hi") == {"prompt": "hi"}
    assert parse_model_prompt(None, [1, 2]) == {"prompt_token_ids": [1, 2]}
    embeds = {"prompt_embeds": torch.zeros(2, 4)}
    assert parse_model_prompt(None, embeds) is embeds
    for bad, message in (([1, "a"], "list of integers"), ({"prompt": 3}, "should be a string"),
                         ({"encoder_prompt": "x"}, "encoder-decoder"),
                         ({"other": 1}, "must contain"), (3.5, "string, list of tokens")):
        with pytest.raises(TypeError, match=message):
            parse_model_prompt(None, bad)


def test_tensor2base64_is_torch_save_in_base64():
    from kvserve.utils.serial_utils import tensor2base64

    x = torch.randn(3, 5, dtype=torch.bfloat16)
    back = torch.load(io.BytesIO(base64.b64decode(tensor2base64(x))), weights_only=True)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "int64", "bool"])
@pytest.mark.parametrize("endianness", ["native", "big", "little"])
def test_tensor2binary_round_trips(dtype: str, endianness: str):
    from kvserve.utils.serial_utils import EMBED_DTYPES, MM_METADATA_DTYPES, binary2tensor, \
        tensor2binary

    info = {**EMBED_DTYPES, **MM_METADATA_DTYPES}[dtype]
    x = (torch.randn(2, 3) * 4).to(info.torch_dtype)
    raw = tensor2binary(x, dtype, endianness)
    assert len(raw) == x.numel() * info.nbytes
    assert torch.equal(binary2tensor(raw, (2, 3), dtype, endianness), x)


def test_tensor2binary_byte_order_is_the_named_one():
    from kvserve.utils.serial_utils import tensor2binary

    x = torch.tensor([1.0])
    assert tensor2binary(x, "float32", "big") == np.array([1.0], ">f4").tobytes()
    assert tensor2binary(x, "float32", "little") == np.array([1.0], "<f4").tobytes()
    with pytest.raises(ValueError, match="dtype"):
        tensor2binary(x, "float64", "big")


def test_numpy2base64_is_an_npy_file():
    from kvserve.utils.serial_utils import numpy2base64

    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(numpy2base64(a)))), a)


def test_cleanup_dist_env_and_memory_ends_this_process_group(tmp_path):
    from kvserve.distributed import cleanup_dist_env_and_memory

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv",
                                         rank=0, world_size=1)
    assert torch.distributed.is_initialized()
    cleanup_dist_env_and_memory()
    assert not torch.distributed.is_initialized()
    cleanup_dist_env_and_memory(shutdown_ray=False)  # nothing to end: still fine


def test_vllm_prompt_dicts_drive_llm_generate(llm):
    from kvserve import SamplingParams
    from kvserve.inputs import TextPrompt, TokensPrompt

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer()("The quick brown fox").input_ids
    by_text, by_ids = llm.generate([TextPrompt(prompt="The quick brown fox"),
                                    TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_llm_from_engine_args_is_vllms(llm, tiny_model_dir):
    """vLLM's sharded-state examples build their LLM with LLM.from_engine_args(EngineArgs)."""
    from kvserve import LLM, EngineArgs, SamplingParams

    other = LLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                            device="cpu", kv_cache_memory=1 << 22))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert other.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids
    other.shutdown()
