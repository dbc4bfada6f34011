"""SGLang's API found by feature (it moves between releases), the engine arguments (colo_rl's own,
the user's rollout.sglang_kwargs checked against ServerArgs), the memory plan, and the CPU branches."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import math
import os
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Optional

import torch

from colo_rl.errors import ConfigError
from colo_rl.rollout.base import ALL_TAGS, KV_CACHE, WEIGHTS

log = logging.getLogger("colo_rl")

GIB = 1 << 30


# ===================================================================== SGLang's API, found by feature
def import_first(candidates: Iterable[tuple[str, str]]) -> Any:
    """The first `module.attr` that imports (SGLang moves things between releases)."""
    import importlib

    for module, attr in candidates:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    return None


# SGLang's context length where config.json names none, and the variable that lets it run past the
# model's own (its get_context_length, ModelConfig._derive_context_length).
SGLANG_DEFAULT_CONTEXT_LENGTH = 2048
SGLANG_LONGER_CONTEXT_VARIABLE = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"

NOT_INSTALLED = ("rollout.engine=sglang needs SGLang, which is not installed in this environment: on a CUDA "
                 "machine `pip install -e '.[gpu]'` (torch 2.11) or `'.[gpu-torch213]'` (torch 2.13), offline "
                 "`make gpu-wheels` then `make gpu-install` (docs/gpu.md); or use rollout.engine=hf")
NO_GPU = ("rollout.engine=sglang runs SGLang on a CUDA GPU and torch sees none here (torch.cuda.is_available() "
          "is False): use rollout.engine=hf, which runs on CPU too")


def check_engine_runs_here(engine: str, sglang_kwargs: Any = None) -> None:
    """rollout.engine=sglang, checked when the run starts (seconds, not once the trainer is built):
    SGLang is installed and the device it would run on is here. Its CPU engine (sglang_kwargs
    device=cpu) is test support and passes; the rest is checked when the engine starts."""
    if engine != "sglang":
        return
    if importlib.util.find_spec("sglang") is None:
        raise ConfigError(NOT_INSTALLED)
    if engine_device(_plain_dict(sglang_kwargs)) == "cuda" and not torch.cuda.is_available():
        raise ConfigError(NO_GPU)


@lru_cache(maxsize=1)
def sglang_api() -> SimpleNamespace:
    """The SGLang pieces colo_rl uses, wherever this release keeps them."""
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        raise ImportError(NOT_INSTALLED) from e
    except Exception as e:  # noqa: BLE001 - installed but broken here (e.g. a CUDA-only torchvision on CPU)
        raise ImportError(f"SGLang is installed but does not import here ({type(e).__name__}: {e}); on a CPU-only "
                          "machine its CUDA builds of torchvision / sgl_kernel cannot load (colo_rl's tests "
                          "run it with the shims in tests/sglang_cpu_shims/), or use rollout.engine=hf") from e
    api = SimpleNamespace(
        serializer=import_first([("sglang.srt.utils", "MultiprocessingSerializer"),
                                 ("sglang.srt.utils.common", "MultiprocessingSerializer")]),
        bucket_cls=import_first([("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
                                 ("sglang.srt.model_executor.model_runner", "FlattenedTensorBucket")]),
        lst_cls=None,
        patch_reductions=import_first([("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions"),
                                       ("sglang.srt.patch_torch", "monkey_patch_torch_reductions")]),
        begin_req=import_first([("sglang.srt.managers.io_struct", "BeginWeightUpdateReqInput")]),
        end_req=import_first([("sglang.srt.managers.io_struct", "EndWeightUpdateReqInput")]),
        memory_tags=import_first([("sglang.srt.constants", "GPU_MEMORY_ALL_TYPES")]),
        server_args_cls=import_first([("sglang.srt.server_args", "ServerArgs")]),
    )
    if api.bucket_cls is None:
        # Only the per-tensor fallback needs LocalSerializedTensor; model_runner is the last place
        # to look: importing it pulls SGLang's whole model-runner stack (sgl_kernel,
        # flashinfer, quantization, triton kernels) into every trainer rank.
        api.lst_cls = import_first([
            ("sglang.srt.utils", "LocalSerializedTensor"),
            ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
            ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor")])
    missing = [name for name in ("serializer", "patch_reductions") if getattr(api, name) is None]
    if api.bucket_cls is None and api.lst_cls is None:
        missing.append("FlattenedTensorBucket or LocalSerializedTensor")
    if missing:
        raise ImportError(f"this SGLang ({getattr(sglang, '__version__', '?')}) lacks {missing}, which the "
                          "CUDA-IPC weight handoff needs: install a release that has update_weights_from_tensor")
    return api


_REDUCTIONS_PATCHED = False


def ensure_reductions_patched(api) -> None:
    """SGLang's torch reductions name GPUs by UUID in IPC handles, so a handle made here opens on
    the right device in the engine whatever CUDA_VISIBLE_DEVICES says. Once per trainer process."""
    global _REDUCTIONS_PATCHED
    if not _REDUCTIONS_PATCHED:
        api.patch_reductions()
        _REDUCTIONS_PATCHED = True


def supported_memory_tags(all_types) -> tuple[str, ...]:
    """Tags this SGLang can release; releases before `cuda_graph` existed know two."""
    known = set(all_types) if all_types else {WEIGHTS, KV_CACHE}
    return tuple(tag for tag in ALL_TAGS if tag in known)


# ===================================================================== the engine
def sglang_dtype(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    if dtype not in names:
        raise ValueError(f"SGLang engine dtype {dtype} unsupported; use bf16, fp16 or fp32")
    return names[dtype]


def known_server_kwargs(kwargs: dict, server_args_cls, required: Iterable[str]) -> dict:
    """Drop optional engine arguments this SGLang's ServerArgs lacks; a missing required one raises."""
    if server_args_cls is None or not dataclasses.is_dataclass(server_args_cls):
        return dict(kwargs)
    fields = {f.name for f in dataclasses.fields(server_args_cls)}
    missing = [k for k in required if k not in fields]
    if missing:
        raise ImportError(f"this SGLang's Engine has no {missing} argument(s), which colocation needs")
    dropped = [k for k in kwargs if k not in fields]
    if dropped:
        log.warning("SGLang ServerArgs lacks %s; not passed", dropped)
    return {k: v for k, v in kwargs.items() if k in fields}


def engine_device(extra: Mapping[str, Any]) -> str:
    """The engine's device: "cuda" unless rollout.sglang_kwargs.device says otherwise (SGLang's
    CPU engine: device=cpu, with SGLANG_USE_CPU_ENGINE=1 in the environment)."""
    return str(extra.get("device") or "cuda")


def memory_saver_for(device: str) -> bool:
    """CPU branch: SGLang's memory saver (torch_memory_saver) is CUDA-only, so a CPU engine runs
    without it; its release / resume calls still run (SGLang's flush, state export / import and
    barriers) but free nothing."""
    return device != "cpu"


def memory_saver_kwargs(device: str) -> dict[str, bool]:
    """The engine arguments of SGLang's memory saver: on (CUDA), and with it no prefill CUDA graph.
    SGLang's default prefill graph on CUDA (the "breakable" backend, 0.5.17 and 0.5.21) refuses the
    memory saver when CUDA graphs are released too (SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, which colo_rl
    sets so that they are): NotImplementedError "Breakable CUDA graph is not compatible with memory
    saver mode" in the scheduler at start (runner_backend/breakable_cuda_graph_backend.py), unless
    under 4 GiB happened to be free after the KV cache. Prefill runs eagerly; decode keeps its
    graphs. rollout.sglang_kwargs may choose another prefill backend (cuda_graph_backend_prefill)."""
    on = memory_saver_for(device)
    return {"enable_memory_saver": on, **({"disable_prefill_cuda_graph": True} if on else {})}


def engine_free_bytes(device: str) -> int:
    """Memory free for the engine now, as SGLang measures it when it sizes its static memory
    (mem_fraction_static is a fraction of this): the GPU's free memory, or on CPU the machine's
    available RAM (psutil)."""
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return torch.cuda.mem_get_info()[0]


# Engine memory outside mem_fraction_static that grows with the KV pool's token count (SGLang
# 0.5.17): the eager runner's input_ids / positions / out_cache_loc buffers, int64 each, sized to
# the pool (runner/eager_runner.py: prefill_ceiling = max_total_num_tokens), and the token
# allocator's int64 free list (mem_cache/allocator/token.py): 32 bytes a token, 48 with room for
# what was not counted. Negligible for real models (tens of KB of KV a token); for a toy model
# (512 B a token) ~10 % of the pool, GiBs past the margin on an 80 GB GPU.
ENGINE_BYTES_PER_KV_TOKEN = 48


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: float, tp_size: int = 1) -> Optional[float]:
    """One token's KV-cache bytes on one TP rank for a standard-attention model's config.json
    (SGLang splits the KV heads over the TP ranks, at least one each); None where the config does
    not name its layer and head counts."""
    layers, heads, hidden = (config.get(k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                          and heads > 0 else None)
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim)):
        return None
    return 2 * layers * max(1, kv_heads // tp_size) * head_dim * dtype_bytes


def kv_cache_bytes(extra: Mapping[str, Any], dtype: torch.dtype) -> float:
    """Bytes of one KV-cache element: rollout.sglang_kwargs.kv_cache_dtype where set (fp8 / fp4 /
    bf16 / ...), else the model's dtype (SGLang's "auto")."""
    name = str(extra.get("kv_cache_dtype") or "auto").lower()
    for key, size in (("fp4", 0.5), ("fp8", 1), ("bf16", 2), ("bfloat16", 2), ("fp16", 2), ("float16", 2)):
        if key in name:
            return size
    return torch.empty((), dtype=dtype).element_size()


# The largest KV pool colo_rl lets SGLang size from memory alone: 2^24 tokens (1,024 sequences of 16K
# tokens on one engine). Real models stay under it on an 80-141 GB GPU (SmolLM2-135M: 3.4M tokens,
# a 0.5B model ~6-10M); a toy model's pool (512 B of KV a token: 145M tokens on an H100) would
# cost GiBs of per-token buffers outside mem_fraction_static, more than the 48 B a token planned:
# the first H100 run's toy-model LoRA test had its scheduler run out of memory right after start.
MAX_POOL_TOKENS = 1 << 24


def bounded_pool_tokens(free_bytes: int, margin_bytes: int, kv_token_bytes: Optional[float]) -> Optional[int]:
    """rollout.sglang_kwargs.max_total_tokens to pass when the KV pool sized from memory would hold
    more than MAX_POOL_TOKENS tokens; None otherwise (or when a token's KV bytes are unknown)."""
    if not kv_token_bytes or free_bytes <= margin_bytes:
        return None
    return MAX_POOL_TOKENS if (free_bytes - margin_bytes) / kv_token_bytes > MAX_POOL_TOKENS else None


def plan_mem_fraction_static(free_bytes: int, margin_bytes: int, override: Optional[float] = None,
                             kv_token_bytes: Optional[float] = None) -> float:
    """SGLang's `mem_fraction_static` (a fraction of memory free when the engine starts) chosen so
    that the engine's weights + KV cache fill what the paged-out trainer leaves, minus a margin,
    and minus the buffers that grow with the KV pool (`kv_token_bytes`: a token's KV bytes; the
    pool holds at most fraction x free / kv_token_bytes tokens)."""
    if override is not None:
        if not 0 < override < 1:
            raise ValueError(f"colocate.mem_fraction_static={override} must be in (0, 1)")
        return override
    if free_bytes <= margin_bytes:
        raise MemoryError(
            f"only {free_bytes / GIB:.1f} GiB free after paging the trainer out, not more than the "
            f"colocate.memory_margin_gib={margin_bytes / GIB:.1f}: use more GPUs (ZeRO-3 shards the "
            "trainer), a smaller model, or a smaller margin")
    per_pool_byte = ENGINE_BYTES_PER_KV_TOKEN / kv_token_bytes if kv_token_bytes else 0.0
    fraction = (free_bytes - margin_bytes) / (free_bytes * (1 + per_pool_byte))
    return math.floor(fraction * 1e4 + 1e-9) / 1e4  # 4 decimals, never rounded into the margin


def plan_engine_memory(free_bytes: int, margin_bytes: int, override: Optional[float] = None,
                       kv_token_bytes: Optional[float] = None) -> tuple[float, Optional[int]]:
    """The engine's memory plan: (mem_fraction_static, max_total_tokens to pass or None). A pool
    memory alone would size past MAX_POOL_TOKENS (a toy model) is bounded there, and its per-token
    buffers come out of the fraction as a fixed amount; a user's fraction (`override`) stands as given."""
    cap = None if override is not None else bounded_pool_tokens(free_bytes, margin_bytes, kv_token_bytes)
    if cap is not None:
        margin_bytes, kv_token_bytes = margin_bytes + cap * ENGINE_BYTES_PER_KV_TOKEN, None
    return plan_mem_fraction_static(free_bytes, margin_bytes, override, kv_token_bytes), cap


def engine_base_gpu_id(device: str, local_rank: int) -> int:
    """The engine's first GPU: this rank's. CPU branch: 0 for every rank (one CPU device; SGLang's CPU
    engine reads the id as a NUMA node index, and a machine with one NUMA node has only node 0)."""
    return 0 if device == "cpu" else local_rank


def check_cpu_engine_kwargs(extra: Mapping[str, Any]) -> None:
    """CPU branch: RAM is shared with the trainer (nothing is paged out), so the KV cache must be
    bounded by max_total_tokens; SGLang's CPU engine also needs SGLANG_USE_CPU_ENGINE=1, without
    which it takes GPU code paths (and fails on a missing vllm import)."""
    if extra.get("max_total_tokens") is None:
        raise ConfigError("rollout.sglang_kwargs.device=cpu needs rollout.sglang_kwargs.max_total_tokens: on CPU "
                          "the KV cache would otherwise take all the RAM that mem_fraction_static leaves")
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() not in ("1", "true"):
        raise ConfigError("rollout.sglang_kwargs.device=cpu needs SGLANG_USE_CPU_ENGINE=1 in the environment")


REQUIRED_SERVER_ARGS = ("model_path", "tp_size", "base_gpu_id", "mem_fraction_static", "enable_memory_saver",
                        "load_format", "skip_tokenizer_init")

# Engine arguments colo_rl sets itself, with what to use instead of rollout.sglang_kwargs.
OWNED_SERVER_ARGS = {
    "model_path": "model.path (the engine reads the architecture there; weights come from the trainer)",
    "tp_size": "rollout.tp_size",
    "base_gpu_id": "nothing: colo_rl puts each engine on its TP group's first GPU (LOCAL_RANK)",
    "enable_memory_saver": "nothing: colocation needs it on (the engine releases its memory between phases; "
                           "off on CPU, where SGLang has none)",
    "load_format": "nothing: the engine starts on dummy weights and takes the trainer's by handoff",
    "skip_tokenizer_init": "nothing: colo_rl sends and reads token ids",
    "port": "nothing: colo_rl picks a free port per engine",
    "nccl_port": "nothing: colo_rl picks a free port per engine",
    "dtype": "model.dtype (the engine must run the trainer's dtype)",
    "mem_fraction_static": "colocate.mem_fraction_static (or colocate.memory_margin_gib)",
    "random_seed": "rollout.seed (each rank its own: rollout.base.sampling_seed)",
    "custom_sigquit_handler": "nothing: colo_rl installs one that raises SGLangEngineError",
}


def validate_sglang_kwargs(extra: Mapping[str, Any], server_args_cls) -> dict:
    """rollout.sglang_kwargs checked against this SGLang's ServerArgs: a key colo_rl owns or a
    key ServerArgs lacks raises ConfigError naming it (unlike colo_rl's own optional arguments,
    a user's argument is never dropped silently)."""
    extra = dict(extra or {})
    for key in extra:
        if key in OWNED_SERVER_ARGS:
            raise ConfigError(f"rollout.sglang_kwargs.{key} is set by colo_rl; use {OWNED_SERVER_ARGS[key]}")
    if server_args_cls is None or not dataclasses.is_dataclass(server_args_cls):
        return extra
    fields = [f.name for f in dataclasses.fields(server_args_cls)]
    for key in extra:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"rollout.sglang_kwargs.{key} is not an argument of this SGLang's ServerArgs "
                              f"(sglang.srt.server_args){hint}")
    return extra


def _plain_dict(value) -> dict:
    """rollout.sglang_kwargs as plain Python (a DictConfig when cfg is not converted to objects)."""
    if value is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return dict(value)
