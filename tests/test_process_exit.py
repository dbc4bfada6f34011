"""process_exit.run_and_exit: a rank ends with its status, its atexit hooks and threads served, and without
the exit-time abort that gloo's threads cause when Python finalizes (CI saw it twice, in the
paging and LoRA recipe workers, after their work was written)."""

from __future__ import annotations

import subprocess

from tests.conftest import WORKERS, run_torchrun

RUNS = 3  # with Python's own exit the worker aborted in 9 of 12 runs here; 3 passing by luck: ~0.02


def torchrun_exit_worker(out, mode: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return run_torchrun(WORKERS / "exit_worker.py", [str(out), mode], nproc=nproc, timeout=180, check=False)


def test_ranks_exit_cleanly_with_gloo_work_in_flight(tmp_path):
    for run in range(RUNS):
        out = tmp_path / f"run{run}"
        out.mkdir()
        proc = torchrun_exit_worker(out, "return")
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "terminate called" not in proc.stderr
        for rank in range(2):  # Python's exit duties still done
            assert (out / f"atexit.rank{rank}").read_text() == "ran"


def test_exit_status_is_kept(tmp_path):
    # One rank: with two, torchrun would SIGTERM the slower rank once the first one exits with 3.
    # It also pins that a torchrun world of one joins the agent's store at MASTER_PORT (a port of its
    # own had nobody listening: the rank waited out the store's timeout).
    proc = torchrun_exit_worker(tmp_path, "exit3", nproc=1)
    assert proc.returncode != 0
    assert "exitcode  : 3" in proc.stderr
    assert (tmp_path / "thread.rank0").read_text() == "ran"  # the sleeping non-daemon thread was joined
    assert (tmp_path / "atexit.rank0").read_text() == "ran"
