"""The CUDA toolkit that JIT builds compile with: DeepSpeed's FusedAdam and dc (torch's cpp_extension)
and SGLang's tvm-ffi kernels, all built on first use on a GPU machine. Two traps, both seen with an
nvcc 13.0 toolkit installed from NVIDIA's wheels (`make gpu-compile-check`):

- torch (`torch.utils.cpp_extension.CUDA_HOME`, fixed when that module is imported), tvm-ffi and
  SGLang take CUDA_HOME or CUDA_PATH, else the directory above the `nvcc` on PATH, else
  /usr/local/cuda. A wrapper script at /usr/local/bin/nvcc (`exec /usr/local/cuda-13.0/bin/nvcc
  "$@"`) makes that /usr/local: no CUDA headers, no lib64/libcudart.so, every build fails
  ("cannot find -lcudart"). Then the first real toolkit (/usr/local/cuda, then /usr/local/cuda-*
  newest first) becomes CUDA_HOME.
- torch's ATen/cuda headers, which DeepSpeed's CUDA ops include, include cuBLAS, cuSPARSE and
  cuSOLVER headers that a compiler-only toolkit lacks ("cusparse.h: No such file or directory").
  pip-installed torch brings them in its nvidia-* wheels (nvidia/cu13/include): that directory is
  appended to CPLUS_INCLUDE_PATH, which gcc and nvcc search after every include path they are given,
  so it only fills the gap. The same for NCCL's header, which torch's c10d NCCLUtils.hpp includes
  (DeepSpeed's DeepCompile op `dc`): no CUDA toolkit has it, the nvidia-nccl wheel does.

Both reach this process and those it starts (SGLang's schedulers); nothing changes where the builds
would work as they are.

A third, seen on the first H100 run (2026-11-25): the GPU image sets TORCH_CUDA_ARCH_LIST with an
architecture-specific suffix (`9.0a`, Hopper's wgmma target). torch reads it; DeepSpeed's op builder
parses each entry as integers (`int("0a")`: ValueError) and FusedAdam failed to build, so every
trainer failed at start. `arch_list_for_deepspeed` gives DeepSpeed the same list without the
suffixes (FusedAdam uses no sm_90a instruction) while it builds, and restores the user's after.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import sys
from typing import Iterable, Iterator, Mapping, Optional

log = logging.getLogger(__name__)

# What torch's and tvm-ffi's builders use: the compiler, the runtime's headers, `-L<home>/lib64 -lcudart`.
TOOLKIT_FILES = (os.path.join("bin", "nvcc"), os.path.join("include", "cuda_runtime.h"),
                 os.path.join("lib64", "libcudart.so"))
# Included by torch's ATen/cuda/CUDAContextLight.h (every CUDA extension that includes ATen/cuda).
ATEN_LIBRARY_HEADERS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")
# Included by torch's torch/csrc/distributed/c10d/NCCLUtils.hpp (DeepCompile's `dc` op).
NCCL_HEADERS = ("nccl.h",)
# Where NVIDIA's wheels put headers: CUDA 13 one folder, CUDA 12 one per library; NCCL its own.
PIP_INCLUDE_SUBDIRS = ("cu13/include", "cublas/include", "cusparse/include", "cusolver/include", "nccl/include")
# The compiler's own search path: a header found there (a distribution's libnccl-dev) needs nothing.
SYSTEM_INCLUDE_DIRS = ("/usr/include", "/usr/local/include")


def is_toolkit(path: Optional[str]) -> bool:
    return bool(path) and all(os.path.exists(os.path.join(path, f)) for f in TOOLKIT_FILES)


def default_candidates() -> list[str]:
    """/usr/local/cuda, then /usr/local/cuda-<version>, newest version first."""
    def version(p: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", os.path.basename(p)))

    return ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), key=version, reverse=True)]


def default_nvidia_roots() -> list[str]:
    """The folders of the `nvidia` namespace package (NVIDIA's wheels, torch's dependencies)."""
    try:
        import nvidia
    except ImportError:
        return []
    return list(getattr(nvidia, "__path__", []))


def build_env_changes(environ: Mapping[str, str], nvcc_on_path: Optional[str], candidates: Iterable[str],
                      nvidia_roots: Iterable[str], system_includes: Iterable[str] = SYSTEM_INCLUDE_DIRS
                      ) -> dict[str, str]:
    """The variables to set for JIT builds (empty when the builders' own choice works). CUDA_HOME
    only when no variable names a toolkit (the user's choice stands) and the guess is not one;
    CPLUS_INCLUDE_PATH only when the toolkit (or, for NCCL's, the system) lacks a header torch's
    CUDA headers include and a wheel has it."""
    changes: dict[str, str] = {}
    users = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    home = users or (os.path.dirname(os.path.dirname(nvcc_on_path)) if nvcc_on_path else "/usr/local/cuda")
    if not users and not is_toolkit(home):
        found = next((c for c in candidates if is_toolkit(c)), None)
        if found is None:
            return changes  # no toolkit: the build fails with its own message, which names CUDA_HOME
        changes["CUDA_HOME"] = home = found
    missing = [h for h in ATEN_LIBRARY_HEADERS if not os.path.exists(os.path.join(home, "include", h))]
    missing += [h for h in NCCL_HEADERS
                if not any(os.path.exists(os.path.join(d, h)) for d in (os.path.join(home, "include"), *system_includes))]
    present = [p for p in environ.get("CPLUS_INCLUDE_PATH", "").split(":") if p]
    added: list[str] = []
    for root in nvidia_roots:
        for sub in PIP_INCLUDE_SUBDIRS:
            inc = os.path.join(root, sub)
            provides = [h for h in missing if os.path.exists(os.path.join(inc, h))]
            if provides and inc not in present and inc not in added:
                added.append(inc)
            missing = [h for h in missing if h not in provides]
    if added:
        changes["CPLUS_INCLUDE_PATH"] = ":".join(present + added)
    return changes


def prepare_jit_builds(candidates: Optional[Iterable[str]] = None,
                       nvidia_roots: Optional[Iterable[str]] = None) -> dict[str, str]:
    """Set what `build_env_changes` finds (and point torch's cached CUDA_HOME at the toolkit). Call
    before the first JIT build; idempotent. Returns the variables it set."""
    import torch

    if not torch.version.cuda:  # a CPU build of torch compiles no CUDA
        return {}
    changes = build_env_changes(os.environ, shutil.which("nvcc"),
                                default_candidates() if candidates is None else candidates,
                                default_nvidia_roots() if nvidia_roots is None else nvidia_roots)
    os.environ.update(changes)
    cpp_extension = sys.modules.get("torch.utils.cpp_extension")  # DeepSpeed reads its CUDA_HOME per build
    if "CUDA_HOME" in changes and cpp_extension is not None:
        cpp_extension.CUDA_HOME = changes["CUDA_HOME"]
    if changes:
        log.info("JIT builds: %s (nvcc on PATH: %s)", ", ".join(f"{k}={v}" for k, v in changes.items()),
                 shutil.which("nvcc"))
    return changes


def deepspeed_arch_list(value: Optional[str]) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can parse it: `9.0a` -> `9.0`, `10.0f+PTX` ->
    `10.0+PTX` (entries kept in order, duplicates dropped); None when it parses as it is."""
    entries = [e for e in (value or "").replace(" ", ";").split(";") if e]
    out: list[str] = []
    for entry in entries:
        m = re.fullmatch(r"(\d+)\.(\d+)[a-z]*(\+PTX)?", entry)
        fixed = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else entry
        if fixed not in out:
            out.append(fixed)
    return None if out == entries else ";".join(out)


@contextlib.contextmanager
def arch_list_for_deepspeed(environ=None) -> Iterator[Optional[str]]:
    """While DeepSpeed builds its ops: TORCH_CUDA_ARCH_LIST without architecture suffixes; the
    variable is back as it was afterwards (yields the list DeepSpeed sees, or None if unchanged)."""
    environ = os.environ if environ is None else environ
    original = environ.get("TORCH_CUDA_ARCH_LIST")
    fixed = deepspeed_arch_list(original)
    if fixed is None:
        yield None
        return
    log.info("TORCH_CUDA_ARCH_LIST=%s is read as %s while DeepSpeed builds its ops (its parser takes no "
             "architecture suffix)", original, fixed)
    environ["TORCH_CUDA_ARCH_LIST"] = fixed
    try:
        yield fixed
    finally:
        environ["TORCH_CUDA_ARCH_LIST"] = original
