"""The offline half of the vLLM peer bench: kvserve's `LLM.generate` in this process and vLLM's in
its own venv (bench/peers/vllm_offline.py), both loaded once, then run round after round in
alternating order on the same token ids."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from peer_spread import order_of_round
from vllm_launch import vllm_offline_cmd
from vllm_offline import MARK


class VllmOfflineWorker:
    """The vLLM worker process: started at once (its ~100 s start-up overlaps kvserve's load),
    driven one batch per `run()`. A thread drains its stdout all the time, so vLLM's log lines
    (written to `log`) never fill the pipe and stall it while this process is busy."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: TextIO) -> None:
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, bufsize=1, start_new_session=True)
        self.answers: queue.Queue[str | None] = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()
        self.info: dict[str, Any] = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.answers.put(line[len(MARK):])
            else:
                self.log.write(line)
        self.answers.put(None)  # the worker closed its stdout: it has exited

    def _read(self, kind: str) -> dict[str, Any]:
        while (answer := self.answers.get()) is not None:
            if answer.startswith(kind + " "):
                return json.loads(answer[len(kind) + 1:])
        raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}) before {kind}; "
                           f"see its log {self.log.name}")

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._read("READY")
        return self.info

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read("RESULT")

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()  # EOF: the worker leaves its loop and shuts vLLM down
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:  # its engine core too: the worker leads its own group
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.pump.join(10)  # its last log lines


def run_kvserve(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One timed pass from an empty prefix cache (the vLLM worker's `run_batch`, for kvserve)."""
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"seconds": seconds, "tokens": sum(map(len, tokens)), "outputs": tokens}


def offline_rounds(args: Any, model_dir: Path, prompts: list[list[int]], env: dict[str, str],
                   log: TextIO) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """{"kvserve": [round results], "vllm": [...]} and the vLLM worker's versions."""
    from kvserve import LLM, SamplingParams

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = vllm_offline_cmd(args.vllm_venv, model_dir, Path(f.name), args.dtype,
                           args.max_model_len, args.max_tokens)
    worker = VllmOfflineWorker(cmd, env, log)
    llm = None
    try:
        llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=256, block_size=16, kv_cache_memory=args.kv_cache_bytes)
        llm.generate(prompt_token_ids=prompts[:2], use_tqdm=False,  # warm-up
                     sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        info = worker.wait_ready()
        results: dict[str, list[dict[str, Any]]] = {"kvserve": [], "vllm": []}
        for i in range(args.rounds):
            for who in order_of_round(i):
                r = run_kvserve(llm, prompts, args.max_tokens) if who == "kvserve" \
                    else worker.run()
                results[who].append(r)
                print(f"  offline round {i + 1} {who}: {r['tokens'] / r['seconds']:.1f} tok/s",
                      flush=True)
        return results, info
    finally:
        worker.close()
        if llm is not None:
            llm.shutdown()
        Path(f.name).unlink()
