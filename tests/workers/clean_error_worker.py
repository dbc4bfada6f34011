"""Run under torchrun (2 ranks): rank FAILING meets a clean error (a ConfigError) that the other
rank does not; the other rank is still working (sleeps SECONDS). runtime.clean_errors must still
say what failed, although rank 0 is the rank that normally speaks.

    python -m colo_rl.launch --nproc_per_node=2 tests/workers/clean_error_worker.py FAILING SECONDS
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from colo_rl import dist, process_exit, runtime
from colo_rl.config import ConfigError  # noqa: E402


@runtime.clean_errors
def main(cfg) -> None:
    if dist.rank() == int(sys.argv[1]):
        raise ConfigError(f"data shard {dist.rank()} holds no records")
    time.sleep(float(sys.argv[2]))


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(OmegaConf.create({})))
