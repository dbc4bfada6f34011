"""PYTHONPATH for a Python child process of colo_rl (a reward worker, a benchmark's run, a test's
torchrun): colo_rl importable from where this process found it, and the inherited PYTHONPATH kept,
because on the GPU machine that is where `make gpu-install` put the carried packages."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the directory holding colo_rl/ (the repo root)


def child_python_path(*first: str) -> str:
    """`first`, the directory holding colo_rl/, then this process's PYTHONPATH; empty parts dropped."""
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(p for p in [*first, str(PACKAGE_ROOT), *inherited] if p)
