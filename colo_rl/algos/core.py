"""What every algorithm shares: the registries, log-probs and entropy from logits, loss aggregation."""

from __future__ import annotations

from typing import Optional

import torch

from colo_rl.registry import Registry

ADV_ESTIMATORS: Registry = Registry("algo.adv_estimator")
POLICY_LOSSES: Registry = Registry("algo.policy_loss")
KL_ESTIMATORS: Registry = Registry("algo.kl_estimator")
LOSS_AGGREGATIONS: Registry = Registry("algo.loss_agg")
DPO_LOSSES: Registry = Registry("algo.dpo_loss")
ROLLOUT_CORRECTIONS: Registry = Registry("algo.rollout_correction")


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[labels], in float32.

    logits: [B, T, V] (position t predicts labels[:, t]); labels: [B, T]. The rollout engine
    reports log-probs of logits / temperature over the full vocabulary, so the trainer divides by
    the same temperature for the two to be comparable.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - logz


# Entropy chunks off the CPU: positions per chunk so that its softmax holds ~1 GiB of float32 (few
# kernel launches per micro-batch, bounded memory); on the CPU 64 positions stay in cache.
_ENTROPY_CHUNK_BYTES = 1 << 30


def entropy_from_logits(logits: torch.Tensor, logz: Optional[torch.Tensor] = None,
                        chunk: Optional[int] = None) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) z, per position. [..., V] -> [...]; pass `logz` when
    logsumexp(z) is already computed. Done `chunk` positions at a time with the dot product as a
    batched matmul. Default chunk: 64 positions on the CPU (the chunk stays in cache, ~4x faster
    than whole-tensor passes over a 49k vocabulary); elsewhere ~1 GiB of float32 per chunk, so a
    GPU launches a few kernels per micro-batch, not three per 64 positions."""
    shape = logits.shape[:-1]
    flat = logits.float().reshape(-1, logits.shape[-1])
    if chunk is None:
        chunk = 64 if flat.device.type == "cpu" else max(64, _ENTROPY_CHUNK_BYTES // (4 * flat.shape[-1]))
    logz = torch.logsumexp(flat, dim=-1) if logz is None else logz.reshape(-1)
    out = torch.empty_like(logz)
    for start in range(0, flat.shape[0], chunk):
        z = flat[start:start + chunk]
        expected_z = torch.bmm(torch.softmax(z, dim=-1).unsqueeze(1), z.unsqueeze(2)).view(-1)
        out[start:start + chunk] = logz[start:start + chunk] - expected_z
    return out.view(shape)


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask, 0 elsewhere, by selection: a NaN / inf in a padded position never reaches a sum
    (x * mask would give NaN * 0 = NaN), and its gradient there is exactly 0."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked(x, mask).sum() / mask.sum().clamp(min=1)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   num_tokens: float | None = None, num_seqs: float | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar (m_it = mask, B sequences, L = `scale`).

        token-mean:               sum_{i,t} l_it m_it / sum_{i,t} m_it          (DAPO, verl default)
        token-sum:                sum_{i,t} l_it m_it                           (no normalisation)
        seq-mean-token-mean:      (1/B) sum_i [ sum_t l_it m_it / sum_t m_it ]  (original GRPO, GSPO)
        seq-mean-token-sum:       (1/B) sum_i   sum_t l_it m_it                 (Dr. GRPO, no length norm)
        seq-mean-token-sum-norm:  (1/B) sum_i   sum_t l_it m_it / L             (Dr. GRPO's constant L)

    B counts the sequences with at least one loss token (`loss_sequences`): a sequence whose mask is
    all 0 carries no loss, so it does not dilute the others' (verl's exclude_fully_masked_seq);
    token-mean's denominator already ignores it.

    num_tokens / num_seqs replace the local denominators with global ones (all micro-batches of
    all ranks), so gradient accumulation gives the same gradient as one big batch. token-sum takes
    no denominator at all: its scale grows with the batch (as verl's). seq-mean-token-sum-norm's L
    (algo.loss_scale_factor, e.g. rollout.max_new_tokens) is one constant for the whole run, so a
    token weighs the same in every sequence and every step; verl divides by L only (its default L
    is the padded response width) and not by B: colo_rl's also divides by B, which keeps the scale
    independent of the batch size and equal to token-mean's when every sequence is L tokens long.

    Masked positions are selected out (`masked`), never multiplied by 0: a NaN or inf there does
    not reach the loss or its gradient.
    """
    return LOSS_AGGREGATIONS.get(mode)(masked(loss_mat, mask), mask.to(loss_mat.dtype), num_tokens, num_seqs, scale)


# Each takes (loss_mat with masked positions already 0, mask, num_tokens, num_seqs, scale).
@LOSS_AGGREGATIONS.register("token-mean")
def _token_mean(loss_mat, mask, num_tokens, num_seqs, scale):
    denom = mask.sum() if num_tokens is None else torch.tensor(float(num_tokens))
    return loss_mat.sum() / denom.clamp(min=1)


@LOSS_AGGREGATIONS.register("token-sum")
def _token_sum(loss_mat, mask, num_tokens, num_seqs, scale):
    return loss_mat.sum()


def loss_sequences(mask: torch.Tensor) -> torch.Tensor:
    """How many rows of `mask` [B, T] hold at least one loss token: the seq-mean modes' B."""
    return (mask.sum(-1) > 0).sum()


def _per_sequence_mean(per_seq: torch.Tensor, mask: torch.Tensor, num_seqs: float | None) -> torch.Tensor:
    if num_seqs is None:
        return per_seq.sum() / loss_sequences(mask).clamp(min=1).to(per_seq.dtype)
    return per_seq.sum() / max(float(num_seqs), 1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, num_tokens, num_seqs, scale):
    return _per_sequence_mean(loss_mat.sum(-1) / mask.sum(-1).clamp(min=1), mask, num_seqs)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, num_tokens, num_seqs, scale):
    return _per_sequence_mean(loss_mat.sum(-1), mask, num_seqs)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, num_tokens, num_seqs, scale):
    if not scale:
        raise ValueError("loss_agg=seq-mean-token-sum-norm divides by a constant length: set algo.loss_scale_factor "
                         "(e.g. to rollout.max_new_tokens)")
    return _per_sequence_mean(loss_mat.sum(-1), mask, num_seqs) / float(scale)
