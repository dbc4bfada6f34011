"""Shared test helpers: the repo root, a torchrun launcher for real multi-rank runs, GPU skips."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colo_rl.child_env import child_python_path  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
# `make gpu-check` sets this: there a GPU test whose stack (SGLang) is missing fails instead of skipping,
# so a wrong PYTHONPATH cannot turn the GPU run into a row of skips.
GPU_STACK_REQUIRED = os.environ.get("COLO_RL_REQUIRE_GPU_STACK") == "1"
WORKERS = Path(__file__).resolve().parent / "workers"


# A test that started a process group in pytest's own process (dist.init) leaves its rendezvous in
# os.environ; a child inheriting MASTER_PORT would try to bind the same, still-held, port.
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                   "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "GROUP_RANK", "ROLE_RANK")


def child_env(**extra: str) -> dict:
    """os.environ for a child process that starts its own process group."""
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}, **extra}


def hydra_dict(d: dict) -> str:
    """A dict as a Hydra override value: {key:value,...} with JSON scalars ("triton", true, 16)."""
    return "{" + ",".join(f"{k}:{json.dumps(v)}" for k, v in d.items()) + "}"


def run_torchrun(script: Path | str, args: list[str], nproc: int = 2, timeout: int = 600,
                 env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `script` under real torchrun (gloo on CPU); fail the test with the output on error
    (check=False: return it, for a test of the failure itself)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), *args]
    # The inherited PYTHONPATH stays: on the GPU machine it is where `make gpu-install` put the carry.
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack.
    full_env = child_env(**{"PYTHONPATH": child_python_path(), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
                            **(env or {})})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(failure_report(proc, script, os.environ.get("COLO_RL_GPU_LOG_DIR"),
                                   os.environ.get("PYTEST_CURRENT_TEST", "")))
    return proc


def failure_report(proc: subprocess.CompletedProcess, script: Path | str, log_dir: str | None, test_id: str) -> str:
    """A failed run's message: the last 6000 characters of stdout and of stderr. Under `make gpu-check`
    (COLO_RL_GPU_LOG_DIR) the whole output is kept there as well, since an SGLang scheduler's
    traceback sits in the middle of it (the first H100 run lost the one of an out-of-memory)."""
    message = f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    if log_dir:
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in test_id.split(" ")[0]) or Path(script).stem
        path = Path(log_dir) / f"failed-{name[-120:]}.log"
        path.write_text(f"$ torchrun {script} (exit {proc.returncode})\n--- stdout\n{proc.stdout}\n"
                        f"--- stderr\n{proc.stderr}")
        message += f"\n(whole output: {path})"
    return message


def wait_for_line(proc: subprocess.Popen, wanted: str) -> None:
    """Read `proc`'s stdout up to the line `wanted` (DeepSpeed's start-up notes come first); fail the
    test with its stderr if the process ends before printing it."""
    for line in proc.stdout:
        if line.strip() == wanted:
            return
    pytest.fail(proc.stderr.read())


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


_session_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _session_status.append(int(exitstatus))


@atexit.register  # registered at start-up, so it runs after pytest's and the libraries' own hooks
def _exit_before_teardown() -> None:
    """pytest's own process keeps a gloo world of one from the in-process SGLang tests. It ends like
    every rank does (dist.run_and_exit, colo_rl/colocate/NOTES.md): with gloo's threads alive, the
    interpreter's teardown can abort the process after the last test, so skip only that."""
    try:
        gloo_alive = any(Path(f"/proc/self/task/{t}/comm").read_text().strip() == "pt_gloo_runloop"
                         for t in os.listdir("/proc/self/task"))
    except OSError:
        return
    if gloo_alive and _session_status:
        from colo_rl import process_exit

        process_exit.exit_skipping_teardown(_session_status[-1])


# ~18 minutes of make test-e2e's ~40 on 2 cores, one file (it shares one engine start-up)
LONGEST_FILES = {"test_sglang_cpu_embedded.py"}


def pytest_collection_modifyitems(config, items):
    # The multi-process files first, the longest of all before them: `make test` hands whole files to
    # 2 workers in this order (pytest-xdist --dist loadfile --no-loadscope-reorder), and a long file
    # last would run alone.
    items.sort(key=lambda item: (item.path.name not in LONGEST_FILES, "slow" not in item.keywords))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
