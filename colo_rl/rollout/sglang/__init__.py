"""SGLang rollout engine: SGLang's offline `sglang.Engine` behind the colo_rl engine protocol (GPU;
also SGLang's CPU engine with rollout.sglang_kwargs.device=cpu, which colo_rl's tests run: the
CPU branches are engine_device / memory_saver_for / engine_base_gpu_id / payload_is_cuda_ipc).

The engine is started with dummy weights and released right away: its weights only ever come
from the trainer's handoff, as CUDA IPC handles to gathered buckets (the engine maps the
trainer's memory and copies device-to-device). See colo_rl/colocate/NOTES.md for the layout,
the transition order and the traps.

Everything that can be decided without a GPU (feature detection, sampling-parameter translation,
output parsing, the per-TP-rank payload layout, tag bookkeeping, result checking) lives in plain
functions so CPU tests can call them with fake inputs. `sglang` is imported lazily: this package
imports on a machine without CUDA or SGLang.

    env.py       the environment SGLang's children start with (every trap in one place)
    compat.py    SGLang's API by feature, engine arguments, the memory plan, the CPU branches
    io.py        sampling parameters in, completions out
    weights.py   weight-update payloads, the update session, result checks
    failure.py   a failed child process as SGLangEngineError
    engine.py    SGLangEngine and its memory-tag state machine
"""

from colo_rl.errors import EngineStateError, SGLangEngineError
from colo_rl.rollout.sglang.compat import (REQUIRED_SERVER_ARGS, check_cpu_engine_kwargs, check_engine_runs_here,
                                           engine_base_gpu_id, engine_device, engine_free_bytes, known_server_kwargs,
                                           memory_saver_for, memory_saver_kwargs, plan_engine_memory,
                                           plan_mem_fraction_static, sglang_api, sglang_dtype, supported_memory_tags,
                                           validate_sglang_kwargs)
from colo_rl.rollout.sglang.engine import SGLangEngine
from colo_rl.rollout.sglang.memory_state import EngineMemoryState
from colo_rl.rollout.sglang.env import (cuda_runtime_dirs, engine_env_overrides, engine_environment,
                                        expandable_segments_enabled, trainer_logging_kept,
                                        without_expandable_segments)
from colo_rl.rollout.sglang.failure import ChildFailure, flush_until_idle, run_in_engine_loop, watch_child_failures
from colo_rl.rollout.sglang.io import expand_prompts, parse_completion, parse_outputs, sglang_sampling_params
from colo_rl.rollout.sglang.weights import (check_bucket_metadata, group_by_dtype, payload_calls, payload_is_cuda_ipc,
                                            prepare_rank_payload, update_result, weight_session_api)

__all__ = [
    "REQUIRED_SERVER_ARGS", "ChildFailure", "EngineMemoryState", "EngineStateError", "SGLangEngine",
    "SGLangEngineError", "check_bucket_metadata", "check_cpu_engine_kwargs", "check_engine_runs_here",
    "cuda_runtime_dirs", "engine_base_gpu_id", "engine_device", "engine_env_overrides", "engine_environment",
    "engine_free_bytes",
    "expand_prompts", "expandable_segments_enabled", "flush_until_idle", "group_by_dtype", "known_server_kwargs",
    "memory_saver_for", "memory_saver_kwargs", "parse_completion", "parse_outputs", "payload_calls", "payload_is_cuda_ipc",
    "plan_engine_memory", "plan_mem_fraction_static", "prepare_rank_payload", "run_in_engine_loop", "sglang_api",
    "sglang_dtype",
    "sglang_sampling_params", "supported_memory_tags", "trainer_logging_kept", "update_result", "validate_sglang_kwargs",
    "watch_child_failures", "weight_session_api", "without_expandable_segments",
]
