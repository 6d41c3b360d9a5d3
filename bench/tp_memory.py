"""The memory plan and each rank's RSS of a real `kvserve serve --tensor-parallel-size N` on the CPU.

Starts the server as a user would, waits for /health, sends one chat request (so every rank has
run a step), then prints the plan line the engine logged and the resident memory of the driver
and of each worker rank (psutil, the same figure as /proc/PID/status VmRSS), and stops it.

    python bench/tp_memory.py                          # smollm2-135m-instruct, 3 ranks
    python bench/tp_memory.py --tp 2 --model /path/to/hf-folder
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

GiB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"no /health within {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    args, extra = ap.parse_known_args()
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="kvserve-tpmem-")) / "server.log"
    cmd = [sys.executable, "-m", "kvserve.service.cli", "serve", args.model,
           "--tensor-parallel-size", str(args.tp), "--port", str(port), *extra]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, args.timeout)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": args.model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        answer = r.json()["choices"][0]["message"]["content"]
        server = psutil.Process(proc.pid)
        ranks = [server] + sorted(server.children(recursive=True), key=lambda c: c.pid)
        text = log.read_text()
        plan = re.search(r"memory plan: (.*)", text)
        print(f"command: {' '.join(cmd[2:])}")
        print(f"plan: {plan.group(1) if plan else '(no plan line in the log)'}")
        kv = re.search(r"KV cache: .*", text)
        print(f"rank 0 cache: {kv.group(0) if kv else '?'}")
        print(f"answer: {answer!r}")
        total = 0
        for i, p in enumerate(ranks):
            rss = p.memory_info().rss
            total += rss
            what = " ".join(p.cmdline()[1:4])[:60]
            print(f"pid {p.pid} ({'server, rank 0' if i == 0 else what}): RSS {rss / GiB:.2f} GiB")
        print(f"all processes: RSS {total / GiB:.2f} GiB; MemAvailable now "
              f"{psutil.virtual_memory().available / GiB:.2f} GiB")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
