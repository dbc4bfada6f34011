"""Start-up and shutdown shared by every recipe: process group, logging, one run directory on all
ranks, the resolved config on disk, seeds."""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from colo_rl import dist
from colo_rl.config import RunConfig, to_object
from colo_rl.models import resolve_dtype

log = logging.getLogger("colo_rl")


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    dtype: torch.dtype
    device: torch.device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def choose_run_dir(cfg: RunConfig) -> Path:
    """Rank 0 picks the directory and broadcasts it: Hydra's timestamps differ per process."""
    if dist.is_rank0():
        if cfg.run_dir:
            path = Path(cfg.run_dir)
        else:
            name = cfg.run_name or f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
            path = Path(cfg.output_root) / name
        path.mkdir(parents=True, exist_ok=True)
        path = path.resolve()
    else:
        path = None
    return Path(dist.broadcast_object(str(path) if path else None))


def start(hydra_cfg: DictConfig, recipe: str) -> RunContext:
    # Validate before starting processes talking to each other: a typo costs seconds, not minutes.
    OmegaConf.set_struct(hydra_cfg, True)
    hydra_cfg.recipe = recipe
    cfg = to_object(hydra_cfg)
    dist.init()
    dist.setup_logging(cfg.debug)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    run_dir = choose_run_dir(cfg)
    if dist.is_rank0():
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(hydra_cfg, resolve=True))
    seed_everything(cfg.trainer.seed + dist.rank())
    dtype = resolve_dtype(cfg.model.dtype)
    log.info("%s: %d rank(s) on %s, %s, run dir %s", recipe, dist.world_size(), dist.device(),
             str(dtype).replace("torch.", ""), run_dir)
    return RunContext(cfg=cfg, run_dir=run_dir, dtype=dtype, device=dist.device())


def finish() -> None:
    dist.cleanup()
