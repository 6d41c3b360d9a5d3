"""Every RoPE variant's cos/sin table against transformers' own rotary module at the positions
HF would use for a sequence of that length; unknown types and keys are refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.engine.errors import ConfigError
from kvserve.engine.layers.rotary import RotaryEmbedding, rope_table

HEAD_DIM = 16


def llama_config(max_pos: int = 64, **rope) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                                     max_position_embeddings=max_pos,
                                     rope_parameters={"rope_theta": 500.0, **rope})


def hf_cos_sin(rotary: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin [length, rotary_dim / 2] for one forward of `length` tokens."""
    x = torch.zeros(1, length, HEAD_DIM)
    cos, sin = rotary(x, torch.arange(length)[None])
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def ours(config, length: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(config, HEAD_DIM, torch.float32, **kw)
    return rope(torch.arange(length))


CASES = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 1.0, "mscale_all_dim": 0.5},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_table_matches_hf(name):
    config = llama_config(**CASES[name])
    expected = hf_cos_sin(transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config),
                          64)
    got = ours(config, 64)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_dynamic_ntk_is_fixed_at_its_longest_length():
    """HF rescales with the sequence; a paged cache cannot, so the table is HF's at the end."""
    config = llama_config(max_pos=16, rope_type="dynamic", factor=2.0)
    assert rope_table(config, HEAD_DIM).length == 32
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    torch.testing.assert_close(ours(config, 32), hf_cos_sin(rotary, 32), atol=1e-6, rtol=1e-5)
    # ...and differs from HF at a short length, where HF has not scaled yet.
    assert not torch.allclose(ours(config, 8)[0], hf_cos_sin(rotary, 8)[0])


def phi3_longrope(max_pos: int = 64, original: int = 16, partial: float = 1.0):
    rot = int(HEAD_DIM * partial) // 2
    return transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=max_pos,
        original_max_position_embeddings=original,
        rope_parameters={"rope_type": "longrope", "rope_theta": 500.0,
                         "partial_rotary_factor": partial,
                         "short_factor": [1.0 + 0.1 * i for i in range(rot)],
                         "long_factor": [2.0 + 0.5 * i for i in range(rot)]})


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_factor_set_is_chosen_once_by_max_model_len(partial):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = phi3_longrope(partial=partial)
    rotary = Phi3RotaryEmbedding(config)
    # max_model_len past the original context: long factors for every position, short ones too.
    long_ref = hf_cos_sin(rotary, 40)
    torch.testing.assert_close(ours(config, 40), long_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(config, 8)[0], long_ref[0][:8], atol=1e-6, rtol=1e-5)
    # max_model_len within it: the short factors, as HF for a short forward.
    short = ours(config, 16, max_model_len=16)
    torch.testing.assert_close(short, hf_cos_sin(Phi3RotaryEmbedding(config), 16),
                               atol=1e-6, rtol=1e-5)
    assert not torch.allclose(short[0], long_ref[0][:16])
    assert RotaryEmbedding(config, HEAD_DIM, torch.float32).rotary_dim == int(HEAD_DIM * partial)


def test_partial_rotary_leaves_the_tail_alone():
    config = phi3_longrope(partial=0.5)
    rope = RotaryEmbedding(config, HEAD_DIM, torch.float32)
    q, k = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    q2, k2 = rope.rotate(q.clone(), k.clone(), rope(torch.arange(5) + 3))
    assert torch.equal(q2[..., 8:], q[..., 8:]) and torch.equal(k2[..., 8:], k[..., 8:])
    assert not torch.allclose(q2[..., :8], q[..., :8])


def test_per_layer_type_parameters():
    config = transformers.Gemma3TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=64,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000.0}})
    local = rope_table(config, HEAD_DIM, "sliding_attention")
    full = rope_table(config, HEAD_DIM, "full_attention")
    torch.testing.assert_close(local.inv_freq[1], torch.tensor(10.0 ** (-2 / HEAD_DIM)))
    torch.testing.assert_close(full.inv_freq[1], torch.tensor(1000.0 ** (-2 / HEAD_DIM) / 2))
    with pytest.raises(ConfigError, match="no entry for layer type 'chunked_attention'"):
        rope_table(config, HEAD_DIM, "chunked_attention")


def test_unknown_type_and_unknown_key_are_refused_by_name():
    config = llama_config()
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 1.0}
    with pytest.raises(ConfigError, match="rope_type 'mrope' is not supported.*longrope"):
        rope_table(config, HEAD_DIM)
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "mrope_section": [1]}
    with pytest.raises(ConfigError, match=r"\['mrope_section'\] are not implemented.*'linear'"):
        rope_table(config, HEAD_DIM)
