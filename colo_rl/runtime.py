"""Start-up and shutdown shared by every recipe: process group, logging, one run directory on all
ranks, the resolved config on disk, seeds."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from colo_rl import console, dist
from colo_rl.checkpoint import CheckpointError, CheckpointManager
from colo_rl.config import ConfigError, RunConfig, to_object
from colo_rl.config.command_line import check_override_keys
from colo_rl.config.validation import check_context_length, check_generation_fits
from colo_rl.data.files import DataError, resolve_data_path
from colo_rl.errors import BuildLockError, EnvError, PoolError
from colo_rl.metrics import MetricsLogger
from colo_rl.lora import check_target_modules, lora_enabled
from colo_rl.models import describe_dtype, known_context_length, model_skeleton, resolve_dtype
from colo_rl.rewards import RewardError
from colo_rl.rollout import ENGINES

log = logging.getLogger("colo_rl")


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    dtype: torch.dtype
    ckpt: Optional[CheckpointManager] = None  # resume=auto|<dir> resolved, the config checked against it
    made_run_dir: bool = False  # this run created run_dir (a refused set-up removes it: remove_stub_run_dir)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# The run's exclusive lock on its directory: the holder's pid and host are written into it.
RUN_LOCK = ".colo_rl.lock"
# this process's locks, by directory: a second start() in one process (tests) keeps the one it holds
_held_locks: dict[str, int] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Take the exclusive lock of `run_dir` (flock on RUN_LOCK), or raise ConfigError naming the run
    that holds it. Two runs in one directory would interleave metrics.jsonl and overwrite each other's
    checkpoints. The OS drops the lock when the holder ends however it ends (kill -9 included), so a
    killed run never blocks its own resume; a stale lock file is just a file. flock is kept by
    every process that inherited the descriptor, and Python opens it close-on-exec, so only a child
    forked without exec (and still alive) keeps it after the run."""
    key = str(run_dir)
    if key in _held_locks:
        return
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another run (BlockingIOError); its pid and host are in the file
        holder = os.read(fd, 512).decode(errors="replace").strip() or "a run that is still starting"
        os.close(fd)
        raise ConfigError(f"run dir {run_dir} is in use by another run ({holder}): two runs in one directory "
                          f"would mix their metrics and overwrite each other's checkpoints. Wait for it to end "
                          f"(or stop it: Ctrl-C / kill its pid; resume=auto continues it), or pass another "
                          f"run_dir / run_name") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _held_locks[key] = fd


def unlock_run_dirs() -> None:
    """Release this process's run-directory locks (exit releases them anyway)."""
    while _held_locks:
        os.close(_held_locks.popitem()[1])


def choose_run_dir(cfg: RunConfig) -> tuple[Path, bool]:
    """Rank 0 picks the directory, takes its lock (lock_run_dir) and broadcasts it (Hydra's timestamps
    differ per process); every rank raises the same refusal. Also: whether this run made it."""
    outcome = None
    if dist.is_rank0():
        if cfg.run_dir:
            path = Path(cfg.run_dir)
        else:
            name = cfg.run_name or f"{cfg.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
            path = Path(cfg.output_root) / name
        made = not path.exists()
        try:
            path.mkdir(parents=True, exist_ok=True)
            path = path.resolve()
            lock_run_dir(path)
            outcome = ("ok", str(path), made)
        except (ConfigError, OSError) as e:
            outcome = ("error", str(e) if isinstance(e, ConfigError) else f"run dir {path}: {e}", made)
    outcome = dist.broadcast_object(outcome)
    if outcome[0] == "error":
        raise ConfigError(outcome[1])
    return Path(outcome[1]), outcome[2]


def remove_stub_run_dir(run_dir: Path) -> None:
    """After a start-up refusal: remove the run directory this run made (rank 0), so a refused
    command leaves nothing behind. Only one holding no checkpoint and no metrics row."""
    metrics = run_dir / "metrics.jsonl"
    if not dist.is_rank0() or (run_dir / "checkpoints").exists() or (metrics.exists() and metrics.stat().st_size):
        return
    unlock_run_dirs()
    shutil.rmtree(run_dir, ignore_errors=True)


def check_run_dir_shared(run_dir: Path) -> None:
    """Every rank sees the directory rank 0 chose (its config.yaml): every rank writes its checkpoint
    shards there and rank 0 renames the checkpoint, so on several nodes it must be on a filesystem
    every node mounts at the same path. Collective."""
    unseen = [node for node, seen in dist.all_gather_objects((dist.node_rank(), (run_dir / "config.yaml").exists()))
              if not seen]
    if unseen:
        raise ConfigError(f"run dir {run_dir} (chosen by rank 0) is not visible on node(s) {sorted(set(unseen))}: with "
                          f"several nodes, put output_root / run_dir on a filesystem every node mounts at the same path")


SWEEP_HINT = ("Hydra multirun (-m) is not supported: each run is its own torchrun process group. Sweep with "
              "one command per value, e.g. `for lr in 1e-5 2e-5; do torchrun --standalone --nproc_per_node=2 "
              "recipes/grpo.py trainer.lr=$lr run_name=lr$lr; done`")


def hydra_overrides() -> tuple[list[str], bool]:
    """The command-line overrides of this Hydra run, and whether it is a multirun (-m)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return [], False
    hc = HydraConfig.get()
    return list(hc.overrides.task), hc.mode == RunMode.MULTIRUN


def start(hydra_cfg: DictConfig, recipe: str, overrides: Optional[list[str]] = None) -> RunContext:
    """Validate (config.validate: every key, every range, what this recipe reads), then the
    process group, logging, the run directory, the resume decision, and only once the run is
    accepted its config.yaml; seeds."""
    # Validate before starting processes talking to each other: a typo costs seconds, not minutes.
    found, multirun = hydra_overrides()
    if multirun:
        raise ConfigError(SWEEP_HINT)
    OmegaConf.set_struct(hydra_cfg, True)
    hydra_cfg.recipe = recipe
    cfg = to_object(hydra_cfg, recipe, found if overrides is None else overrides)
    check_input_paths(cfg)
    ENGINES.get(cfg.rollout.engine).check_runs_here(cfg)
    dist.init(debug=cfg.debug)
    console.setup_logging(cfg.debug)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    run_dir, made = choose_run_dir(cfg)  # the run's lock on it, or a refusal naming the run holding it
    try:
        ckpt = CheckpointManager(run_dir, cfg)  # resolves resume=auto|<dir>; refuses a config that changes its meaning
    except CheckpointError:
        if made:
            remove_stub_run_dir(run_dir)
        raise
    if dist.is_rank0():  # the run is accepted: its config, and step logs of its own
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
        if ckpt.checkpoint is None:
            set_aside_stale_logs(run_dir)
    dist.barrier()
    check_run_dir_shared(run_dir)
    seed_everything(cfg.trainer.seed + dist.rank())
    dtype = resolve_dtype(cfg.model.dtype)
    log.info("%s: %d rank(s) on %s, %s, run dir %s", recipe, dist.world_size(), dist.device(),
             describe_dtype(cfg.model.dtype), run_dir)
    return RunContext(cfg=cfg, run_dir=run_dir, dtype=dtype, ckpt=ckpt, made_run_dir=made)


def metrics_logger(ctx: RunContext, console_keys: list[str]) -> MetricsLogger:
    """The run's metrics writers (logger=[...]), each given the resolved config."""
    return MetricsLogger(ctx.run_dir, ctx.cfg.logger, console_keys,
                         config=OmegaConf.to_container(OmegaConf.structured(ctx.cfg), resolve=True))


def run_context_length(cfg: RunConfig) -> tuple[Optional[int], str]:
    """The longest sequence the run's model takes (None: unknown) and where that figure comes from:
    the model's own (config.json), as the run's engine takes it (`Engine.context_length`)."""
    model = known_context_length(cfg.model.path)  # FileNotFoundError naming model.path
    return ENGINES.get(cfg.rollout.engine).context_length(cfg, model)


def check_input_paths(cfg: RunConfig) -> None:
    """The model and data the run names exist (seconds, before any process group or model), and
    the run's sequences fit the model's context."""
    context, source = run_context_length(cfg)  # resolves model.path first: FileNotFoundError naming it
    if lora_enabled(cfg.model):  # the adapters' layer names, against the model's structure (no weights loaded)
        check_target_modules(model_skeleton(cfg.model), cfg.model.lora.target_modules)
    if cfg.data.path is not None:
        resolve_data_path(cfg.data.path)  # DataError naming data.path and where it looked
    if cfg.data.eval_path is not None:
        if cfg.data.path is None:
            raise ConfigError("data.eval_path is a held-out file for data.path's records; the embedded task "
                              "(data.path=null) holds out its own problems: set data.path too, or drop data.eval_path")
        resolve_data_path(cfg.data.eval_path, "data.eval_path")
    if context is not None:
        check_context_length(cfg, context, source)


def check_held_out_generation(cfg: RunConfig, prompts: list[list[int]]) -> None:
    """SFT / DPO's greedy held-out accuracy: each held-out prompt + a completion fits the context
    (known only once the data is read; SGLang would refuse the request, the HF engine would generate
    past the trained positions)."""
    context, source = run_context_length(cfg)
    if context is not None and prompts:
        check_generation_fits(cfg, max(len(p) for p in prompts), context, source)


STEP_LOGS = ("metrics.jsonl", "rollouts.jsonl", "ledger.jsonl")  # rows by step, appended to as a run goes


def set_aside_stale_logs(run_dir: Path) -> Optional[int]:
    """A fresh start in a directory an earlier run (without a checkpoint) logged into: its step logs
    (STEP_LOGS) move to <name>.previous-N.jsonl, one N for all of them, so no file mixes two runs'
    steps. Returns N, None when there was nothing to move."""
    run_dir = Path(run_dir)
    stale = [run_dir / name for name in STEP_LOGS if (run_dir / name).exists()]
    if not stale:
        return None
    n = 1
    while any((run_dir / f"{Path(name).stem}.previous-{n}.jsonl").exists() for name in STEP_LOGS):
        n += 1
    for path in stale:
        path.rename(run_dir / f"{path.stem}.previous-{n}.jsonl")
    log.warning("%s holds an earlier run's step logs (no checkpoint to resume from): %s moved to *.previous-%d.jsonl",
                run_dir, ", ".join(p.name for p in stale), n)
    return n


# Failures with a message that says what to do: one line from rank 0, no traceback (debug=true adds it).
CLEAN_ERRORS: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, DataError, RewardError, EnvError,
                                                BuildLockError, PoolError, FileNotFoundError)


# On a clean error the other ranks wait this long before exiting, so that rank 0 says it first:
# torchrun stops every rank once one has exited (and SIGTERMs the waiting ones at once).
RANK0_SPEAKS_FIRST_S = 5.0


def check_command_line(recipe: str, argv: Optional[list[str]] = None) -> None:
    """Before Hydra composes the config: an override key colo_rl lacks (a verl / TRL / OpenRLHF / slime
    name, a typo, any other unknown key) or an argparse-style `--name value` (config/command_line.py)
    ends the run as `clean_errors` does: `error: <message>` from rank 0 (every rank meets the same),
    exit status 2, never Hydra's usage block or its own error on each rank."""
    try:
        check_override_keys(sys.argv[1:] if argv is None else argv, recipe)
    except ConfigError as e:
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def clean_errors(fn: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Wrap a recipe's main: a CLEAN_ERRORS failure prints `error: <message>` once and exits with
    status 2. Rank 0 prints at once; another rank prints `error (rank N): ...` only if the run is
    still going RANK0_SPEAKS_FIRST_S later (rank 0 did not meet that error), so an error of one
    rank's own is never silent. With debug=true every rank's traceback is printed as well."""

    @functools.wraps(fn)
    def wrapper(hydra_cfg: DictConfig) -> Any:
        try:
            return fn(hydra_cfg)
        except CLEAN_ERRORS as e:
            debug = bool(OmegaConf.select(hydra_cfg, "debug", default=False))
            if debug:
                traceback.print_exc()
            if dist.rank() == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            else:
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's SIGTERM ends the wait, not StopSignal
                time.sleep(RANK0_SPEAKS_FIRST_S)
                print(f"error (rank {dist.rank()}): {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper


def finish() -> None:
    dist.cleanup()
    unlock_run_dirs()
