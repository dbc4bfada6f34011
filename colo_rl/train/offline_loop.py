"""The run shared by the fixed-dataset recipes (SFT, DPO): the step plan, the trainer (plus the
rollout engine when held-out accuracy is wanted), and the step loop with resume, evaluation,
checkpoints and a clean stop on SIGINT / SIGTERM.

A recipe supplies what differs: its data and `step_fn(indices) -> metrics` (one optimizer step on
the examples at those indices), `eval_fn(step) -> metrics`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from colo_rl import dist
from colo_rl.config import ConfigError
from colo_rl.data.files import DataError
from colo_rl.metrics import Progress, Timer, read_jsonl
from colo_rl.rewards import RewardScorer

log = logging.getLogger("colo_rl")


@dataclass
class StepPlan:
    total_steps: int
    steps_per_epoch: int
    local_batch: int  # examples per rank per step
    grad_accum: int  # micro-batches per rank per step


def plan_steps(cfg, n_train: int, unit: str = "examples") -> StepPlan:
    """trainer.epochs (cut at trainer.max_steps) over n_train examples in batches of
    trainer.batch_size; refuses a batch the ranks cannot share or packing the attention cannot do."""
    tr, world = cfg.trainer, dist.world_size()
    if not n_train:
        raise DataError(f"no training {unit} left (all over-length?): raise data.max_seq_len")
    if tr.batch_size % world:
        raise ConfigError(f"trainer.batch_size={tr.batch_size} must be divisible by the number of ranks ({world})")
    if cfg.algo.packing and cfg.model.attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(f"algo.packing=true needs model.attn_implementation=sdpa or eager (4D attention masks), "
                          f"not {cfg.model.attn_implementation!r}")
    steps_per_epoch = math.ceil(n_train / tr.batch_size)
    total = tr.epochs * steps_per_epoch
    if tr.max_steps:
        total = min(total, tr.max_steps)
    local_batch = tr.batch_size // world
    return StepPlan(total, steps_per_epoch, local_batch, math.ceil(local_batch / tr.micro_batch_size))


@dataclass
class OfflineTrainer:
    actor: Any  # DeepSpeedActor
    update_phase: Callable  # context manager: the trainer holds its states inside it
    colo: Any = None  # the colocated set (engine + switch) when generating for evaluation
    scorer: Optional[RewardScorer] = None

    @property
    def engine(self):
        return self.colo.engine if self.colo is not None else None

    @property
    def guard(self):
        return self.colo.guard if self.colo is not None else None


def build_offline_trainer(cfg, ctx, tokenizer, plan: StepPlan, gen_eval: bool) -> OfflineTrainer:
    """The DeepSpeed actor alone, or (gen_eval) the colocated actor + rollout engine, which the
    greedy held-out accuracy needs."""
    from colo_rl.colocate.setup import build_colocated
    from colo_rl.train.actor import DeepSpeedActor

    if gen_eval:
        colo = build_colocated(cfg, tokenizer, ctx.dtype, ctx.run_dir, total_steps=plan.total_steps,
                               grad_accum=plan.grad_accum)
        return OfflineTrainer(colo.actor, colo.switch.update, colo, RewardScorer(cfg.reward))
    actor = DeepSpeedActor(cfg, ctx.dtype, total_steps=plan.total_steps, grad_accum=plan.grad_accum)
    return OfflineTrainer(actor, contextlib.nullcontext)


@dataclass
class LoopResult:
    first_eval: dict
    last_eval: dict
    stopped_by: Optional[str]  # the signal that stopped the run early, or None
    start_step: int  # > 0 when the run resumed

    @property
    def exit_code(self) -> int:
        return dist.StopSignal.exit_code(self.stopped_by) if self.stopped_by else 0


def run_offline_loop(name: str, cfg, plan: StepPlan, trainer: OfflineTrainer, sampler, ckpt, metrics,
                     step_fn: Callable[[list[int]], dict], eval_fn: Callable[[int], dict], n_train: int,
                     start_metrics: Optional[dict] = None) -> LoopResult:
    """Resume (or evaluate the starting model), then plan.total_steps steps of step_fn on the next
    trainer.batch_size examples (this rank's share), evaluating every trainer.eval_every steps and
    at the end, checkpointing every trainer.save_every steps, on a stop signal and at the end.
    `start_metrics` (e.g. set-up timings) join the step-0 row of a fresh run."""
    tr = cfg.trainer
    stop = dist.StopSignal()  # every rank stops after the same step, with a checkpoint
    timer = Timer()
    with trainer.update_phase():  # DeepSpeed state, data position, RNGs
        start = ckpt.maybe_resume(trainer.actor, sampler, trainer.engine)
    if start == 0:
        with timer("eval"):
            first_eval = eval_fn(0)
        metrics.log(0, {**first_eval, **timer.pop(), **(start_metrics or {})}, console=False)
        last_eval = first_eval
    else:  # the evaluations the interrupted run logged (metrics.jsonl was cut at the checkpoint)
        rows = ({k: v for k, v in r.items() if k.startswith("eval/")} for r in read_jsonl(metrics.path))
        evals = [e for e in rows if e]
        first_eval, last_eval = (evals[0], evals[-1]) if evals else ({}, {})
    progress = Progress(plan.total_steps, name, start=start)
    eval_every = tr.eval_every or plan.total_steps
    stopped_by = None
    for step in range(start, plan.total_steps):
        with timer("step"):
            indices = sampler.next_local(tr.batch_size)
            with trainer.update_phase():
                step_metrics = step_fn(indices)
        step_metrics.update(timer.pop())
        if "train/tokens" in step_metrics:
            step_metrics["throughput/tokens_per_s"] = step_metrics["train/tokens"] / step_metrics["time/step"]
        step_metrics["train/epoch"] = (step + 1) * tr.batch_size / n_train
        if (step + 1) % eval_every == 0 or step + 1 == plan.total_steps:
            with timer("eval"):
                last_eval = eval_fn(step + 1)
            step_metrics.update({**last_eval, **timer.pop()})
        metrics.log(step + 1, step_metrics)
        progress.advance()
        stopped_by = stop.requested()  # collective
        if ckpt.due(step + 1) or stopped_by or step + 1 == plan.total_steps:
            with trainer.update_phase():
                ckpt.save(step + 1, trainer.actor, sampler, trainer.engine)
        if stopped_by:
            log.warning("stopped by %s after step %d; continue with resume=auto run_dir=%s", stopped_by, step + 1,
                        ckpt.run_dir)
            break
    progress.close()
    stop.restore()
    return LoopResult(first_eval, last_eval, stopped_by, start)
