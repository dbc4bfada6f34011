"""DeepSpeed ops built on another machine, loaded instead of built here: `COLO_RL_PREBUILT_OPS=DIR`.

Why: DeepSpeed JIT-builds FusedAdam (the optimizer every ZeRO-3 step runs) with nvcc on a machine's
first run: about a minute, which the first GPU session paid out of its device time. nvcc needs no
GPU, so `benchmarks/gpu/check_compile.py --keep-ops DIR` builds the op on a CPU machine against the
GPU machine's torch and keeps `<op>.so` with `<op>.json`, the manifest of what it was built for.

`load_prebuilt_ops` registers each op whose manifest matches this process (torch version, CUDA
version, the device's compute capability among its architectures) in DeepSpeed's table of loaded
ops (`OpBuilder._loaded_ops`), which `OpBuilder.load()` reads before it builds anything. An op that
does not match is logged with the reason and DeepSpeed builds it as before: a stale directory
costs the build, never a wrong kernel.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

ENV = "COLO_RL_PREBUILT_OPS"


def build_manifest(torch_version: str, cuda_version: Optional[str], archs: list[str]) -> dict:
    """What an op was built against: the torch release (ABI), the CUDA runtime (None: a CPU op) and
    the compute capabilities its kernels were compiled for ("9.0"; a trailing "a" is Hopper's
    arch-specific variant, which runs on that capability only)."""
    return {"torch": torch_version, "cuda": cuda_version, "archs": list(archs)}


def manifest_mismatch(manifest: dict, torch_version: str, cuda_version: Optional[str],
                      capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why an op built per `manifest` must not run in a process with this torch, CUDA runtime and
    device capability (None when it may). torch's local tag counts (2.11.0+cu130 vs +cu128): an
    extension links against that exact build's C++ ABI."""
    if manifest.get("torch") != torch_version:
        return f"built for torch {manifest.get('torch')}, this is torch {torch_version}"
    if manifest.get("cuda") != cuda_version:
        return f"built for CUDA {manifest.get('cuda')}, this torch has CUDA {cuda_version}"
    if manifest.get("cuda") is not None and capability is None:
        return "built for CUDA devices, this process sees none"
    if capability is not None:
        have = f"{capability[0]}.{capability[1]}"
        if not any(a.rstrip("a") == have for a in manifest.get("archs", [])):
            return f"built for compute capabilities {manifest.get('archs')}, this device is {have}"
    return None


def save_prebuilt_op(name: str, built: Path, directory: Path, manifest: dict) -> Path:
    """Keep a built op (`built`: its .so) in `directory` as `<name>.so` + `<name>.json`, without its
    debug symbols where `strip` is installed (FusedAdam for sm_90: 10.3 MiB -> 0.5 MiB, which decides
    whether it fits a GPU call's 64 MiB beside the carried stack)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{name}.so"
    shutil.copyfile(built, target)
    if shutil.which("strip"):
        subprocess.run(["strip", "--strip-unneeded", str(target)], check=True)
    (directory / f"{name}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def load_prebuilt_ops(directory: Optional[str] = None) -> list[str]:
    """Register the matching ops of `directory` (default: $COLO_RL_PREBUILT_OPS) with DeepSpeed;
    returns their names. Nothing to do without a directory."""
    directory = directory or os.environ.get(ENV)
    if not directory:
        return []
    import torch
    from deepspeed.ops.op_builder.builder import OpBuilder

    root = Path(directory)
    if not root.is_dir():
        log.warning("%s=%s is not a directory: DeepSpeed builds its ops here", ENV, directory)
        return []
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    loaded = []
    for manifest_path in sorted(root.glob("*.json")):
        name = manifest_path.stem
        so = root / f"{name}.so"
        if name in OpBuilder._loaded_ops or not so.is_file():
            continue
        why = manifest_mismatch(json.loads(manifest_path.read_text()), torch.__version__, torch.version.cuda,
                                capability)
        if why:
            log.warning("prebuilt op %s not used (%s): DeepSpeed builds it", so, why)
            continue
        # The module name must be the one it was built as: its init function is PyInit_<name>.
        spec = importlib.util.spec_from_file_location(name, so, loader=importlib.machinery.ExtensionFileLoader(name, str(so)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        OpBuilder._loaded_ops[name] = module
        loaded.append(name)
        log.info("DeepSpeed op %s: prebuilt %s (no build)", name, so)
    return loaded
