"""CheckpointManager: which checkpoint to resume, atomic saves, pruning (the layout: __init__.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from colo_rl import dist
from colo_rl.checkpoint.compat import capture_rng, compare_configs, config_container, restore_rng
from colo_rl.errors import CheckpointError
from colo_rl.loggers import parse_rows, read_jsonl
from colo_rl.metrics import clean_value

log = logging.getLogger("colo_rl")

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
DS_TAG = "ds"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / COMPLETE).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (a checkpoints/ directory), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory (step-NNNNNN) holds."""
    return int(_STEP_DIR.match(Path(path).name).group(1))


def newest_checkpoint(root: Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint directory `resume` names: None (fresh start), `auto` (newest complete one in
    <run_dir>/checkpoints, or None), a checkpoint directory, or a run / checkpoints directory
    (its newest complete checkpoint). Raises CheckpointError for anything unusable."""
    if resume is None or str(resume).strip().lower() in ("", "null", "none", "false", "no"):
        return None
    if str(resume).strip().lower() == "auto":
        return newest_checkpoint(Path(run_dir) / CHECKPOINTS)
    path = Path(resume).expanduser()
    if not path.exists():
        raise CheckpointError(f"resume={resume!r}: no such directory. Pass a checkpoint directory "
                              f"(<run_dir>/{CHECKPOINTS}/step-NNNNNN), a run directory, or resume=auto.")
    if is_complete(path):
        return path.resolve()
    if path.name.startswith("step-"):
        hint = newest_checkpoint(path.parent)
        raise CheckpointError(
            f"resume={resume!r} is not a complete checkpoint (no {COMPLETE} marker under its final name: its "
            f"save was interrupted)" + (f"; the newest complete one next to it is {hint}" if hint else "")
            + ". Pass a complete checkpoint, or resume=auto.")
    for root in (path / CHECKPOINTS, path):
        newest = newest_checkpoint(root)
        if newest is not None:
            return newest.resolve()
    raise CheckpointError(f"resume={resume!r}: no complete checkpoint in {path} or {path / CHECKPOINTS}. "
                          "Pass a checkpoint directory, or resume=null to start from scratch.")


# Room asked for a save beyond the last checkpoint's size (a step's state grows a little: counters, RNGs).
SPACE_MARGIN = 1.1
# A failed write with less than this free on the checkpoint's filesystem was a full disk (torch.save's
# C++ writer says only "file write failed").
NEARLY_FULL_BYTES = 256 * 2**20


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _fsync_path(path: Path | str) -> None:
    """fsync a file or directory; best effort (some filesystems refuse directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            _fsync_path(os.path.join(root, name))
        _fsync_path(root)


class CheckpointManager:
    """Save / resume for one run. Construct it on every rank before building the models: it
    resolves `cfg.resume` (rank 0 decides, every rank gets the same answer) and refuses a config
    that would make the checkpoint mean something else, before any expensive start-up work."""

    def __init__(self, run_dir: Path, cfg, keep_last: Optional[int] = None):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.cfg = cfg
        self.keep_last = cfg.trainer.keep_last if keep_last is None else keep_last
        self.last_saved_step: Optional[int] = None
        self.last_saved: Optional[Path] = None
        self.extra: dict = {}
        # The step's metrics row, set by the loop before a save: the checkpoint keeps it, and a resume
        # writes it back where a kill between the checkpoint and the row's write left it out.
        self.step_row: Optional[dict] = None
        outcome = None
        if dist.is_rank0():
            try:
                outcome = ("ok", self._resolve_on_rank0())
            except (CheckpointError, OSError, ValueError, KeyError) as e:
                outcome = ("error", str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}")
        outcome = dist.broadcast_object(outcome)
        if outcome[0] == "error":  # every rank raises the same message: no rank waits for a peer
            raise CheckpointError(outcome[1])
        self.checkpoint: Optional[Path] = Path(outcome[1]) if outcome[1] else None

    def _resolve_on_rank0(self) -> Optional[str]:
        for aside in sorted(self.root.glob("step-*.tmp")) + sorted(self.root.glob("step-*.old")) \
                if self.root.is_dir() else []:
            final = aside.with_suffix("")
            if (aside / COMPLETE).is_file() and not final.exists():  # killed between a save's renames
                log.warning("%s is complete and %s missing (a save was cut between its renames): restored",
                            aside.name, final.name)
                os.rename(aside, final)
            else:
                log.warning("removing %s: an interrupted save (never completed) or a replaced one", aside)
                shutil.rmtree(aside, ignore_errors=True)
        path = resolve_resume(self.cfg.resume, self.run_dir)
        if path is None:
            existing = newest_checkpoint(self.root)
            if str(self.cfg.resume).strip().lower() == "auto":
                hint = "" if (self.cfg.run_dir or self.cfg.run_name) else \
                    " (this run got a new directory: pass run_dir=<the interrupted run's directory> to continue it)"
                log.info("resume=auto: no complete checkpoint in %s, starting at step 0%s", self.root, hint)
                return None
            if existing is None:
                return None
            raise CheckpointError(
                f"run dir {self.run_dir} already holds checkpoints (newest: {existing.name}) and resume is "
                f"not set: pass resume=auto to continue that run, or choose another run_dir (or delete "
                f"{self.root}) to start from scratch")
        self.check_branch(path)
        self.check_compatible(path)
        return str(path)

    def check_branch(self, path: Path) -> None:
        """Refuse to resume from a checkpoint older than one this run directory already holds: the
        two timelines would mix (pruning keeps the highest steps, so the old run's would outlive the
        new run's own, and resume=auto would later pick the old run's newest)."""
        step = checkpoint_step(path)
        newer = [c.name for c in complete_checkpoints(self.root) if checkpoint_step(c) > step]
        if newer:
            raise CheckpointError(
                f"cannot resume from {path}: {self.root} holds newer checkpoint(s) of the run that went on "
                f"from it ({', '.join(newer)}); continuing here would mix the two runs' checkpoints and "
                f"metrics. To branch from {path.name}: move the newer ones out of {self.root} (or delete them), "
                f"or start in a new run_dir with resume={path}. To continue the newest: resume=auto")

    def check_compatible(self, path: Path) -> None:
        state = json.loads((path / "state.json").read_text())
        # the job's ranks (a split run's trainer pool writes the shards: world_size is the pool's)
        written = state.get("job_world_size", state["world_size"])
        if written != dist.job_world_size():
            raise CheckpointError(
                f"cannot resume from {path}: it was written by {written} rank(s), this run has "
                f"{dist.job_world_size()}. DeepSpeed's ZeRO shards and the per-rank RNG states are per rank: "
                f"run with --nproc_per_node={written}, or export it "
                f"(python -m colo_rl.checkpoint {path} <out_dir>) and start a new run from model.path=<out_dir>")
        saved = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=True)
        refusals, warnings = compare_configs(saved, config_container(self.cfg))
        if refusals:
            keys = ", ".join(r.split(":")[0] for r in refusals)
            raise CheckpointError(
                f"cannot resume from {path}: config key(s) {keys} differ from the checkpoint's:\n  "
                + "\n  ".join(refusals)
                + "\nSet them back to the checkpoint's values, or start a new run (resume=null and a new run_dir; "
                  "model.path=<an exported checkpoint> to start from its weights).")
        if warnings:
            log.warning("resuming from %s with changed config (the run will not reproduce an uninterrupted "
                        "one):\n  %s", path, "\n  ".join(warnings))

    # -----------------------------------------------------------------------------------------
    def maybe_resume(self, actor, sampler=None, engine=None) -> int:
        """Load the chosen checkpoint into the actor (DeepSpeed), sampler, RNGs and engine; return
        the step to continue from (0 when there is nothing to resume). Every rank calls it."""
        if self.checkpoint is None:
            return 0
        path = self.checkpoint
        state = json.loads((path / "state.json").read_text())
        if sampler is not None:  # before DeepSpeed's load: a different training set is said at once
            sampler.load_state_dict(state["sampler"], str(path))
        actor.load_checkpoint(str(path), DS_TAG)  # DeepSpeed: model, optimizer, scheduler (this rank's shards)
        if hasattr(actor, "load_counters"):
            actor.load_counters(state.get("actor", {}))
        rank_file = path / f"rank{dist.rank():05d}.pt"
        notes = restore_rng(torch.load(rank_file, map_location="cpu", weights_only=False), engine)
        for note in notes:
            log.warning("resume: %s (metrics after resuming will differ from an uninterrupted run)", note)
        self.extra = state.get("extra", {})
        self.last_saved_step = state["step"]
        self.last_saved = path
        if dist.is_rank0():
            self._truncate_logs(state["step"], state.get("row"))
        dist.barrier()
        log.info("resumed from %s: continuing after step %d", path, state["step"])
        return int(state["step"])

    def _truncate_logs(self, step: int, row: Optional[dict] = None) -> None:
        """Drop what an interrupted run logged after its last checkpoint (after `step` steps): those
        steps are redone. metrics.jsonl's and rollouts.jsonl's rows name steps done (1-based),
        ledger.jsonl's records the step they belong to (0-based: the checkpoint's last is step - 1).
        The checkpoint's own step row (`row`, kept in it) is written back where the run was killed
        before it logged it."""
        self._truncate_jsonl("metrics.jsonl", lambda r: r.get("step", 0) <= step)
        self._truncate_jsonl("ledger.jsonl", lambda record: record.get("step", 0) < step)
        self._truncate_jsonl("rollouts.jsonl", lambda r: r.get("step", 0) <= step)
        path = self.run_dir / "metrics.jsonl"
        if row is not None and not any(r.get("step") == step for r in read_jsonl(path)):
            with open(path, "a") as fh:
                fh.write(json.dumps({**row, "step": step}) + "\n")
            log.info("metrics.jsonl: step %d's row, written before the kill only into its checkpoint, restored", step)

    def _truncate_jsonl(self, name: str, kept) -> None:
        path = self.run_dir / name
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        keep = [ln for ln, row in zip(lines, parse_rows(lines, path)) if row is not None and kept(row)]
        if len(keep) != len([ln for ln in lines if ln.strip()]):
            log.info("%s: dropping %d row(s) logged after the checkpoint by the interrupted run", name,
                     len(lines) - len(keep))
            tmp = path.with_suffix(".jsonl.tmp")
            _write_file(tmp, "".join(ln + "\n" for ln in keep))
            os.replace(tmp, path)

    # -----------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return every > 0 and step % every == 0

    def save(self, step: int, actor, sampler=None, engine=None, extra: Optional[dict] = None) -> Path:
        """Write checkpoint `step` (= steps completed) atomically; every rank must call it."""
        final = self.root / step_dir_name(step)
        if self.last_saved_step == step and self.last_saved is not None:
            return self.last_saved
        t0 = time.perf_counter()
        tmp = final.with_name(final.name + ".tmp")
        self._check_space()  # collective: every rank refuses together, before anything is written
        if dist.is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        try:
            # DeepSpeed: every rank writes its own shards (model, optimizer, scheduler); barriers inside.
            actor.save_checkpoint(str(tmp), DS_TAG)
            torch.save(capture_rng(engine), tmp / f"rank{dist.rank():05d}.pt")
            if dist.is_rank0():
                state = {"step": step, "world_size": dist.world_size(), "job_world_size": dist.job_world_size(),
                         "time": time.time(),
                         "dtype": str(actor.dtype).replace("torch.", ""),
                         "sampler": sampler.state_dict() if sampler is not None else None,
                         "actor": actor.counters() if hasattr(actor, "counters") else {}, "extra": extra or {},
                         "row": (None if self.step_row is None
                                 else {k: clean_value(v) for k, v in self.step_row.items()})}
                _write_file(tmp / "state.json", json.dumps(state, indent=1))
                _write_file(tmp / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config_container(self.cfg))))
            _fsync_tree(tmp)  # every rank flushes what it wrote before saying it is done
        except (OSError, RuntimeError) as e:  # this rank's write failed: a full disk is said as such
            free = free_bytes(self.root)
            if not (getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)
                    or free < NEARLY_FULL_BYTES):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # the partial checkpoint must not keep the disk full
            raise CheckpointError(self._no_space(tree_bytes(self.last_saved) if self.last_saved else None,
                                                 free)) from None
        dist.barrier()  # every rank's files are on disk
        if dist.is_rank0():
            _write_file(tmp / COMPLETE, json.dumps({"step": step, "world_size": dist.world_size()}) + "\n")
            old = final.with_name(final.name + ".old")
            if final.exists():  # a re-run of the same step: the old one stays whole until the new is in
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_path(self.root)
            shutil.rmtree(old, ignore_errors=True)
            self._prune()
        dist.barrier()
        self.last_saved_step, self.last_saved = step, final
        log.info("checkpoint %s written in %.1fs", final, time.perf_counter() - t0)
        return final

    def _prune(self, keep: Optional[int] = None) -> None:
        keep = self.keep_last if keep is None else keep
        if keep <= 0:
            return
        for old in complete_checkpoints(self.root)[:-keep]:
            (old / COMPLETE).unlink(missing_ok=True)  # first: a half-deleted one must not look complete
            shutil.rmtree(old, ignore_errors=True)

    def _check_space(self) -> None:
        """Before a save (collective; rank 0 looks): room for one more checkpoint the size of the newest
        one (unknown before the first). Short of it, the checkpoints the save would prune go first (the
        newest complete one is always kept); still short, CheckpointError saying what is needed."""
        message = None
        if dist.is_rank0():
            newest = newest_checkpoint(self.root)
            need = SPACE_MARGIN * tree_bytes(newest) if newest is not None else 0
            if need and free_bytes(self.root) < need and self.keep_last > 1:
                self._prune(self.keep_last - 1)  # these go after the save anyway
            if need and (free := free_bytes(self.root)) < need:
                message = self._no_space(need, free)
        message = dist.broadcast_object(message)
        if message:
            raise CheckpointError(message)

    def _no_space(self, need: Optional[float], free: int) -> str:
        newest = newest_checkpoint(self.root)
        kept = (f"the last complete checkpoint, {newest.name}, is intact: resume=auto continues from it"
                if newest is not None else "no complete checkpoint yet")
        needs = f"needs ~{_size(need)}, " if need else ""
        lower = (f"lower trainer.keep_last (now {self.keep_last}) or " if self.keep_last > 1 else
                 "keep fewer checkpoints (trainer.keep_last=1) or " if self.keep_last <= 0 else "")
        return f"no space left on {self.root}: {needs}{_size(free)} free; {lower}free space ({kept})"
