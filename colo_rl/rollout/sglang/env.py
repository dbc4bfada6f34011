"""The environment SGLang's child processes start with (every trap in one place), the trainer's logging
kept through the engine's start, and CUDA-IPC-safe producer allocations."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import site
import sys
from typing import Iterable, Mapping, Optional

import torch


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
# Unset for the engine's children: with it SGLang's sampler returns log-probs of the logits before
# temperature, while colo_rl's trainer, its rollout correction and its engine-vs-trainer check read
# them as log softmax(logits / temperature).
ENGINE_UNSET_VARS = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)


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
    # TP > 1: NCCL registers the buffers of collectives captured in CUDA graphs, which live in the
    # memory saver's pausable graph pool; resume maps new memory at the same addresses, and replay
    # through the stale registration can hang (torch_memory_saver#88, sglang#40648). Only the
    # engine's children see it (NCCL_* are restored after start); an explicit setting wins.
    if "NCCL_GRAPH_REGISTER" not in environ:
        changes["NCCL_GRAPH_REGISTER"] = "0"
    for var in TRAINER_ONLY_VARS + ENGINE_UNSET_VARS:
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
RESTORED_AFTER_START = ALLOC_CONF_VARS + ("LD_LIBRARY_PATH",) + TRAINER_ONLY_VARS + ENGINE_UNSET_VARS


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


# SGLang logs (at ERROR, in the trainer process, on every rank) that it uses the SIGQUIT handler we passed.
OWN_SIGQUIT_NOTICE = "Using custom SIGQUIT handler"


@contextlib.contextmanager
def trainer_logging_kept(environ=None):
    """Start SGLang inside this context: the trainer's logging comes out as it went in.

    `sglang.Engine()` configures logging as a server would: `configure_logger` calls
    `logging.basicConfig(force=True)`, which closes the root handlers and puts a stderr handler at the
    engine's log level in their place. In a trainer rank that changed every later line's format,
    dropped the rank tag of debug=true and sent the lines to stderr as it was then, past the stream the
    progress bar redirects (console.CurrentStdout). The root handlers are
    kept aside while the engine starts (so none is closed) and put back after with the root level;
    whatever SGLang attached is closed. SGLang's ERROR that it uses colo_rl's own SIGQUIT handler is
    dropped: it is no error and came once per rank. A user's SGLANG_LOGGING_CONFIG_PATH stands."""
    environ = os.environ if environ is None else environ
    if environ.get("SGLANG_LOGGING_CONFIG_PATH"):
        yield
        return
    root, engine_log = logging.getLogger(), logging.getLogger("sglang.srt.entrypoints.engine")
    kept, level = list(root.handlers), root.level

    def not_own_sigquit(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(OWN_SIGQUIT_NOTICE)

    for handler in kept:
        root.removeHandler(handler)
    engine_log.addFilter(not_own_sigquit)
    try:
        yield
    finally:
        engine_log.removeFilter(not_own_sigquit)
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in kept:
            root.addHandler(handler)
        root.setLevel(level)


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
