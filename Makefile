# kvserve: `make run` serves the default model, `make test` runs the suite. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PORT   ?= 8000
MODEL  ?= smollm2-135m-instruct

.PHONY: setup run run-offline test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

setup: $(STAMP)

run: setup
	$(VENV)/bin/kvserve fetch-model $(MODEL)
	$(PY) examples/offline.py

run-offline: setup
	$(VENV)/bin/kvserve fetch-model $(MODEL)
	$(PY) examples/offline.py

test: setup
	$(VENV)/bin/pytest -q

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow"

bench: setup
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
