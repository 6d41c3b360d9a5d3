"""Our Llama-family model against HF transformers: prefill, chunked prefill and decode through a
paged KV cache with shuffled block tables, for Llama, Qwen2 (biases), Mistral and rope scalings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from family_checks import copy_with, perturb
from kvserve.engine.errors import ConfigError, ModelNotFoundError
from kvserve.engine.worker.model_loader import iter_weights, load_model
from kvserve.kernels.metadata import AttentionMetadata

ATOL = 1e-4
BLOCK_SIZE = 4


class PagedSequences:
    """A minimal stand-in for the scheduler + runner: blocks handed out from a shuffled pool."""

    def __init__(self, config, num_blocks: int = 48, seed: int = 0) -> None:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape))
                       for _ in range(config.num_hidden_layers)]
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // BLOCK_SIZE:
            table.append(self.free.pop())
        return table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def step(self, model, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, list[slice]]:
        """Run one flattened batch of new tokens per sequence; logits [T, vocab] and each span."""
        ids, positions, slots, seq_lens, starts, spans = [], [], [], [], [0], []
        for seq, new in chunks.items():
            past = self.tokens.setdefault(seq, [])
            first = len(ids)
            for i, tok in enumerate(new):
                ids.append(tok)
                positions.append(len(past) + i)
                slots.append(self._slot(seq, len(past) + i))
            past.extend(new)
            seq_lens.append(len(past))
            starts.append(len(ids))
            spans.append(slice(first, len(ids)))
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(c) for c in chunks.values()), max_seq_len=max(seq_lens))
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), self.caches, attn)
            return model.compute_logits(hidden), spans


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def load_pair(folder: Path):
    from transformers import AutoModelForCausalLM

    ours, config = load_model(folder, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, hf, config


def check_against_hf(folder: Path, prompt_lens=(5, 11, 17), decode_steps: int = 3) -> None:
    """Prefill 3 sequences in one batch, a mixed chunked-prefill + decode step, then decodes."""
    ours, hf, config = load_pair(folder)
    gen = torch.Generator().manual_seed(1)
    vocab = config.vocab_size
    prompts = {s: torch.randint(0, vocab, (n,), generator=gen).tolist()
               for s, n in enumerate(prompt_lens)}
    paged = PagedSequences(config)
    # Step 1: full prompts of seq 0 and 1, the first half of seq 2 (chunked prefill).
    half = len(prompts[2]) // 2
    logits, spans = paged.step(ours, {0: prompts[0], 1: prompts[1], 2: prompts[2][:half]})
    for seq, span in zip((0, 1, 2), spans):
        ref = hf_logits(hf, paged.tokens[seq])
        torch.testing.assert_close(logits[span], ref, atol=ATOL, rtol=0)
    # Step 2: decode for 0 and 1, rest of the prompt of 2 in the same batch.
    steps = [{0: [3], 1: [7], 2: prompts[2][half:]}]
    steps += [{s: [int(torch.randint(0, vocab, (1,), generator=gen))] for s in (2, 0, 1)}
              for _ in range(decode_steps)]
    for chunks in steps:
        logits, spans = paged.step(ours, chunks)
        for seq, span in zip(chunks, spans):
            ref = hf_logits(hf, paged.tokens[seq])[-(span.stop - span.start):]
            torch.testing.assert_close(logits[span], ref, atol=ATOL, rtol=0)


def build_random(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A random HF model with non-trivial norms and biases (HF initialises them to 1 and 0)."""
    import transformers

    cfg = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg.update(overrides)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    torch.manual_seed(seed)
    perturb(getattr(transformers, arch)(config).eval()).save_pretrained(path)
    return path


def test_llama_matches_hf_prefill_chunked_and_decode(tiny_model_dir):
    check_against_hf(tiny_model_dir)


def test_qwen2_with_qkv_biases_matches_hf(tmp_path):
    folder = build_random(tmp_path / "qwen2", "Qwen2ForCausalLM")
    ours, _, _ = load_pair(folder)
    assert ours.model.layers[0].self_attn.qkv_proj.bias is not None
    assert ours.model.layers[0].self_attn.o_proj.bias is None
    check_against_hf(folder)


def test_mistral_untied_matches_hf(tmp_path):
    check_against_hf(build_random(tmp_path / "mistral", "MistralForCausalLM", head_dim=24,
                                  sliding_window=None))


def test_llama_with_attention_and_mlp_biases_matches_hf(tmp_path):
    check_against_hf(build_random(tmp_path / "llama-bias", "LlamaForCausalLM",
                                  attention_bias=True, mlp_bias=True))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
], ids=["linear", "llama3"])
def test_rope_scaling_matches_hf(tmp_path, scaling):
    folder = build_random(tmp_path / "rope", "LlamaForCausalLM",
                          rope_parameters={"rope_theta": 500.0, **scaling})
    check_against_hf(folder, prompt_lens=(9, 40, 23))


def test_dynamic_ntk_rope_matches_hf_at_full_length(tmp_path):
    """Dynamic NTK is fixed at max_position * factor; HF agrees for a sequence of that length."""
    folder = build_random(tmp_path / "dyn", "LlamaForCausalLM", max_position_embeddings=16,
                          rope_parameters={"rope_theta": 500.0, "rope_type": "dynamic",
                                           "factor": 2.0})
    ours, hf, config = load_pair(folder)
    assert ours.max_position == 32
    tokens = torch.randint(0, config.vocab_size, (32,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    logits, _ = PagedSequences(config).step(ours, {0: tokens})
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_bf16_error_is_no_worse_than_hf_bf16(tiny_model_dir):
    """Against fp32 HF, our bf16 model errs about as much as HF's own bf16 model does."""
    from transformers import AutoModelForCausalLM

    ours, config = load_model(tiny_model_dir, torch.bfloat16, torch.device("cpu"))
    proj = ours.model.layers[0].mlp.gate_up_proj  # oneDNN-packed where this CPU supports it
    assert getattr(proj, "packed_weight", getattr(proj, "weight", None)).dtype == torch.bfloat16
    tokens = list(range(5, 25))
    paged = PagedSequences(config)
    paged.caches = [(k.bfloat16(), v.bfloat16()) for k, v in paged.caches]
    logits, _ = paged.step(ours, {0: tokens})
    assert logits.dtype == torch.bfloat16  # as HF's; the sampler widens what it must
    logits = logits.float()
    ref = hf_logits(AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32).eval(), tokens)
    hf_bf16 = hf_logits(AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16).eval(), tokens)
    ours_err = (logits - ref).abs().mean()
    hf_err = (hf_bf16 - ref).abs().mean()
    assert 0 < ours_err <= 1.5 * hf_err, (ours_err, hf_err)


def test_fused_weights_hold_the_checkpoint_tensors(tiny_model_dir):
    ours, config = load_model(tiny_model_dir, torch.float32, torch.device("cpu"),
                              pack_linears=False)
    weights = dict(iter_weights(tiny_model_dir))
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    q_size, kv_size = attn.q_size, attn.kv_size
    qkv = attn.qkv_proj.weight
    assert torch.equal(qkv[:q_size], weights["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q_size + kv_size:], weights["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[config.intermediate_size:],
                       weights["model.layers.1.mlp.up_proj.weight"])
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_give_the_plain_model_outputs(tiny_model_dir, dtype):
    """CPU loads swap nn.Linear for oneDNN-prepacked weights: same logits as the plain model."""
    from kvserve.engine.layers.packed_linear import PackedLinear

    packed, config = load_model(tiny_model_dir, dtype, torch.device("cpu"))
    plain, _ = load_model(tiny_model_dir, dtype, torch.device("cpu"), pack_linears=False)
    kinds = {type(m) for m in packed.modules() if isinstance(m, (nn.Linear, PackedLinear))}
    if torch.backends.mkldnn.is_available() and (
            dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        assert kinds == {PackedLinear}
    tokens = list(range(5, 40))
    logits = []
    for model in (packed, plain):
        paged = PagedSequences(config)
        paged.caches = [(k.to(dtype), v.to(dtype)) for k, v in paged.caches]
        logits.append(paged.step(model, {0: tokens})[0])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(logits[0], logits[1], atol=tol, rtol=tol)


def test_unsupported_architecture_is_a_config_error(tmp_path, tiny_model_dir):
    folder = copy_with(tiny_model_dir, tmp_path / "gpt2ish", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*supported: Gemma2ForCausalLM.*LlamaForCausalLM"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_missing_folder_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="cannot load the model config"):
        load_model(tmp_path / "nowhere" / "model", torch.float32, torch.device("cpu"))


def test_incomplete_or_mismatched_weights_are_typed_errors(tiny_model_dir):
    from kvserve.engine.models import LlamaForCausalLM
    from kvserve.engine.worker.model_loader import load_config

    config = load_config(tiny_model_dir)
    weights = dict(iter_weights(tiny_model_dir))
    model = LlamaForCausalLM(config, torch.float32)
    partial = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ModelNotFoundError, match="lacks 1 tensor.*layers.1.mlp.up_proj"):
        model.load_weights(partial.items())
    weights["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ModelNotFoundError, match="model.norm.weight.*shape"):
        model.load_weights(weights.items())
    with pytest.raises(ModelNotFoundError, match="no place"):
        model.load_weights([("model.layers.9.self_attn.q_proj.weight", torch.zeros(1))])


@pytest.mark.parametrize("arch,kw", [
    ("MistralForCausalLM", {"sliding_window": 11}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 11,
                          "max_window_layers": 1}),
], ids=["mistral-every-layer", "qwen2-layer-types"])
def test_sliding_windows_match_hf(tmp_path, arch, kw):
    """Mistral slides on every layer, Qwen2 from max_window_layers on: windows of 11 tokens under
    prompts of up to 37, chunked prefill in 16-token steps, prefix cache cold and warm."""
    from family_checks import build_family, check_family

    check_family(build_family(tmp_path, arch, **kw))
