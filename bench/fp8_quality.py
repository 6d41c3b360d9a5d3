"""How much of the fp8 KV cache's accuracy loss each remedy wins back, on the default model.

Every variant runs the fp32 model with an fp32 cache into which K/V are written after a
transform (rounded through e4m3 with some scale, through bf16, rotated, shifted). An fp32 cache
holding e4m3-rounded values gives exactly the real fp8 cache's tokens (tests/integration/
test_fp8_kv.py asserts it), so this isolates the number format from the kernels. Prefix caching
is off: a block cached by one variant must not be reused by the next.

Variants: `bf16` (a bf16 cache, for scale), `fp8` (scale 1.0, K and V), `fp8-k` / `fp8-v` (one
of them only), `fp8-layer` (per-layer scales from the run's amax, vLLM's 200 headroom),
`fp8-k-hadamard` (K rotated by a normalised 64x64 Hadamard before rounding and back after;
q.k is unchanged by the rotation), `fp8-k-mean-hadamard` (the same after subtracting each
layer's mean post-RoPE key, which shifts every logit of a query by the same amount, so softmax
is unchanged). Two rows are whole models rather than cache transforms, for the noise floor:
`bf16-model` (the model run in bf16, weights and cache, as `dtype="auto"` picks on a CPU with
bf16 matmuls) and `bf16-model-fp8` (that model with the real fp8 cache, scale 1.0); both are
scored against the same fp32 reference.

    python bench/fp8_quality.py [--prompts 32] [--tokens 32] [--variants fp8,fp8-k,...]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import write_kv as write_kv_module
from kvserve.kernels.fp8 import FP8_DTYPE
from kvserve.kernels.reference import dequantize, quantize

# The first six are tests/integration/test_fp8_kv.py's prompts, kept verbatim so that this
# script's figures on `--prompts 6` line up with the test's; bench/ does not import tests/.
PROMPTS = [
    "What is the capital of France?",
    "Explain the multi-head attention mechanism in the Transformer architecture",
    "Write a haiku about the sea.",
    "How can the GPU memory efficiency of large model inference be optimised?",
    "List three prime numbers and say why they are prime.",
    "Who wrote Romeo and Juliet?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and French.",
    "Why is the sky blue?",
    "Describe how a bicycle works.",
    "What is photosynthesis?",
    "Summarise the plot of Hamlet in three sentences.",
    "What are the benefits of regular exercise?",
    "Write a short poem about autumn leaves.",
    "How does a refrigerator keep food cold?",
    "Explain recursion to a ten-year-old.",
    "What is the difference between a virus and a bacterium?",
    "Name five countries in South America.",
    "How do airplanes stay in the air?",
    "Give three tips for learning a new language.",
    "What is the Pythagorean theorem?",
    "Describe the water cycle.",
    "Why do cats purr?",
    "What is machine learning?",
    "Write a limerick about a programmer.",
    "How is cheese made?",
    "What were the causes of World War I?",
    "Explain what a black hole is.",
    "How do vaccines work?",
    "What is the tallest mountain in the world?",
    "Suggest a name for a coffee shop and explain it.",
]
HEADROOM = 200.0


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise SystemExit(f"head_dim {n} is not a power of two: no Sylvester Hadamard")
    return h / n ** 0.5


def rnd(x: torch.Tensor, scale: float) -> torch.Tensor:
    return dequantize(quantize(x, scale, FP8_DTYPE), scale, x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--variants", default="bf16,fp8,fp8-k,fp8-v,fp8-layer,fp8-k-hadamard,"
                                          "fp8-k-mean-hadamard,bf16-model,bf16-model-fp8")
    args = ap.parse_args()
    n_tok = args.tokens
    def make_llm(dtype: str, **kw) -> LLM:
        return LLM("smollm2-135m-instruct", dtype=dtype, device="cpu", max_model_len=512,
                   kv_cache_memory=1 << 27, enable_prefix_caching=False, **kw)

    llm = make_llm("float32")
    tok = llm.get_tokenizer()
    chats = [list(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False))
             for p in PROMPTS[: args.prompts]]
    layer_of = {kc.data_ptr(): i for i, (kc, _) in enumerate(llm.llm_engine.runner.kv_caches)}
    n_layers = len(layer_of)
    amax_k, amax_v = torch.zeros(n_layers), torch.zeros(n_layers)
    k_sum: list[torch.Tensor | float] = [0.0] * n_layers
    k_count = [0] * n_layers
    real_write = write_kv_module.write_kv
    variant: dict = {}

    def write(key, value, kc, vc, slots, k_scale=1.0, v_scale=1.0, **kw):
        i = layer_of.get(kc.data_ptr())
        if i is None:  # another model's cache (the bf16-model rows): written as it is
            return real_write(key, value, kc, vc, slots, k_scale, v_scale, **kw)
        if not variant:  # the reference pass: record statistics, write unchanged
            amax_k[i] = max(amax_k[i], key.abs().max())
            amax_v[i] = max(amax_v[i], value.abs().max())
            k_sum[i] = k_sum[i] + key.sum(0)
            k_count[i] += key.shape[0]
            return real_write(key, value, kc, vc, slots, k_scale, v_scale, **kw)
        if "cast" in variant:
            c = variant["cast"]
            return real_write(key.to(c).float(), value.to(c).float(), kc, vc, slots, **kw)
        if variant.get("mean"):
            key = key - k_sum[i] / k_count[i]
        ks, vs = variant["ks"](i), variant["vs"](i)
        rot = variant.get("rot")
        if variant["k"]:
            key = rnd(key @ rot.T, ks) @ rot if rot is not None else rnd(key, ks)
        if variant["v"]:
            value = rnd(value, vs)
        return real_write(key, value, kc, vc, slots, **kw)

    write_kv_module.write_kv = write  # the model resolves it on its first forward

    def greedy(prompts, max_tokens=n_tok, model=llm):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in model.generate(prompts, params,
                                                                     use_tqdm=False)]

    ref = greedy(chats)
    head_dim = llm.llm_engine.runner.kv_caches[0][0].shape[-1]
    had = hadamard(head_dim)
    one = lambda i: 1.0  # noqa: E731
    k_layer = lambda i: float(amax_k[i]) / HEADROOM  # noqa: E731
    v_layer = lambda i: float(amax_v[i]) / HEADROOM  # noqa: E731
    variants = {
        "bf16": dict(cast=torch.bfloat16),
        "fp8": dict(k=1, v=1, ks=one, vs=one),
        "fp8-k": dict(k=1, v=0, ks=one, vs=one),
        "fp8-v": dict(k=0, v=1, ks=one, vs=one),
        "fp8-layer": dict(k=1, v=1, ks=k_layer, vs=v_layer),
        "fp8-k-hadamard": dict(k=1, v=0, ks=one, vs=one, rot=had),
        "fp8-k-mean-hadamard": dict(k=1, v=0, ks=one, vs=one, rot=had, mean=1),
        "bf16-model": dict(model=dict(dtype="bfloat16")),
        "bf16-model-fp8": dict(model=dict(dtype="bfloat16", kv_cache_dtype="fp8")),
    }
    print(f"{len(chats)} prompts x {n_tok} greedy tokens; agreement with the fp32 model and its "
          "fp32 cache")
    print(f"{'variant':22s} {'free-running':>12s} {'teacher-forced':>15s}")
    for name in args.variants.split(","):
        variant.clear()
        variant.update(variants[name])
        t0 = time.perf_counter()
        model = make_llm(**variant["model"]) if "model" in variant else llm
        out = greedy(chats, model=model)
        free = sum(x == y for a, b in zip(out, ref) for x, y in zip(a, b)) / (len(ref) * n_tok)
        hist = [c + r[:i] for c, r in zip(chats, ref) for i in range(n_tok)]
        target = [r[i] for r in ref for i in range(n_tok)]
        got = [o[0] for o in greedy(hist, 1, model)]
        forced = sum(g == t for g, t in zip(got, target)) / len(target)
        print(f"{name:22s} {free:12.1%} {forced:15.1%}   ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        del model


if __name__ == "__main__":
    main()
