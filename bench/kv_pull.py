"""One KV pull between a prefill engine's and a decode engine's KVServeConnector, timed as the
decode side sees it: from the scheduler's first ask to the scatter's end (bench/pd.py on the
CPU, bench/pd_gpu.py on a GPU)."""

from __future__ import annotations

import time


def pull(p_sched, c_sched, c_worker, src: list[int], dst: list[int], block_size: int,
         tag: str) -> float:
    """Seconds of the decode side's whole path for the blocks `src` of the producer's cache
    into the blocks `dst` of the consumer's; `tag` keeps the request ids apart."""
    from kvserve.engine.core.sequence import Sequence
    from kvserve.engine.sample.sampling_params import SamplingParams

    n = len(src)
    held = Sequence(0, f"p{tag}", 0, [1] * (block_size * n + 1), SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    held.finish_reason = "length"
    _, params = p_sched.request_finished(held, list(src))
    seq = Sequence(0, f"d{tag}", 0, [1] * (block_size * n + 1), SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": params}))
    t0 = time.perf_counter()
    got = None
    while got is None:
        got = c_sched.get_num_new_matched_tokens(seq, 0)[0]
        if got is None:
            time.sleep(0.0001)
    assert got == block_size * n, \
        f"pulled {got} tokens of {block_size * n} ({c_sched.figures.failures})"
    c_sched.update_state_after_alloc(seq, list(dst), got)
    c_worker.bind_connector_metadata(c_sched.build_connector_meta(None))
    c_worker.start_load_kv()
    c_worker.wait_for_save()  # a GPU's LayerLoader.finish: its side stream synchronized
    seconds = time.perf_counter() - t0
    c_sched.request_finished(seq, [])
    return seconds
