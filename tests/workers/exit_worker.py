"""Run under torchrun (2 gloo ranks): a rank that ends through process_exit.run_and_exit, as every recipe
does, in one of two ways:

- `return`: with gloo collectives still in flight on gloo's own threads. Letting Python finalize
  here (`finalize`, for comparison; no test runs it) aborts the process in about half the runs:
  `terminate called without an active exception`, a gloo thread dropping tensors while the
  interpreter tears down, as CI saw in recipe workers after all their work was written.
- `exit3`: sys.exit(3) with a non-daemon thread still sleeping, which must be joined first.
Either way the rank's atexit hook must still run. Markers go to DIR.

    python -m torch.distributed.run --nproc_per_node=2 tests/workers/exit_worker.py DIR {return|exit3|finalize}
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colo_rl import dist, process_exit


def main(out: Path, mode: str) -> None:
    dist.init()
    rank = dist.rank()
    atexit.register(lambda: (out / f"atexit.rank{rank}").write_text("ran"))
    if mode == "exit3":
        def late_writer():
            time.sleep(0.3)
            (out / f"thread.rank{rank}").write_text("ran")

        threading.Thread(target=late_writer).start()
        sys.exit(3)
    works = [torch.distributed.all_reduce(torch.ones(10_000), async_op=True) for _ in range(200)]
    works[0].wait()


if __name__ == "__main__":
    out_dir, how = Path(sys.argv[1]), sys.argv[2]
    if how == "finalize":
        main(out_dir, "return")
    else:
        process_exit.run_and_exit(lambda: main(out_dir, how))
