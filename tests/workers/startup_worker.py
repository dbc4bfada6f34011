"""Run under torchrun (2 gloo ranks): start the process group and logging as every recipe does, then
say something on each rank through DeepSpeed's logger (an error) and through stdout, to show that the
start-up's quieting of the other ranks is over once the group is up.

    python -m torch.distributed.run --nproc_per_node=2 tests/workers/startup_worker.py {quiet|debug}
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colo_rl import console, dist, process_exit


def main(debug: bool) -> None:
    dist.init(debug=debug)
    console.setup_logging(debug)
    logging.getLogger("DeepSpeed").error("deepspeed error on rank %d", dist.rank())
    print(f"stdout after start-up on rank {dist.rank()}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(sys.argv[1] == "debug"))
