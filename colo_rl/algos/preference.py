"""SFT and preference losses: completion NLL, sequence log-probs, DPO / IPO / hinge (cDPO smoothing)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colo_rl.algos.core import DPO_LOSSES, aggregate_loss


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Negative log-likelihood of the completion tokens, token-mean:

        L = - sum_t m_t log p(y_t | y_<t) / sum_t m_t

    logp: [B, T] log-probs of the target tokens; mask: 1 on completion (assistant) tokens.
    """
    return aggregate_loss(-logp.float(), mask, "token-mean", num_tokens=num_tokens)


# --------------------------------------------------------------------------------------------
# DPO family
# --------------------------------------------------------------------------------------------


def sequence_logprobs(logp: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-prob of the masked tokens, [B, T] -> [B]:

        sum_t m_t log p(y_t | y_<t)                       (average=False: DPO, hinge)
        sum_t m_t log p(y_t | y_<t) / sum_t m_t           (average=True: length-normalised, IPO)
    """
    m = mask.to(torch.float32)
    total = (logp.float() * m).sum(-1)
    return total / m.sum(-1).clamp(min=1) if average else total


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """IPO (Azar et al. 2023), per pair [B]:

        h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))
        L = (h - 1 / (2 beta))^2

    The log-probs are length-normalised (mean over the response tokens, `sequence_logprobs(...,
    average=True)`), as in the paper's implementation and TRL: with sums, the target margin
    1 / (2 beta) would mean different things for short and long responses.
    """
    h = (policy_chosen.float() - ref_chosen.float()) - (policy_rejected.float() - ref_rejected.float())
    return _dpo_ipo(h, beta, 0.0)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses from sequence log-probs, all [B] (sums over response tokens for
    sigmoid / hinge; length-normalised means for ipo, see `ipo_loss`).

    With h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)):
        sigmoid (DPO):   -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)   (eps = label
                         smoothing: cDPO, labels flipped with probability eps)
        ipo:             (h - 1 / (2 beta))^2
        hinge (SLiC):    max(0, 1 - beta h)
    Returns (losses, chosen_rewards, rejected_rewards) with reward = beta (log pi - log ref);
    margin = chosen - rejected = beta h, and a pair counts as ranked right when margin > 0.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"algo.label_smoothing={label_smoothing} must be in [0, 0.5)")
    loss_fn = DPO_LOSSES.get(loss_type)
    chosen_logratio = policy_chosen.float() - ref_chosen.float()
    rejected_logratio = policy_rejected.float() - ref_rejected.float()
    losses = loss_fn(chosen_logratio - rejected_logratio, beta, label_smoothing)
    return losses, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


@DPO_LOSSES.register("sigmoid")
def _dpo_sigmoid(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


@DPO_LOSSES.register("ipo")
def _dpo_ipo(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return (h - 1 / (2 * beta)).square()


@DPO_LOSSES.register("hinge")
def _dpo_hinge(h: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return torch.relu(1 - beta * h)
