"""Tensor parallelism: the split arithmetic, shard-by-shard loading, and N-rank engines (real
worker processes over gloo) that give the same greedy tokens as one rank, with prefix caching,
chunked prefill, preemption (recompute and swap), fp8 KV and n > 1; a killed worker is an error,
not a hang, and no worker outlives its engine."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import psutil
import pytest
import torch
from forked_workers import forked_workers

from kvserve import LLM, SamplingParams
from kvserve.engine.distributed import TPGroup, TPShape, check_tensor_parallel
from kvserve.engine.errors import ConfigError, WorkerDiedError
from kvserve.engine.worker.model_loader import load_model

PROMPTS = ["The quick brown fox jumps over", "Paged attention stores the KV cache",
           "What is the capital of France?", "Explain how the KV cache works in"]
SHARED = "You are a helpful assistant. Answer briefly and precisely. "


@pytest.fixture(scope="module", autouse=True)
def _forked_workers():
    """Workers fork from a preloaded fork server (forked_workers.py): no import each."""
    with forked_workers():
        yield


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.runner.workers.procs]


def assert_gone(pids: list[int], timeout: float = 30.0) -> None:
    """Every pid has exited (a zombie counts as gone: it holds no memory or GPU)."""
    _, alive = psutil.wait_procs([p for p in _procs(pids)], timeout=timeout)
    assert not alive, f"worker processes left behind: {alive}"


def _procs(pids: list[int]) -> Iterator[psutil.Process]:
    for pid in pids:
        try:
            yield psutil.Process(pid)
        except psutil.NoSuchProcess:
            pass


def tokens(llm: LLM, prompts: list[str], **kw) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 24), **kw)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]


# ---------------------------------------------------------------------------- arithmetic


def test_shapes_split_heads_and_replicate_kv_heads_past_their_count() -> None:
    # The default model: 9 query heads, 3 KV heads; N = 3 gives each rank 3 and 1.
    s = TPShape.of(2, 3, 9, 3, 1536, 49152)
    assert (s.num_heads, s.q_head_start, s.num_kv_heads, s.kv_head_start) == (3, 6, 1, 2)
    assert (s.intermediate, s.vocab_per_rank, s.vocab_start) == (512, 16384, 32768)
    # 4 query / 2 KV heads over 4 ranks: ranks 0-1 share KV head 0, ranks 2-3 KV head 1, and each
    # rank's query head belongs to the KV head it holds (query head h uses KV head h // 2).
    for rank in range(4):
        s = TPShape.of(rank, 4, 4, 2, 128, 385)
        assert s.num_kv_heads == 1 and s.kv_head_start == s.q_head_start // 2
    last = TPShape.of(3, 4, 4, 2, 128, 385)  # the vocabulary is padded, not refused
    assert (last.vocab_per_rank, last.vocab_rows) == (97, 94)


def test_an_impossible_n_is_refused_with_the_sizes() -> None:
    with pytest.raises(ConfigError, match=r"9 attention heads.*sizes that work for it: \[1, 3\]"):
        check_tensor_parallel(2, 9, 3, 1536)
    with pytest.raises(ConfigError, match="6 KV heads"):
        check_tensor_parallel(4, 8, 6, 1024)
    check_tensor_parallel(8, 8, 2, 1024)  # 2 KV heads each replicated on 4 ranks


def test_impossible_n_refused_before_any_worker_starts(tiny_model_dir) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match="4 attention heads"):
        LLM(model=str(tiny_model_dir), tensor_parallel_size=3, dtype="float32")
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_each_rank_loads_only_its_slices(tiny_model_dir) -> None:
    """Loading needs no collective: build both ranks' shards here and put them back together."""
    cpu, f32 = torch.device("cpu"), torch.float32
    full, _ = load_model(tiny_model_dir, f32, cpu, pack_linears=False)
    shards = [load_model(tiny_model_dir, f32, cpu, pack_linears=False, tp=TPGroup(r, 2))[0]
              for r in range(2)]
    whole = sum(p.numel() for p in full.parameters())
    for shard in shards:
        assert sum(p.numel() for p in shard.parameters()) < 0.6 * whole
    f, s0, s1 = (m.model.layers[1] for m in (full, *shards))
    q, kv = 4 * 16, 2 * 16  # query / KV rows of the full fused qkv (head_dim 16)
    fq, fk = f.self_attn.qkv_proj.weight[:q], f.self_attn.qkv_proj.weight[q:q + kv]
    for rank, s in enumerate((s0, s1)):
        w = s.self_attn.qkv_proj.weight
        assert torch.equal(w[:32], fq[rank * 32:(rank + 1) * 32])  # its 2 query heads
        assert torch.equal(w[32:48], fk[rank * 16:(rank + 1) * 16])  # its KV head
    down = torch.cat([s0.mlp.down_proj.weight, s1.mlp.down_proj.weight], dim=1)
    assert torch.equal(down, f.mlp.down_proj.weight)
    emb = torch.cat([m.model.embed_tokens.weight for m in shards])[:full.dims.vocab]
    assert torch.equal(emb, full.model.embed_tokens.weight)


# ---------------------------------------------------------------------------- N ranks


def engine_kw(tiny_model_dir, **kw) -> dict:
    """A small cache (12 blocks) and 64-token steps: prompts are chunked and requests preempted."""
    return {"model": str(tiny_model_dir), "dtype": "float32", "num_gpu_blocks_override": 12,
            "max_num_batched_tokens": 64, "max_model_len": 256, "seed": 0, **kw}


def run_both(tiny_model_dir, ranks: int, prompts: list[str], **kw) -> tuple[list, list, LLM]:
    """(tokens at N = 1, tokens at N = ranks, the N-rank LLM still running)."""
    sample = {k: kw.pop(k) for k in ("n", "max_tokens") if k in kw}
    one = LLM(**engine_kw(tiny_model_dir, **kw))
    expected = tokens(one, prompts, **sample)
    llm = LLM(**engine_kw(tiny_model_dir, tensor_parallel_size=ranks, **kw))
    try:
        return expected, tokens(llm, prompts, **sample), llm
    except BaseException:
        llm.shutdown()
        raise


@pytest.mark.parametrize("n", [2, 4])  # 4 ranks > 2 KV heads: KV heads replicated
def test_greedy_tokens_identical_with_preemption_prefix_cache_and_chunks(tiny_model_dir,
                                                                        n) -> None:
    prompts = [SHARED + p for p in PROMPTS]
    expected, got, llm = run_both(tiny_model_dir, n, prompts, n=2, max_tokens=24)
    try:
        stats = llm.llm_engine.get_stats()
        pids = worker_pids(llm)
        assert len(pids) == n - 1
        assert got == expected
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        budget = llm.llm_engine.memory_budget
        assert budget.num_blocks == 12
        assert budget.bytes_per_block == 2 * 2 * 1 * 16 * 4 * 16  # one KV head per rank
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_swap_preemption_and_fp8_kv_identical(tiny_model_dir) -> None:
    prompts = [SHARED + p for p in PROMPTS]
    expected, got, llm = run_both(tiny_model_dir, 2, prompts, preemption_mode="swap",
                                  swap_space=0.01, kv_cache_dtype="fp8",
                                  calculate_kv_scales=True, n=2, max_tokens=24)
    try:
        engine = llm.llm_engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.num_cpu_blocks > 0
        assert got == expected
    finally:
        llm.shutdown()


def test_a_killed_worker_is_an_error_not_a_hang(tiny_model_dir) -> None:
    llm = LLM(**engine_kw(tiny_model_dir, tensor_parallel_size=2))
    pids = worker_pids(llm)
    try:
        engine = llm.llm_engine
        engine.add_request("a", "The quick brown fox", SamplingParams(max_tokens=150,
                                                                      ignore_eos=True))
        engine.step()
        os.kill(pids[0], signal.SIGKILL)
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
        assert not thread.is_alive(), "the engine hung on a dead worker"
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
        assert f"rank 1 (pid {pids[0]}) died" in str(errors[0])
        with pytest.raises(WorkerDiedError):  # and it stays dead
            engine.step() if engine.has_unfinished_requests() else engine.runner.workers.check_alive()
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_dropping_the_llm_stops_its_workers(tiny_model_dir) -> None:
    import gc

    llm = LLM(**engine_kw(tiny_model_dir, tensor_parallel_size=2))
    pids = worker_pids(llm)
    procs = list(llm.llm_engine.runner.workers.procs)
    assert tokens(llm, PROMPTS[:1], max_tokens=4)
    del llm
    gc.collect()
    assert_gone(pids)
    assert [p.exitcode for p in procs] == [0]  # told to stop, not killed at the timeout
    # and the group is released: a new tensor-parallel engine starts in this process
    again = LLM(**engine_kw(tiny_model_dir, tensor_parallel_size=2))
    again.shutdown()
