"""GRPO, colocated: every rank generates with its engine, then trains with DeepSpeed ZeRO.

    torchrun --standalone --nproc_per_node=2 recipes/grpo.py                 # embedded default
    torchrun --nproc_per_node=8 recipes/grpo.py model.path=/models/x rollout.engine=sglang

One step:
    [generation phase] hand off weights -> sample group_size completions per prompt
    rewards (verifier) -> group-normalised advantages
    [update phase] log-probs (+ reference) -> clipped policy loss -> optimizer step
"""

from __future__ import annotations

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
from colo_rl.colocate.handoff import LogprobAgreement  # noqa: E402
from colo_rl.colocate.setup import build_colocated  # noqa: E402
from colo_rl.config import ConfigError, register_configs  # noqa: E402
from colo_rl.data import PromptBuilder, load_problems  # noqa: E402
from colo_rl.data.sampler import EpochSampler  # noqa: E402
from colo_rl.evaluation import evaluate  # noqa: E402
from colo_rl.metrics import MetricsLogger, Progress, Timer, plot_curves, read_jsonl  # noqa: E402
from colo_rl.models import load_tokenizer  # noqa: E402
from colo_rl.rewards import RewardScorer  # noqa: E402
from colo_rl.rollout.base import SamplingParams  # noqa: E402
from colo_rl.train.batch import build_batch, group_micro_batches, micro_batches, pack_groups  # noqa: E402

log = logging.getLogger("colo_rl")
register_configs()

CONSOLE = ["reward/mean", "reward/accuracy", "response/len_mean", "train/clip_frac", "train/grad_norm",
           "handoff/logprob_diff_mean", "time/step", "eval/accuracy"]


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    t_start = time.perf_counter()
    ctx = runtime.start(hydra_cfg, recipe="grpo")
    cfg, run_dir = ctx.cfg, ctx.run_dir
    world = dist.world_size()
    ckpt = ctx.ckpt  # resume=auto|<dir> resolved; a config that changes its meaning was refused
    stop = dist.StopSignal()  # SIGINT / SIGTERM: every rank stops after the current step, with a checkpoint

    # ---- data: prompts tokenised once; over-length ones dropped or cut by policy (and counted)
    tokenizer = load_tokenizer(cfg.model.path)
    train_problems, eval_problems = load_problems(cfg.data)
    builder = PromptBuilder(tokenizer, cfg.data)
    train = [(p, ids) for p in train_problems if (ids := builder.encode(p)) is not None]
    eval_set = [(p, ids) for p in eval_problems if (ids := builder.encode(p)) is not None]
    log.info("data: %d train / %d held-out prompts (%d over-length dropped, %d truncated)",
             len(train), len(eval_set), builder.stats.dropped, builder.stats.truncated)
    sampler = EpochSampler(len(train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)

    # ---- shapes: each rank owns prompts_per_step / world prompts and their whole groups
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                          f"number of ranks ({world})")
    prompts_per_rank = cfg.rollout.prompts_per_step // world
    n_micro = len(split_micro_batches(cfg, [0.0] * (prompts_per_rank * cfg.rollout.group_size)))
    if n_micro % cfg.trainer.mini_batches_per_step:
        raise ConfigError(f"trainer.mini_batches_per_step={cfg.trainer.mini_batches_per_step} must divide the "
                          f"{n_micro} micro-batches per rank")

    # ---- the colocated pieces: DeepSpeed actor (+ reference), rollout engine, phase switcher
    colo = build_colocated(cfg, tokenizer, ctx.dtype, run_dir, total_steps=cfg.trainer.total_steps,
                           grad_accum=n_micro // cfg.trainer.mini_batches_per_step)
    scorer = RewardScorer(cfg.reward)
    metrics = MetricsLogger(run_dir, cfg.tensorboard, CONSOLE)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, n=cfg.rollout.group_size)

    def run_eval(step: int) -> dict:
        if not eval_set:  # data.eval_size=0: no held-out problems, nothing to report
            return {}
        result = evaluate(colo.engine, tokenizer, [ids for _, ids in eval_set], [p.answer for p, _ in eval_set],
                          scorer, cfg.rollout.eval_max_new_tokens)
        samples = result.pop("eval/samples")
        log.info("eval @ step %d: accuracy %.3f (lenient %.3f, format %.3f) on %d held-out problems; e.g. %r",
                 step, result["eval/accuracy"], result["eval/accuracy_lenient"], result["eval/format_rate"],
                 int(result["eval/count"]), samples[0]["completion"][:120] if samples else "")
        return result

    with colo.switch.update():  # DeepSpeed state, data position, RNGs (the engine's sampling RNG too)
        start_step = ckpt.maybe_resume(colo.actor, sampler, colo.engine)
    if start_step == 0:
        with colo.switch.generation():  # step-0 evaluation of the starting model
            metrics.log(0, {**run_eval(0), "data/overlong_dropped": builder.stats.dropped,
                            "data/overlong_truncated": builder.stats.truncated}, console=False)
    progress = Progress(cfg.trainer.total_steps, "GRPO", start=start_step)
    timer = Timer()
    eval_every = cfg.trainer.eval_every or cfg.trainer.total_steps
    stopped_by = None
    for step in range(start_step, cfg.trainer.total_steps):
        colo.switch.step = step
        colo.switch.reset_timers()
        step_metrics: dict[str, float] = {}
        with timer("step"):
            # ================= generation phase =================
            with colo.switch.generation():
                batch_problems = [train[i] for i in sampler.next_local(cfg.rollout.prompts_per_step)]
                with timer("generation"):
                    completions = colo.engine.generate([ids for _, ids in batch_problems], sampling)

            # ================= rewards and advantages (CPU verifiers) =================
            with timer("reward"):
                texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
                answers = [p.answer for p, _ in batch_problems for _ in range(cfg.rollout.group_size)]
                scored = scorer.score(texts, answers)
                rewards = torch.tensor(scored.rewards)
                advantages = algos.group_advantages(rewards, cfg.rollout.group_size, cfg.algo.scale_by_std)
                batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions],
                                    tokenizer.pad_token_id, per_token={"rollout_logp": [c.logprobs for c in completions]},
                                    per_row={"advantages": advantages.tolist()})

            # ================= update phase =================
            with colo.switch.update():
                step_metrics.update(train_on_batch(cfg, colo, batch, completions, n_micro, timer))

        # ---- metrics for the step (reduced over ranks)
        n_gen_tokens = sum(len(c.token_ids) for c in completions)
        r_sum, r_sq, n, acc, acc_len, fmt, gen_tok, n_stop, fails = dist.all_reduce_sum([
            float(rewards.sum()), float((rewards ** 2).sum()), float(len(rewards)), sum(scored.correct),
            sum(scored.correct_lenient), sum(scored.formatted), n_gen_tokens,
            sum(c.finish_reason == "stop" for c in completions), scored.failures])
        times = timer.pop()
        times.update(colo.switch.timed_phase_seconds())
        step_metrics.update({
            "reward/mean": r_sum / n, "reward/std": max(0.0, r_sq / n - (r_sum / n) ** 2) ** 0.5,
            "reward/accuracy": acc / n, "reward/accuracy_lenient": acc_len / n, "reward/format_rate": fmt / n,
            "reward/failures": fails, "response/len_mean": gen_tok / n, "response/stop_rate": n_stop / n,
            "throughput/gen_tokens_per_s": gen_tok / max(times.get("time/generation", 1e-9), 1e-9),
            **times,
        })
        if (step + 1) % eval_every == 0 or step + 1 == cfg.trainer.total_steps:
            with colo.switch.generation():  # the final weights go to the engine for evaluation
                with timer("eval"):
                    step_metrics.update(run_eval(step + 1))
                step_metrics.update(timer.pop())
        metrics.log(step + 1, step_metrics)
        progress.advance()
        stopped_by = stop.requested()  # collective: all ranks stop after the same step
        if ckpt.due(step + 1) or stopped_by:
            with colo.switch.update():
                ckpt.save(step + 1, colo.actor, sampler, colo.engine)
        if stopped_by:
            break
    progress.close()
    if stopped_by:
        log.warning("stopped by %s after step %d; continue with resume=auto run_dir=%s", stopped_by, step + 1, run_dir)
        metrics.close()
        runtime.finish()
        sys.exit(stop.exit_code(stopped_by))

    # ---- outputs: final checkpoint (resumable) and HF model, plots
    with colo.switch.update():
        ckpt.save(cfg.trainer.total_steps, colo.actor, sampler, colo.engine)
        export_hf(colo.actor, tokenizer, run_dir / "checkpoint-final")
    if cfg.plots:
        plot_curves(read_jsonl(run_dir / "metrics.jsonl"), run_dir / "reward_curve.png",
                    [("reward", ["reward/mean", "reward/accuracy"]),
                     ("held-out accuracy (greedy)", ["eval/accuracy", "eval/accuracy_lenient"]),
                     ("seconds per step", ["time/generation", "time/update", "time/handoff", "time/phase_switch"])],
                    f"GRPO {run_dir.name}")
    metrics.close()
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    if len(evals) >= 2:
        first, last = evals[0], evals[-1]
        log.info("held-out accuracy (greedy, %d problems): step %d %.3f -> step %d %.3f (%+.1f points); "
                 "lenient %.3f -> %.3f", int(last["eval/count"]), first["step"], first["eval/accuracy"],
                 last["step"], last["eval/accuracy"], 100 * (last["eval/accuracy"] - first["eval/accuracy"]),
                 first["eval/accuracy_lenient"], last["eval/accuracy_lenient"])
    log.info("done in %.1f min: %s", (time.perf_counter() - t_start) / 60, run_dir)
    runtime.finish()


def split_micro_batches(cfg, lengths: list[float]) -> list[list[int]]:
    """This rank's rows (response lengths given) as micro-batches: whole packed groups, or padded
    micro-batches of trainer.micro_batch_size sequences. Also sizes the run at start-up."""
    if cfg.trainer.pack_groups:
        return group_micro_batches(lengths, cfg.rollout.group_size, cfg.trainer.micro_batch_size)
    return micro_batches(len(lengths), cfg.trainer.micro_batch_size, lengths)


def train_on_batch(cfg, colo, batch, completions, n_micro: int, timer: Timer) -> dict[str, float]:
    """Policy-gradient update on one rollout batch: mini_batches_per_step optimizer steps over
    n_micro micro-batches; losses normalised by global token / sequence counts (all ranks)."""
    actor, ref, algo = colo.actor, colo.ref, cfg.algo
    temp = cfg.rollout.temperature
    G = cfg.rollout.group_size
    mbs = split_micro_batches(cfg, batch.response_mask.sum(-1).tolist())
    assert len(mbs) == n_micro, (len(mbs), n_micro)  # equal on every rank: ZeRO-3 gathers are collectives

    def select(idx: list[int]):
        """A micro-batch built when used: it carries the batch's extras as they are at that moment
        (old_logp / ref_logp are added after the first pass)."""
        if not cfg.trainer.pack_groups:
            return batch.select(idx)
        groups = [idx[k:k + G] for k in range(0, len(idx), G)]  # one row per group, its prompt computed once
        return pack_groups([(completions[g[0]].prompt_ids, [completions[i].token_ids for i in g], batch.select(g))
                            for g in groups], actor.dtype)

    on_policy = cfg.trainer.mini_batches_per_step == 1
    agreement = LogprobAgreement()
    with timer("logprobs"):
        if not on_policy:  # pi_old: the weights before this batch's first optimizer step
            batch.extras["old_logp"] = torch.zeros_like(batch.extras["rollout_logp"])
            for idx in mbs:
                mb = select(idx)
                old, _ = actor.response_logprobs(mb, temp, grad=False)
                agreement.add(mb.extras["rollout_logp"], old, mb.response_mask)
                batch.extras["old_logp"][idx, :old.shape[1]] = old
        if ref is not None:
            batch.extras["ref_logp"] = torch.zeros_like(batch.extras["rollout_logp"])
            for idx in mbs:
                mb = select(idx)
                ref_lp, _ = ref.response_logprobs(mb, temp, grad=False)
                batch.extras["ref_logp"][idx, :ref_lp.shape[1]] = ref_lp
    per_step = len(mbs) // cfg.trainer.mini_batches_per_step
    sums = {"loss": 0.0, "clip_frac": 0.0, "entropy": 0.0, "kl": 0.0, "tokens": 0.0}
    step_stats: dict[str, float] = {}
    skipped = 0.0  # optimizer steps skipped for a non-finite loss / gradient (all ranks agree)
    with timer("update"):
        for k in range(cfg.trainer.mini_batches_per_step):
            group = mbs[k * per_step:(k + 1) * per_step]
            rows = [i for idx in group for i in idx]
            n_tok, n_seq = dist.all_reduce_sum([float(batch.response_mask[rows].sum()) if rows else 0.0,
                                                float(len(rows))])
            for j, idx in enumerate(group):
                last = j == len(group) - 1
                mb = select(idx)
                logp, entropy = actor.response_logprobs(mb, temp, with_entropy=True)
                old = logp.detach() if on_policy else mb.extras["old_logp"]
                if on_policy:
                    agreement.add(mb.extras["rollout_logp"], old, mb.response_mask)
                is_w = algos.truncated_is_weights(old, mb.extras["rollout_logp"], algo.tis_cap) if algo.tis_cap else None
                loss, stats = algos.policy_loss(logp, old, mb.extras["advantages"], mb.response_mask, algo.clip_low,
                                                algo.clip_high, algo.loss_agg, is_w, num_tokens=n_tok, num_seqs=n_seq)
                if ref is not None:
                    kl = algos.kl_penalty(logp, mb.extras["ref_logp"], algo.kl_estimator)
                    loss = loss + algo.kl_coef * algos.aggregate_loss(kl, mb.response_mask, algo.loss_agg,
                                                                      n_tok, n_seq)
                    sums["kl"] += float((kl.detach() * mb.response_mask).sum())
                actor.backward(loss, last)
                m_tok = float(mb.response_mask.sum())
                sums["loss"] += float(loss.detach())
                sums["clip_frac"] += float(stats["clip_frac"]) * m_tok
                sums["entropy"] += float((entropy * mb.response_mask).sum())
                sums["tokens"] += m_tok
            step_stats = actor.step()
            skipped += step_stats["skipped"]
            if k == 0:  # before any weight change: engine and trainer saw the same weights
                step_stats.update(agreement.check(cfg.rollout.handoff_check_max_mean_abs))
    loss_sum, clip_sum, ent_sum, kl_sum, tok = dist.all_reduce_sum(
        [sums["loss"], sums["clip_frac"], sums["entropy"], sums["kl"], sums["tokens"]])
    out = {"train/loss": loss_sum / cfg.trainer.mini_batches_per_step, "train/clip_frac": clip_sum / max(tok, 1),
           "train/entropy": ent_sum / max(tok, 1), "train/grad_norm": step_stats["grad_norm"],
           "train/lr": step_stats["lr"], "throughput/train_tokens": tok, "train/skipped_steps": skipped,
           "train/skipped_steps_total": float(actor.nonfinite_total),
           **{k: v for k, v in step_stats.items() if k.startswith("handoff/")}}
    if ref is not None:
        out["train/kl"] = kl_sum / max(tok, 1)
    return out


if __name__ == "__main__":
    main()
