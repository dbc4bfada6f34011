"""Direct preference optimisation on the DeepSpeed ZeRO trainer (sigmoid / IPO / hinge, cDPO).

    make dpo                                                    # embedded default, 2 CPU ranks
    torchrun --nproc_per_node=8 recipes/dpo.py data.path=pairs.jsonl model.path=out/sft/checkpoint-final

Reference log-probs: with algo.precompute_ref_logprobs=true they are computed once, before the
first step, with the starting weights (which are the reference) and cached for the whole run;
with false a frozen ZeRO-3 reference model (no optimizer states) scores every micro-batch.

One step:
    the next trainer.batch_size pairs (each rank takes its share)
    micro-batches of [chosen; rejected] behind the shared prompt -> sequence log-probs
    -> algos.dpo_loss against the reference -> summed over pairs / pairs on all ranks -> step
Checkpoints (every trainer.save_every steps, on SIGINT / SIGTERM, at the end) resume exactly
with resume=auto run_dir=<the run's directory>.
Held-out evaluation (trainer.eval_every, end): loss, implicit rewards of chosen and rejected,
their margin, and preference accuracy (share of pairs whose chosen reward is higher).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colo_rl import algos, dist, runtime  # noqa: E402
from colo_rl.checkpoint import export_hf  # noqa: E402
from colo_rl.config import ConfigError, register_configs  # noqa: E402
from colo_rl.data.preference import load_preference_data  # noqa: E402
from colo_rl.data.sampler import EpochSampler  # noqa: E402
from colo_rl.metrics import MetricsLogger, Timer, plot_curves, read_jsonl  # noqa: E402
from colo_rl.models import load_tokenizer  # noqa: E402
from colo_rl.train.actor import DeepSpeedActor  # noqa: E402
from colo_rl.train.offline import (empty_batch, equalise, held_out_accuracy, pair_logps,  # noqa: E402
                                   pair_micro_batches, split_pair_logps)
from colo_rl.train.offline_loop import build_offline_trainer, plan_steps, run_offline_loop  # noqa: E402

log = logging.getLogger("colo_rl")
register_configs()

CONSOLE = ["train/loss", "rewards/margins", "rewards/accuracy", "train/grad_norm", "time/step", "eval/rewards/margins",
           "eval/rewards/accuracy"]


@hydra.main(config_path="../conf", config_name="dpo", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    t_start = time.perf_counter()
    ctx = runtime.start(hydra_cfg, recipe="dpo")
    cfg, run_dir, tr, algo = ctx.cfg, ctx.run_dir, ctx.cfg.trainer, ctx.cfg.algo
    ckpt = ctx.ckpt  # resume=auto|<dir> resolved; a config that changes its meaning was refused
    average = algo.dpo_loss == "ipo"  # IPO works on length-normalised log-probs

    # ---- data: prompt / chosen / rejected, tokenised once, over-length policy (counted)
    tokenizer = load_tokenizer(cfg.model.path)
    pad = tokenizer.pad_token_id
    train, held, length_stats = load_preference_data(tokenizer, cfg.data)
    log.info("data: %d train / %d held-out pairs from %s; data.overlong_policy=%s: %s", len(train), len(held),
             cfg.data.path or "the embedded arithmetic task", cfg.data.overlong_policy, length_stats.summary())
    plan = plan_steps(cfg, len(train), "pairs")
    if not 0.0 <= algo.label_smoothing < 0.5:
        raise ConfigError(f"algo.label_smoothing={algo.label_smoothing} must be in [0, 0.5)")
    sampler = EpochSampler(len(train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    log.info("plan: %d steps (%d epoch(s) x %d steps of %d pairs; %d per rank, micro-batches of %d pairs); "
             "loss %s, beta %g, label smoothing %g; reference log-probs %s", plan.total_steps, tr.epochs,
             plan.steps_per_epoch, tr.batch_size, plan.local_batch, tr.micro_batch_size, algo.dpo_loss, algo.beta,
             algo.label_smoothing, "precomputed once" if algo.precompute_ref_logprobs else "from a frozen reference model")

    # ---- policy (+ rollout engine for the optional greedy accuracy) and reference
    gen_eval = bool(tr.eval_generate and held and all(p.answer is not None for p in held))
    trainer = build_offline_trainer(cfg, ctx, tokenizer, plan, gen_eval)
    actor = trainer.actor
    ref = None
    if not algo.precompute_ref_logprobs:
        ref = DeepSpeedActor(cfg, ctx.dtype, total_steps=plan.total_steps, with_optimizer=False, guard=trainer.guard)
    metrics = MetricsLogger(run_dir, cfg.tensorboard, CONSOLE)
    timer = Timer()

    def logps_all(model, pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) sequence log-probs of every pair, each rank scoring its share."""
        shard = dist.shard(list(range(len(pairs))))
        c, r = pair_logps(model, [pairs[i] for i in shard], tr.micro_batch_size, pad, average, algo.packing,
                          ctx.dtype)
        chosen, rejected = torch.zeros(len(pairs)), torch.zeros(len(pairs))
        for idx, ci, ri in dist.all_gather_objects((shard, c, r)):
            chosen[idx], rejected[idx] = ci, ri
        return chosen, rejected

    # ---- reference log-probs, precomputed: the starting weights are the reference (also on a
    # resume: the actor holds model.path's weights until the loop loads the checkpoint)
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if algo.precompute_ref_logprobs:
        with trainer.update_phase(), timer("ref_precompute"):
            cache["train"] = logps_all(actor, train)
            cache["eval"] = logps_all(actor, held) if held else (torch.zeros(0), torch.zeros(0))
        log.info("reference log-probs of %d pairs precomputed in %.1fs", len(train) + len(held),
                 timer.seconds["ref_precompute"])
        if dist.is_rank0():
            torch.save({k: {"chosen": c, "rejected": r} for k, (c, r) in cache.items()}, run_dir / "ref_logprobs.pt")

    def run_eval(step: int) -> dict:
        out: dict = {}
        if held:
            with trainer.update_phase():
                # at step 0 the policy is the reference: with precomputing, its log-probs are the cached ones
                pol = cache["eval"] if step == 0 and ref is None else logps_all(actor, held)
                ref_lp = cache["eval"] if ref is None else logps_all(ref, held)
            out.update(preference_metrics(*pol, *ref_lp, algo, prefix="eval/"))
            if step == 0:  # how often the reference itself already ranks the pair right
                out["eval/ref_logp_accuracy"] = float((ref_lp[0] > ref_lp[1]).float().mean())
            log.info("eval @ step %d: held-out preference accuracy %.3f, margin %.4f (chosen %.4f, rejected %.4f), "
                     "loss %.4f on %d pairs", step, out["eval/rewards/accuracy"], out["eval/rewards/margins"],
                     out["eval/rewards/chosen"], out["eval/rewards/rejected"], out["eval/loss"], len(held))
        if gen_eval:
            out.update(held_out_accuracy(trainer.colo, tokenizer, held, trainer.scorer,
                                         cfg.rollout.eval_max_new_tokens, step))
        return out

    def step_fn(indices: list[int]) -> dict:
        return train_step(cfg, actor, ref, [train[i] for i in indices], indices, cache.get("train"), pad, average,
                          ctx.dtype)

    # ---- the loop: resume or evaluate the starting model, steps, evaluations, checkpoints
    result = run_offline_loop("DPO", cfg, plan, trainer, sampler, ckpt, metrics, step_fn, run_eval, len(train),
                              start_metrics=timer.pop())  # time/ref_precompute
    if result.stopped_by:
        metrics.close()
        runtime.finish()
        sys.exit(result.exit_code)
    first_eval, last_eval = result.first_eval, result.last_eval

    # ---- outputs: HF checkpoint, curves, summary
    with trainer.update_phase():
        final = export_hf(actor, tokenizer, run_dir / "checkpoint-final")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if cfg.plots:
        plot_curves(rows, run_dir / "loss_curve.png",
                    [("DPO loss", ["train/loss", "eval/loss"]),
                     ("reward margin (chosen - rejected)", ["rewards/margins", "eval/rewards/margins"]),
                     ("preference accuracy", ["rewards/accuracy", "eval/rewards/accuracy"]),
                     ("implicit rewards", ["rewards/chosen", "rewards/rejected", "eval/rewards/chosen",
                                           "eval/rewards/rejected"])], f"DPO ({algo.dpo_loss}) {run_dir.name}")
    summary = {"recipe": "dpo", "loss": algo.dpo_loss, "beta": algo.beta, "steps": plan.total_steps,
               "train_pairs": len(train), "held_out_pairs": len(held), "resumed_at_step": result.start_step,
               "overlong": vars(length_stats) | {"dropped_origins": length_stats.dropped_origins[:10]},
               "start": first_eval, "end": last_eval, "checkpoint": str(final),
               "seconds": time.perf_counter() - t_start}
    if dist.is_rank0():
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    metrics.close()
    if held and "eval/rewards/accuracy" in first_eval:
        log.info("held-out preference accuracy %.3f -> %.3f, margin %.4f -> %.4f (%d pairs)",
                 first_eval["eval/rewards/accuracy"], last_eval["eval/rewards/accuracy"],
                 first_eval["eval/rewards/margins"], last_eval["eval/rewards/margins"], len(held))
    log.info("done in %.0fs: %s (next: recipes/grpo.py model.path=%s)", summary["seconds"], run_dir, final)
    runtime.finish()


def preference_metrics(pol_c, pol_r, ref_c, ref_r, algo, prefix: str = "") -> dict[str, float]:
    """Mean loss, implicit rewards beta (log pi - log ref) of chosen / rejected, their margin, and
    the share of pairs ranked right (chosen reward > rejected reward)."""
    losses, rc, rr = algos.dpo_loss(pol_c, pol_r, ref_c, ref_r, algo.beta, algo.dpo_loss, algo.label_smoothing)
    return {f"{prefix}loss": float(losses.mean()), f"{prefix}rewards/chosen": float(rc.mean()),
            f"{prefix}rewards/rejected": float(rr.mean()), f"{prefix}rewards/margins": float((rc - rr).mean()),
            f"{prefix}rewards/accuracy": float((rc > rr).float().mean()),
            f"{prefix}logps/chosen": float(pol_c.mean()), f"{prefix}logps/rejected": float(pol_r.mean())}


def train_step(cfg, actor, ref, pairs: list, gidx: list[int], cached, pad_id: int, average: bool,
               dtype: torch.dtype) -> dict[str, float]:
    """One optimizer step over this rank's pairs; the loss is the sum of per-pair losses divided by
    the number of pairs on all ranks."""
    algo, n_pairs = cfg.algo, float(cfg.trainer.batch_size)
    batches, _ = equalise(pair_micro_batches(pairs, cfg.trainer.micro_batch_size, pad_id, algo.packing, dtype),
                          pad_id,
                          make=lambda: ([], empty_batch(pad_id)))
    keys = ("loss", "chosen", "rejected", "correct", "logp_chosen", "logp_rejected", "pairs")
    sums = dict.fromkeys(keys, 0.0)
    for j, (idx, batch) in enumerate(batches):
        logp, _ = actor.response_logprobs(batch)
        ref_logp = ref.response_logprobs(batch, grad=False)[0] if ref is not None else None  # every rank: collectives
        if not idx:  # an empty micro-batch (this rank ran out): joins the collectives, adds zero
            actor.backward(logp.sum() * 0.0, last_micro_batch=j == len(batches) - 1)
            continue
        pol_c, pol_r = split_pair_logps(logp, batch, average)
        if ref_logp is None:
            ref_c, ref_r = (t[[gidx[i] for i in idx]].to(pol_c.device) for t in cached)
        else:
            ref_c, ref_r = split_pair_logps(ref_logp, batch, average)
        losses, rc, rr = algos.dpo_loss(pol_c, pol_r, ref_c, ref_r, algo.beta, algo.dpo_loss, algo.label_smoothing)
        actor.backward(losses.sum() / n_pairs, last_micro_batch=j == len(batches) - 1)
        for k, v in (("loss", losses.detach()), ("chosen", rc), ("rejected", rr), ("correct", (rc > rr).float()),
                     ("logp_chosen", pol_c.detach()), ("logp_rejected", pol_r.detach())):
            sums[k] += float(v.sum())
        sums["pairs"] += len(idx)
    stats = actor.step()
    totals = dict(zip(keys, dist.all_reduce_sum([sums[k] for k in keys])))
    n = max(totals["pairs"], 1.0)
    return {"train/loss": totals["loss"] / n, "rewards/chosen": totals["chosen"] / n,
            "rewards/rejected": totals["rejected"] / n, "rewards/margins": (totals["chosen"] - totals["rejected"]) / n,
            "rewards/accuracy": totals["correct"] / n, "logps/chosen": totals["logp_chosen"] / n,
            "logps/rejected": totals["logp_rejected"] / n, "train/grad_norm": stats["grad_norm"],
            "train/lr": stats["lr"]}


if __name__ == "__main__":
    main()
