"""In-process multi-rank engines (tensor or pipeline parallel) whose worker processes fork from
multiprocessing's fork server (as forked_process.py forks server processes), which has already
imported what a worker imports, instead of being spawned (the conftest default): a spawned
worker imports torch, transformers (and through it torch._dynamo) and our loader again, seconds
of CPU for each rank of each engine; a forked one starts in milliseconds. The fork server is a
clean single-threaded process, as safe to fork from as a spawn; the worker's code and the
pickled spec it gets are the same.

A worker forked so sees the environment of the moment the server started (the module's first
multi-rank engine), not the test's: the driver passes what a worker needs in its spec
(layer split, micro-batches, threads), so only a test that sets a variable a worker itself reads
must not use this.

Use it as a module's autouse fixture:

    @pytest.fixture(scope="module", autouse=True)
    def _forked_workers():
        with forked_workers():
            yield
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from forked_process import stop_forkserver

# What a worker imports: our worker loop, loader and runner, transformers (its config classes
# and type validators) and torch._dynamo (torch imports it lazily when a meta-device Embedding
# is initialised).
WORKER_MODULES = ["kvserve.engine.worker.workers", "kvserve.engine.worker.model_loader",
                  "kvserve.engine.worker.model_runner", "kvserve.engine.models",
                  "kvserve.engine.layers.quantization", "kvserve.engine.layers.packed_linear",
                  "kvserve.lora.model", "kvserve.engine.config",
                  "kvserve.engine.worker.gguf_loader", "transformers", "transformers.models.auto",
                  "transformers.utils.type_validators", "torch._dynamo", "safetensors"]


@contextmanager
def forked_workers(*extra: str) -> Iterator[None]:
    """KVSERVE_WORKER_MULTIPROC_METHOD=forkserver with WORKER_MODULES (and the modules `extra`)
    preloaded, on a fork server of the module's own (one left running is ended first: it has
    another preload list and another environment); ended on the way out too (it holds a torch's
    worth of memory)."""
    stop_forkserver()
    patch = pytest.MonkeyPatch()
    patch.setenv("KVSERVE_WORKER_MULTIPROC_METHOD", "forkserver")
    multiprocessing.set_forkserver_preload([*WORKER_MODULES, *extra])
    try:
        yield
    finally:
        patch.undo()
        stop_forkserver()


__all__ = ["WORKER_MODULES", "forked_workers"]
