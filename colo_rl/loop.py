"""The one training loop, shared by GRPO, SFT and DPO (in the manner of torchtune's recipe interface).

A recipe is a class with five methods; `run` drives it:

    start = recipe.resume(ckpt)            # a checkpoint's step, or 0 for a fresh run
    step 0 (fresh run): recipe.evaluate(0)  # the starting model, logged before any update
    for step in start .. total_steps - 1:
        recipe.train_step(step)             # one optimizer step (GRPO: generate, score, update);
                                            # profiled when step + 1 is in trainer.profile_steps
        recipe.evaluate(step + 1)           # every trainer.eval_every steps and at the end
        collective stop check
        recipe.save(ckpt, step + 1)         # every trainer.save_every steps, on a stop, at the end
        metrics row (the save's time in it); progress
    recipe.finish(result)                   # export, plots, summary (skipped after a stop)

A SIGINT / SIGTERM on any rank stops every rank after the same step, with a checkpoint; the
caller exits with `result.exit_code` (130 / 143), and `resume=auto run_dir=...` continues.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from colo_rl import dist, runtime
from colo_rl.loggers import read_jsonl
from colo_rl.metrics import MetricsLogger, Progress, Timer
from colo_rl.profiling import StepProfiler
from colo_rl.stop_signal import StopSignal

log = logging.getLogger("colo_rl")


class Recipe(Protocol):
    name: str  # the progress bar's label
    total_steps: int
    metrics: MetricsLogger
    start_metrics: dict  # joins the step-0 row of a fresh run (set-up counts and timings)

    def resume(self, ckpt) -> int:
        """Restore from the checkpoint `ckpt` resolved (resume=...), returning its step; 0 when fresh."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics of the current weights (every rank calls it)."""

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step; returns the step's metrics, already reduced over ranks."""

    def save(self, ckpt, step: int) -> Optional[dict[str, float]]:
        """A resumable checkpoint after `step` steps (every rank calls it); what it cost besides its
        time (GRPO: the switch out of the generation phase an evaluation left), or None."""

    def plot(self) -> object:
        """The run's curves from its metrics.jsonl (after a stop too: the steps so far)."""

    def finish(self, result: "LoopResult") -> None:
        """After the last step of an uninterrupted run: final export, plots, summary."""


@dataclass
class LoopResult:
    first_eval: dict
    last_eval: dict
    stopped_by: Optional[str]  # the signal that stopped the run early, or None
    start_step: int  # > 0 when the run resumed

    @property
    def exit_code(self) -> int:
        return StopSignal.exit_code(self.stopped_by) if self.stopped_by else 0


def logged_evals(metrics_path) -> tuple[dict, dict]:
    """The first and last evaluation rows a resumed run had logged (metrics.jsonl is cut back to
    the checkpoint on resume, so these are the interrupted run's own)."""
    rows = ({k: v for k, v in r.items() if k.startswith("eval/")} for r in read_jsonl(metrics_path))
    evals = [e for e in rows if e]
    return (evals[0], evals[-1]) if evals else ({}, {})


def eval_due(steps_done: int, total_steps: int, eval_every: int) -> bool:
    """Is the held-out evaluation due after `steps_done` steps: every `eval_every` (0: only at the
    end) and after the last step. Step 0's evaluation is the caller's (a fresh run's)."""
    return steps_done == total_steps or (eval_every > 0 and steps_done % eval_every == 0)


def run(recipe: Recipe, cfg, ckpt, metrics: MetricsLogger, start_metrics: Optional[dict] = None) -> LoopResult:
    """Drive `recipe` through its steps (see the module docstring). `start_metrics` (set-up timings)
    join the step-0 row of a fresh run."""
    stop = StopSignal()
    timer = Timer()
    profiler = StepProfiler(cfg.trainer.profile_steps, ckpt.run_dir, timer)
    stopped_by = None
    try:
        start = recipe.resume(ckpt)
        if start == 0:
            with timer("eval"):
                first_eval = recipe.evaluate(0)
            metrics.log(0, {**first_eval, **timer.pop(), **(start_metrics or {})}, console=False)
            last_eval = first_eval
        else:
            first_eval, last_eval = logged_evals(metrics.path)
        profiler.check_reach(start, recipe.total_steps)
        progress = Progress(recipe.total_steps, recipe.name, start=start)
        for step in range(start, recipe.total_steps):
            with profiler(step + 1), timer("step"):  # trainer.profile_steps: this step's trace, written after it
                step_metrics = recipe.train_step(step)
            step_metrics.update(timer.pop())
            last = step + 1 == recipe.total_steps
            if eval_due(step + 1, recipe.total_steps, cfg.trainer.eval_every):
                with timer("eval"):
                    last_eval = recipe.evaluate(step + 1)
                step_metrics.update({**last_eval, **timer.pop()})
            stopped_by = stop.requested()  # a collective: every rank stops after the same step
            if ckpt.due(step + 1) or stopped_by or last:
                ckpt.step_row = step_metrics  # kept in the checkpoint: a kill before the row is logged loses nothing
                with timer("save"):
                    saved = recipe.save(ckpt, step + 1)
                step_metrics.update({**(saved or {}), **timer.pop()})
            progress.advance()
            metrics.log(step + 1, step_metrics, progress=progress.status())  # i/N and ETA where no bar is drawn
            if stopped_by:  # every rank stops here; one says so
                (log.warning if dist.is_rank0() else log.info)(
                    "stopped by %s after step %d; continue with resume=auto run_dir=%s", stopped_by, step + 1,
                    ckpt.run_dir)
                break
        progress.close()
    finally:
        stop.restore()
    result = LoopResult(first_eval, last_eval, stopped_by, start)
    if stopped_by:
        recipe.plot()  # the curves so far: a stopped run is looked at before it is resumed
    else:
        recipe.finish(result)
    return result


def main(recipe_cls: Callable[..., Recipe], hydra_cfg, recipe: str) -> None:
    """A recipe's entry point: start-up (the config check, the process group, the run directory,
    the resume decision), the recipe's set-up, the loop, shutdown; after a stop signal the
    process exits with 128 + the signal's number."""
    t0 = time.perf_counter()
    ctx = runtime.start(hydra_cfg, recipe=recipe)
    try:
        instance = recipe_cls(ctx)  # data, rewards, models, engine: a refusal here leaves no stub run dir
    except runtime.CLEAN_ERRORS:
        if ctx.made_run_dir:
            runtime.remove_stub_run_dir(ctx.run_dir)
        raise
    if getattr(instance, "serves", False):  # a split run's generation rank: its pool's loop, no steps of its own
        instance.serve()
        instance.metrics.close()
        runtime.finish()
        return
    result = run(instance, ctx.cfg, ctx.ckpt, instance.metrics, instance.start_metrics)
    getattr(instance, "close", lambda: None)()  # a split run's trainer stops its generators
    instance.metrics.close()
    if not result.stopped_by:
        log.info("done in %.1f min: %s", (time.perf_counter() - t0) / 60, ctx.run_dir)
    runtime.finish()
    if result.stopped_by:
        sys.exit(result.exit_code)
