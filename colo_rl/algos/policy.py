"""Policy losses (PPO-clip with dual-clip, GSPO, CISPO), KL estimators, truncated IS, and `rl_loss`.

Shapes: B sequences, T response tokens; `mask` [B, T] is 1 on generated tokens. Advantages are
[B] (broadcast over tokens) or [B, T]. Registered losses take
`(logp, old_logp, advantages, mask, algo, is_weights, num_tokens, num_seqs)` and return
`(loss, stats)`; the stats are detached token means over the mask.
"""

from __future__ import annotations

import torch

from colo_rl.algos.advantages import kl_goes_in_reward
from colo_rl.algos.core import KL_ESTIMATORS, POLICY_LOSSES, aggregate_loss, masked, masked_mean
from colo_rl.algos.correction import Correction, mismatch_sums, rollout_correction

# |k3| larger than this is a broken policy, not information: bounded so one token cannot swamp the loss.
K3_BOUND = 10.0
# GSPO's sequence log-ratio above this is a broken sample: clamped, no gradient above (as verl).
GSPO_LOG_RATIO_MAX = 10.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = -d = log pi - log pi_ref: unbiased, high variance, can be negative."""
    return logp.float() - ref_logp.float()


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2: biased, low variance."""
    return 0.5 * (ref_logp.float() - logp.float()).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 (unbiased, low variance, >= 0), bounded to [-K3_BOUND, K3_BOUND] as verl's
    low_var_kl is: one token the policy has moved far from the reference cannot dominate the loss."""
    d = (ref_logp.float() - logp.float()).clamp(-20, 20)  # exp overflow guard
    return (torch.exp(d) - d - 1).clamp(-K3_BOUND, K3_BOUND)


@KL_ESTIMATORS.register("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|d| = |log pi - log pi_ref| (verl's `abs`): biased, >= 0."""
    return (logp.float() - ref_logp.float()).abs()


KL_ESTIMATORS.register("low_var_kl")(kl_k3)  # verl's name for the bounded k3


def _straight_through_k2(estimator):
    """value of `estimator`, gradient of k2: value + (k2 - sg[k2]) - sg[...]. The sampled k1 and k3 have
    the KL as expectation but not its gradient; k2's gradient, (log pi - log pi_ref) grad log pi, is
    the KL's gradient in expectation (Schulman; verl's `+` suffix)."""

    def st(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logp, ref_logp)
        return estimator(logp, ref_logp).detach() + k2 - k2.detach()

    st.__doc__ = f"{estimator.__name__}'s value with k2's gradient (straight-through)."
    return st


kl_k1_plus = KL_ESTIMATORS.register("k1+")(_straight_through_k2(kl_k1))
kl_k3_plus = KL_ESTIMATORS.register("k3+")(_straight_through_k2(kl_k3))
KL_ESTIMATORS.register("low_var_kl+")(kl_k3_plus)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With d = log pi_ref - log pi:
        k1 = -d                    (unbiased, high variance, can be negative)
        k2 = d^2 / 2               (biased, low variance; its gradient is the KL's)
        k3 = exp(d) - d - 1        (unbiased, low variance, >= 0; bounded, see kl_k3); low_var_kl = k3
        abs = |d|
        k1+, k3+ (= low_var_kl+): k1's / k3's value with k2's gradient (straight-through)
    """
    return KL_ESTIMATORS.get(estimator)(logp, ref_logp)


def _broadcast(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.float().unsqueeze(-1) if advantages.dim() == 1 else advantages.float()


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, loss_agg: str = "token-mean",
                is_weights: torch.Tensor | None = None, num_tokens: float | None = None,
                num_seqs: float | None = None, clip_ratio_c: float | None = None, loss_scale: float | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate (PPO/GRPO) with separate low / high clip ranges, and dual-clip.

        r_t  = exp(log pi(a_t) - log pi_old(a_t))
        l_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A) * w_t
        dual-clip (Ye et al. 2020), for A < 0 only:  l_t = min(l_t, -c A)      (c = clip_ratio_c > 1)

    Dual-clip bounds the loss of a negative-advantage token whose ratio has grown very large (the
    plain clip leaves -r A unbounded there). w_t are optional rollout-correction weights (keep_t *
    w_t of colo_rl/algos/correction.py: TIS, masked IS, IcePop), 1 otherwise. Stats: clip fraction, dual-clip fraction, approx KL to
    pi_old, mean ratio.
    """
    adv = _broadcast(advantages)
    log_ratio = (logp.float() - old_logp.float()).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss_mat = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(loss_mat, dtype=torch.bool)
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1:
            raise ValueError(f"algo.clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip's lower bound on A < 0 tokens)")
        bound = -clip_ratio_c * adv
        dual = (adv < 0) & (loss_mat > bound)
        loss_mat = torch.where(adv < 0, torch.minimum(loss_mat, bound), loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, loss_agg, num_tokens, num_seqs, loss_scale)
    with torch.no_grad():
        m = mask.float()
        stats = {
            "clip_frac": masked_mean((clipped < unclipped).float(), m),
            "dual_clip_frac": masked_mean(dual.float(), m),
            "approx_kl_old": masked_mean(0.5 * log_ratio.square(), m),
            "ratio_mean": masked_mean(ratio, m),
        }
    return loss, stats


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logp, old_logp, advantages, mask, algo, is_weights=None, num_tokens=None, num_seqs=None):
    """The clipped surrogate (`policy_loss`) with the algo's clip range, dual-clip and aggregation."""
    return policy_loss(logp, old_logp, advantages, mask, algo.clip_low, algo.clip_high, algo.loss_agg, is_weights,
                       num_tokens, num_seqs, algo.clip_ratio_c, algo.loss_scale_factor)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp, old_logp, advantages, mask, algo, is_weights=None, num_tokens=None, num_seqs=None):
    """GSPO (Zheng et al. 2025): a sequence-level, length-normalised importance ratio, clipped per sequence.

        s_i   = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp( mean_t (log pi - log pi_old) )
        s_i,t = sg[s_i] * pi(a_t) / sg[pi(a_t)]          (value s_i; gradient s_i grad log pi(a_t))
        l_i,t = -min(s_i,t A_i, clip(s_i,t, 1 - clip_low, 1 + clip_high) A_i)

    The paper's objective averages per sequence: use algo.loss_agg=seq-mean-token-mean, and clip
    ranges of the paper's order (3e-4 / 4e-4), not PPO's 0.2. Sequence-level advantages only.
    log s_i,t is clamped at GSPO_LOG_RATIO_MAX = 10 with zero gradient above (verl's choice): a
    sequence whose ratio exceeds e^10 is a broken sample; its unclipped branch (A < 0) then has
    value e^10 |A| and no gradient. No lower clamp: exp of a very negative log-ratio is 0, finite.
    algo.clip_ratio_c (dual-clip) does not apply (refused at start-up).
    """
    m = mask.float()
    adv = _broadcast(advantages)
    log_ratio = masked(logp.float() - old_logp.float(), m)
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logp.float() - logp.float().detach()
    ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * adv
    loss_mat = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, algo.loss_agg, num_tokens, num_seqs, algo.loss_scale_factor)
    with torch.no_grad():
        stats = {"clip_frac": masked_mean((clipped < unclipped).float(), m),
                 # weighed by the sequence's tokens: the update sums token means over micro-batches,
                 # so a plain mean over rows (empty ones too) would move with the split
                 "seq_ratio_mean": masked_mean(torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(m), m)}
    return loss, stats


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp, old_logp, advantages, mask, algo, is_weights=None, num_tokens=None, num_seqs=None):
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update; every token keeps a gradient.

        l_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A * log pi(a_t)

    algo.clip_ratio_c (dual-clip) does not apply (refused at start-up).
    """
    adv = _broadcast(advantages)
    ratio = torch.exp((logp.float() - old_logp.float()).clamp(-20, 20))
    weight = ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high).detach()
    loss_mat = -weight * adv * logp.float()
    if is_weights is not None:
        loss_mat = loss_mat * is_weights.detach()
    loss = aggregate_loss(loss_mat, mask, algo.loss_agg, num_tokens, num_seqs, algo.loss_scale_factor)
    with torch.no_grad():
        m = mask.float()
        stats = {"clip_frac": masked_mean((ratio != weight).float(), m), "ratio_mean": masked_mean(ratio, m)}
    return loss, stats


def correction_of(algo) -> tuple[str, float, float | None] | None:
    """The run's rollout correction (name, C, c), or None: algo.tis_cap is tis_token with C = tis_cap."""
    if algo.tis_cap:
        return "tis_token", algo.tis_cap, None
    if algo.rollout_correction:
        return algo.rollout_correction, algo.rollout_is_threshold, algo.rollout_is_threshold_lower
    return None


def rl_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, algo,
            rollout_logp: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
            num_tokens: float | None = None, num_seqs: float | None = None,
            entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The GRPO-family loss of one micro-batch:

        L = policy_loss(pi, pi_old, A; w, keep) + kl_coef * agg_t KL_est(pi || pi_ref) - entropy_coef * agg_t H_t
        (w, keep) = rollout correction of rho_t = pi_old(a_t) / pi_rollout(a_t)   (algo.rollout_correction,
                    or algo.tis_cap: w_t = min(rho_t, tis_cap); colo_rl/algos/correction.py)

    `algo` names the registered policy loss, KL estimator, aggregation and correction (an
    AlgoConfig). The KL term needs `ref_logp` and algo.kl_coef > 0, and is left out when the KL
    goes into the reward (`kl_goes_in_reward`: algo.kl_in_reward, or REINFORCE++); the entropy
    term needs `entropy` and algo.entropy_coef > 0. Every input is read only where `mask` is set
    (selected, so padding holding NaN / inf changes neither the loss nor its gradient). Returns the
    loss and detached statistics: the policy loss's own token means, `kl_sum` (per-token KL summed
    over the mask, for a global mean) whenever `ref_logp` is given, and `mismatch` (tensor sums
    for `algos.mismatch_metrics`, engine vs trainer) whenever `rollout_logp` is given.
    """
    m = mask.bool()
    logp, old_logp, advantages = masked(logp, m), masked(old_logp, m), masked(advantages, m if advantages.dim() == 2
                                                                                 else m.any(-1))
    corr: Correction | None = None
    spec = correction_of(algo)
    if rollout_logp is not None:
        rollout_logp = masked(rollout_logp, m)
        if spec is not None:
            corr = rollout_correction(old_logp, rollout_logp, m, *spec)
    is_w = masked(corr.weights, corr.keep) if corr is not None else None  # a dropped token weighs 0
    loss, stats = POLICY_LOSSES.get(algo.policy_loss)(logp, old_logp, advantages, mask, algo, is_w, num_tokens,
                                                      num_seqs)
    if rollout_logp is not None:
        stats["mismatch"] = mismatch_sums(old_logp, rollout_logp, mask, corr)
    if ref_logp is not None:
        kl = kl_penalty(logp, masked(ref_logp, mask), algo.kl_estimator)
        if algo.kl_coef > 0 and not kl_goes_in_reward(algo):
            loss = loss + algo.kl_coef * aggregate_loss(kl, mask, algo.loss_agg, num_tokens, num_seqs,
                                                        algo.loss_scale_factor)
        stats["kl_sum"] = masked(kl.detach(), mask).sum()
    if entropy is not None and algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * aggregate_loss(masked(entropy, mask), mask, algo.loss_agg, num_tokens,
                                                         num_seqs, algo.loss_scale_factor)
    return loss, stats
