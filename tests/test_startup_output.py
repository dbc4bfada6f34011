"""Only rank 0 prints (README): DeepSpeed's start-up lines, said on every rank before logging is
rank-aware, come once; `debug=true` keeps every rank's; after start-up the other ranks' errors and
output still get through (the quieting ends with the start-up)."""

import pytest
import torch

from conftest import WORKERS, run_torchrun

ACCELERATOR = "Setting accelerator to CPU"  # DeepSpeed's WARNING when it finds no GPU
SHM_OP = "deepspeed_shm_comm_op built successfully"  # DeepSpeed's print when its CPU collective op loads


@pytest.fixture(scope="module")
def output():
    def run(mode: str) -> str:
        proc = run_torchrun(WORKERS / "startup_worker.py", [mode], timeout=300)
        return proc.stdout + proc.stderr

    return {mode: run(mode) for mode in ("quiet", "debug")}


def test_deepspeed_start_up_lines_come_from_rank_0_only(output):
    quiet, debug = output["quiet"], output["debug"]
    for line in (ACCELERATOR, SHM_OP):
        assert quiet.count(line) <= 1, (line, quiet)
        assert debug.count(line) == 2 * quiet.count(line), (line, debug)  # debug: every rank's
    if not torch.cuda.is_available():
        assert quiet.count(ACCELERATOR) == 1, quiet


def test_other_ranks_still_speak_after_start_up(output):
    for text in output.values():
        for rank in (0, 1):
            assert f"deepspeed error on rank {rank}" in text, text
            assert f"stdout after start-up on rank {rank}" in text, text
