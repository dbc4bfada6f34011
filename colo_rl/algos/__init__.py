"""Algorithms as pure tensor functions behind registries (in the manner of verl's core_algos).

Every choice a config key makes is a registry: a decorator registers a function under the name
the config uses, and the config's allowed values are the registry's names.

    registry            config key           signature
    ADV_ESTIMATORS      algo.adv_estimator   (rewards [N], group_size, algo, mask, kl_penalty) -> [N] or [N, T]
    POLICY_LOSSES       algo.policy_loss     (logp, old_logp, adv, mask, algo, is_weights, n_tok, n_seq) -> (loss, stats)
    KL_ESTIMATORS       algo.kl_estimator    (logp, ref_logp) -> per-token KL [B, T]
    LOSS_AGGREGATIONS   algo.loss_agg        (loss_mat, mask, n_tok, n_seq, scale) -> scalar
    DPO_LOSSES          algo.dpo_loss        (h, beta, label_smoothing) -> per-pair loss [B]
    ROLLOUT_CORRECTIONS algo.rollout_correction  (log rho, mask, upper, lower) -> Correction(weights, keep, truncated)

Modules: core (registries, log-probs, entropy, aggregation), advantages (GRPO, RLOO, REINFORCE++,
DAPO's dynamic-sampling filter and overlong shaping, KL in the reward), policy (PPO-clip with
dual-clip, GSPO, CISPO, KL estimators, `rl_loss` = the whole GRPO-family loss), correction
(train-inference mismatch: truncated / masked IS, IcePop, the mismatch metrics), preference (SFT
NLL, DPO / IPO / hinge). Everything is re-exported here: `algos.rl_loss(...)`.
"""

from colo_rl.algos.advantages import (GROUP_ESTIMATORS, KL_IN_REWARD_ESTIMATORS, TOKEN_LEVEL_ESTIMATORS,
                                      AdaptiveKLController, global_whiten,
                                      group_advantages, grpo_advantages, informative_groups, kl_goes_in_reward,
                                      kl_in_reward, outcome_token_rewards, overlong_penalty, reinforce_pp_advantages,
                                      reinforce_pp_baseline_advantages, rloo_advantages, sequence_mean_kl)
from colo_rl.algos.core import (ADV_ESTIMATORS, DPO_LOSSES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                                ROLLOUT_CORRECTIONS, aggregate_loss, entropy_from_logits, logprobs_from_logits,
                                loss_sequences, masked, masked_mean)
from colo_rl.algos.correction import MAX_KEYS as MISMATCH_MAX_KEYS
from colo_rl.algos.correction import TWO_SIDED as TWO_SIDED_CORRECTIONS
from colo_rl.algos.correction import Correction, mismatch_metrics, mismatch_sums, rollout_correction
from colo_rl.algos.policy import (GSPO_LOG_RATIO_MAX, K3_BOUND, cispo_loss, gspo_loss, kl_abs, kl_k1, kl_k1_plus, kl_k2,
                                  kl_k3, kl_k3_plus, kl_penalty, policy_loss, ppo_clip_loss, rl_loss)
from colo_rl.algos.preference import dpo_loss, ipo_loss, sequence_logprobs, sft_loss

__all__ = [
    "ADV_ESTIMATORS", "DPO_LOSSES", "ROLLOUT_CORRECTIONS", "TWO_SIDED_CORRECTIONS", "Correction", "MISMATCH_MAX_KEYS",
    "mismatch_metrics", "mismatch_sums", "rollout_correction", "masked", "GSPO_LOG_RATIO_MAX", "kl_abs", "kl_k1_plus",
    "kl_k3_plus", "sequence_mean_kl", "GROUP_ESTIMATORS", "KL_IN_REWARD_ESTIMATORS", "TOKEN_LEVEL_ESTIMATORS", "kl_goes_in_reward", "K3_BOUND", "KL_ESTIMATORS", "LOSS_AGGREGATIONS",
    "POLICY_LOSSES", "AdaptiveKLController", "aggregate_loss", "cispo_loss", "dpo_loss", "entropy_from_logits",
    "global_whiten", "group_advantages", "grpo_advantages", "gspo_loss", "informative_groups", "ipo_loss",
    "kl_in_reward", "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "logprobs_from_logits", "loss_sequences", "masked_mean",
    "outcome_token_rewards", "overlong_penalty", "policy_loss", "ppo_clip_loss", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages", "rl_loss", "rloo_advantages", "sequence_logprobs", "sft_loss",
]
