"""SGLang rollout engine: SGLang's offline `sglang.Engine` behind the colo_rl engine protocol (GPU;
also SGLang's CPU engine with rollout.sglang_kwargs.device=cpu, which colo_rl's tests run: the
CPU branches are engine_device / memory_saver_for / engine_base_gpu_id / payload_is_cuda_ipc).

The engine is started with dummy weights and released right away: its weights only ever come
from the trainer's handoff, as CUDA IPC handles to gathered buckets (the engine maps the
trainer's memory and copies device-to-device). See colo_rl/colocate/NOTES.md for the layout,
the transition order and the traps.

Everything that can be decided without a GPU (feature detection, sampling-parameter translation,
output parsing, the per-TP-rank payload layout, tag bookkeeping, result checking) lives in plain
functions below so CPU tests can call them with fake inputs. `sglang` is imported lazily: this
module imports on a machine without CUDA or SGLang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import multiprocessing
import os
import re
import signal
import site
import sys
import tempfile
import threading
import time
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Optional

import torch

from colo_rl import dist
from colo_rl.errors import ConfigError, HandoffError
from colo_rl.models import eos_token_ids, model_config, resolve_model_path
from colo_rl.phase import Phase
from colo_rl.rollout.base import ALL_TAGS, KV_CACHE, WEIGHTS, Completion, SamplingParams

log = logging.getLogger("colo_rl")

GIB = 1 << 30
FLUSH_TIMEOUT_S = 60.0  # how long to wait for an idle scheduler before a flush / release

# ===================================================================== environment traps (all here)
# Read by SGLang's child processes, which inherit our environment when the engine starts.
ENGINE_ENV = {
    # Trainer memory differs across GPUs (ZeRO partitions, rank 0 extras): SGLang's check that
    # every TP rank sees the same free memory would refuse to start.
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
    # Without it `release_memory_occupation(["cuda_graph"])` keeps the CUDA-graph memory.
    "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1",
}
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# Unset for the engine's children: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) torch's tcp://
# rendezvous joins the elastic agent's store as a client instead of hosting its own, so SGLang's
# scheduler waits forever in init_process_group on its private port.
TRAINER_ONLY_VARS = ("TORCHELASTIC_USE_AGENT_STORE",)


def without_expandable_segments(conf: Optional[str]) -> Optional[str]:
    """The allocator config minus `expandable_segments` (None when nothing else remains).

    Expandable segments map memory with cuMemCreate instead of cudaMalloc: torch_memory_saver
    cannot release it and CUDA IPC cannot export it."""
    if conf is None:
        return None
    kept = [part for part in conf.split(",") if part.strip() and
            part.split(":", 1)[0].strip() != "expandable_segments"]
    return ",".join(kept) or None


def expandable_segments_enabled(environ: Mapping[str, str]) -> bool:
    for var in ALLOC_CONF_VARS:
        for part in (environ.get(var) or "").split(","):
            key, _, value = part.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() in ("true", "1"):
                return True
    return False


_CUDART = re.compile(r"libcudart\.so\.\d+(\.\d+)*")
# pip's CUDA runtime: nvidia-cuda-runtime (CUDA 13: nvidia/cu13/lib; CUDA 12: nvidia/cuda_runtime/lib).
PIP_CUDART_SUBDIRS = (os.path.join("nvidia", "cu13", "lib"), os.path.join("nvidia", "cuda_runtime", "lib"))


def cuda_runtime_dirs(maps_text: str) -> list[str]:
    """Directories of the CUDA runtimes (libcudart.so.N) mapped into a process, from its
    /proc/<pid>/maps text, in order of first appearance."""
    dirs: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if not path.startswith("/") or path.endswith("(deleted)"):
            continue
        head, base = os.path.split(path)
        if _CUDART.fullmatch(base) and head not in dirs:
            dirs.append(head)
    return dirs


def pip_cuda_runtime_dirs(site_dirs: Iterable[str]) -> list[str]:
    """pip-installed CUDA runtime directories (those holding a libcudart.so.N) under site-packages."""
    found = []
    for root in site_dirs:
        for sub in PIP_CUDART_SUBDIRS:
            d = os.path.join(root, sub)
            try:
                names = os.listdir(d)
            except OSError:
                continue
            if any(_CUDART.fullmatch(n) for n in names) and d not in found:
                found.append(d)
    return found


def _own_maps() -> str:
    try:
        with open("/proc/self/maps") as fh:
            return fh.read()
    except OSError:
        return ""


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    return dirs + [p for p in sys.path if p.endswith("-packages") and p not in dirs]


def with_library_dirs(value: Optional[str], dirs: Iterable[str]) -> Optional[str]:
    """LD_LIBRARY_PATH with `dirs` in front (those not already in it); the value itself when
    nothing is missing."""
    present = [p for p in (value or "").split(":") if p]
    missing = [d for d in dict.fromkeys(dirs) if d not in present]
    if not missing:
        return value
    return ":".join(missing + ([value] if value else []))


def engine_env_overrides(environ: Mapping[str, str], maps_text: Optional[str] = None,
                         site_dirs: Optional[Iterable[str]] = None) -> dict[str, Optional[str]]:
    """Environment changes for starting the engine (value None = unset the variable).

    LD_LIBRARY_PATH: SGLang starts its schedulers with torch_memory_saver's hook in LD_PRELOAD;
    the hook NEEDs libcudart.so.13 and carries no RPATH, so with pip's CUDA runtime (found by torch
    through its own RPATH, not by ld.so) the scheduler dies at exec with exit code 127
    (sglang#36533). The directory of the runtime this process loaded goes first (it matches
    torch); pip's nvidia/*/lib directories are the fallback. `maps_text` / `site_dirs` are for tests."""
    changes: dict[str, Optional[str]] = dict(ENGINE_ENV)
    for var in TRAINER_ONLY_VARS:
        if var in environ:
            changes[var] = None
    for var in ALLOC_CONF_VARS:
        if var in environ:
            cleaned = without_expandable_segments(environ[var])
            if cleaned != environ[var]:
                changes[var] = cleaned
    dirs = cuda_runtime_dirs(_own_maps() if maps_text is None else maps_text)
    if not dirs:
        dirs = pip_cuda_runtime_dirs(_site_dirs() if site_dirs is None else site_dirs)
    old = environ.get("LD_LIBRARY_PATH")
    new = with_library_dirs(old, dirs)
    if new != old:
        changes["LD_LIBRARY_PATH"] = new
    return changes


# Restored once the engine is up: SGLang spawns every child inside Engine(), and the trainer's
# later children (DataLoader workers, compilers) should see the user's values.
RESTORED_AFTER_START = ALLOC_CONF_VARS + ("LD_LIBRARY_PATH",) + TRAINER_ONLY_VARS


@contextlib.contextmanager
def engine_environment(environ=None, maps_text: Optional[str] = None, site_dirs: Optional[Iterable[str]] = None):
    """Start SGLang inside this context.

    Sets ENGINE_ENV, strips expandable segments and puts the CUDA runtime on LD_LIBRARY_PATH for
    the engine's children, forces the `spawn` start method (SGLang does too; CUDA cannot be
    forked), and afterwards restores the allocator config, LD_LIBRARY_PATH and every NCCL_*
    variable SGLang changed: its child processes already have what they need, while the trainer's
    later NCCL communicators should not inherit SGLang's choices.
    """
    environ = os.environ if environ is None else environ
    changes = engine_env_overrides(environ, maps_text=maps_text, site_dirs=site_dirs)
    restore_keys = [k for k in changes if k in RESTORED_AFTER_START]
    saved = {k: environ.get(k) for k in changes}
    nccl_before = {k: v for k, v in environ.items() if k.startswith("NCCL_")}
    for key, value in changes.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield changes
    finally:
        for key in restore_keys:
            if saved[key] is None:
                environ.pop(key, None)
            else:
                environ[key] = saved[key]
        for key in [k for k in environ if k.startswith("NCCL_")]:
            if key not in nccl_before:
                del environ[key]
        environ.update(nccl_before)


@contextlib.contextmanager
def ipc_producer_allocations():
    """Tensors allocated inside come from cudaMalloc even when this process runs with expandable
    segments, so CUDA IPC can export them to the engine."""
    switch = torch.cuda.is_available() and expandable_segments_enabled(os.environ)
    if switch:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        if switch:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


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


@lru_cache(maxsize=1)
def sglang_api() -> SimpleNamespace:
    """The SGLang pieces colo_rl uses, wherever this release keeps them."""
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "rollout.engine=sglang needs SGLang (GPU only; `pip install sglang` on a CUDA machine, "
            "see `make gpu-check`), or use rollout.engine=hf") from e
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


# ===================================================================== generation (pure)
def sglang_sampling_params(params: SamplingParams, eos_token_ids: list[int]) -> dict:
    """Our SamplingParams as SGLang's dict. `n` is always 1: we expand the prompts ourselves so the
    order of the outputs is ours to define (a GRPO group is contiguous)."""
    if params.greedy:
        temperature, top_p, top_k = 0.0, 1.0, 1
    else:
        if not params.temperature > 0:
            raise ValueError(f"sampling temperature must be > 0 (got {params.temperature}); use greedy=True")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {params.top_p})")
        temperature, top_p, top_k = float(params.temperature), float(params.top_p), -1
    return {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "n": 1,
        "stop_token_ids": list(eos_token_ids),
        # Keep the EOS token in the output: the trainer must see (and learn) the stop.
        "no_stop_trim": True,
    }


def expand_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt n times in a row: completions j*n .. j*n+n-1 belong to prompt j."""
    if n < 1:
        raise ValueError(f"completions per prompt must be >= 1 (got {n})")
    return [list(p) for p in prompts for _ in range(n)]


class SGLangEngineError(RuntimeError):
    """SGLang answered something colo_rl cannot use (the message says what and what to do)."""


def finish_reason(meta: Mapping) -> str:
    """SGLang's finish reason as "stop" / "length"; an aborted request raises."""
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        message = reason.get("message") if isinstance(reason, Mapping) else ""
        raise SGLangEngineError(f"SGLang aborted a request: {message}. Common causes: a prompt longer than the "
                                "engine's context length, or a KV cache too small for one sequence "
                                "(raise rollout.mem_fraction_static or lower rollout.memory_margin_gib)")
    raise SGLangEngineError(f"SGLang returned an unfinished request (finish_reason={reason!r}); "
                            "colo_rl never streams, so this is an SGLang API change")


def parse_completion(prompt_ids: list[int], out: Mapping) -> Completion:
    """One SGLang output dict (from generate with return_logprob=True) as a Completion.

    Token ids and sampling log-probs both come from meta_info["output_token_logprobs"] (entries
    (logprob, token_id, text)), so they are aligned by construction; the plain output ids must
    agree with them (trimmed by one stop token at most)."""
    meta = out.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangEngineError("SGLang returned no meta_info['output_token_logprobs']: the request must be "
                                "sent with return_logprob=True")
    token_ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    reason = finish_reason(meta)
    output_ids = out.get("output_ids", out.get("token_ids"))
    if output_ids is not None:
        output_ids = [int(t) for t in output_ids]
        if output_ids != token_ids and not (reason == "stop" and output_ids == token_ids[:-1]):
            raise SGLangEngineError(f"SGLang's output ids ({len(output_ids)}) disagree with the token ids of its "
                                    f"log-probs ({len(token_ids)}): cannot tell which tokens were sampled")
    return Completion(prompt_ids=list(prompt_ids), token_ids=token_ids, logprobs=logprobs, finish_reason=reason)


def parse_outputs(expanded_prompts: list[list[int]], outputs) -> list[Completion]:
    if isinstance(outputs, Mapping):  # a batch of one can come back unwrapped
        outputs = [outputs]
    if len(outputs) != len(expanded_prompts):
        raise SGLangEngineError(f"SGLang returned {len(outputs)} outputs for {len(expanded_prompts)} requests")
    return [parse_completion(p, o) for p, o in zip(expanded_prompts, outputs)]


# ===================================================================== weight updates (pure)
def update_result(result, what: str, allow_none: bool = False) -> str:
    """Check an SGLang `(success, message)` answer (tuple, dict or object); raise HandoffError
    with the engine's message on failure. Returns the message."""
    if result is None:
        if allow_none:
            return ""
        raise HandoffError(f"SGLang's {what} returned nothing, so colo_rl cannot tell whether the engine "
                           "took the weights; this SGLang release is not supported for the handoff")
    if isinstance(result, Mapping):
        success, message = result.get("success"), result.get("message", "")
    elif isinstance(result, (tuple, list)):
        success, message = (result[0], result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", "")
    else:
        raise HandoffError(f"SGLang's {what} returned {result!r}; expected (success, message)")
    if success is not True:
        raise HandoffError(f"SGLang's {what} failed: {message!r}. The engine may not be sampling from the "
                           "trainer's weights; stopping rather than training on samples from the wrong policy")
    return str(message or "")


@dataclasses.dataclass
class WeightSession:
    """How to open/close SGLang's weight-update session (SGLang >= 0.5.21 refuses updates outside
    one). `via` is "engine" (Engine.begin/end_weight_update) or "tokenizer_manager"."""

    via: str
    begin: Any
    end: Any


def weight_session_api(engine, begin_req=None, end_req=None) -> Optional[WeightSession]:
    """Detect the session API by feature: the engine's own methods, else the tokenizer manager's
    coroutines with SGLang's request objects, else None (an older release: no session)."""
    begin, end = getattr(engine, "begin_weight_update", None), getattr(engine, "end_weight_update", None)
    if callable(begin) and callable(end):
        return WeightSession("engine", lambda: begin(), lambda: end())
    tm = getattr(engine, "tokenizer_manager", None)
    tm_begin, tm_end = getattr(tm, "begin_weight_update", None), getattr(tm, "end_weight_update", None)
    if callable(tm_begin) and callable(tm_end) and begin_req is not None and end_req is not None:
        def run(coro_fn, req_cls):
            return engine.loop.run_until_complete(coro_fn(req_cls(), None))

        return WeightSession("tokenizer_manager", lambda: run(tm_begin, begin_req), lambda: run(tm_end, end_req))
    return None


def group_by_dtype(named_tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Split a bucket by dtype, groups in order of first appearance (older FlattenedTensorBucket
    concatenates, which needs one dtype)."""
    groups: dict[torch.dtype, list] = {}
    for name, tensor in named_tensors:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def check_bucket_metadata(metadata, named_tensors) -> None:
    """The flattened bucket must describe exactly our tensors, in order, back to back. Checked
    because a layout change in SGLang would otherwise load scrambled weights silently."""
    if len(metadata) != len(named_tensors):
        raise HandoffError(f"SGLang's FlattenedTensorBucket describes {len(metadata)} tensors, the bucket has "
                           f"{len(named_tensors)}")
    end = 0
    for meta, (name, tensor) in zip(metadata, named_tensors):
        size = meta.end_idx - meta.start_idx
        ok = (meta.name == name and tuple(meta.shape) == tuple(tensor.shape) and meta.dtype == tensor.dtype
              and meta.start_idx == end and size == meta.numel
              and size in (tensor.numel(), tensor.numel() * tensor.element_size()))
        if not ok:
            raise HandoffError(f"SGLang's FlattenedTensorBucket entry {meta!r} does not match tensor {name!r} "
                               f"{tuple(tensor.shape)} {tensor.dtype} at offset {end}: this SGLang's bucket "
                               "layout is not the one colo_rl checks for")
        end = meta.end_idx


@dataclasses.dataclass
class UpdateCall:
    """One `update_weights_from_tensor(named_tensors=..., load_format=...)` call."""

    named_tensors: list
    load_format: Optional[str]


def payload_calls(rank_payloads: list[dict], lst_cls=None) -> list[UpdateCall]:
    """Engine calls for one bucket from the payloads of every TP rank (index = TP rank).

    Each TP rank of the engine deserialises only its own entry, a handle to memory on its own GPU:
    - "flattened_bucket": one call per dtype group, `named_tensors` = [payload of rank 0, 1, ...];
    - "tensors": one call, each tensor a LocalSerializedTensor whose values[i] is rank i's handle.
    """
    if not rank_payloads:
        raise ValueError("no payloads: the engine's TP group sent nothing")
    formats = {p["format"] for p in rank_payloads}
    if len(formats) != 1:
        raise HandoffError(f"TP ranks prepared different payload formats {sorted(formats)}: every rank of an "
                           "engine group must run the same SGLang")
    fmt = formats.pop()
    counts = {len(p["items"]) for p in rank_payloads}
    if len(counts) != 1:
        raise HandoffError(f"TP ranks prepared different numbers of payload items {sorted(counts)} for one bucket: "
                           "the ranks gathered different tensors (handoff buckets must be planned identically)")
    if fmt == "flattened_bucket":
        return [UpdateCall([p["items"][i] for p in rank_payloads], "flattened_bucket") for i in range(counts.pop())]
    if fmt == "tensors":
        if lst_cls is None:
            raise HandoffError("this SGLang has no LocalSerializedTensor for per-tensor handoff")
        named = []
        for j, (name, _) in enumerate(rank_payloads[0]["items"]):
            names = {p["items"][j][0] for p in rank_payloads}
            if names != {name}:
                raise HandoffError(f"TP ranks disagree on tensor {j} of the bucket: {sorted(names)}")
            named.append((name, lst_cls(values=[p["items"][j][1] for p in rank_payloads])))
        return [UpdateCall(named, None)] if named else []
    raise HandoffError(f"unknown payload format {fmt!r}")


def payload_is_cuda_ipc(named_tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """CPU branch of the handoff: CPU tensors travel as shared memory (torch's ForkingPickler moves
    their storage to shm and passes a file descriptor), and SGLang's reduction patch must stay off
    for them: it rewrites the device index of a CUDA reduce tuple (its 7th entry), which a CPU
    tensor's reduction does not have."""
    return any(t.is_cuda for _, t in named_tensors)


def prepare_rank_payload(named_tensors: list[tuple[str, torch.Tensor]], api=None) -> tuple[dict, list]:
    """This rank's share of an engine update: CUDA IPC handles to (a flattened copy of) the bucket
    (on CPU: shared-memory handles, see payload_is_cuda_ipc).

    Returns (payload, keepalive). The payload is small and picklable (it can travel to the rank
    that drives the engine); `keepalive` holds the producer tensors, which must outlive the
    engine's update call (the engine maps their memory)."""
    api = api or sglang_api()
    if payload_is_cuda_ipc(named_tensors):
        ensure_reductions_patched(api)
    with ipc_producer_allocations():
        if api.bucket_cls is not None:
            one_call = getattr(api.bucket_cls, "supports_multi_dtypes", False)
            groups = [named_tensors] if one_call else group_by_dtype(named_tensors)
            items, keepalive = [], []
            for group in groups:
                if not group:
                    continue
                bucket = api.bucket_cls(named_tensors=[(n, t.detach()) for n, t in group])
                data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
                check_bucket_metadata(data["metadata"], group)
                keepalive.append(data)
                items.append(api.serializer.serialize(data, output_str=True))
            return {"format": "flattened_bucket", "items": items}, keepalive
        items = [(name, api.serializer.serialize(t.detach())) for name, t in named_tensors]
        return {"format": "tensors", "items": items}, [t for _, t in named_tensors]


# ===================================================================== memory tags (pure)
class EngineStateError(RuntimeError):
    """The engine was asked to do something its memory state does not allow."""


class EngineMemoryState:
    """Which SGLang memory tags are released, whether the weights are valid, whether a cache flush
    or a weight-update session is pending.

    SGLang raises when resuming a tag that is not released and must not release a tag twice
    (torch_memory_saver aborts the process on a double pause); resumed weights are garbage
    until a weight update finishes. `sleep`/`wake` are idempotent over this bookkeeping.
    """

    def __init__(self, supported: Iterable[str] = ALL_TAGS):
        self.supported = tuple(supported)
        self.released: set[str] = set()
        self.weights_valid = False  # dummy weights at start: only the handoff makes them real
        self.flush_pending = False
        self.session_open = False

    def _validate(self, tags: Iterable[str], verb: str) -> list[str]:
        tags = list(tags)
        unknown = [t for t in tags if t not in ALL_TAGS]
        if unknown:
            raise ValueError(f"cannot {verb} unknown memory tags {unknown}; known: {list(ALL_TAGS)}")
        return [t for t in ALL_TAGS if t in tags and t in self.supported]  # canonical order

    def plan_release(self, tags: Iterable[str]) -> list[str]:
        if self.session_open:
            raise EngineStateError("release requested during a weight update: call finish_weight_update() first")
        return [t for t in self._validate(tags, "release") if t not in self.released]

    def mark_released(self, tags: Iterable[str]) -> None:
        tags = list(tags)
        double = [t for t in tags if t in self.released]
        if double:
            raise EngineStateError(f"tags {double} are already released; releasing twice kills the engine")
        self.released.update(tags)

    def plan_resume(self, tags: Iterable[str]) -> list[str]:
        return [t for t in self._validate(tags, "resume") if t in self.released]

    def mark_resumed(self, tags: Iterable[str]) -> None:
        tags = list(tags)
        held = [t for t in tags if t not in self.released]
        if held:
            raise EngineStateError(f"tags {held} are not released; SGLang raises when resuming them")
        self.released.difference_update(tags)
        if WEIGHTS in tags:
            self.weights_valid = False

    def require_weights_resident(self, what: str) -> None:
        if WEIGHTS in self.released:
            raise EngineStateError(f"{what} while the engine's weights are released: wake(['weights']) first")

    def finish_update(self) -> bool:
        """A weight update finished: weights valid, cache to flush. Returns whether to flush now
        (the KV cache is resident); otherwise the flush waits for the KV cache to be resumed."""
        self.weights_valid = True
        self.flush_pending = True
        return KV_CACHE not in self.released

    def require_generate(self) -> None:
        released = [t for t in ALL_TAGS if t in self.released]
        if released:
            raise EngineStateError(f"generate while {released} are released: wake the engine first")
        if self.session_open:
            raise EngineStateError("generate during a weight update: call finish_weight_update() first")
        if not self.weights_valid:
            raise EngineStateError("generate on weights that no finished weight update has written (dummy or "
                                   "just-resumed memory): run the handoff before generating")


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


def engine_free_bytes(device: str) -> int:
    """Memory free for the engine now, as SGLang measures it when it sizes its static memory
    (mem_fraction_static is a fraction of this): the GPU's free memory, or on CPU the machine's
    available RAM (psutil)."""
    if device == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return torch.cuda.mem_get_info()[0]


def plan_mem_fraction_static(free_bytes: int, margin_bytes: int, override: Optional[float] = None) -> float:
    """SGLang's `mem_fraction_static` (a fraction of memory free when the engine starts) chosen so
    that the engine's weights + KV cache fill what the paged-out trainer leaves, minus a margin."""
    if override is not None:
        if not 0 < override < 1:
            raise ValueError(f"rollout.mem_fraction_static={override} must be in (0, 1)")
        return override
    if free_bytes <= margin_bytes:
        raise MemoryError(
            f"only {free_bytes / GIB:.1f} GiB free after paging the trainer out, not more than the "
            f"rollout.memory_margin_gib={margin_bytes / GIB:.1f}: use more GPUs (ZeRO-3 shards the "
            "trainer), a smaller model, or a smaller margin")
    return round((free_bytes - margin_bytes) / free_bytes, 4)


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
    "mem_fraction_static": "rollout.mem_fraction_static (or rollout.memory_margin_gib)",
    "random_seed": "rollout.seed (colo_rl adds the rank)",
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


# ===================================================================== a failed SGLang child (SIGQUIT)
CHILD_FAILED = (
    "the SGLang scheduler process failed (SIGQUIT from a child): see its traceback above; common causes: "
    "CUDA out of memory when the KV cache resumes or while generating (raise rollout.memory_margin_gib), "
    "a weight name or shape the engine's model lacks (update_weights_from_tensor), a kernel missing from the "
    "installed sgl_kernel (e.g. FA3's flash_ops: rollout.sglang_kwargs={attention_backend:triton}), a failed "
    "JIT build (nvcc / ninja), or 'libcudart.so.13: cannot open shared object file' (exit code 127: the "
    "CUDA runtime is not on LD_LIBRARY_PATH)")


class ChildFailure:
    """SGLang's children send SIGQUIT to this process when one fails (scheduler.py, its subprocess
    watchdog), and SGLang's own handler then kills this process's tree, trainer included, before
    any error can be reported. Ours records the failure and raises SGLangEngineError in the main
    thread (Python runs signal handlers there), so the caller's error handling and test reports run."""

    def __init__(self):
        self.failed = False
        self.previous: Any = None
        self.installed = False

    def __call__(self, signum=None, frame=None):
        self.failed = True
        # Inside a running event loop (the engine's, waiting for an answer the dead scheduler never
        # sends) the loop runs this handler as a callback and only logs what it raises (uvloop):
        # stopping the loop ends the pending call, which SGLangEngine._call turns into our error.
        with contextlib.suppress(RuntimeError):
            import asyncio

            asyncio.get_running_loop().stop()
        raise SGLangEngineError(CHILD_FAILED)

    def check(self) -> None:
        """Refuse to talk to an engine whose child already failed (a dead scheduler never answers)."""
        if self.failed:
            raise SGLangEngineError(CHILD_FAILED + " (earlier; the engine cannot be used any more)")

    def install(self) -> bool:
        """Make ours the SIGQUIT handler; the first install remembers the handler to restore.
        Only possible from the main thread (False elsewhere, as for SGLang's)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.signal(signal.SIGQUIT, _sigquit_from_child)
        if not self.installed:
            self.previous = previous
            self.installed = True
        return True

    def restore(self) -> None:
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed = False


_CHILD_FAILURE: Optional[ChildFailure] = None


def _sigquit_from_child(signum, frame):
    # A module-level function, not the ChildFailure: SGLang pickles ServerArgs (which carries it
    # as custom_sigquit_handler) into its spawned children, and a function pickles by name.
    handler = _CHILD_FAILURE
    if handler is None:
        raise SGLangEngineError(CHILD_FAILED)
    handler(signum, frame)


def watch_child_failures() -> ChildFailure:
    """A ChildFailure for the engine about to start, installed; SIGQUIT (one handler per process)
    reaches the newest one. An engine that failed earlier keeps its own, failed, record."""
    global _CHILD_FAILURE
    _CHILD_FAILURE = ChildFailure()
    _CHILD_FAILURE.install()
    return _CHILD_FAILURE


def flush_until_idle(flush, timeout_s: float, poll_s: float = 0.05):
    """Call SGLang's flush_cache until it succeeds or `timeout_s` passes; returns the last answer
    as (success, message). The scheduler flushes only when idle, and right after a generate (or
    right after start) it may not be idle yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = flush()
        if isinstance(result, bool):  # some releases answer a bare bool
            result = (result, "")
        success = result.get("success") if isinstance(result, Mapping) else (
            result[0] if isinstance(result, (tuple, list)) else getattr(result, "success", None))
        if result is None or success is True or time.monotonic() >= deadline:
            return result
        time.sleep(poll_s)


def run_in_engine_loop(engine, fn) -> None:
    """Call `fn` inside the engine's event loop (Engine.loop, which every offline call runs).

    SGLang >= 0.5.21 creates the tokenizer manager's handle loop on the *running* loop, and with
    none running on a new one (get_or_create_event_loop): called from outside, the handle loop
    lands on a loop nobody runs and every later engine call waits forever for its answer."""
    loop = getattr(engine, "loop", None)
    if loop is None or not hasattr(loop, "run_until_complete") or loop.is_running():
        fn()
        return

    async def call():
        fn()

    loop.run_until_complete(call())


def take_over_sigquit(engine, child_failure: ChildFailure) -> None:
    """Re-install ours after SGLang's tokenizer manager took SIGQUIT.

    SGLang passes custom_sigquit_handler to signal.signal while the engine starts, but its
    tokenizer manager's first request (auto_create_handle_loop) adds an asyncio SIGQUIT handler
    that kills the process tree. Run that step now (it happens once), drop its SIGQUIT handler
    and put ours back."""
    tm = getattr(engine, "tokenizer_manager", None)
    create = getattr(tm, "auto_create_handle_loop", None)
    if create is not None:
        run_in_engine_loop(engine, create)
    loop = getattr(tm, "event_loop", None) or getattr(engine, "loop", None)
    if loop is not None and hasattr(loop, "remove_signal_handler"):
        with contextlib.suppress(Exception):  # not registered there / not the main thread: nothing to undo
            loop.remove_signal_handler(signal.SIGQUIT)
    child_failure.install()


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


def engine_model_dir(model_cfg) -> str:
    """The directory SGLang reads the architecture from (weights are dummy: never read). A
    shrunk random model gets its config written to a temporary directory."""
    if not model_cfg.random_init:
        return str(resolve_model_path(model_cfg.path))
    out = tempfile.mkdtemp(prefix="colo_rl-sglang-config-")
    model_config(model_cfg).save_pretrained(out)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangEngine:
    """The colo_rl engine protocol on SGLang's offline Engine (one per TP group, on its first rank).

    With tp_size > 1, wrap it in colo_rl.rollout.tp_group.TPGroupEngine: every TP rank must
    contribute a payload for its own GPU, so `load_weights` alone only serves tp_size == 1.
    """

    def __init__(self, engine, tp_size: int, eos_token_ids: list[int], guard=None,
                 supported_tags: Iterable[str] = ALL_TAGS, api=None, child_failure: Optional[ChildFailure] = None,
                 device: str = "cuda"):
        self.engine = engine
        self.device = device
        self.tp_size = tp_size
        self.eos = list(eos_token_ids)
        self.guard = guard
        self.api = api
        self.child_failure = child_failure
        self.state = EngineMemoryState(supported_tags)
        self.session = weight_session_api(engine, getattr(api, "begin_req", None), getattr(api, "end_req", None))

    @classmethod
    def create(cls, cfg, tokenizer, dtype: torch.dtype, guard=None, free_bytes: Optional[int] = None):
        """Start the engine on this rank's GPU (and the next tp_size - 1), sized from the memory
        free now: call it while the trainer is paged out (see `trainer_paged_out`)."""
        api = sglang_api()
        import sglang

        rollout = cfg.rollout
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size()))
        if rollout.tp_size > 1 and local_world % rollout.tp_size:
            raise ValueError(f"rollout.tp_size={rollout.tp_size} must divide the GPUs per node ({local_world}): "
                             "an engine's TP ranks must share a node")
        # Checked before the engine starts: a typo fails in seconds, not after a failed launch.
        extra = validate_sglang_kwargs(_plain_dict(getattr(rollout, "sglang_kwargs", None)), api.server_args_cls)
        device = engine_device(extra)
        if device == "cpu":
            check_cpu_engine_kwargs(extra)
        if free_bytes is None:
            free_bytes = engine_free_bytes(device)
        fraction = plan_mem_fraction_static(free_bytes, int(rollout.memory_margin_gib * GIB),
                                            rollout.mem_fraction_static)
        model_dir = engine_model_dir(cfg.model)
        child_failure = watch_child_failures()
        kwargs = known_server_kwargs(dict(
            model_path=model_dir, tp_size=rollout.tp_size, base_gpu_id=engine_base_gpu_id(device, dist.local_rank()),
            mem_fraction_static=fraction, enable_memory_saver=memory_saver_for(device), load_format="dummy",
            skip_tokenizer_init=True, dtype=sglang_dtype(dtype), random_seed=rollout.seed + dist.rank(),
            port=_free_port(), nccl_port=_free_port(), log_level="error",
            custom_sigquit_handler=_sigquit_from_child,
        ), api.server_args_cls, REQUIRED_SERVER_ARGS)
        kwargs.update(extra)
        log.info("starting SGLang %s (tp=%d, %s %d, mem_fraction_static=%.3f of %.1f GiB free%s)",
                 getattr(sglang, "__version__", "?"), rollout.tp_size, device, dist.local_rank(), fraction,
                 free_bytes / GIB,
                 f", {extra}" if extra else "")
        t0 = time.perf_counter()
        try:
            with engine_environment():
                engine = sglang.Engine(**kwargs)
            take_over_sigquit(engine, child_failure)
        except BaseException:
            child_failure.restore()
            raise
        log.info("SGLang engine up in %.1fs", time.perf_counter() - t0)
        return cls(engine, rollout.tp_size, eos_token_ids(tokenizer, model_dir), guard=guard,
                   supported_tags=supported_memory_tags(api.memory_tags), api=api, child_failure=child_failure,
                   device=device)

    def _alive(self) -> None:
        if self.child_failure is not None:
            self.child_failure.check()

    def _call(self, fn, *args, **kwargs):
        """One call into SGLang; when a child failed meanwhile (SIGQUIT stopped the engine's loop),
        whatever the interrupted call raised becomes SGLangEngineError."""
        self._alive()
        try:
            return fn(*args, **kwargs)
        except SGLangEngineError:
            raise
        except Exception as e:
            if self.child_failure is not None and self.child_failure.failed:
                raise SGLangEngineError(CHILD_FAILED) from e
            raise

    # ---------------------------------------------------------------- memory protocol
    def _free_bytes(self) -> int:
        if self.device == "cpu" or not torch.cuda.is_available():  # CPU: SGLang's release frees nothing
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def sleep(self, tags: Iterable[str] = ALL_TAGS) -> int:
        """Release `tags`; returns the bytes freed on this rank's GPU."""
        todo = self.state.plan_release(tags)
        if not todo:
            return 0
        self._alive()
        if KV_CACHE not in self.state.released:
            # SGLang asserts an idle scheduler in release_memory_occupation (a failed assertion kills
            # the scheduler), and it may still be finishing the last batch: a flush succeeds only
            # once it is idle.
            self._flush()
        before = self._free_bytes()
        self._call(self.engine.release_memory_occupation, tags=todo)
        self.state.mark_released(todo)
        return max(0, self._free_bytes() - before)

    def wake(self, tags: Iterable[str] = ALL_TAGS) -> int:
        """Resume `tags`; returns the bytes taken on this rank's GPU. Resumed weights are garbage
        until the next weight update finishes."""
        todo = self.state.plan_resume(tags)
        if not todo:
            return 0
        self._alive()
        before = self._free_bytes()
        self._call(self.engine.resume_memory_occupation, tags=todo)
        self.state.mark_resumed(todo)
        if KV_CACHE in todo and self.state.flush_pending:
            self._flush()
        return max(0, before - self._free_bytes())

    def _flush(self) -> None:
        # The radix cache holds KV computed with the old weights. Flushing touches KV-cache
        # bookkeeping, so it runs only while the KV cache is resident.
        result = flush_until_idle(lambda: self._call(self.engine.flush_cache), FLUSH_TIMEOUT_S)
        update_result(result, "flush_cache", allow_none=True)
        self.state.flush_pending = False

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.tp_size > 1:
            raise RuntimeError(f"SGLangEngine.load_weights with tp_size={self.tp_size}: every TP rank must send "
                               "its own payload; use colo_rl.rollout.tp_group.TPGroupEngine")
        payload, keepalive = prepare_rank_payload(named_tensors, self.api)
        try:
            self.load_rank_payloads([payload])
        finally:
            del keepalive
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()

    def load_rank_payloads(self, rank_payloads: list[dict]) -> None:
        """One bucket, as prepared by every TP rank (index = TP rank); producers stay alive until
        this returns."""
        self.state.require_weights_resident("load_weights")
        self._alive()
        if len(rank_payloads) != self.tp_size:
            raise HandoffError(f"{len(rank_payloads)} payloads for an engine with tp_size={self.tp_size}")
        if self.session is not None and not self.state.session_open:
            update_result(self._call(self.session.begin), "begin_weight_update", allow_none=True)
            self.state.session_open = True
        for call in payload_calls(rank_payloads, getattr(self.api, "lst_cls", None)):
            result = self._call(self.engine.update_weights_from_tensor, named_tensors=call.named_tensors,
                                load_format=call.load_format, flush_cache=False)
            update_result(result, "update_weights_from_tensor")

    def finish_weight_update(self) -> None:
        if self.state.session_open:
            self.state.session_open = False  # closed or failed: never end a session twice
            update_result(self._call(self.session.end), "end_weight_update", allow_none=True)
        if self.state.finish_update():
            self._flush()

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.guard is not None:
            self.guard.require(Phase.GENERATION, "engine.generate")
        self.state.require_generate()
        self._alive()
        if self.state.flush_pending:
            self._flush()
        expanded = expand_prompts(prompts, params.n)
        if not expanded:
            return []
        outputs = self._call(self.engine.generate, input_ids=expanded,
                             sampling_params=sglang_sampling_params(params, self.eos), return_logprob=True,
                             logprob_start_len=-1)
        return parse_outputs(expanded, outputs)

    def shutdown(self) -> None:
        # SGLang's shutdown kills every child process of this process, not only its own.
        try:
            if self.engine is not None:
                self.engine.shutdown()
                self.engine = None
        finally:
            if self.child_failure is not None:  # the handler that was there before the engine
                self.child_failure.restore()
