"""Shared fixtures: a tiny random Llama with a real tokenizer, the default model, real Redis.

`KVSERVE_REQUIRE_REDIS=1` (set by .ci/run) turns a missing redis-server into a failure instead of
a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import kvserve  # noqa: F401  before torch, as a user's script: libgomp's short spin (engine/cpu_threads.py)

if TYPE_CHECKING:
    from kvserve import LLM

# Triton decides at `import triton` whether its own library functions (tl.max, ...) are compiled
# or interpreted, so on a machine without CUDA the interpreter must be on before any test imports
# triton, or the interpreted kernel tests fail after an earlier test imported it compiled.
# Under pytest-xdist (`make test` runs -n auto) each worker gets its share of the cores, as do
# the servers and scripts it starts: N workers each running torch on every core would
# oversubscribe the CPU, and OpenMP's spinning threads slow down badly when they do.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    import torch

    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]

# The SmolLM2 chat template, so the tiny model is templated exactly like the default one.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks, like virtual memory pages.",
    "What is the capital of France? The capital of France is Paris.",
    "Explain how the KV cache works in a transformer language model.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "0123456789 !?.,;:'\"()[]{}<>-_=+*/\\|@#$%^&~` abcdefghijklmnopqrstuvwxyz",
]


# In-process tensor-parallel tests spawn their workers: forking a pytest process whose engine
# threads may hold locks can hang the child (scripts fork: test_worker_start_method.py).
os.environ.setdefault("KVSERVE_WORKER_MULTIPROC_METHOD", "spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float = 30.0,
             what: str = "condition") -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def bench_smoke_run(script: str, timeout: float) -> str:
    """The output of `bench/<script> --smoke` (a lent-GPU script's whole code path at tiny shapes
    on the CPU, with this Python), which must exit 0."""
    out = subprocess.run(["bash", str(ROOT / "bench" / script), "--smoke"],
                         env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@contextmanager
def triton_interpreted(*names: str) -> Iterator[list[Any]]:
    """The kernel modules `names` reloaded under TRITON_INTERPRET=1 (a module fixture's body);
    on the way out the variable is restored and they are reloaded again, so later tests on a GPU
    get compiled kernels."""
    import importlib

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    modules = [importlib.reload(importlib.import_module(name)) for name in names]
    try:
        yield modules
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
        for module in modules:
            importlib.reload(module)


def replay_kv_events(events: list[Any], state: set[str] | None = None) -> set[str]:
    """What a consumer (the Redis prefix index) holds after applying `events`."""
    state = set() if state is None else state
    for e in events:
        if e.kind == "cleared":
            state.clear()
        elif e.kind == "stored":
            state.update(e.block_hashes)
        else:
            state.difference_update(e.block_hashes)
    return state


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer trained in milliseconds, with SmolLM2's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(path: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight Llama (2 layers, GQA 4:2, head_dim 16) with the tiny tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id,
               initializer_range=0.3)  # large enough that greedy output does not repeat
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def make_llm(path: Path | str, **kw: Any) -> LLM:
    """The offline LLM on a model folder: fp32 on the CPU, a 4 MiB KV cache unless `kw` says."""
    from kvserve import LLM

    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(path), dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    """The tiny model's LLM with make_llm's defaults, one per test module."""
    return make_llm(tiny_model_dir)


@pytest.fixture
def client(server):
    """The openai client of the test module's `server` fixture (a server_thread.ServerThread)."""
    import openai

    return openai.Client(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, fetched once into the kvserve cache."""
    from kvserve.engine.worker.model_loader import fetch_model

    return fetch_model("smollm2-135m-instruct")


class RedisServer:
    """A real redis-server on an ephemeral port that a test can stop and restart."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def require_redis_binary(name: str = "redis-server") -> str:
    """The path of `name` (redis-server, redis-cli); skip the test without it, fail it with
    KVSERVE_REQUIRE_REDIS=1. Every Redis-backed test gets its binary through here."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("KVSERVE_REQUIRE_REDIS") == "1":
            pytest.fail(f"{name} is not installed but KVSERVE_REQUIRE_REDIS=1")
        pytest.skip(f"{name} is not installed (apt install redis-server)")
    return path


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """redis-server's path, for tests and fixtures that start their own (require_redis_binary)."""
    return require_redis_binary()


@pytest.fixture
def redis_server(tmp_path, redis_binary) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary, tmp_path)
    server.start()
    yield server
    server.stop()
