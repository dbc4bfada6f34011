"""Rollout correction: the engine samples from pi_rollout, the trainer's pi_old differs (bf16 kernels,
another attention implementation); per-token ratios correct or filter the loss (verl's
`algorithm.rollout_correction`, OpenRLHF's `is_correction_type`).

    rho_t = pi_old(a_t) / pi_rollout(a_t)              per token
    rho_i = prod_t rho_t = exp(sum_t log rho_t)        per sequence (the exact sequence IS weight)
    g_i   = rho_i^(1/|y_i|) = exp(mean_t log rho_t)    per sequence, geometric mean (length-free)

A correction (registry ROLLOUT_CORRECTIONS, config key algo.rollout_correction) maps the ratios to
a weight w_t multiplying the token's policy loss and a keep mask dropping tokens from it:

    l_t  <-  keep_t * w_t * l_t          (the policy loss's IS weight: a dropped token weighs 0)

C = algo.rollout_is_threshold, c = algo.rollout_is_threshold_lower (two-sided ones; default 1/C).
A dropped token still counts in the loss's denominators (as in IcePop's objective): dropping lowers
the step's gradient instead of rescaling the rest (verl's rejection recomputes the denominators
without them). Everything here is detached: the weights change the measure, not the objective.
The KL and entropy terms are not weighted.

`mismatch_sums` / `mismatch_metrics` measure the mismatch every step, whatever the correction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from colo_rl.algos.core import ROLLOUT_CORRECTIONS, masked

# exp() guard: a log-ratio beyond +-20 is a broken token, not a weight (exp(20) ~ 5e8).
SAFETY_BOUND = 20.0
# Corrections with a band [c, C] around 1: the ratio deviates in both directions.
TWO_SIDED = ("mis_geo", "icepop")


class Correction(NamedTuple):
    weights: torch.Tensor    # [B, T] w_t (1 where the correction only masks)
    keep: torch.Tensor       # [B, T] bool: the token stays in the loss
    truncated: torch.Tensor  # [B, T] bool: w_t was capped below its ratio


def _seq(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t log rho_t per sequence, broadcastable to [B, T]."""
    return masked(log_ratio, mask).sum(-1, keepdim=True)


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


@ROLLOUT_CORRECTIONS.register("tis_token")
def tis_token(log_ratio, mask, upper, lower) -> Correction:
    """Token-level truncated IS (Yao et al. 2025; algo.tis_cap is this): w_t = min(rho_t, C); every token kept."""
    rho = _ratio(log_ratio)
    return Correction(rho.clamp(max=upper), mask.bool(), mask.bool() & (rho > upper))


@ROLLOUT_CORRECTIONS.register("tis_seq")
def tis_seq(log_ratio, mask, upper, lower) -> Correction:
    """Sequence-level truncated IS: w_t = min(rho_i, C) for every token of sequence i (unbiased before the
    cap, but rho_i is a product over the sequence: high variance, hence the cap)."""
    rho = _ratio(_seq(log_ratio, mask)).expand_as(log_ratio)
    return Correction(rho.clamp(max=upper), mask.bool(), mask.bool() & (rho > upper))


@ROLLOUT_CORRECTIONS.register("mis_token")
def mis_token(log_ratio, mask, upper, lower) -> Correction:
    """Token-level masked IS: w_t = rho_t, keep_t = [rho_t <= C] (a token the engine sampled far more
    readily than the trainer would is dropped, not capped)."""
    rho = _ratio(log_ratio)
    return Correction(rho, mask.bool() & (rho <= upper), torch.zeros_like(mask, dtype=torch.bool))


@ROLLOUT_CORRECTIONS.register("mis_seq")
def mis_seq(log_ratio, mask, upper, lower) -> Correction:
    """Sequence-level masked IS: w_t = rho_i, keep_t = [rho_i <= C] for every token of sequence i."""
    rho = _ratio(_seq(log_ratio, mask)).expand_as(log_ratio)
    return Correction(rho, mask.bool() & (rho <= upper), torch.zeros_like(mask, dtype=torch.bool))


@ROLLOUT_CORRECTIONS.register("mis_geo")
def mis_geo(log_ratio, mask, upper, lower) -> Correction:
    """Geometric-mean sequence masking: keep_t = [c <= g_i <= C], w_t = 1 (verl's seq_mean_k1 rejection).

    g_i does not grow with the length as rho_i does, so one band fits short and long sequences; it
    is a trust-region test, not an IS weight: the kept sequences are unweighted."""
    m = mask.bool()
    g = (_seq(log_ratio, mask) / m.sum(-1, keepdim=True).clamp(min=1)).exp().expand_as(log_ratio)
    return Correction(torch.ones_like(g), m & (g >= lower) & (g <= upper), torch.zeros_like(m))


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(log_ratio, mask, upper, lower) -> Correction:
    """IcePop (Ling team, 2025): two-sided token masking, w_t = rho_t, keep_t = [c <= rho_t <= C]; a token
    whose probabilities disagree in either direction gets no gradient."""
    rho = _ratio(log_ratio)
    return Correction(rho, mask.bool() & (rho >= lower) & (rho <= upper), torch.zeros_like(mask, dtype=torch.bool))


def correction_band(name: str, upper: float, lower: float | None) -> tuple[float, float]:
    """(C, c) for a correction: two-sided ones default c to 1/C; one-sided ones have no lower edge (0)."""
    if name in TWO_SIDED:
        return upper, (1.0 / upper if lower is None else lower)
    return upper, 0.0


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, name: str,
                       upper: float, lower: float | None = None) -> Correction:
    """The registered correction `name` for log rho = log pi_old - log pi_rollout (detached; masked positions 0)."""
    with torch.no_grad():
        log_ratio = masked(old_logp.float() - rollout_logp.float(), mask)
        return ROLLOUT_CORRECTIONS.get(name)(log_ratio, mask, *correction_band(name, upper, lower))


def mismatch_sums(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                  correction: Correction | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch's mismatch statistics as tensor sums (and maxima), to accumulate without a sync:

        k1 = log pi_rollout - log pi_old = -log rho_t       (KL(pi_rollout || pi_old), sampled from the engine)
        k3 = rho_t - 1 - log rho_t                           (the same KL, >= 0, lower variance)
    plus the counts of tokens and sequences, of those the correction dropped (a sequence counts when
    any of its tokens is dropped) or truncated, and the largest token and sequence ratios.
    """
    with torch.no_grad():
        m = mask.bool()
        log_ratio = masked(old_logp.float() - rollout_logp.float(), m)
        rho = _ratio(log_ratio)
        has_tokens = m.any(-1)
        out = {
            "k1": masked(-log_ratio, m).sum(), "k3": masked(rho - 1 - log_ratio, m).sum(),
            "tokens": m.sum().float(), "seqs": has_tokens.sum().float(),
            # ratios are > 0: 0 is neutral for the max
            "ratio_max": masked(rho, m).max(), "seq_ratio_max": masked(_ratio(log_ratio.sum(-1)), has_tokens).max(),
        }
        dropped = m & ~correction.keep if correction is not None else torch.zeros_like(m)
        truncated = m & correction.truncated if correction is not None else torch.zeros_like(m)
        out.update(tokens_masked=dropped.sum().float(), seqs_masked=dropped.any(-1).sum().float(),
                   tokens_truncated=truncated.sum().float(), seqs_truncated=truncated.any(-1).sum().float())
    return out


MAX_KEYS = ("ratio_max", "seq_ratio_max")


def mismatch_metrics(totals: dict[str, torch.Tensor | float] | None) -> dict[str, float]:
    """The step's metrics from `mismatch_sums` added up over its micro-batches and ranks (the
    maxima of MAX_KEYS, the sums of the others: colo_rl.metrics.StepSums(maxima=MAX_KEYS)):

        mismatch/kl_k1, mismatch/kl_k3          per-token means
        mismatch/tokens_masked_frac, ..._truncated_frac   shares of response tokens
        mismatch/seqs_masked_frac, ..._truncated_frac     shares of sequences
        mismatch/ratio_max, mismatch/seq_ratio_max        the largest rho_t and rho_i
    """
    if not totals:
        return {}
    t = {k: float(v) for k, v in totals.items()}
    tok, seq = max(t["tokens"], 1.0), max(t["seqs"], 1.0)
    return {"mismatch/kl_k1": t["k1"] / tok, "mismatch/kl_k3": t["k3"] / tok,
            "mismatch/tokens_masked_frac": t["tokens_masked"] / tok,
            "mismatch/tokens_truncated_frac": t["tokens_truncated"] / tok,
            "mismatch/seqs_masked_frac": t["seqs_masked"] / seq,
            "mismatch/seqs_truncated_frac": t["seqs_truncated"] / seq,
            "mismatch/ratio_max": t["ratio_max"], "mismatch/seq_ratio_max": t["seq_ratio_max"]}
