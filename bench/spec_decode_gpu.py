"""Speculative decoding on a GPU at Llama-3.1-8B's shape (random weights, bf16): the target's
plain decode step against its verification step (each sequence scores its last token and k
drafts in one forward), and an EAGLE-3 head in the published layout (random, 32k draft
vocabulary) drafting k tokens through kvserve's Eagle3Proposer (fed by the target's prefill
through its layer hooks).

Acceptance cannot be measured on random weights (a random head's drafts are never the target's
tokens), so the speed-up rows are projections for assumed acceptance rates:
  E[tokens per step] = (1 - a^(k+1)) / (1 - a),
  speed-up = E * t(decode) / (t(verify k) + t(draft k)).

The verification step is timed eager and replayed from a captured CUDA graph of k + 1 tokens per
sequence (engine/worker/cuda_graph.py's verification ladder, as the engine captures it with a
speculative_config), with the largest difference of their logits.

`--smoke` (or KV_BENCH_SMOKE=1) runs the same code path at a tiny shape on the CPU.
Usage: bash bench/spec_decode_gpu.sh [--smoke]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig

from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.draft_kv import DraftKV
from kvserve.engine.spec_decode.eagle import Eagle3Proposer
from kvserve.engine.spec_decode.eagle_head import write_random_head
from kvserve.engine.spec_decode.proposer import ProposerContext, SpecRequestView, StepHiddenStates
from kvserve.engine.worker.cuda_graph import DecodeGraphs, cuda_capture

SMOKE = os.environ.get("KV_BENCH_SMOKE") == "1" or "--smoke" in sys.argv
DEV = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float32 if SMOKE else torch.bfloat16
LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                   max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
            tie_word_embeddings=False)
SHAPE = TINY if SMOKE else LLAMA_31_8B
DRAFT_VOCAB = 64 if SMOKE else 32000  # the published Llama 3.x EAGLE-3 heads' reduced vocabulary
CONTEXT = 24 if SMOKE else 1024
BATCHES = (1, 3) if SMOKE else (1, 8, 32, 64)
KS = (2,) if SMOKE else (2, 4)
REPS = 1 if SMOKE else 20
ACCEPTANCE = (0.6, 0.7, 0.8)


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int = REPS) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def random_target(config: LlamaConfig) -> LlamaForCausalLM:
    """kvserve's Llama with random weights made on the device (norm weights at 1)."""
    model = LlamaForCausalLM(config, DTYPE, DEV, max_model_len=CONTEXT + 64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(std=0.02)
    return model.eval()


def forward(model, kv: DraftKV, batch: int, start: int, width: int, rows_per_seq: int):
    """`batch` sequences each writing `width` tokens at `start`, then the logits of their last
    `rows_per_seq` positions (1: a decode step; k + 1: a verification)."""
    ids = [[7] * width for _ in range(batch)]
    b = kv.batch([f"s{i}" for i in range(batch)], [start] * batch, ids)
    hidden = model(b.input_ids, b.positions, kv.kv_caches, b.meta)
    rows = (b.last_rows[:, None] - torch.arange(rows_per_seq, device=DEV)[None]).reshape(-1)
    return hidden, model.compute_logits(hidden[rows])


def host_verify_inputs(kv: DraftKV, batch: int, start: int, q: int) -> tuple[torch.Tensor, ...]:
    """The host tensors of `batch` sequences each scoring q tokens at `start` (what the model
    runner stages into a graph): ids, positions, slots, block tables, lengths."""
    bs = kv.block_size
    tables = [kv.tables[f"s{i}"] for i in range(batch)]
    bt = torch.tensor(tables, dtype=torch.int32)
    pos = (start + torch.arange(q)).repeat(batch)
    seq_idx = torch.arange(batch).repeat_interleave(q)
    slots = bt[seq_idx, pos // bs].long() * bs + pos % bs
    seq_lens = torch.full((batch,), start + q, dtype=torch.int32)
    return torch.full((batch * q,), 7, dtype=torch.int64), pos, slots, bt, seq_lens


def bench_verify_graph(model, kv: DraftKV, batch: int, k: int, t_eager: float) -> None:
    """The verification step replayed from a captured graph (the smoke: a plain call stands in
    for the capture) against the eager one, same inputs, logits compared."""
    q = k + 1
    width = len(kv.tables["s0"])
    capture = cuda_capture() if DEV.type == "cuda" else (lambda fn: fn)
    graphs = DecodeGraphs(lambda ids, pos, meta, lora: model(ids, pos, kv.kv_caches, meta),
                          batch, width, kv.block_size, DEV, capture, "triton",
                          query_lens=(q,))
    inputs = host_verify_inputs(kv, batch, CONTEXT, q)
    size = graphs.size_for(batch, batch * q, width, q)

    def replay() -> torch.Tensor:
        return model.compute_logits(graphs.run(*inputs, None, size, None, q))
    t_graph = timed(replay)
    _, eager = forward(model, kv, batch, CONTEXT, q, q)
    # forward's rows run from each sequence's last token back: put them in token order
    eager = eager.view(batch, q, -1).flip(1).reshape(batch * q, -1)
    diff = (replay().float() - eager.float()).abs().max().item()
    print(f"verify graph batch {batch} k={k}: {t_graph * 1e3:.2f} ms replayed (size {size} x "
          f"{q} tokens) vs {t_eager * 1e3:.2f} ms eager ({t_eager / t_graph:.2f}x); max logit "
          f"difference {diff:.3g}", flush=True)
    del graphs


def eagle_proposer(config: LlamaConfig, model, head_dir: Path, k: int) -> Eagle3Proposer:
    write_random_head(head_dir, config, draft_vocab_size=DRAFT_VOCAB)
    spec = SpeculativeConfig(method="eagle3", model=str(head_dir), num_speculative_tokens=k)
    context = ProposerContext(config.vocab_size, CONTEXT + 64, DEV, DTYPE, config, model)
    return Eagle3Proposer(spec, context)


def bench_batch(model, config, proposer: Eagle3Proposer, batch: int) -> None:
    heads = config.num_attention_heads
    kv = DraftKV(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                 head_dim=config.hidden_size // heads, dtype=DTYPE, device=DEV,
                 initial_blocks=batch * (-(-(CONTEXT + 16) // 16)))
    for i in range(batch):
        kv.ensure(f"s{i}", CONTEXT + 16)
    with torch.inference_mode():
        hidden, _ = forward(model, kv, batch, 0, CONTEXT, 1)  # the prefill (hooks see it too)
        qsl = [i * CONTEXT for i in range(batch + 1)]
        proposer.on_step(StepHiddenStates([f"s{i}" for i in range(batch)], hidden, qsl,
                                          [CONTEXT] * batch, [[7] * CONTEXT] * batch,
                                          [0] * batch, [True] * batch))
        t_decode = timed(lambda: forward(model, kv, batch, CONTEXT, 1, 1))
        print(f"decode batch {batch}, context {CONTEXT}: {t_decode * 1e3:.2f} ms/step, "
              f"{batch / t_decode:.0f} tok/s", flush=True)
        views = [SpecRequestView(f"s{i}", np.full(CONTEXT + 1, 7, dtype=np.int64), CONTEXT)
                 for i in range(batch)]
        for k in KS:
            t_verify = timed(lambda: forward(model, kv, batch, CONTEXT, k + 1, k + 1))
            drafts = proposer.propose(views, k)  # the first call runs the prompt's rows
            assert all(len(d) == k and all(0 <= t < config.vocab_size for t in d)
                       for d in drafts), drafts
            t_draft = timed(lambda: proposer.propose(views, k))
            print(f"verify batch {batch} k={k}: {t_verify * 1e3:.2f} ms "
                  f"({t_verify / t_decode:.2f}x decode); eagle3 draft k={k}: "
                  f"{t_draft * 1e3:.2f} ms", flush=True)
            bench_verify_graph(model, kv, batch, k, t_verify)
            projected = []
            for a in ACCEPTANCE:
                tokens = (1 - a ** (k + 1)) / (1 - a)
                projected.append(f"{a}: {tokens * t_decode / (t_verify + t_draft):.2f}x")
            print(f"projected speed-up batch {batch} k={k} at acceptance "
                  f"{', '.join(projected)} (assumed rates)", flush=True)
    for i in range(batch):
        proposer.release(f"s{i}")


def main() -> None:
    config = LlamaConfig(**SHAPE)
    print(f"device {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu (smoke)'}, "
          f"{DTYPE}, shape {'Llama-3.1-8B' if not SMOKE else 'tiny'} (random weights)")
    print("acceptance cannot be measured on random weights: the speed-ups below are "
          "projections for assumed acceptance rates")
    model = random_target(config)
    with tempfile.TemporaryDirectory() as tmp:
        proposer = eagle_proposer(config, model, Path(tmp) / "eagle3", max(KS))
        for batch in BATCHES:
            bench_batch(model, config, proposer, batch)


if __name__ == "__main__":
    main()
