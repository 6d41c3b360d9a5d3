"""The GPU step's code path, run on the CPU: the Triton backend and elementwise kernels under
TRITON_INTERPRET=1 (RoPE in the KV write on decode steps, fresh prefills through SDPA) give the
CPU path's tokens; and no host sync happens in a step before its outputs are needed (issue 28):
the forward, the logits and the sampler queue device work without reading a device value back.

A CPU has no device to wait for, so the test marks what would live on a GPU: the model's weights,
the KV cache and the step tensors the runner copies to its device (ModelRunner._dev) become
`OnDevice` tensors, and so does every result computed from one. A read of an `OnDevice` value on
the host (`.item()`, `.tolist()`, `bool()`/`int()`/`float()`, `nonzero`, boolean-mask indexing,
`unique`, `multinomial`, `.cpu()`, `.numpy()`) is recorded with its caller. The engine runs a
mixed workload (prefills, decodes, sampling with top-k/top-p/min-p, penalties, seeds, logprobs,
min_tokens) with the whole runner.execute under watch; the sampled tokens are read (the step's
outputs) only after it returns.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from conftest import make_llm, triton_interpreted

HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.unique, torch.unique, torch.Tensor.multinomial, torch.multinomial,
    torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.masked_select, torch.masked_select,
    torch.Tensor.argwhere, torch.argwhere, torch.Tensor.__len__,
}
_ROOT = "kvserve"


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on a GPU; results computed from it stay OnDevice."""

    reads: list[str] = []
    watching = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.watching and (func in HOST_READS or _bool_mask_index(func, args)):
            stack = traceback.extract_stack()[:-1]
            if any(f"{os.sep}triton{os.sep}" in f.filename for f in stack):
                return super().__torch_function__(func, types, args, kwargs or {})
            frames = [f for f in stack if _ROOT in f.filename and "/tests/" not in f.filename]
            where = f"{frames[-1].filename.split(_ROOT)[-1]}:{frames[-1].lineno} " \
                    f"{frames[-1].name}" if frames else "?"
            cls.reads.append(f"{getattr(func, '__name__', func)} at {where}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _bool_mask_index(func, args) -> bool:
    """x[mask] with a boolean tensor mask: its output size is read from the device."""
    if func is not torch.Tensor.__getitem__ or len(args) < 2:
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)


def _on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OnDevice)


def put_on_device(llm) -> None:
    """Weights, buffers, the KV cache and the runner's copies to its device become OnDevice."""
    runner = llm.llm_engine.runner
    for module in runner.model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(_on_device(p.data),
                                                               requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = _on_device(b)
    runner.kv_caches = [(_on_device(k), _on_device(v)) for k, v in runner.kv_caches]
    runner._dev = lambda t: _on_device(t)


@pytest.fixture(scope="module")
def interpreter():
    """The GPU path's Triton kernels under TRITON_INTERPRET=1 (reloaded under it, and back)."""
    with triton_interpreted(*(f"kvserve.kernels.triton_{name}"
                              for name in ("attention", "cache", "fused", "moe"))):
        yield


def gpu_path(monkeypatch) -> None:
    """The GPU's code path on the CPU: Triton elementwise ops, plain linears, quantised MoE
    experts stacked for the fused kernel."""
    from kvserve.engine.layers import moe, packed_linear
    from kvserve.kernels import cpu_ops

    monkeypatch.setattr(cpu_ops, "_fused", lambda x: False)
    monkeypatch.setattr(cpu_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(packed_linear, "pack_linears", lambda model, **kw: 0)
    monkeypatch.setattr(moe, "stack_on", lambda device: True)


def watching(fn):
    """`fn` with host reads of OnDevice values recorded while it runs."""
    def run(*args, **kwargs):
        OnDevice.watching = True
        try:
            return fn(*args, **kwargs)
        finally:
            OnDevice.watching = False
    return run


def watch(llm) -> None:
    """Every step's runner.execute of `llm` watched for host reads of OnDevice values."""
    runner = llm.llm_engine.runner
    runner.execute = watching(runner.execute)
    OnDevice.reads = []


@pytest.fixture
def watched(interpreter, tiny_model_dir, monkeypatch):
    """An engine on the GPU's code path (the Triton attention backend and the Triton elementwise
    ops, plain linears), with OnDevice tensors as the device's; every step's runner.execute
    watched. The interpreter's own reads of kernel arguments are not counted: on a GPU a launch
    passes pointers."""
    from kvserve.kernels import checks

    gpu_path(monkeypatch)
    monkeypatch.setattr(checks, "host_readable", lambda t: not isinstance(t, OnDevice))
    llm = make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4,
                   max_model_len=96, enforce_eager=True)
    put_on_device(llm)
    watch(llm)
    yield llm
    OnDevice.reads = []


def _workload():
    from kvserve import SamplingParams

    prompts = ["the cat sat on the mat", "a dog", "hello there", "one two three four five six"]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, seed=3,
                       ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=3,
                       ignore_eos=False),
        SamplingParams(max_tokens=6, temperature=0.7, top_p=0.5, ignore_eos=True),
    ]
    return prompts, params


def test_the_step_reads_nothing_back_from_the_device(watched):
    prompts, params = _workload()
    outputs = watched.generate(prompts, params)
    assert all(o.outputs[0].token_ids for o in outputs)
    assert OnDevice.reads == [], sorted(set(OnDevice.reads))


def test_a_host_read_in_the_step_is_caught(watched, monkeypatch):
    """The detector fails meaningfully: a `.item()` put back into the sampler is reported."""
    from kvserve.engine.sample import sampler

    real = sampler.inverse_cdf
    monkeypatch.setattr(sampler, "inverse_cdf",
                        lambda logits, u: logits.max().item() and real(logits, u))
    prompts, params = _workload()
    watched.generate(prompts, params)
    assert any(r.startswith("item at ") for r in OnDevice.reads), OnDevice.reads


def test_gpu_path_gives_the_cpu_paths_tokens(interpreter, tiny_model_dir, monkeypatch):
    """Greedy tokens and logprobs of the GPU path (rope_write_kv on decode steps, fresh prompts
    through SDPA, a prompt over a cached prefix through the paged kernel) equal the CPU's."""
    from kvserve import SamplingParams
    from kvserve.engine.layers import packed_linear
    from kvserve.kernels import cpu_ops, fresh_prefill, triton_fused

    prefix = "one two three four five six seven eight nine ten eleven twelve"
    first = ["the cat sat on the mat", prefix + "fourteen", "hello"]
    second = [prefix + "and then", "a dog ran"]  # over the first call's cached prefix
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True)
    cpu = make_llm(tiny_model_dir, max_model_len=96)
    want = cpu.generate(first, params) + cpu.generate(second, params)

    calls: list[str] = []
    monkeypatch.setattr(cpu_ops, "_fused", lambda x: False)
    monkeypatch.setattr(cpu_ops, "use_triton", lambda x: True)
    monkeypatch.setattr(packed_linear, "pack_linears", lambda model, **kw: 0)
    for module, name in ((triton_fused, "rope_write_kv"), (fresh_prefill, "fresh_attention")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **k:
                            calls.append(_n) or _r(*a, **k))
    gpu = make_llm(tiny_model_dir, attention_backend="triton", max_model_len=96,
                   enforce_eager=True)
    got = gpu.generate(first, params) + gpu.generate(second, params)
    assert got[3].num_cached_tokens > 0  # the paged kernel served it, on a sub-plan
    assert "rope_write_kv" in calls and "fresh_attention" in calls
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            tok = next(iter(lw))
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-3


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen2-MoE: layer 0 dense, then 4 experts of [64, 64], top 2, a gated shared
    expert."""
    from family_checks import build_family

    return build_family(tmp_path_factory.mktemp("moe") / "qwen2_moe", "Qwen2MoeForCausalLM",
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=96, mlp_only_layers=[0],
                        norm_topk_prob=False, initializer_range=0.3)


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["dense", "w8a8_int8"])
def test_moe_step_is_sync_free_and_gives_the_cpu_paths_tokens(interpreter, moe_dir, monkeypatch,
                                                               quantization):
    """An MoE model's step on the GPU path (the fused Triton experts kernel: dense experts read
    in place, or --quantization int8's experts stacked at load) reads nothing back from the
    device, and its greedy tokens and logprobs are the CPU path's (per-expert segments)."""
    from kvserve import SamplingParams
    from kvserve.engine.layers import moe, moe_gpu
    from kvserve.engine.layers.quantization import int8_w8a8

    # the attention's int8 linears as plain tensors (a GPU's), not oneDNN's opaque prepacked ones
    # (onednn_int8_fast is cached per process: patching what it calls may come too late)
    monkeypatch.setattr(int8_w8a8, "onednn_int8_fast", lambda: False)
    prompts = ["the cat sat on the mat", "a dog", "one two three four five six seven"]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True)
    want = make_llm(moe_dir, max_model_len=96, quantization=quantization).generate(prompts,
                                                                                 params)
    calls: list[int] = []
    real = moe_gpu.gpu_experts
    gpu_path(monkeypatch)
    monkeypatch.setattr(moe, "gpu_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    from kvserve.kernels import checks

    monkeypatch.setattr(checks, "host_readable", lambda t: not isinstance(t, OnDevice))
    llm = make_llm(moe_dir, attention_backend="triton", max_num_seqs=4, max_model_len=96,
                   enforce_eager=True, quantization=quantization)
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, moe.FusedMoE)]
    assert len(layers) == 2 and all((m.w13_stacked is not None) == bool(quantization)
                                    for m in layers)
    put_on_device(llm)
    watch(llm)
    got = llm.generate(prompts, params)
    assert OnDevice.reads == [], sorted(set(OnDevice.reads))
    assert calls, "the fused MoE kernel did not run"
    # Per-token int8 codes may round apart: the Triton elementwise ops and the CPU's torch ops
    # sum in different orders, and a code that flips at a rounding boundary moves this random
    # model's logprob by up to 0.03 on an AVX2 CPU (0.02 sufficed on AVX-512); a wrong expert,
    # scale or code moves it by whole units. Measured 2026-12-07 on an AVX2 EPYC: at most 3e-6
    # (dense) and 1.2e-6 (int8, no code flipped); with the first MoE layer's expert scales x1.05
    # (the negative control below) 0.04, 0.12 and 0.21 over the three prompts.
    tol = 1e-3 if quantization is None else 5e-2
    if quantization is None:
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    gaps = first_token_gaps(got, want)
    assert max(gaps) < tol, gaps
    if quantization:  # negative control: the first MoE layer's expert scales 5% off fail it
        layers[0].w13_stacked.scale.mul_(1.05)
        llm.llm_engine.reset_prefix_cache()
        off = first_token_gaps(llm.generate(prompts, params), want)
        assert max(off) >= tol, off


def first_token_gaps(got, want) -> list[float]:
    """|first token's logprob on one path - on the other| per prompt (the same prompt on both
    paths, so the same context)."""
    gaps = []
    for g, w in zip(got, want, strict=True):
        lg, lw = g.outputs[0].logprobs[0], w.outputs[0].logprobs[0]
        tok = next(iter(lw))
        gaps.append(abs(lg[tok].logprob - lw[tok].logprob))
    return gaps


def test_async_scheduling_launch_reads_nothing_back(interpreter, tiny_model_dir, monkeypatch):
    """With async scheduling the whole launch of step N+1 (schedule, inputs, the device fill of
    its decode tokens from step N's sampled ids, forward, sampler) runs while step N's tokens
    are still unread: none of it may read a device value. Tokens equal the synchronous run's."""
    from kvserve import SamplingParams
    from kvserve.kernels import checks

    gpu_path(monkeypatch)
    monkeypatch.setattr(checks, "host_readable", lambda t: not isinstance(t, OnDevice))
    prompts = ["the cat sat on the mat", "a dog", "hello there", "one two three four five six"]
    params = [SamplingParams(max_tokens=7, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=5, temperature=0.8, top_k=5, top_p=0.9, seed=3,
                             ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3)]
    runs = []
    for overlap in (False, True):
        llm = make_llm(tiny_model_dir, attention_backend="triton", max_num_seqs=4,
                       max_model_len=96, enforce_eager=True, async_scheduling=overlap)
        put_on_device(llm)
        stepper = llm.llm_engine._stepper
        stepper._launch = watching(stepper._launch)
        OnDevice.reads = []
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert OnDevice.reads == [], sorted(set(OnDevice.reads))
    assert runs[1] == runs[0]
    assert stepper.overlapped_steps >= 4
