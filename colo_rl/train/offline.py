"""Pieces shared by the fixed-dataset recipes (SFT, DPO): the step plan, micro-batches,
sequence-level forward passes.

Under ZeRO-3 every forward and backward gathers parameters collectively, so all ranks must run
the same number of passes: `equalise` pads a rank's list of micro-batches with empty ones
(a single masked token: it joins the collectives and adds nothing to the loss or the gradient).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from colo_rl import algos, dist
from colo_rl.errors import ConfigError
from colo_rl.data.files import DataError
from colo_rl.train.packing import pack_bins, packed_batch, packed_pairs
from colo_rl.train.batch import TokenBatch, build_batch, empty_batch, micro_batches

log = logging.getLogger("colo_rl")


@dataclass
class StepPlan:
    total_steps: int
    steps_per_epoch: int
    local_batch: int  # examples per rank per step
    grad_accum: int  # micro-batches per rank per step


def plan_steps(cfg, n_train: int, unit: str = "examples") -> StepPlan:
    """trainer.epochs (cut at trainer.max_steps) over n_train examples in batches of
    trainer.batch_size, each epoch's last one short (`EpochSampler.next_global(short_last=True)`):
    each example once per epoch; refuses a batch the ranks cannot share (packing vs the attention:
    config/validation.py check_packing_attention)."""
    tr, world = cfg.trainer, dist.world_size()
    if not n_train:
        raise DataError(f"no training {unit} left (all over-length?): raise data.max_seq_len")
    if tr.batch_size % world:
        raise ConfigError(f"trainer.batch_size={tr.batch_size} must be divisible by the number of ranks ({world})")
    steps_per_epoch = math.ceil(n_train / tr.batch_size)  # an epoch's last batch is what is left of it
    total = tr.epochs * steps_per_epoch
    if tr.max_steps:
        total = min(total, tr.max_steps)
    local_batch = tr.batch_size // world
    return StepPlan(total, steps_per_epoch, local_batch, math.ceil(local_batch / max(1, tr.micro_batch_size)))


def equalise(batches: list, pad_id: int, make=None) -> tuple[list, int]:
    """Pad `batches` to the largest count over ranks; returns (batches, how many are real)."""
    real = len(batches)
    (n,) = dist.all_reduce_max([float(real)])
    filler = make or (lambda: empty_batch(pad_id))
    return batches + [filler() for _ in range(int(n) - real)], real


# ------------------------------------------------------------------ SFT
def sft_micro_batches(examples: list, micro_batch_size: int, pad_id: int, packing: bool = False,
                      max_len: int = 1024, dtype: torch.dtype = torch.float32, budget: int = 0) -> list[TokenBatch]:
    """This rank's examples as micro-batches of at most `budget` tokens (0: no cap) and
    micro_batch_size units (`batch.micro_batches`): unpacked, the units are examples (shortest
    first); packed, rows of at most max_len tokens (longest first)."""
    if not examples:
        return []
    if packing:
        seqs = [(ex.prompt_ids + ex.completion_ids, [0] * len(ex.prompt_ids) + ex.completion_mask)
                for ex in examples]
        bins = pack_bins([len(s) for s, _ in seqs], max_len)
        bins.sort(key=lambda b: -sum(len(seqs[i][0]) for i in b))
        rows = [sum(len(seqs[i][0]) for i in b) for b in bins]
        return [packed_batch([[seqs[i] for i in bins[r]] for r in mb], pad_id, dtype, example_ids=[bins[r] for r in mb])
                for mb in micro_batches(rows, budget, micro_batch_size, order=list(range(len(bins))))]
    batch = build_batch([ex.prompt_ids for ex in examples], [ex.completion_ids for ex in examples], pad_id,
                        response_masks=[ex.completion_mask for ex in examples])
    return [batch.select(idx) for idx in micro_batches([len(ex) for ex in examples], budget, micro_batch_size)]


def masked_token_count(batches: list[TokenBatch]) -> float:
    return float(sum(float(b.response_mask.sum()) for b in batches))


# ------------------------------------------------------------------ DPO
def pair_micro_batches(pairs: list, micro_batch_size: int, pad_id: int, packing: bool = False,
                       dtype: torch.dtype = torch.float32, budget: int = 0) -> list[tuple[list[int], TokenBatch]]:
    """(indices into `pairs`, batch) per micro-batch of whole pairs, at most `budget` tokens (0: no
    cap) and micro_batch_size pairs (`batch.micro_batches`, shortest first): padded (chosen rows
    first, then rejected, each behind its prompt) or, with packing (train/packing.packed_pairs),
    each pair is one row [prompt | chosen | p' | rejected] that computes its prompt once."""
    out = []
    tokens = [len(p.prompt_ids) + len(p.chosen_ids) + 1 + len(p.rejected_ids) if packing else 2 * len(p) for p in pairs]
    for idx in micro_batches(tokens, budget, micro_batch_size, order=[len(p) for p in pairs]):
        sel = [pairs[i] for i in idx]
        if packing:
            out.append((idx, packed_pairs(sel, pad_id, dtype)))
            continue
        batch = build_batch([p.prompt_ids for p in sel] * 2,
                            [p.chosen_ids for p in sel] + [p.rejected_ids for p in sel], pad_id,
                            response_masks=[p.chosen_mask for p in sel] + [p.rejected_mask for p in sel])
        out.append((idx, batch))
    return out


def split_pair_logps(logp: torch.Tensor, batch: TokenBatch, average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs of a pair micro-batch -> (chosen [k], rejected [k]): from the padded
    layout (chosen rows, then rejected rows) or the packed one (one row per pair, masks in extras)."""
    if "rejected_mask" in batch.extras:
        return (algos.sequence_logprobs(logp, batch.extras["chosen_mask"].to(logp.device), average),
                algos.sequence_logprobs(logp, batch.extras["rejected_mask"].to(logp.device), average))
    seq = algos.sequence_logprobs(logp, batch.response_mask, average)
    k = seq.shape[0] // 2
    return seq[:k], seq[k:]


@torch.no_grad()
def pair_logps(model, pairs: list, micro_batch_size: int, pad_id: int, average: bool, packing: bool = False,
               dtype: torch.dtype = torch.float32, budget: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs (chosen, rejected) [len(pairs)] of this rank's pairs under `model`
    (a DeepSpeedActor: policy or frozen reference); every rank must call it (collectives)."""
    mbs, _ = equalise(pair_micro_batches(pairs, micro_batch_size, pad_id, packing, dtype, budget), pad_id,
                      make=lambda: ([], empty_batch(pad_id)))
    order, values = [], []  # on the device until the end: one transfer, not one per micro-batch
    for idx, batch in mbs:
        batch = model.to_device(batch)
        logp, _ = model.response_logprobs(batch, grad=False)
        if idx:
            order += idx
            values.append(torch.stack(split_pair_logps(logp, batch, average)))
    chosen, rejected = torch.zeros(len(pairs)), torch.zeros(len(pairs))
    if values:
        chosen[order], rejected[order] = torch.cat(values, dim=1).float().cpu()
    return chosen, rejected


