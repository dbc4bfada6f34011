"""Advantage estimators and reward shaping.

Rewards arrive as [N] with N = num_groups * G, the G completions of one prompt contiguous. An
estimator returns a sequence-level advantage [N] (broadcast over the sequence's tokens by the
policy loss) or a token-level one [N, T] (REINFORCE++). Registered estimators take
`(rewards, group_size, algo, mask=None, kl_penalty=None)`: `mask` [N, T] marks response tokens;
`kl_penalty` [N, T] is the KL in the reward, coefficient applied: beta * (log pi - log pi_ref) per
token (k1), given when the KL goes into the reward (algo.kl_in_reward, or an estimator that
always puts it there) and None otherwise. Sequence-level estimators subtract its sum from the
reward; REINFORCE++ subtracts it token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from colo_rl import dist
from colo_rl.algos.core import ADV_ESTIMATORS, masked

# Estimators whose baseline comes from the other completions of the same prompt: a group of one
# completion carries no signal for them (colo_rl refuses rollout.group_size=1 with these).
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
# Estimators that put the KL in the reward by definition (REINFORCE++): no KL term in the loss.
KL_IN_REWARD_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")
# Estimators whose advantages differ between a sequence's tokens when the KL is in the reward
# (returns-to-go of a per-token penalty); every other estimator gives one advantage per sequence.
TOKEN_LEVEL_ESTIMATORS = ("reinforce_pp",)


def kl_goes_in_reward(algo) -> bool:
    """Whether the run's KL (when a reference exists) is a reward penalty rather than a loss term."""
    return algo.kl_in_reward or algo.adv_estimator in KL_IN_REWARD_ESTIMATORS


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages (GRPO; Dr. GRPO with scale_by_std=False).

        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     if scale_by_std
        A_i =  r_i - mean_g(r)                         otherwise

    std is the unbiased sample std (as in the GRPO paper's implementation). A group whose rewards
    are all equal gets A = 0: it carries no learning signal.
    """
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = g.std(dim=1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return centred.view(-1)


def kl_in_reward(rewards: torch.Tensor, kl_penalty: Optional[torch.Tensor], mask: Optional[torch.Tensor]
                 ) -> torch.Tensor:
    """Sequence rewards minus their summed per-token KL penalty: r_i - beta sum_t (log pi - log pi_ref)_t."""
    if kl_penalty is None:
        return rewards.float()
    return rewards.float() - masked(kl_penalty.float(), mask).sum(-1)


@ADV_ESTIMATORS.register("grpo")
def grpo_advantages(rewards, group_size, algo, mask=None, kl_penalty=None) -> torch.Tensor:
    """GRPO's group-normalised advantage (`group_advantages`); algo.scale_by_std=false is Dr. GRPO."""
    return group_advantages(kl_in_reward(rewards, kl_penalty, mask), group_size, algo.scale_by_std)


@ADV_ESTIMATORS.register("rloo")
def rloo_advantages(rewards, group_size, algo=None, mask=None, kl_penalty=None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each completion's baseline is the mean of the other G - 1.

        A_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean_g(r))
    """
    if group_size < 2:
        raise ValueError("rloo needs rollout.group_size >= 2 (the baseline is the other completions' mean)")
    g = _groups(kl_in_reward(rewards, kl_penalty, mask), group_size)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others).view(-1)


def global_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over the masked entries of every rank (n of them), 0 elsewhere:

        mu  = (1/n) sum_i x_i
        var = 1/(n-1) sum_i (x_i - mu)^2                 (unbiased)
        w_i = (x_i - mu) / sqrt(var + eps)

    Two passes, each one float64 all-reduce (sum and count, then the squared deviations): the
    one-pass E[x^2] - E[x]^2 in float32 cancels to <= 0 when the values vary little around a large
    mean (rewards on an offset, a whole batch right with a small KL), and the division was then by eps.
    1/sqrt(var + eps) (verl's masked_whiten), not 1/(std + eps): on a near-constant batch (var ~ eps)
    it caps the amplification at 1/sqrt(eps) = 1e4 instead of up to 1/eps; elsewhere they agree.
    """
    keep = mask.bool()
    x64 = torch.where(keep, x.double(), 0.0)
    total, count = dist.all_reduce_sum([float(x64.sum()), float(keep.sum())])
    mean = total / max(count, 1.0)
    centred = torch.where(keep, x64 - mean, 0.0)
    (squares,) = dist.all_reduce_sum([float(centred.square().sum())])
    var = squares / max(count - 1.0, 1.0)
    return (centred / (var + eps) ** 0.5).float()


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sequence reward placed on each sequence's last response token: [N] -> [N, T]."""
    m = mask.float()
    last = (m.cumsum(-1) == m.sum(-1, keepdim=True)) & (m > 0)
    return last.float() * rewards.float().unsqueeze(-1)


@ADV_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(rewards, group_size, algo, mask=None, kl_penalty=None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): KL folded into the token rewards, returns-to-go, global whitening.

        rho_t = r * [t = last] - beta * (log pi(a_t) - log pi_ref(a_t))      (the kl_penalty)
        G_t   = sum_{s >= t} rho_s                                         (gamma = 1)
        A_t   = (G_t - mean(G)) / std(G)      over the response tokens of the whole batch, all ranks

    Token-level: returns [N, T]. Without a reference (kl_penalty None) the KL term is absent.
    """
    if mask is None:
        raise ValueError("reinforce_pp needs the response mask (token-level advantages)")
    m = mask.float()
    token_rewards = outcome_token_rewards(rewards, m)
    if kl_penalty is not None:
        token_rewards = token_rewards - masked(kl_penalty.float(), m)
    returns = masked(token_rewards.flip(-1).cumsum(-1).flip(-1), m)
    return global_whiten(returns, m)


@ADV_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards, group_size, algo, mask=None, kl_penalty=None) -> torch.Tensor:
    """REINFORCE++-baseline: the group mean subtracted, then whitened over the global batch.

        s_i = r_i - beta * sum_t (log pi - log pi_ref)_t      (the KL term only with a reference)
        A_i = s_i - mean_g(s);   A_t = whiten(A_i broadcast to its tokens)   over all ranks
    Token-level: returns [N, T].
    """
    if mask is None:
        raise ValueError("reinforce_pp_baseline needs the response mask (token-level advantages)")
    m = mask.float()
    g = _groups(kl_in_reward(rewards, kl_penalty, m), group_size)
    centred = (g - g.mean(dim=1, keepdim=True)).view(-1)
    return global_whiten(centred.unsqueeze(-1) * m, m)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for groups whose rewards are not all equal ([num_groups]).
    A group of equal rewards has zero advantage under any group baseline: it only dilutes the batch."""
    g = _groups(rewards, group_size)
    return (g.max(dim=1).values - g.min(dim=1).values) > 0


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward:

        0                                          if L <= max_len - buffer_len
        -penalty * (L - (max_len - buffer_len)) / buffer_len    inside the buffer (down to -penalty at max_len)
    """
    if buffer_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    exceed = (lengths.float() - (max_len - buffer_len)).clamp(min=0)
    return -penalty * (exceed / buffer_len).clamp(max=1.0)


def sequence_mean_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean over its response tokens of a per-token KL: [N, T] -> [N].

        kl_i = sum_t m_it kl_it / sum_t m_it

    Averaged over the batch's sequences it is the adaptive controller's observed KL (verl's
    convention, k1 of the rollout vs the reference): a per-token value, so algo.kl_target means
    the same whatever the response length."""
    m = mask.bool()
    return masked(kl.float(), m).sum(-1) / m.sum(-1).clamp(min=1)


@dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019): the KL-in-reward coefficient moves towards a target KL.

        coef <- coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)

    kl: the batch mean of `sequence_mean_kl` of the k1 in the reward (per token, as verl's), n: the
    batch's sequences.
    """

    coef: float
    target: Optional[float] = None  # None: a fixed coefficient
    horizon: int = 10000

    def update(self, observed_kl: float, n_sequences: int) -> float:
        if self.target:
            error = max(-0.2, min(0.2, observed_kl / self.target - 1.0))
            self.coef *= 1.0 + error * n_sequences / self.horizon
        return self.coef
