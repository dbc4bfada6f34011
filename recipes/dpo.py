"""Direct preference optimisation on the DeepSpeed ZeRO trainer (sigmoid / IPO / hinge, cDPO).

    make dpo                                                    # embedded default, 2 CPU ranks
    torchrun --nproc_per_node=8 recipes/dpo.py data.path=pairs.jsonl model.path=out/sft/checkpoint-final

Reference log-probs: with algo.precompute_ref_logprobs=true they are computed once, before the
first step, with the starting weights (which are the reference), for the pairs the run's steps
draw (all of them once it covers an epoch), and cached for the whole run;
with false a frozen ZeRO-3 reference model (no optimizer states) scores every micro-batch.

One step (`DPORecipe.train_step`):
    the next trainer.batch_size pairs (each rank takes its share; an epoch's last batch is what
    is left of it)
    micro-batches of [chosen; rejected] behind the shared prompt -> sequence log-probs
    -> algos.dpo_loss against the reference -> summed over pairs / pairs on all ranks -> step
Held-out evaluation (trainer.eval_every, end): loss, implicit rewards of chosen and rejected,
their margin, and preference accuracy (share of pairs whose chosen reward is higher).
The loop around it (resume, evaluation, checkpoints, clean stop) is colo_rl/loop.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Optional

import hydra
import torch
from omegaconf import DictConfig

from colo_rl import algos, dist, loop, process_exit, runtime
from colo_rl.checkpoint import export_hf
from colo_rl.colocate.setup import build_actor, reference_model
from colo_rl.config import register_configs
from colo_rl.data.preference import load_preference_data
from colo_rl.data.sampler import EpochSampler
from colo_rl.evaluation import check_held_out_size, generates_for_accuracy, held_out_accuracy
from colo_rl.loggers import read_jsonl
from colo_rl.metrics import StepSums, Timer, json_text, plot_curves
from colo_rl.models import load_tokenizer
from colo_rl.rewards import RewardScorer
from colo_rl.train.offline import empty_batch, equalise, pair_logps, pair_micro_batches, plan_steps, split_pair_logps

log = logging.getLogger("colo_rl")

CONSOLE = ["train/loss", "rewards/margins", "rewards/accuracy", "train/grad_norm", "time/step", "eval/rewards/margins",
           "eval/rewards/accuracy"]


class DPORecipe:
    """Set-up in __init__ (with the reference log-probs precomputed); the loop calls resume /
    evaluate / train_step / save / finish."""

    name = "DPO"

    def __init__(self, ctx):
        self.cfg, self.run_dir, self.dtype, self.t_start = ctx.cfg, ctx.run_dir, ctx.dtype, time.perf_counter()
        cfg, tr, algo = self.cfg, self.cfg.trainer, self.cfg.algo
        self.length_normalised = algo.dpo_loss == "ipo"  # IPO compares mean, not summed, log-probs
        # ---- data: prompt / chosen / rejected, tokenised once, over-length policy (counted)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad = self.tokenizer.pad_token_id
        self.train, self.held, self.length_stats = load_preference_data(self.tokenizer, cfg.data)
        log.info("data: %d train / %d held-out pairs from %s; data.overlong_policy=%s: %s", len(self.train),
                 len(self.held), cfg.data.path or "the embedded arithmetic task", cfg.data.overlong_policy,
                 self.length_stats.summary())
        self.plan = plan_steps(cfg, len(self.train), "pairs")
        self.total_steps = self.plan.total_steps
        check_held_out_size(len(self.held), dist.world_size())
        self.sampler = EpochSampler(len(self.train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        log.info("plan: %d steps (%d epoch(s) x %d steps of %d pairs; %d per rank, micro-batches of whole pairs up "
                 "to trainer.micro_batch_tokens=%s); loss %s, beta %g, label smoothing %g; reference log-probs %s",
                 self.plan.total_steps, tr.epochs, self.plan.steps_per_epoch, tr.batch_size, self.plan.local_batch,
                 tr.micro_batch_tokens, algo.dpo_loss,
                 algo.beta, algo.label_smoothing,
                 "precomputed once" if algo.precompute_ref_logprobs else "from a frozen reference model")
        # ---- policy (+ rollout engine for the optional greedy accuracy) and reference
        self.gen_eval = generates_for_accuracy(tr.eval_generate, self.held)
        if self.gen_eval:  # prompt + eval_max_new_tokens within the context, checked before the model loads
            runtime.check_held_out_generation(cfg, [ex.prompt_ids for ex in self.held])
        self.actor, self.colo = build_actor(cfg, ctx.dtype, self.tokenizer, ctx.run_dir, self.plan.total_steps,
                                            self.plan.grad_accum, with_engine=self.gen_eval)
        self.scorer = RewardScorer(cfg.reward) if self.gen_eval else None
        self.ref = None
        if not algo.precompute_ref_logprobs:
            self.ref = reference_model(cfg, self.actor, ctx.dtype, self.plan.total_steps,
                                       self.colo.guard if self.colo is not None else None)
        self.metrics = runtime.metrics_logger(ctx, CONSOLE)
        # ---- reference log-probs, precomputed: the starting weights are the reference (also on a
        # resume: the actor holds model.path's weights until the loop loads the checkpoint)
        self.cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        timer = Timer()
        if algo.precompute_ref_logprobs:
            # only the pairs the run's steps draw (from step 0: a resume's actor holds the starting weights too)
            used = self.sampler.planned(tr.batch_size, self.plan.total_steps, short_last=True)
            with self.update_phase(), timer("ref_precompute"):
                self.cache["train"] = self.logps_all(self.actor, self.train, used)
                self.cache["eval"] = self.logps_all(self.actor, self.held) if self.held else (torch.zeros(0),
                                                                                             torch.zeros(0))
            log.info("reference log-probs precomputed in %.1fs: %d of %d train pairs (those %d steps draw) and %d "
                     "held-out", timer.seconds["ref_precompute"], len(used), len(self.train), self.plan.total_steps,
                     len(self.held))
            if dist.is_rank0():
                torch.save({k: {"chosen": c, "rejected": r} for k, (c, r) in self.cache.items()},
                           self.run_dir / "ref_logprobs.pt")
        self.start_metrics = timer.pop()  # time/ref_precompute joins the step-0 row

    def update_phase(self):
        """The trainer holds its states inside (with a colocated engine: the update phase)."""
        return self.colo.switch.update() if self.colo is not None else contextlib.nullcontext()

    @property
    def engine(self):
        return self.colo.engine if self.colo is not None else None

    def logps_all(self, model, pairs: list, only: Optional[list[int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) sequence log-probs of every pair (or of the pairs `only` lists: NaN for the
        others), each rank scoring its share."""
        cfg = self.cfg
        shard = dist.shard(list(range(len(pairs))) if only is None else list(only))
        c, r = pair_logps(model, [pairs[i] for i in shard], cfg.trainer.micro_batch_size, self.pad,
                          self.length_normalised, cfg.trainer.packing, self.dtype, self.actor.micro_batch_tokens())
        chosen, rejected = torch.full((len(pairs),), math.nan), torch.full((len(pairs),), math.nan)
        for idx, ci, ri in dist.all_gather_objects((shard, c, r)):
            chosen[idx], rejected[idx] = ci, ri
        return chosen, rejected

    # ------------------------------------------------------------------ the loop's calls
    def resume(self, ckpt) -> int:
        with self.update_phase():  # DeepSpeed state, data position, RNGs
            return ckpt.maybe_resume(self.actor, self.sampler, self.engine)

    def evaluate(self, step: int) -> dict[str, float]:
        out: dict = {}
        if self.held:
            with self.update_phase():
                # at step 0 the policy is the reference: with precomputing, its log-probs are the cached ones
                pol = self.cache["eval"] if step == 0 and self.ref is None else self.logps_all(self.actor, self.held)
                ref_lp = self.cache["eval"] if self.ref is None else self.logps_all(self.ref, self.held)
            out.update(preference_metrics(*pol, *ref_lp, self.cfg.algo, prefix="eval/"))
            if step == 0:  # how often the reference itself already ranks the pair right
                out["eval/ref_logp_accuracy"] = float((ref_lp[0] > ref_lp[1]).float().mean())
            log.info("eval @ step %d: held-out preference accuracy %.3f, margin %.4f (chosen %.4f, rejected %.4f), "
                     "loss %.4f on %d pairs", step, out["eval/rewards/accuracy"], out["eval/rewards/margins"],
                     out["eval/rewards/chosen"], out["eval/rewards/rejected"], out["eval/loss"], len(self.held))
        if self.gen_eval:
            out.update(held_out_accuracy(self.colo, self.tokenizer, [ex.prompt_ids for ex in self.held],
                                         [ex.answer for ex in self.held], self.scorer,
                                         self.cfg.rollout.eval_max_new_tokens, step))
        return out

    def train_step(self, step: int) -> dict[str, float]:
        if self.colo is not None:
            self.colo.switch.begin_step(step)
        indices = self.sampler.next_local(self.cfg.trainer.batch_size, short_last=True)
        with self.update_phase():
            out = dpo_step(self.cfg, self.actor, self.ref, [self.train[i] for i in indices], indices,
                           self.cache.get("train"), self.pad, self.length_normalised, self.dtype)
        out["train/epoch"] = self.sampler.epochs_done()
        return out

    def save(self, ckpt, step: int) -> None:
        with self.update_phase():
            ckpt.save(step, self.actor, self.sampler, self.engine)

    def plot(self) -> None:
        """loss_curve.png from metrics.jsonl (cfg.plots)."""
        if self.cfg.plots:
            plot_curves(read_jsonl(self.run_dir / "metrics.jsonl"), self.run_dir / "loss_curve.png",
                        [("DPO loss", ["train/loss", "eval/loss"]),
                         ("reward margin (chosen - rejected)", ["rewards/margins", "eval/rewards/margins"]),
                         ("preference accuracy", ["rewards/accuracy", "eval/rewards/accuracy"]),
                         ("implicit rewards", ["rewards/chosen", "rewards/rejected", "eval/rewards/chosen",
                                               "eval/rewards/rejected"])],
                        f"DPO ({self.cfg.algo.dpo_loss}) {self.run_dir.name}")

    def finish(self, result: loop.LoopResult) -> None:
        algo = self.cfg.algo
        with self.update_phase():
            final = export_hf(self.actor, self.tokenizer, self.run_dir / "checkpoint-final")
        self.plot()
        first, last = result.first_eval, result.last_eval
        stats = self.length_stats
        summary = {"recipe": "dpo", "loss": algo.dpo_loss, "beta": algo.beta, "steps": self.plan.total_steps,
                   "train_pairs": len(self.train), "held_out_pairs": len(self.held),
                   "resumed_at_step": result.start_step,
                   "overlong": vars(stats) | {"dropped_origins": stats.dropped_origins[:10]},
                   "start": first, "end": last, "checkpoint": str(final), "seconds": time.perf_counter() - self.t_start}
        if dist.is_rank0():
            (self.run_dir / "summary.json").write_text(json_text(summary))
        if self.held and "eval/rewards/accuracy" in first:
            log.info("held-out preference accuracy %.3f -> %.3f, margin %.4f -> %.4f (%d pairs)",
                     first["eval/rewards/accuracy"], last["eval/rewards/accuracy"], first["eval/rewards/margins"],
                     last["eval/rewards/margins"], len(self.held))
        log.info("next: recipes/grpo.py model.path=%s", final)


def preference_metrics(pol_c, pol_r, ref_c, ref_r, algo, prefix: str = "") -> dict[str, float]:
    """Mean loss, implicit rewards beta (log pi - log ref) of chosen / rejected, their margin, and
    the share of pairs ranked right (chosen reward > rejected reward)."""
    losses, rc, rr = algos.dpo_loss(pol_c, pol_r, ref_c, ref_r, algo.beta, algo.dpo_loss, algo.label_smoothing)
    return {f"{prefix}loss": float(losses.mean()), f"{prefix}rewards/chosen": float(rc.mean()),
            f"{prefix}rewards/rejected": float(rr.mean()), f"{prefix}rewards/margins": float((rc - rr).mean()),
            f"{prefix}rewards/accuracy": float((rc > rr).float().mean()),
            f"{prefix}logps/chosen": float(pol_c.mean()), f"{prefix}logps/rejected": float(pol_r.mean())}


def dpo_step(cfg, actor, ref, pairs: list, indices: list[int], cached, pad_id: int, length_normalised: bool,
             dtype: torch.dtype) -> dict[str, float]:
    """One optimizer step over this rank's pairs; the loss is the sum of per-pair losses divided by
    the number of pairs on all ranks. `indices` are the pairs' places in the training set (for
    the cached reference log-probs)."""
    # the step's pairs on all ranks (an epoch's last batch is short)
    algo, (n_pairs,) = cfg.algo, dist.all_reduce_sum([float(len(pairs))])
    batches, _ = equalise(pair_micro_batches(pairs, cfg.trainer.micro_batch_size, pad_id, cfg.trainer.packing, dtype,
                                             actor.micro_batch_tokens()),
                          pad_id, make=lambda: ([], empty_batch(pad_id)))
    sums = StepSums(["loss", "chosen", "rejected", "correct", "logp_chosen", "logp_rejected", "pairs"])
    for j, (rows, batch) in enumerate(batches):
        if rows and ref is None:  # the cached reference log-probs travel with the batch
            batch.extras.update(zip(("ref_chosen", "ref_rejected"), (t[[indices[i] for i in rows]] for t in cached)))
        batch = actor.to_device(batch)  # pinned, non-blocking on a GPU
        logp, _ = actor.response_logprobs(batch)
        ref_logp = ref.response_logprobs(batch, grad=False)[0] if ref is not None else None  # every rank: collectives
        if not rows:  # an empty micro-batch (this rank ran out): joins the collectives, adds zero
            actor.backward(logp.sum() * 0.0, last_micro_batch=j == len(batches) - 1)
            continue
        policy_chosen, policy_rejected = split_pair_logps(logp, batch, length_normalised)
        if ref_logp is None:
            ref_chosen, ref_rejected = batch.extras["ref_chosen"], batch.extras["ref_rejected"]
        else:
            ref_chosen, ref_rejected = split_pair_logps(ref_logp, batch, length_normalised)
        losses, rc, rr = algos.dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, algo.beta,
                                        algo.dpo_loss, algo.label_smoothing)
        actor.backward(losses.sum() / n_pairs, last_micro_batch=j == len(batches) - 1)
        sums.add({k: v.detach().sum() for k, v in (("loss", losses), ("chosen", rc), ("rejected", rr),
                                                   ("correct", (rc > rr).float()), ("logp_chosen", policy_chosen),
                                                   ("logp_rejected", policy_rejected))}, pairs=len(rows))
    stats = actor.step()
    totals = sums.totals()
    n = max(totals["pairs"], 1.0)
    return {"train/loss": totals["loss"] / n, "rewards/chosen": totals["chosen"] / n,
            "rewards/rejected": totals["rejected"] / n, "rewards/margins": (totals["chosen"] - totals["rejected"]) / n,
            "rewards/accuracy": totals["correct"] / n, "logps/chosen": totals["logp_chosen"] / n,
            "logps/rejected": totals["logp_rejected"] / n, "train/grad_norm": stats["grad_norm"],
            "train/lr": stats["lr"]}


@hydra.main(config_path="../conf", config_name="dpo", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    loop.main(DPORecipe, hydra_cfg, "dpo")


if __name__ == "__main__":
    register_configs()
    runtime.check_command_line("dpo")
    process_exit.run_and_exit(main)
