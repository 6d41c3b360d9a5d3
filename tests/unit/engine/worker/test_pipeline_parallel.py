"""Pipeline parallelism: the layer split (balanced as vLLM, VLLM_PP_LAYER_PARTITION), where a
rank sits in the PP x TP grid and in a multi-host group (LWS, torchrun), each stage loading only
its layers, and engines of 2 stages (and 2 stages x 2 tensor-parallel ranks) as real processes
over gloo giving what one rank gives (greedy tokens and logprobs, fp32) through chunked prefill,
preemption and prefix-cache hits, with quantised weights and LoRA adapters; what stages cannot
do is refused by name, and a killed stage is an error, not a hang."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import replace

import pytest
import torch

from conftest import build_tiny_llama
from forked_workers import forked_workers
from lora_checks import adapters, lora_base  # noqa: F401 - fixtures
from kvserve import LLM, SamplingParams
from kvserve.engine.errors import ConfigError, WorkerDiedError
from kvserve.engine.worker.model_loader import load_model
from kvserve.engine.worker.pipeline import Layout, PPStage, partition_layers
from kvserve.engine.worker.rank_env import from_environ

PROMPTS = ["The quick brown fox jumps over", "Paged attention stores the KV cache",
           "What is the capital of France?", "Explain how the KV cache works in"]
SHARED = "You are a helpful assistant. Answer briefly and precisely. "


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Stage workers fork from a preloaded fork server (forked_workers.py): no import each."""
    with forked_workers():
        yield


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """The tiny Llama with 4 layers (2 per stage) and a tied lm_head."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-4", num_hidden_layers=4)


def engine_kw(model, **kw) -> dict:
    """A 12-block cache and 64-token steps: prompts are chunked and requests preempted."""
    return {"model": str(model), "dtype": "float32", "device": "cpu",
            "num_gpu_blocks_override": 12, "max_num_batched_tokens": 64, "max_model_len": 256,
            "seed": 0, **kw}


def generate(llm: LLM, prompts: list[str], **kw) -> list[tuple[list[int], list[dict]]]:
    """(token ids, [{token: logprob} per position]) of each prompt's first completion."""
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 24), logprobs=2, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
            for o in outs for c in o.outputs]


class Refuse:
    """A driver sampler that must never be called: with stages and no logits hook on the
    driver, the last stage samples."""

    def __call__(self, *args):  # noqa: ANN002
        raise AssertionError("the driver sampled")


SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=12, logprobs=1)
          for i in range(3)]


def run(model, prompts: list[str], sample: dict | None = None, seeded: bool = False, **kw):
    """(outputs, stats, the driver's KV shape, [the driver's stage-link figures, then each
    worker's]) of one engine, shut down after; with stages the driver's sampler refuses. With
    `seeded`, the outputs of SEEDED over three prompts come after (the figures are before)."""
    llm = LLM(**engine_kw(model, **kw))
    try:
        engine = llm.llm_engine
        runner = engine.runner
        if runner.link is not None:
            runner.sampler = Refuse()
        out = generate(llm, prompts, **(sample or {}))
        links = [replace(runner.link.figures), *runner.workers.link_figures()] \
            if runner.link else []
        stats = engine.get_stats()
        if seeded:
            got = llm.generate(PROMPTS[:3], SEEDED, use_tqdm=False)
            out = (out, [(list(o.outputs[0].token_ids),
                          [{t: v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs])
                         for o in got])
        return out, stats, tuple(runner.kv.shape), links
    finally:
        llm.shutdown()


def assert_same(got, want, tol: float = 0.0) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        for da, db in zip(a, b):
            assert da.keys() == db.keys()
            assert max(abs(da[t] - db[t]) for t in da) <= tol


# ---------------------------------------------------------------------------- arithmetic


def test_layers_split_as_vllm_and_by_the_env_list(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert partition_layers(4, 2) == [2, 2]
    assert partition_layers(7, 4) == [2, 2, 2, 1]  # the remainder before the last stage
    assert partition_layers(6, 4) == [1, 2, 2, 1]
    assert partition_layers(30, 4) == [7, 8, 8, 7]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    assert partition_layers(4, 2) == [3, 1]
    assert PPStage.of(1, 2, 4) == PPStage(1, 2, 3, 4)
    for bad in ("2,1", "4,0", "a,b", "1,1,2"):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", bad)
        with pytest.raises(ConfigError, match="VLLM_PP_LAYER_PARTITION"):
            partition_layers(4, 2)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    with pytest.raises(ConfigError, match="at least one layer per stage"):
        partition_layers(2, 3)


def test_ranks_are_stage_major_as_vllm() -> None:
    grid = Layout(tp=2, pp=3)
    assert grid.world == 6
    assert [grid.stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [grid.tp_rank_of(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert grid.tp_ranks(1) == [2, 3] and grid.last_stage_driver() == 4


def test_ranks_from_leader_worker_set_and_torchrun_variables() -> None:
    lws = from_environ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1",
                        "LWS_LEADER_ADDRESS": "svc-0.svc.ns", "MASTER_PORT": "29600"})
    assert (lws.nodes, lws.node, lws.master_addr, lws.source) == (2, 1, "svc-0.svc.ns", "lws")
    assert lws.init_method() == "tcp://svc-0.svc.ns:29600" and lws.command_port == 29601
    assert list(lws.ranks(8)) == [4, 5, 6, 7]  # PP 2 x TP 4: this pod holds stage 1
    leader = from_environ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0",
                           "LWS_LEADER_ADDRESS": "a", "MASTER_ADDR": "b"})
    assert leader.is_leader and leader.master_addr == "b" and leader.master_port == 29500
    torchrun = from_environ({"MASTER_ADDR": "10.0.0.1", "RANK": "3", "WORLD_SIZE": "4"})
    assert list(torchrun.ranks(4)) == [3] and torchrun.source == "torchrun"
    local = from_environ({})
    assert not local.multi_node and list(local.ranks(4)) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="LWS_GROUP_SIZE"):
        lws.__class__(3, 1, source="lws").local_ranks(4)
    with pytest.raises(ConfigError, match="names the leader"):
        from_environ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"})
    with pytest.raises(ConfigError, match="outside a group"):
        from_environ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "2", "MASTER_ADDR": "x"})


def test_a_host_started_in_the_wrong_role_is_told_which(four_layers, monkeypatch) -> None:
    from kvserve.engine.worker.headless import run_headless
    from kvserve.service.api_server import run_headless_host

    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    with pytest.raises(ConfigError, match="run `kvserve serve --headless` here"):
        LLM(**engine_kw(four_layers, pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="this is the leader"):
        run_headless(2, from_environ({"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0",
                                      "LWS_LEADER_ADDRESS": "127.0.0.1"}))
    for name in ("LWS_GROUP_SIZE", "LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(name)
    from kvserve.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="--headless needs a multi-host group"):
        run_headless_host(EngineConfig(model=str(four_layers), pipeline_parallel_size=2))


def test_each_stage_loads_only_its_layers(four_layers) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    full, _ = load_model(four_layers, f32, cpu, pack_linears=False)
    first, last = (load_model(four_layers, f32, cpu, pack_linears=False,
                              pp=PPStage.of(s, 2, 4))[0] for s in range(2))
    whole = sum(p.numel() for p in full.parameters())
    for stage in (first, last):
        assert sum(p.numel() for p in stage.parameters()) < 0.6 * whole
    assert not list(first.model.layers[2].parameters()) and not list(first.lm_head.parameters())
    assert not list(last.model.layers[0].parameters())
    assert not list(last.model.embed_tokens.parameters())
    # the tied head: the last stage holds the embedding's rows as its own lm_head
    assert torch.equal(last.lm_head.weight, full.model.embed_tokens.weight)
    assert torch.equal(last.model.layers[3].mlp.down_proj.weight,
                       full.model.layers[3].mlp.down_proj.weight)


def test_micro_batches_cut_between_sequences_by_tokens() -> None:
    from kvserve.engine.worker.microbatch import cut_points, split_step
    from kvserve.engine.worker.model_runner import BlockMoves, StepInput

    assert cut_points(torch.tensor([0, 1, 2, 3, 4]), 2) == [0, 2, 4]  # decode: by sequences
    assert cut_points(torch.tensor([0, 100, 101, 102, 103]), 2) == [0, 1, 4]  # by tokens
    assert cut_points(torch.tensor([0, 1, 2]), 4) == [0, 1, 2]  # at most one per sequence
    assert cut_points(torch.tensor([0, 7]), 2) == [0, 1]
    qsl = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    step = StepInput(torch.arange(6), torch.tensor([0, 1, 2, 9, 4, 5]),
                     torch.arange(6).view(1, 6), torch.arange(9, dtype=torch.int32).view(1, 3, 3),
                     torch.tensor([3, 10, 6], dtype=torch.int32), qsl, 3, 10, [0, 1, 2],
                     BlockMoves(), lora_slots=torch.tensor([0, 0, 0, 1, -1, -1]),
                     embeds=(torch.tensor([1, 5]), torch.ones(2, 4)))
    first, second = split_step(step, 2)
    assert (first.lo, first.hi, second.lo, second.hi) == (0, 3, 3, 6)
    assert second.step.query_start_loc.tolist() == [0, 1, 3]
    assert second.step.block_tables.tolist() == [[[3, 4, 5], [6, 7, 8]]]
    assert (second.step.max_query_len, second.step.max_seq_len) == (2, 10)
    assert second.step.lora_slots.tolist() == [1, -1, -1]
    assert first.step.embeds[0].tolist() == [1] and second.step.embeds[0].tolist() == [2]


# ---------------------------------------------------------------------------- engines


@pytest.fixture(scope="module")
def reference(four_layers):
    """One rank's outputs, stats and KV shape for the shared-prefix prompts (then the seeded
    rows' outputs)."""
    return run(four_layers, [SHARED + p for p in PROMPTS], seeded=True)


@pytest.fixture(scope="module")
def staged(four_layers):
    """The same with two stages (two layers each, two micro-batches per step)."""
    return run(four_layers, [SHARED + p for p in PROMPTS], seeded=True, pipeline_parallel_size=2)


def test_two_stages_equal_one_rank_through_preemption_and_prefix_hits(reference,
                                                                       staged) -> None:
    (want, _), _, full_kv, _ = reference
    (got, _), stats, stage_kv, links = staged
    assert_same(got, want)  # exact: the same ops in the same order, split over processes
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert full_kv[1] == 4 and stage_kv[1] == 2  # the driver's cache: its 2 layers only
    assert stage_kv[2] == full_kv[2] == 12  # the same blocks on every stage
    sent, received = links
    assert sent.sends == received.recvs > 0 and sent.bytes_sent == received.bytes_received


def test_the_last_stage_samples_seeded_rows_as_one_rank(reference, staged) -> None:
    """The last stage samples (run() makes the driver's sampler raise) and seeded random rows
    draw what one rank draws."""
    want, got = reference[0][1], staged[0][1]
    assert got == want


def test_two_stages_by_two_ranks_equal_one_rank(four_layers, reference) -> None:
    want = reference[0][0]
    got, stats, _, _ = run(four_layers, [SHARED + p for p in PROMPTS],
                           pipeline_parallel_size=2, tensor_parallel_size=2)
    # tensor parallelism sums each row-parallel product in two halves: logprobs within 1e-4
    assert_same(got, want, tol=1e-4)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_an_uneven_split_and_whole_steps(four_layers, reference, staged, monkeypatch) -> None:
    """VLLM_PP_LAYER_PARTITION=3,1, and KVSERVE_PP_MICROBATCHES=1: each step goes through the
    stages whole, in fewer hand-offs than the default two micro-batches of the same steps."""
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    monkeypatch.setenv("KVSERVE_PP_MICROBATCHES", "1")
    got, _, stage_kv, links = run(four_layers, [SHARED + p for p in PROMPTS],
                                  pipeline_parallel_size=2)
    assert_same(got, reference[0][0])
    assert stage_kv[1] == 3
    assert 0 < links[0].sends < staged[3][0].sends  # the same steps, cut in two there


def test_prompt_logprobs_and_int8_weights_across_stages(four_layers) -> None:
    sample = {"prompt_logprobs": 1, "max_tokens": 8}
    llm = LLM(**engine_kw(four_layers, quantization="int8"))
    staged = LLM(**engine_kw(four_layers, quantization="int8", pipeline_parallel_size=2))
    try:
        params = SamplingParams(temperature=0, **sample)
        a, b = (m.generate(PROMPTS[:2], params, use_tqdm=False) for m in (llm, staged))
    finally:
        llm.shutdown()
        staged.shutdown()
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [d and {t: v.logprob for t, v in d.items()} for d in x.prompt_logprobs] == \
            [d and {t: v.logprob for t, v in d.items()} for d in y.prompt_logprobs]


def test_what_stages_cannot_do_is_refused_by_name(four_layers) -> None:
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        LLM(**engine_kw(four_layers, pipeline_parallel_size=2, kv_cache_dtype="fp8",
                        calculate_kv_scales=True))
    with pytest.raises(ConfigError, match="sharded_state"):
        LLM(**engine_kw(four_layers, pipeline_parallel_size=2, load_format="sharded_state"))
    with pytest.raises(ConfigError, match="at least one layer per stage"):
        LLM(**engine_kw(four_layers, pipeline_parallel_size=5))
    with pytest.raises(ConfigError, match="integer >= 1"):
        LLM(**engine_kw(four_layers, pipeline_parallel_size=0))


def test_a_killed_stage_is_an_error_not_a_hang(four_layers) -> None:
    llm = LLM(**engine_kw(four_layers, pipeline_parallel_size=2))
    engine = llm.llm_engine
    pid = engine.runner.workers.procs[0].pid
    try:
        engine.add_request("a", "The quick brown fox", SamplingParams(max_tokens=150,
                                                                      ignore_eos=True))
        engine.step()
        os.kill(pid, signal.SIGKILL)
        errors: list[BaseException] = []

        def drive() -> None:
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        thread = threading.Thread(target=drive, daemon=True)
        thread.start()
        thread.join(timeout=60)  # a hang guard (the collective timeout is 300 s), not a speed bar
        assert not thread.is_alive(), "the engine hung on a dead stage"
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
        assert f"rank 1 (pid {pid}) died" in str(errors[0])
    finally:
        llm.shutdown()


def test_lora_adapters_across_stages(lora_base, adapters) -> None:
    """Each stage loads its layers' share of an adapter: the same tokens as one rank."""
    from kvserve.lora.request import LoRARequest

    reqs = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters[:2])]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    outs = []
    for pp in (1, 2):
        llm = LLM(str(lora_base), dtype="float32", device="cpu", kv_cache_memory=1 << 22,
                  enable_lora=True, max_loras=2, max_lora_rank=8, block_size=8,
                  pipeline_parallel_size=pp)
        try:
            got = llm.generate(["Hello there", "Hello there", "Hello there"], params,
                               use_tqdm=False, lora_request=reqs)
            outs.append([(o.outputs[0].token_ids,
                          [{t: v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs])
                         for o in got])
        finally:
            llm.shutdown()
    assert outs[0] == outs[1]
    assert len({str(t) for t, _ in outs[0]}) == 3  # each adapter changes the output


def test_host_tier_restores_reach_every_stage(tiny_model_dir) -> None:
    """Tenants whose 5-block prefixes do not fit 12 device blocks together: with two stages
    each turn's prefix comes back from the host tier into both stages' caches, and the tokens
    and cached counts are one rank's."""
    import random

    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 380) for _ in range(80)] for _ in range(3)]
    turns = [p + [rng.randrange(3, 380) for _ in range(5)] for _ in range(2) for p in prefixes]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = []
    for pp in (1, 2):
        llm = LLM(**engine_kw(tiny_model_dir, kv_offloading_size=0.01,
                              pipeline_parallel_size=pp))
        try:
            outs = [llm.generate([{"prompt_token_ids": t}], params, use_tqdm=False)[0]
                    for t in turns]
            stats = llm.llm_engine.get_stats()
        finally:
            llm.shutdown()
        results.append(([o.outputs[0].token_ids for o in outs],
                        [o.num_cached_tokens for o in outs], stats.host_blocks_restored))
    assert results[0] == results[1]
    assert results[1][2] > 0 and results[1][1][3:] == [80, 80, 80]


def test_swap_preemption_and_fp8_kv_across_stages(four_layers) -> None:
    """Swapped-out blocks leave and come back on every stage; an fp8 cache (scale 1) too."""
    prompts = [SHARED + p for p in PROMPTS]
    kw = {"preemption_mode": "swap", "swap_space": 0.01, "kv_cache_dtype": "fp8"}
    want, _, _, _ = run(four_layers, prompts, **kw)
    llm = LLM(**engine_kw(four_layers, pipeline_parallel_size=2, **kw))
    try:
        got = generate(llm, prompts)
        engine = llm.llm_engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.num_cpu_blocks > 0
    finally:
        llm.shutdown()
    assert_same(got, want)
