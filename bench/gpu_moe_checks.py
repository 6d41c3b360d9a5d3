"""MoE and gpt-oss paths on a CUDA GPU, in one short run (a few minutes on an H100, Triton's
compiles included; not yet timed there) on a lent GPU:

  attention sinks   the compiled Triton kernel with sinks (with and without a sliding window,
                    fp32 / bf16 / fp8 KV, split-KV decode) against the reference
  FusedMoE          fp32 and bf16 on the device (the fused Triton experts kernel) against a
                    naive per-token reference, on the rows whose routing bf16 does not flip
  models            tiny gpt-oss and Qwen2-MoE checkpoints on the device (Triton attention)
                    against HF fp32 logits: prefill, then three decode steps
  fused MoE kernel  kernels/triton_moe.py on the device in every weight format (dense, W4A16
                    sym / asym / act order, W8A16, FP8 per channel / block, W8A8 int8, FP8
                    dynamic) against the dequantised reference; at Mixtral's expert shape
                    (8 x 4096 -> 14336, top 2, bf16) fused vs grouped_mm vs per-expert mm, and
                    W4A16 fused vs one Triton W4A16 matmul per expert, at 1 / 16 / 512 / 4096
                    tokens
  graphs            a tiny Qwen2-MoE's decode captured in CUDA graphs, tokens equal eager's

Prints OK/FAIL per check (9 of them) and exits 1 if any fails. It imports helpers from tests/ (the kernel
batches, the MoE reference, the paged-sequence driver), so run it from a checkout:

    python bench/gpu_moe_checks.py            # CUDA
    python bench/gpu_moe_checks.py --smoke    # the CPU, Triton interpreted: checks the script
"""
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / p) for p in (".", "unit/kernels", "unit/engine/models",
                                                  "unit/engine/layers")]
import torch  # noqa: E402

dev = torch.device("cpu" if SMOKE else "cuda")
print("torch", torch.__version__, dev, torch.cuda.get_device_name() if dev.type == "cuda" else "",
      flush=True)
from kv_batches import FP8, Spec, assert_close_to, build_batch  # noqa: E402

from kvserve.kernels.attention import paged_attention  # noqa: E402
from kvserve.kernels.plan import plan_attention  # noqa: E402
from kvserve.kernels.triton_attention import triton_paged_attention  # noqa: E402

FAILS = []


def to(b):
    for f in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"):
        setattr(b, f, getattr(b, f).to(dev))
    return b


def check(name, fn):
    t = time.perf_counter()
    try:
        fn()
        print("OK  ", name, f"{time.perf_counter() - t:.1f}s", flush=True)
    except Exception as e:  # noqa: BLE001
        FAILS.append(name)
        print("FAIL", name, type(e).__name__, str(e)[:600], flush=True)


BIG = dev.type == "cuda"
SEQS = ((70, 1), (5, 1), (40, 13), (33, 33), (1, 1)) + (((1500, 1), (300, 70)) if BIG else ())
SINKS = torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2


def attn_case(dt, qdt, window):
    b = build_batch(Spec(seqs=SEQS, num_kv_heads=2, group=4, head_dim=64, block_size=16,
                         cache_dtype=dt, q_dtype=qdt, shared_blocks=1, seed=3))
    exp = paged_attention(*b.args(), backend="reference", sliding_window=window, sinks=SINKS)
    b = to(b)
    got = paged_attention(*b.args(), backend="triton", sliding_window=window,
                          sinks=SINKS.to(dev))
    assert_close_to(got.cpu(), exp)
    for ns in (2, 5):
        d = build_batch(Spec(seqs=((1500 if BIG else 90, 1), (9, 1), (333 if BIG else 40, 1)),
                             num_kv_heads=2, group=4, head_dim=64, block_size=16,
                             cache_dtype=dt, q_dtype=qdt, seed=9))
        e2 = paged_attention(*d.args(), backend="reference", sliding_window=window, sinks=SINKS)
        d = to(d)
        p2 = plan_attention(d.block_tables, d.seq_lens, d.query_start_loc, 16)
        o2 = triton_paged_attention(d.q, d.k_cache, d.v_cache, p2, d.scale, d.k_scale,
                                    d.v_scale, num_splits=ns, sliding_window=window,
                                    sinks=SINKS.to(dev))
        assert_close_to(o2.cpu(), e2)


CACHES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (FP8, torch.bfloat16))
for dt, qdt in CACHES[:1] if SMOKE else CACHES:  # the smoke run: one of each code path
    for window in (None, 7) if SMOKE else (None, 7, 128):
        check(f"triton sinks {dt} window={window}", lambda: attn_case(dt, qdt, window))

import test_moe as tm  # noqa: E402

from kvserve.engine.layers import moe as moe_mod  # noqa: E402

print("grouped_mm on", dev, "bf16:", moe_mod._grouped_mm_works(dev.type, torch.bfloat16),
      "fp32:", moe_mod._grouped_mm_works(dev.type, torch.float32), flush=True)


def moe_case(act):
    gpt = act != "silu"
    spec = replace(tm.SPEC, hidden=64, intermediate=128, num_experts=8, top_k=2,
                   activation=act, expert_bias=gpt, router_bias=gpt, renormalize=gpt,
                   shared_intermediate=0 if gpt else 64)
    gen, x, router = tm.inputs(spec, tokens=300)
    x = x.abs()
    router[[1, 4]] = -50.0
    rb = torch.randn(spec.num_experts, generator=gen) if gpt else None
    ex = tm.random_experts(spec, gen, bias=gpt)
    shared = None if gpt else (
        (torch.randn(64, 64, generator=gen) * .3, torch.randn(64, 64, generator=gen) * .3,
         torch.randn(64, 64, generator=gen) * .3), torch.randn(64, generator=gen))
    layer = tm.build(spec, ex, router, rb, shared)
    ref = tm.naive(x, router, rb, ex, spec, shared)
    for dtype in (torch.float32, torch.bfloat16):
        lay = layer.to(dev, dtype)
        xd = x.to(dev, dtype)
        with torch.no_grad():
            got = lay(xd).float().cpu()
            ids = moe_mod.route(lay.gate(xd), spec.top_k, spec.renormalize)[1].sort(-1)[0].cpu()
        ref_ids = moe_mod.route(x @ router.T + (0 if rb is None else rb), spec.top_k,
                                spec.renormalize)[1].sort(-1)[0]
        same = (ids == ref_ids).all(-1)  # bf16 rounding may flip near-tied experts
        assert same.float().mean() > 0.9, same.float().mean()
        err = ((got[same] - ref[same]).norm() / ref[same].norm()).item()
        agree = same.float().mean().item()
        print("   ", dtype, f"routing agrees on {agree:.3f}, rel err {err:.2e}")
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


for act in ("silu", "swiglu_clamped"):
    check(f"FusedMoE {act} on {dev}", lambda: moe_case(act))


def bench(f, n=2 if SMOKE else 20):
    for _ in range(3):
        f()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


import test_triton_moe as ttm  # noqa: E402

from kvserve.engine.layers import moe_gpu  # noqa: E402
from kvserve.engine.layers.quantization.activation import ActivationScheme  # noqa: E402


def fused_formats():
    """The fused kernel on the device, every weight format, against x @ dequantised W^T."""
    for fmt in [*ttm.FORMATS, *ttm.ACTIVATIONS]:
        base, kind = ttm.ACTIVATIONS.get(fmt, (fmt, None))
        ws13, ws2 = ttm.experts_of(base)
        act = ActivationScheme(kind) if kind else None
        x, weights, ids = ttm.routing(13)
        s13, s2 = moe_gpu.StackedExperts(ws13, act).to(dev), moe_gpu.StackedExperts(ws2, act).to(dev)
        got = moe_gpu.gpu_experts(x.to(dev), s13, s2, weights.to(dev), ids.to(dev), ttm.SPEC)
        err = ttm.rel_err(got.cpu(), ttm.reference_layer(x, ws13, ws2, weights, ids, kind))
        print(f"    {fmt}: rel err {err:.2e}", flush=True)
        assert err < (1e-4 if kind is None else 3e-3), (fmt, err)


check("fused MoE kernel, every weight format", fused_formats)


def random_int4(e, n, k, group, gen):
    from kvserve.engine.layers.quantization.qweight import QuantizedWeight
    return [QuantizedWeight(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8,
                                          device=dev),
                            torch.rand(n, k // group, generator=gen, device=dev) * 2e-3, None,
                            group, 4)
            for _ in range(e)]


def fused_timing():
    """Mixtral's expert shape (8 x 4096 -> 14336, top 2) in bf16: the fused kernel against the
    grouped_mm and per-expert-mm paths (dense), and W4A16 (group 128) fused against one
    Triton W4A16 matmul per expert; the fused kernel's output against each."""
    from kvserve.engine.layers.moe import ExpertLinears, MoESpec, fused_experts
    from kvserve.engine.layers.quantization.gpu_linear import TritonW4A16Linear
    e, h, i = (8, 4096, 14336) if BIG else (8, 256, 128)
    spec = MoESpec(num_experts=e, top_k=2, hidden=h, intermediate=i, renormalize=True)
    gen = torch.Generator(dev).manual_seed(0)  # built on the device: 2.8 GB of bf16 weights
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    q13, q2 = random_int4(e, 2 * i, h, 128, gen), random_int4(e, h, i, 128, gen)
    s13, s2 = moe_gpu.StackedExperts(q13, None).to(dev), moe_gpu.StackedExperts(q2, None).to(dev)
    loop13 = ExpertLinears([TritonW4A16Linear(w, torch.bfloat16) for w in q13], 2 * i)
    loop2 = ExpertLinears([TritonW4A16Linear(w, torch.bfloat16) for w in q2], h)
    orig = moe_mod._grouped_mm_works
    for t in (16,) if SMOKE else (1, 16, 512, 4096):
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        weights, ids = moe_mod.route(torch.randn(t, e, device=dev), 2, True)
        with torch.no_grad():
            fused = moe_gpu.gpu_experts(x, w13, w2, weights, ids, spec)
            ref = fused_experts(x, w13, w2, weights, ids, spec)
            err = ((fused.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 2e-2, err
            f = bench(lambda: moe_gpu.gpu_experts(x, w13, w2, weights, ids, spec))
            g = bench(lambda: fused_experts(x, w13, w2, weights, ids, spec))
            moe_mod._grouped_mm_works = lambda *_: False
            p = bench(lambda: fused_experts(x, w13, w2, weights, ids, spec))
            moe_mod._grouped_mm_works = orig
            q = bench(lambda: moe_gpu.gpu_experts(x, s13, s2, weights, ids, spec))
            qref = fused_experts(x, loop13, loop2, weights, ids, spec)
            qerr = ((moe_gpu.gpu_experts(x, s13, s2, weights, ids, spec).float() - qref.float())
                    .norm() / qref.float().norm()).item()
            assert qerr < 2e-2, qerr
            ql = bench(lambda: fused_experts(x, loop13, loop2, weights, ids, spec))
        print(f"MoE E={e} H={h} I={i} top2 T={t} bf16: fused {f:.3f} ms, grouped_mm {g:.3f} ms, "
              f"per-expert mm {p:.3f} ms (rel err {err:.1e}); W4A16 g128: fused {q:.3f} ms, "
              f"per-expert Triton W4A16 {ql:.3f} ms (rel err {qerr:.1e})", flush=True)


check("fused MoE timing, Mixtral's expert shape", fused_timing)

import transformers  # noqa: E402
from test_llama import PagedSequences, hf_logits  # noqa: E402

from kvserve.engine.worker.model_loader import load_model  # noqa: E402


def model_case(arch, **kw):
    import tempfile
    from pathlib import Path
    d = Path(tempfile.mkdtemp()) / arch
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2)
    base.update(kw)
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**base)
    torch.manual_seed(0)
    m = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, .5)
            elif "norm" in n:
                p.add_(.3 * torch.randn_like(p))
    m.save_pretrained(d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager").eval()
    ours, config = load_model(d, torch.float32, dev)
    paged = PagedSequences(config)
    paged.caches = [(k.to(dev), v.to(dev)) for k, v in paged.caches]

    class OnDev:
        def __call__(self, ids, pos, caches, attn):
            attn = replace(attn, slot_mapping=attn.slot_mapping.to(dev),
                           block_tables=attn.block_tables.to(dev),
                           seq_lens=attn.seq_lens.to(dev),
                           query_start_loc=attn.query_start_loc.to(dev))
            return ours(ids.to(dev), pos.to(dev), caches, attn)

        def compute_logits(self, h):
            return ours.compute_logits(h).cpu()

    gen = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, 320, (40,), generator=gen).tolist(),
               1: torch.randint(0, 320, (7,), generator=gen).tolist()}
    logits, spans = paged.step(OnDev(), prompts)
    for s, sp in zip(prompts, spans):
        torch.testing.assert_close(logits[sp], hf_logits(hf, paged.tokens[s]), atol=2e-3, rtol=0)
    for _ in range(3):
        logits, spans = paged.step(OnDev(), {0: [5], 1: [9]})
        for s, sp in zip((0, 1), spans):
            torch.testing.assert_close(logits[sp], hf_logits(hf, paged.tokens[s])[-1:],
                                       atol=2e-3, rtol=0)


YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}
check("gpt-oss tiny on device vs HF", lambda: model_case(
    "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, sliding_window=11,
    rope_parameters=YARN, swiglu_limit=1.5))
check("qwen2-moe tiny on device vs HF", lambda: model_case(
    "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, mlp_only_layers=[0]))


def moe_graphs():
    """A tiny Qwen2-MoE's decode captured in CUDA graphs (the fused experts read nothing back,
    so capture succeeds) and replayed: its greedy tokens are the eager engine's. The smoke run
    captures with a stand-in (a plain call): the code path, not CUDA."""
    import tempfile

    from family_checks import build_family

    from kvserve import LLM, SamplingParams
    d = build_family(Path(tempfile.mkdtemp()) / "qwen2_moe", "Qwen2MoeForCausalLM",
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=96, mlp_only_layers=[0],
                     norm_topk_prob=False, initializer_range=0.3)
    kw = {"dtype": "float32", "device": dev.type, "attention_backend": "triton",
          "max_num_seqs": 4, "max_model_len": 128}
    kw.update({"kv_cache_memory": 1 << 22} if SMOKE else {"gpu_memory_utilization": 0.3})
    prompts = ["the cat sat on the mat", "a dog", "one two three four five six seven"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLM(str(d), enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    del eager
    graphs = LLM(str(d), enforce_eager=SMOKE, **kw)
    runner = graphs.llm_engine.runner
    if SMOKE:
        runner.capture_decode_graphs(4, 128, capture=lambda fn: fn)
    assert runner.graphs is not None, "CUDA graph capture of the MoE decode failed (see log)"
    replays = []
    for size, fn in list(runner.graphs.graphs.items()):
        runner.graphs.graphs[size] = lambda fn=fn: replays.append(1) or fn()
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params)]
    assert replays, "no decode step ran from a captured graph"
    assert got == want, (got, want)
    print(f"    captured sizes {sorted(runner.graphs.graphs)}, {len(replays)} replays, "
          "tokens equal eager's", flush=True)


check("MoE decode in CUDA graphs", moe_graphs)
print("FAILED:" if FAILS else "all checks passed", ", ".join(FAILS))
sys.exit(1 if FAILS else 0)
