"""EAGLE / EAGLE-3 proposers with random heads in the published layout: the engine's target
feeds them through `on_step` (EAGLE-3's states through hooks on the target's layers), and the
drafts equal a dense re-implementation of the head over HF transformers' hidden states."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny_llama
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.draft_kv import DraftKV
from kvserve.engine.spec_decode.eagle import Eagle3Proposer, EagleProposer, default_aux_layers
from kvserve.engine.spec_decode.eagle_head import write_random_head
from kvserve.engine.spec_decode.proposer import ProposerContext, SpecRequestView, StepHiddenStates
from kvserve.engine.spec_decode.registry import make_proposer, proposer_class
from kvserve.engine.worker.model_loader import load_model

K = 3
LAYERS = 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("eagle") / "target", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def hf(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(target_dir):
    model, _ = load_model(target_dir, torch.float32, torch.device("cpu"), max_model_len=512)
    return model


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _dense_head(w, cfg, ids, states, pos, eagle3, embed):
    """The head over all rows at once (causal attention, no cache): (logit states, feedback)."""
    pre = "midlayer." if eagle3 else "layers.0."
    heads, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    emb = embed[ids]
    if eagle3:
        residual = states
        x = torch.cat([_rms(emb, w[pre + "input_layernorm.weight"]),
                       _rms(states, w[pre + "hidden_norm.weight"])], -1)
    else:
        x = torch.cat([emb, states], -1) @ w["fc.weight"].T
        residual = x
    t = x.shape[0]
    q = _rope((x @ w[pre + "self_attn.q_proj.weight"].T).view(t, heads, hd), pos)
    k = _rope((x @ w[pre + "self_attn.k_proj.weight"].T).view(t, kvh, hd), pos)
    v = (x @ w[pre + "self_attn.v_proj.weight"].T).view(t, kvh, hd)
    k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * hd)
    x = attn @ w[pre + "self_attn.o_proj.weight"].T + residual
    h = _rms(x, w[pre + "post_attention_layernorm.weight"])
    gate, up = h @ w[pre + "mlp.gate_proj.weight"].T, h @ w[pre + "mlp.up_proj.weight"].T
    x = (torch.nn.functional.silu(gate) * up) @ w[pre + "mlp.down_proj.weight"].T + x
    return (_rms(x, w["norm.weight"]) if eagle3 else x), x


def _reference_drafts(w, cfg, hf, tokens, start, k, eagle3):
    """Greedy drafts for `tokens` (the last not yet run by the target), the head fed from
    position `start` on with HF's hidden states."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    if eagle3:
        states = torch.cat([out.hidden_states[i][0] for i in default_aux_layers(LAYERS)], -1)
        states = states @ w["fc.weight"].T
    else:
        states = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
    embed = hf.model.embed_tokens.weight.detach()
    n = len(tokens)
    ids, pos, rows = list(tokens[start + 1:]), list(range(start, n - 1)), states[start:]
    drafts = []
    for _ in range(k):
        with torch.no_grad():
            logit_states, feed = _dense_head(w, cfg, torch.tensor(ids), rows,
                                             torch.tensor(pos), eagle3, embed)
        if eagle3:
            d = int((logit_states[-1] @ w["lm_head.weight"].T).argmax())
            d += int(w["d2t"][d])
        else:
            d = int((logit_states[-1] @ embed.T).argmax())  # the tiny target ties its head
        drafts.append(d)
        ids.append(d)
        pos.append(pos[-1] + 1)
        rows = torch.cat([rows, feed[-1:]])
    return drafts


def _proposer(method, head_dir, target, hf):
    config = SpeculativeConfig(method=method, model=str(head_dir), num_speculative_tokens=K)
    context = ProposerContext(vocab_size=hf.config.vocab_size, max_model_len=512,
                              device=torch.device("cpu"), dtype=torch.float32,
                              hf_config=hf.config, target_model=target)
    return make_proposer(config, context)


def _run_target(target, kv, rid, tokens, start):
    """The engine's target over tokens at positions start..: its last hidden states (the
    EAGLE-3 hooks see the forward too)."""
    kv.ensure(rid, start + len(tokens))
    batch = kv.batch([rid], [start], [tokens])
    with torch.inference_mode():
        return target(batch.input_ids, batch.positions, kv.kv_caches, batch.meta)


def _feed(proposer, target, kv, rid, seq, start, end):
    hidden = _run_target(target, kv, rid, seq[start:end], start)
    proposer.on_step(StepHiddenStates([rid], hidden, [0, end - start], [end - start],
                                      [seq[start:end]], [start], [True]))


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_drafts_equal_a_dense_head_across_steps(method, tmp_path, target_dir, hf, target):
    eagle3 = method == "eagle3"
    head_dir = write_random_head(tmp_path / "head", hf.config, eagle3=eagle3,
                                 draft_vocab_size=200 if eagle3 else None, std=0.3)
    w = load_file(str(head_dir / "model.safetensors"))
    proposer = _proposer(method, head_dir, target, hf)
    assert type(proposer) is (Eagle3Proposer if eagle3 else EagleProposer)
    kv = DraftKV(num_layers=LAYERS, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 device=torch.device("cpu"))
    rng = np.random.default_rng(3)
    seq = rng.integers(0, hf.config.vocab_size, 40).tolist()
    p = 20
    _feed(proposer, target, kv, "a", seq, 0, p)  # the prefill
    view = SpecRequestView("a", np.array(seq[: p + 1]), p)
    first = proposer.propose([view], K)[0]
    assert first == _reference_drafts(w, hf.config, hf, seq[: p + 1], 0, K, eagle3)
    # A verification kept the last token and 2 drafts: rows p..p+2; 2 more tokens are known.
    _feed(proposer, target, kv, "a", seq, p, p + 3)
    view = SpecRequestView("a", np.array(seq[: p + 4]), p)
    assert proposer.propose([view], K)[0] == \
        _reference_drafts(w, hf.config, hf, seq[: p + 4], 0, K, eagle3)


def test_eagle3_after_a_prefix_cache_hit_and_release(tmp_path, hf, target):
    head_dir = write_random_head(tmp_path / "head", hf.config, draft_vocab_size=150, std=0.3)
    w = load_file(str(head_dir / "model.safetensors"))
    proposer = _proposer("eagle3", head_dir, target, hf)
    kv = DraftKV(num_layers=LAYERS, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 device=torch.device("cpu"))
    seq = np.random.default_rng(5).integers(0, hf.config.vocab_size, 40).tolist()
    _run_target(target, kv, "b", seq[:16], 0)  # the cached prefix: computed earlier
    proposer.capture.take(16)  # (that forward's states went to another request)
    _feed(proposer, target, kv, "b", seq, 16, 30)  # only the uncached part reaches the head
    out = proposer.propose([SpecRequestView("b", np.array(seq[:31]), 30)], K)[0]
    assert out == _reference_drafts(w, hf.config, hf, seq[:31], 16, K, eagle3=True)
    assert all(0 <= t < hf.config.vocab_size for t in out)
    proposer.release("b")
    assert "b" not in proposer.kv.tables
    # A stream the head has no states for gets no drafts.
    assert proposer.propose([SpecRequestView("c", np.array(seq[:5]), 4)], K) == [[]]


def test_registered_methods():
    assert proposer_class("eagle") is EagleProposer
    assert proposer_class("eagle3") is Eagle3Proposer
