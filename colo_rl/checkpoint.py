"""Checkpoints: atomic save, exact resume, HF export.

A recipe uses it in a few lines:

    ckpt = CheckpointManager(run_dir, cfg)                  # picks the checkpoint, checks the config
    start_step = ckpt.maybe_resume(actor, sampler, engine)  # 0 on a fresh run
    ...
    ckpt.save(step, actor, sampler, engine)                 # every rank calls it (collective)

On disk, one directory per checkpoint under <run_dir>/checkpoints/:

    step-000004/
      ds/                DeepSpeed's own checkpoint (engine.save_checkpoint): every rank writes its
                         ZeRO shards: model, optimizer, scheduler, DeepSpeed's step counters
      rank00000.pt ...   per rank: Python / NumPy / torch (+ CUDA) RNG states, the rollout engine's
                         sampling RNG (each rank seeds differently)
      state.json         step, data-sampler position and shuffle epoch, trainer counters, world size
      config.yaml        the run's config (compared on resume)
      COMPLETE           written last, before the rename

Atomicity: everything is written into `step-000004.tmp/`; after a barrier (every rank finished),
rank 0 writes COMPLETE, fsyncs and renames the directory to `step-000004`. A kill at any point
before the rename leaves only a `.tmp` directory, which resume ignores (and the next run removes);
a directory counts as a checkpoint only with its final name *and* its COMPLETE marker.
Assumes the run directory is on one filesystem that every rank sees (one node, or a shared FS).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from colo_rl import dist
from colo_rl.errors import CheckpointError

log = logging.getLogger("colo_rl")

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
DS_TAG = "ds"
_STEP_DIR = re.compile(r"^step-(\d+)$")



# ---------------------------------------------------------------------------------------------
# Which config keys may differ between a checkpoint and the run resuming from it.
# REFUSED: the saved state means something else (or is silently overridden) under a new value.
# HARMLESS: how long / how often / where to log; changed silently.
# Anything else (loss coefficients, sampling temperature, ...) is allowed with a warning: the
# state is usable, but the resumed run no longer reproduces an uninterrupted one.
REFUSED: dict[str, str] = {
    "recipe": "a checkpoint of another recipe",
    "model.path": "the weights and optimizer state belong to another model",
    "model.random_init": "the weights and optimizer state belong to another model",
    "model.hidden_size": "the weights and optimizer state belong to another model",
    "model.num_layers": "the weights and optimizer state belong to another model",
    "model.dtype": "DeepSpeed's optimizer state differs between bf16 and fp32 training",
    "data.": "the saved data position indexes a different dataset / order",
    "trainer.zero_stage": "DeepSpeed's shards are laid out per ZeRO stage",
    "trainer.seed": "the saved per-rank RNG states were derived from the old seed",
    "trainer.lr": "the restored optimizer and scheduler state would silently keep the old value",
    "trainer.betas": "the restored optimizer state would silently keep the old value",
    "trainer.weight_decay": "the restored optimizer state would silently keep the old value",
    "trainer.batch_size": "the saved data position counts batches of the old size",
    "rollout.prompts_per_step": "the saved data position counts batches of the old size",
    "rollout.group_size": "a step's batch would no longer be the one the state was saved for",
    "rollout.seed": "the saved engine sampling state was derived from the old seed",
}
HARMLESS: tuple[str, ...] = (
    "trainer.total_steps", "trainer.save_every", "trainer.keep_last", "trainer.eval_every",
    "trainer.max_nonfinite_steps", "trainer.offload_pin_memory", "trainer.max_steps", "trainer.epochs",
    "trainer.eval_generate", "rollout.eval_max_new_tokens", "rollout.eval_batch_size",
    "rollout.mem_fraction_static", "rollout.memory_margin_gib", "rollout.handoff_bucket_mb",
    "rollout.handoff_check_max_mean_abs", "reward.max_failure_rate", "output_root", "run_name", "run_dir",
    "resume", "debug", "tensorboard", "plots",
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _matches(key: str, pattern: str) -> bool:
    return key.startswith(pattern) if pattern.endswith(".") else key == pattern


def config_container(cfg) -> dict:
    if isinstance(cfg, dict):
        return cfg
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def compare_configs(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(refusals, warnings): one line per differing key, naming it with both values."""
    old, new = _flatten(saved), _flatten(current)
    refusals, warnings = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b or any(_matches(key, p) for p in HARMLESS):
            continue
        reason = next((why for p, why in REFUSED.items() if _matches(key, p)), None)
        line = f"{key}: checkpoint {a!r}, now {b!r}"
        if reason is not None:
            refusals.append(f"{line} ({reason})")
        else:
            warnings.append(line)
    return refusals, warnings


# ---------------------------------------------------------------------------------------------
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
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


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


# ---------------------------------------------------------------------------------------------
def _engine_with(engine, attr: str):
    """The engine, or the engine a wrapper (TPGroupEngine.inner) holds, if it has `attr`."""
    for candidate in (engine, getattr(engine, "inner", None)):
        if candidate is not None and callable(getattr(candidate, attr, None)):
            return candidate
    return None


def capture_rng(engine=None) -> dict:
    """This rank's RNG states; `engine_sampling` is None for engines without `rng_state()`."""
    owner = _engine_with(engine, "rng_state")
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "engine_sampling": owner.rng_state() if owner is not None else None,
    }


def restore_rng(state: dict, engine=None) -> list[str]:
    """Restore what `capture_rng` saved; returns notes on what could not be restored exactly."""
    notes = []
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            notes.append("CUDA RNG states not restored (different device count)")
    saved = state.get("engine_sampling")
    owner = _engine_with(engine, "set_rng_state")
    if saved is not None and owner is not None:
        owner.set_rng_state(saved)
    elif saved is not None and engine is not None:
        notes.append(f"{type(engine).__name__} has no set_rng_state(): its sampling RNG restarts from its seed")
    elif saved is None and owner is not None:
        notes.append("the checkpoint holds no engine sampling state: sampling restarts from the engine's seed")
    return notes


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


# ---------------------------------------------------------------------------------------------
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
        for stale in self.root.glob("step-*.tmp") if self.root.is_dir() else []:
            log.warning("removing %s: an interrupted save (never completed)", stale)
            shutil.rmtree(stale, ignore_errors=True)
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
        self.check_compatible(path)
        return str(path)

    def check_compatible(self, path: Path) -> None:
        state = json.loads((path / "state.json").read_text())
        if state["world_size"] != dist.world_size():
            raise CheckpointError(
                f"cannot resume from {path}: it was written by {state['world_size']} rank(s), this run has "
                f"{dist.world_size()}. DeepSpeed's ZeRO shards and the per-rank RNG states are per rank: "
                f"run with --nproc_per_node={state['world_size']}, or export it "
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
        actor.load_checkpoint(str(path), DS_TAG)  # DeepSpeed: model, optimizer, scheduler (this rank's shards)
        if hasattr(actor, "load_counters"):
            actor.load_counters(state.get("actor", {}))
        if sampler is not None:
            sampler.load_state_dict(state["sampler"])
        rank_file = path / f"rank{dist.rank():05d}.pt"
        notes = restore_rng(torch.load(rank_file, map_location="cpu", weights_only=False), engine)
        for note in notes:
            log.warning("resume: %s (metrics after resuming will differ from an uninterrupted run)", note)
        self.extra = state.get("extra", {})
        self.last_saved_step = state["step"]
        self.last_saved = path
        if dist.is_rank0():
            self._truncate_metrics(state["step"])
        dist.barrier()
        log.info("resumed from %s: continuing after step %d", path, state["step"])
        return int(state["step"])

    def _truncate_metrics(self, step: int) -> None:
        """Drop rows an interrupted run logged after its last checkpoint: they are redone."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        lines = path.read_text().splitlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        if len(keep) != len([ln for ln in lines if ln.strip()]):
            log.info("metrics.jsonl: dropping %d row(s) logged after step %d by the interrupted run",
                     len(lines) - len(keep), step)
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
        if dist.is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        # DeepSpeed: every rank writes its own shards (model, optimizer, scheduler); barriers inside.
        actor.save_checkpoint(str(tmp), DS_TAG)
        torch.save(capture_rng(engine), tmp / f"rank{dist.rank():05d}.pt")
        if dist.is_rank0():
            state = {"step": step, "world_size": dist.world_size(), "time": time.time(),
                     "dtype": str(actor.dtype).replace("torch.", ""),
                     "sampler": sampler.state_dict() if sampler is not None else None,
                     "actor": actor.counters() if hasattr(actor, "counters") else {}, "extra": extra or {}}
            _write_file(tmp / "state.json", json.dumps(state, indent=1))
            _write_file(tmp / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(config_container(self.cfg))))
        _fsync_tree(tmp)  # every rank flushes what it wrote before saying it is done
        dist.barrier()  # every rank's files are on disk
        if dist.is_rank0():
            _write_file(tmp / COMPLETE, json.dumps({"step": step, "world_size": dist.world_size()}) + "\n")
            if final.exists():  # a re-run of the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_path(self.root)
            self._prune()
        dist.barrier()
        self.last_saved_step, self.last_saved = step, final
        log.info("checkpoint %s written in %.1fs", final, time.perf_counter() - t0)
        return final

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for old in complete_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            _fsync_path(os.path.join(root, name))
        _fsync_path(root)


# ---------------------------------------------------------------------------------------------
def export_hf(actor, tokenizer, out_dir: Path) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer) that
    `AutoModelForCausalLM.from_pretrained` and SGLang load. Every rank must call it (ZeRO-3
    gathers are collectives); rank 0 writes, atomically via a temporary directory."""
    out_dir = Path(out_dir)
    state = actor.full_state_dict_on_rank0()
    if dist.is_rank0():
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        actor.module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        log.info("HF model written to %s", out_dir)
    dist.barrier()
    return out_dir


def export_checkpoint_to_hf(checkpoint: Path, out_dir: Path) -> Path:
    """Export a saved checkpoint (any rank count, any ZeRO stage) to an HF model directory, in one
    process without torchrun: DeepSpeed consolidates the fp32 master weights from the shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from colo_rl.config import RunConfig
    from colo_rl.models import load_tokenizer, model_config

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {COMPLETE} marker)")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                              OmegaConf.load(checkpoint / "config.yaml")))
    state = json.loads((checkpoint / "state.json").read_text())
    dtype = getattr(torch, state.get("dtype", "float32"))
    weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)
    model = AutoModelForCausalLM.from_config(model_config(cfg.model), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())  # a dict {tied: source} or a list
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint}: its weights do not match the model its config describes "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.tie_weights()
    model = model.to(dtype)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(cfg.model.path).save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log.info("HF model from %s written to %s", checkpoint, out_dir)
    return out_dir


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Export a colo_rl checkpoint to an HF model directory.")
    parser.add_argument("checkpoint", help="<run_dir>/checkpoints/step-NNNNNN, or a run dir (its newest)")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = Path(args.checkpoint)
    if not is_complete(path):
        path = resolve_resume(str(path), path)
    export_checkpoint_to_hf(path, Path(args.out_dir))


if __name__ == "__main__":
    main()
