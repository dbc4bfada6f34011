"""Run under colo_rl.launch (2 ranks), in one of two modes:

    dead N   rank 1 is killed by SIGKILL (the OOM killer's signature) while rank 0 waits in a collective
    stop N S a loop of N "steps" of S seconds with colo_rl's stop check (colo_rl.stop_signal.StopSignal), as the training loop has it;
             prints "ready" once it runs, and "stopped by <signal> after step <k>" on a clean stop
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from colo_rl import dist, process_exit
from colo_rl.stop_signal import StopSignal  # noqa: E402


def main() -> None:
    mode, steps = sys.argv[1], int(sys.argv[2])
    dist.init()
    # every rank's handler is in place before the barrier: "ready" then means no rank can still be
    # inside start-up code that a SIGINT would interrupt (a slow rank on a loaded machine was)
    stop = StopSignal() if mode == "stop" else None
    dist.barrier()
    if mode == "dead":
        if dist.rank() == 1:
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(steps):
            dist.all_reduce_max([1.0])
            time.sleep(0.5)
        return
    dist.barrier()  # ... and every rank has left the first barrier
    if dist.is_rank0():
        print("ready", flush=True)
    for step in range(steps):
        time.sleep(float(sys.argv[3]))
        stopped_by = stop.requested()
        if stopped_by:
            if dist.is_rank0():
                print(f"stopped by {stopped_by} after step {step + 1}; continue with resume=auto", flush=True)
            sys.exit(StopSignal.exit_code(stopped_by))


if __name__ == "__main__":
    process_exit.run_and_exit(main)
