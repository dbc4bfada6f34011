"""Process groups and rank helpers. nccl on GPU, gloo on CPU; works without torchrun (world of 1)."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("colo_rl")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_rank0() -> bool:
    return rank() == 0


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def init(timeout_minutes: float = 30.0) -> None:
    """Initialise the default process group the way DeepSpeed expects.

    Single-process runs (plain `python recipes/grpo.py`) get a world of one, so the same code
    path runs with and without torchrun.
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    import deepspeed

    # gloo on CPU: DeepSpeed's CPU accelerator picks gloo when oneCCL is absent.
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo",
        timeout=datetime.timedelta(minutes=timeout_minutes),
        verbose=False,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    if dist.is_initialized() and world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank."""
    if not dist.is_initialized() or world_size() == 1:
        return obj
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a list of floats over ranks (float64 on CPU: exact enough for counts and sums)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.to(device())
        dist.all_reduce(t)
    return t.cpu().tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.to(device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def shard(items: list[Any]) -> list[Any]:
    """This rank's contiguous share of `items` (ranks differ by at most one item)."""
    n, r, w = len(items), rank(), world_size()
    start = r * n // w
    return items[start:(r + 1) * n // w]


def setup_logging(debug: bool = False) -> None:
    """Rank-aware logging: rank 0 logs at INFO; other ranks only warnings unless debugging."""
    import warnings

    if not debug:  # torch's per-call deprecation notices from DeepSpeed's collectives
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    level = logging.INFO if (is_rank0() or debug) else logging.WARNING
    fmt = f"[%(asctime)s r{rank()}] %(message)s" if debug else "[%(asctime)s] %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    log.setLevel(level)
    # DeepSpeed and transformers are chatty on every rank.
    for name in ("DeepSpeed", "deepspeed", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING if is_rank0() or debug else logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING if is_rank0() or debug else logging.ERROR)
    except Exception:
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:
        pass


def cleanup() -> None:
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()
