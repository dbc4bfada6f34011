"""Token batches in the layout the trainer's forward pass wants.

Each row is [left-padded prompt | right-padded response]: every response starts at column P, so
a forward pass needs logits only for the last R+1 positions (`logits_to_keep`), which skips the
LM head and the softmax over the vocabulary for prompt tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from colo_rl import dist
from colo_rl.algos import entropy_from_logits
from colo_rl.train.lm_head import fusable_head, fused_head_logprobs


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: Optional[torch.Tensor]  # [B, P + R]; None for group-packed rows (built from `segments`)
    position_ids: torch.Tensor  # [B, P + R]
    response_ids: torch.Tensor  # [B, R] targets
    response_mask: torch.Tensor  # [B, R] 1 on tokens that count for the loss
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row [B] or per-token [B, R]
    # Group-packed micro-batches (see `pack_groups`): one input row per group [prompt | r_1 | ... | r_G];
    # targets and extras keep the [sum G, R] layout. `logit_positions` [U]: the input columns whose
    # logits are computed; `logit_index` [sum G, R]: which of the [B, U] kept logits predicts each
    # response token (-1 on padding).
    logit_positions: Optional[torch.Tensor] = None
    logit_index: Optional[torch.Tensor] = None
    # Group-packed rows' segment ids [B, L] (0 = prompt, i = response i, negative = padding) and the
    # column where responses start: their attention (`packing.group_attention`) is built from these.
    segments: Optional[torch.Tensor] = None
    prompt_end: int = 0

    @property
    def response_len(self) -> int:
        return self.response_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: list[int]) -> "TokenBatch":
        """Rows `rows`, trimmed to the columns they use (less padding per micro-batch)."""
        idx = torch.tensor(rows, dtype=torch.long)
        attn = self.attention_mask[idx]
        P = self.input_ids.shape[1] - self.response_len
        used_prompt = int((attn[:, :P].sum(-1)).max())
        used_resp = max(1, int(self.response_mask[idx].ne(0).sum(-1).max()), int(attn[:, P:].sum(-1).max()))
        cols = slice(P - used_prompt, P + used_resp)
        return TokenBatch(self.input_ids[idx][:, cols], attn[:, cols], self.position_ids[idx][:, cols],
                          self.response_ids[idx][:, :used_resp], self.response_mask[idx][:, :used_resp],
                          extras={k: (v[idx][:, :used_resp] if v.dim() == 2 else v[idx]) for k, v in self.extras.items()})

    def apply(self, fn) -> "TokenBatch":
        """The same batch with `fn` applied to every tensor."""
        opt = lambda t: None if t is None else fn(t)  # noqa: E731
        return TokenBatch(fn(self.input_ids), opt(self.attention_mask), fn(self.position_ids), fn(self.response_ids),
                          fn(self.response_mask), extras={k: fn(v) for k, v in self.extras.items()},
                          logit_positions=opt(self.logit_positions), logit_index=opt(self.logit_index),
                          segments=opt(self.segments), prompt_end=self.prompt_end)

    def to(self, device, non_blocking: bool = False) -> "TokenBatch":
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def to_device(self, device) -> "TokenBatch":
        """On `device`; to a GPU from pinned host memory with non-blocking copies, so the host does
        not wait for the copy (nor for the GPU work queued before it). A batch already there is
        returned as it is."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        if device.type == "cuda":
            return self.apply(lambda t: t.pin_memory() if t.device.type == "cpu" else t).to(device, non_blocking=True)
        return self.to(device)


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                response_masks: Optional[list[Optional[list[int]]]] = None,
                per_token: Optional[dict[str, list[list[float]]]] = None,
                per_row: Optional[dict[str, list[float]]] = None) -> TokenBatch:
    """Collate sequences. `response_masks` (or a None entry in it) defaults to all response tokens counting;
    `per_token` values are aligned with the response tokens and padded with 0."""
    if not all(prompts):  # its first response token would be scored from padding, or from itself
        raise ValueError("build_batch: a sequence with an empty prompt; every response token needs a token before it")
    for name, rows in {"response_masks": response_masks or [], **(per_token or {})}.items():
        # a short row would be padded with zeros (a log-prob of 0, a token out of the loss) unnoticed
        bad = next((i for i, (vals, r) in enumerate(zip(rows, responses)) if vals is not None and len(vals) != len(r)),
                   None)
        if bad is not None or (rows and len(rows) != len(responses)):
            at = f"sequence {bad}: {len(rows[bad])} values for {len(responses[bad])} response tokens" \
                if bad is not None else f"{len(rows)} rows for {len(responses)} sequences"
            raise ValueError(f"build_batch: {name} is not aligned with the response tokens ({at})")
    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(1, max(len(r) for r in responses))
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    resp = torch.full((B, R), pad_id, dtype=torch.long)
    rmask = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):P + len(r)] = 1
        if r:
            ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
            resp[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            m = response_masks[i] if response_masks is not None and response_masks[i] is not None else [1] * len(r)
            rmask[i, :len(r)] = torch.tensor(m, dtype=torch.float32)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    extras: dict[str, torch.Tensor] = {}
    for key, rows in (per_token or {}).items():
        t = torch.zeros((B, R), dtype=torch.float32)
        for i, vals in enumerate(rows):
            if len(vals):
                t[i, :len(vals)] = torch.tensor(vals, dtype=torch.float32)
        extras[key] = t
    for key, vals in (per_row or {}).items():
        extras[key] = torch.tensor(vals, dtype=torch.float32)
    return TokenBatch(ids, attn, pos, resp, rmask, extras)


def empty_batch(pad_id: int, per_token: tuple[str, ...] = ()) -> TokenBatch:
    """One row, one masked target: a forward / backward that contributes exactly zero (a rank with
    fewer micro-batches joins the others' collectives with it); `per_token` columns are zeros."""
    return build_batch([[pad_id]], [[pad_id]], pad_id, response_masks=[[0]],
                       per_token={name: [[0.0]] for name in per_token})


def micro_batches(costs: list[int], budget: int, max_units: int = 0,
                  order: Optional[list[float]] = None) -> list[list[int]]:
    """Units (GRPO groups, DPO pairs, SFT examples or packed rows) as micro-batches of whole units:
    taken in ascending `order` (default: their cost, so similar lengths share a micro-batch and pad
    little) and filled up to `budget` tokens (trainer.micro_batch_tokens) and `max_units` units
    (trainer.micro_batch_size); 0 = no cap on either. A unit over the budget gets a micro-batch of its own.

        micro-batch b = a run of consecutive units u with  sum_u cost_u <= budget,  |b| <= max_units
    """
    key = costs if order is None else order
    bins: list[list[int]] = []
    used = 0
    for i in sorted(range(len(costs)), key=lambda i: key[i]):
        if bins and (budget <= 0 or used + costs[i] <= budget) and (max_units <= 0 or len(bins[-1]) < max_units):
            bins[-1].append(i)
            used += costs[i]
        else:
            bins.append([i])
            used = costs[i]
    return bins


def spread(bins: list[list[int]], n: int, costs: list[int]) -> list[list[int]]:
    """`bins` as exactly `n` micro-batches (n >= len(bins)): the costliest micro-batch of several
    units is halved until there are n (each half still within the budget), then empty ones ([]:
    a pass that adds nothing) where every micro-batch holds one unit."""
    bins = [list(b) for b in bins]
    while len(bins) < n:
        several = [k for k, b in enumerate(bins) if len(b) > 1]
        if not several:
            break
        k = max(several, key=lambda k: sum(costs[i] for i in bins[k]))
        half = len(bins[k]) // 2
        bins[k:k + 1] = [bins[k][:half], bins[k][half:]]
    return bins + [[] for _ in range(n - len(bins))]


def agreed_micro_batches(costs: list[int], budget: int, max_units: int = 0,
                         order: Optional[list[float]] = None) -> list[list[int]]:
    """`micro_batches`, as many on every rank (ZeRO-3's gathers are collectives, so every rank runs
    the same number of passes): the largest count over ranks, reached by `spread`. One all-reduce."""
    return agreed_mini_batches(costs, budget, max_units, order)[0]


def agreed_mini_batches(costs: list[int], budget: int, max_units: int = 0, order: Optional[list[float]] = None,
                        mini_batches: int = 1, seed: Optional[int] = None) -> list[list[list[int]]]:
    """The units cut into `mini_batches` runs of equal size, each a sample of them (not a band of
    lengths): with several, shuffled by `seed` first, so units a rollout appends last (DAPO's refill
    groups) or a file's order spread over them; each run planned as `micro_batches` and agreed over
    ranks as `agreed_micro_batches` (one all-reduce for all runs). Indices are into `costs`."""
    if mini_batches < 1 or len(costs) % mini_batches:
        raise ValueError(f"{len(costs)} units do not split into {mini_batches} mini-batches of equal size")
    units = list(range(len(costs)))
    if mini_batches > 1 and seed is not None:
        random.Random(seed).shuffle(units)
    size = len(costs) // mini_batches
    plans = []
    for k in range(mini_batches):
        run = units[k * size:(k + 1) * size]
        bins = micro_batches([costs[i] for i in run], budget, max_units,
                             None if order is None else [order[i] for i in run])
        plans.append([[run[i] for i in b] for b in bins])
    counts = dist.all_reduce_max([float(len(p)) for p in plans])
    return [spread(p, int(n), costs) for p, n in zip(plans, counts)]


def response_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(response tokens | prefix) [B_resp, R] in float32 (0 on padding) and, with
    `with_entropy`, the entropy of each predicting distribution (differentiable only with
    `entropy_grad`, for an entropy bonus: its graph holds the softmax over the vocabulary). `model` is any HF
    causal LM callable (a DeepSpeed engine or the bare module); the vocabulary projection runs only
    on the positions whose logits are needed. Where the model's LM head allows it (`lm_head.fusable_head`)
    it computes log-probs and entropy in chunks of positions (`lm_head.head_logprobs`): the
    [positions, vocabulary] logits never exist whole; else from the logits, logsumexp once for both.

    Padded layout: logits of the last R+1 positions, position P-1+j predicts response token j.
    Group-packed layout (`pack_groups`): logits at `logit_positions`, picked per token by
    `logit_index`."""
    packed = batch.logit_positions is not None
    attention = batch.attention_mask
    if attention is None and batch.segments is not None:  # group-packed: the mask the model's attention takes
        from colo_rl.train.packing import group_attention

        core = getattr(model, "module", model)  # a DeepSpeed engine's `config` is its own, not the model's
        attention = group_attention(batch.segments, batch.prompt_end, core.dtype,
                                    flex=getattr(core.config, "_attn_implementation", None) == "flex_attention")
    inputs = dict(input_ids=batch.input_ids, attention_mask=attention, position_ids=batch.position_ids, use_cache=False,
                  logits_to_keep=batch.logit_positions if packed else batch.response_len + 1)
    # `at`: each response token's predicting position among the kept ones, flattened ([B * U])
    if packed:
        valid, at = batch.logit_index >= 0, batch.logit_index.clamp(min=0)
    else:  # the last R+1 columns of each row are kept; column j < R predicts response token j
        valid = None
        device = batch.input_ids.device
        at = (torch.arange(len(batch), device=device)[:, None] * (batch.response_len + 1)
              + torch.arange(batch.response_len, device=device))
    head = fusable_head(model)
    if head is not None:  # the LM head's log-softmax in chunks: no [positions, V] logits (train/lm_head.py)
        logp, entropy = fused_head_logprobs(model, head, inputs, at, batch.response_ids, temperature,
                                            with_entropy, entropy_grad)
    else:
        logits = model(**inputs).logits
        flat = logits.float().reshape(-1, logits.shape[-1])  # [positions, V]
        if temperature != 1.0:
            flat = flat / temperature
        logz = torch.logsumexp(flat, dim=-1)
        logp = flat[at, batch.response_ids] - logz[at]
        entropy = None
        if with_entropy:
            with torch.enable_grad() if entropy_grad else torch.no_grad():
                entropy = entropy_from_logits(flat, logz)[at]
    if valid is not None:
        logp = torch.where(valid, logp, 0.0)
        entropy = None if entropy is None else torch.where(valid, entropy, 0.0)
    return logp, entropy
