"""One rollout's RL update (recipes/grpo.py's update phase): the rollout's groups packed into
micro-batches of whole groups, then trainer.ppo_epochs x trainer.mini_batches_per_step optimizer
steps of `algos.rl_loss`, its statistics summed on the device and read once.

    packed = pack_update_batches(rollout, cfg, actor, pad_token_id)
    metrics = rl_update(packed, rollout, cfg, actor, ref, kl_ctl, timer, agreement)

The loss does not depend on how a step is cut into micro-batches: every micro-batch's loss is
normalised by the mini-batch's global token / sequence counts (all ranks), and every rank runs as
many micro-batches (the collectives line up). tests/test_micro_batches.py holds it to that.
"""

from __future__ import annotations

from typing import Optional

import torch

from colo_rl import algos, dist
from colo_rl.metrics import StepSums, Timer
from colo_rl.samples import Rollout
from colo_rl.train.batch import agreed_mini_batches
from colo_rl.train.packing import PackedRollout, pack_rollout


def pack_update_batches(rollout: Rollout, cfg, actor, pad_token_id: int) -> PackedRollout:
    """The rollout's micro-batches, built once for the whole update: trainer.mini_batches_per_step
    mini-batches of as many groups each, in a seeded shuffle of the rollout (a sample of the batch,
    not a band of lengths); each cut into micro-batches of whole groups, at most trainer.micro_batch_tokens
    tokens (and trainer.micro_batch_size sequences) each, groups of similar length together, as
    many on every rank."""
    groups = rollout.groups
    cap = cfg.trainer.micro_batch_size and max(1, cfg.trainer.micro_batch_size // rollout.group_size)
    plan = agreed_mini_batches([g.tokens for g in groups], actor.micro_batch_tokens(), cap,
                               order=[sum(c.trained_tokens for c in g.completions) for g in groups],
                               mini_batches=cfg.trainer.mini_batches_per_step,
                               seed=cfg.trainer.seed * 1_000_003 + rollout.policy_version * 1_009 + dist.rank())
    return pack_rollout(rollout, plan, pad_token_id, actor.dtype, cfg.trainer.packing)


def rl_update(packed: PackedRollout, rollout: Rollout, cfg, actor, ref, kl_ctl: algos.AdaptiveKLController,
              timer: Timer, agreement: Optional[object] = None) -> dict[str, float]:
    """trainer.ppo_epochs x trainer.mini_batches_per_step optimizer steps on one packed rollout;
    losses normalised by global token / sequence counts (all ranks). `agreement` (a
    colocate.handoff.LogprobAgreement, or None for a stale rollout): the engine-vs-trainer log-prob
    check on the weights that generated the rollout, made before the first weight change (a stale
    rollout's log-probs are the behaviour policy's: the loss's rollout correction weighs them,
    decoupled PPO). Returns the step's train/ metrics; `kl_ctl` adapts when the KL goes in the reward."""
    algo = cfg.algo
    plan, table = packed.rows, packed.table
    on_policy = cfg.trainer.mini_batches_per_step == 1 and cfg.trainer.ppo_epochs == 1
    with timer("logprobs"):
        if not on_policy:  # pi_old: the weights before this batch's first optimizer step
            packed.attach("old_logp", packed.logprobs(actor, cfg.rollout.temperature, agreement))
        kl_penalty = None
        if ref is not None:
            ref_logp = packed.logprobs(ref, cfg.rollout.temperature)
            packed.attach("ref_logp", ref_logp)
            if algos.kl_goes_in_reward(algo):  # k1 on the sampled tokens, pi_old = the engine's
                kl_penalty = kl_ctl.coef * (table.extras["rollout_logp"] - ref_logp)
        packed.attach("advantages", algos.ADV_ESTIMATORS.get(algo.adv_estimator)(
            rollout.total(), rollout.group_size, algo, table.response_mask, kl_penalty))
    # summed on the device (no sync per micro-batch), read once after the loop; + the policy loss's own
    # statistics (token means) and the engine-vs-trainer mismatch sums
    sums = StepSums(["loss", "entropy", "kl", "tokens"], maxima=[f"mismatch:{k}" for k in algos.MISMATCH_MAX_KEYS])
    want_entropy = algo.entropy_coef > 0 or algo.log_entropy  # in the loss, or train/entropy
    step_stats: dict[str, float] = {}
    grad_norms: list[float] = []  # every optimizer step's: several per step with mini-batches or PPO epochs
    handoff_stats: dict[str, float] = {}  # the engine-vs-trainer check, kept past later optimizer steps
    skipped = 0.0  # optimizer steps skipped for a non-finite loss / gradient (all ranks agree)
    with timer("update"):
        for epoch in range(cfg.trainer.ppo_epochs):
            for k, span in enumerate(packed.steps):  # as many micro-batches on every rank: collectives
                chunk = packed.micro[span]
                rows = [i for idx in plan[span] for i in idx]
                n_tok, n_seq = dist.all_reduce_sum([float(table.response_mask[rows].sum()) if rows else 0.0,
                                                    float(algos.loss_sequences(table.response_mask[rows]))])
                for j, mb in enumerate(chunk):
                    m_tok = float(mb.response_mask.sum())  # the host copy's: no sync
                    mb = actor.to_device(mb)  # pinned, non-blocking on a GPU
                    logp, entropy = actor.response_logprobs(mb, cfg.rollout.temperature, with_entropy=want_entropy,
                                                            entropy_grad=algo.entropy_coef > 0)
                    if on_policy and agreement is not None:
                        agreement.add(mb.extras["rollout_logp"], logp, mb.response_mask)
                    old = logp.detach() if on_policy else mb.extras["old_logp"]
                    loss, stats = algos.rl_loss(
                        logp, old, mb.extras["advantages"], mb.response_mask, algo,
                        rollout_logp=mb.extras["rollout_logp"],
                        ref_logp=mb.extras["ref_logp"] if ref is not None else None,
                        num_tokens=n_tok, num_seqs=n_seq, entropy=entropy)
                    actor.backward(loss, last_micro_batch=j == len(chunk) - 1)
                    sums.add(loss=loss, kl=stats.pop("kl_sum", 0.0), tokens=m_tok,
                             entropy=(entropy.detach() * mb.response_mask).sum() if entropy is not None else 0.0)
                    sums.add(stats.pop("mismatch"), prefix="mismatch:")
                    # clip_frac, dual_clip_frac, ratio_mean, ...: token means, weighed by the tokens
                    sums.add({key: value * m_tok for key, value in stats.items()})
                step_stats = actor.step()
                grad_norms.append(step_stats["grad_norm"])
                skipped += step_stats["skipped"]
                if epoch == 0 and k == 0 and agreement is not None:  # before any weight change: the same weights
                    handoff_stats = agreement.check(cfg.colocate.handoff_check_max_mean_abs)
        # the statistics' one device-to-host transfer; timed with the update: it waits for the
        # device's queued work (the last backward, the optimizer step)
        totals = sums.totals()
    mismatch = {k.split(":", 1)[1]: totals.pop(k) for k in list(totals) if k.startswith("mismatch:")}
    loss_sum, ent_sum, kl_sum, tok = (totals.pop(k) for k in ("loss", "entropy", "kl", "tokens"))
    n_steps = cfg.trainer.mini_batches_per_step * cfg.trainer.ppo_epochs
    passes = cfg.trainer.ppo_epochs  # every token is seen once per epoch
    out = {"train/loss": loss_sum / n_steps, **{f"train/{k}": v / max(tok, 1) for k, v in totals.items()},
           **({"train/entropy": ent_sum / max(tok, 1)} if want_entropy else {}),
           # a non-finite norm (a skipped step) shows in both; max() alone would drop a NaN by position
           "train/grad_norm": sum(grad_norms) / len(grad_norms),
           "train/grad_norm_max": float(torch.tensor(grad_norms, dtype=torch.float64).max()),
           "train/lr": step_stats["lr"], "throughput/train_tokens": tok / passes, "train/skipped_steps": skipped,
           "train/micro_batches": float(len(plan)),
           "train/skipped_steps_total": float(actor.nonfinite_total),
           **handoff_stats, **algos.mismatch_metrics(mismatch)}
    if ref is not None:
        out["train/kl"] = kl_sum / max(tok, 1)
        if algos.kl_goes_in_reward(algo):
            seq_kl = algos.sequence_mean_kl(table.extras["rollout_logp"] - ref_logp,
                                            table.response_mask)  # the k1 in the reward, per token
            seq_kl_sum, n_seq_total = dist.all_reduce_sum([float(seq_kl.sum()), float(len(rollout))])
            out["train/kl_in_reward_coef"] = kl_ctl.coef
            kl_ctl.update(seq_kl_sum / max(n_seq_total, 1.0), int(n_seq_total))
    return out
