"""Token batches in the layout the trainer's forward pass wants.

Each row is [left-padded prompt | right-padded response]: every response starts at column P, so
a forward pass needs logits only for the last R+1 positions (`logits_to_keep`), which skips the
LM head and the softmax over the vocabulary for prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]
    response_ids: torch.Tensor  # [B, R] targets
    response_mask: torch.Tensor  # [B, R] 1 on tokens that count for the loss
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row [B] or per-token [B, R]
    # Group-packed rows (see `pack_group`): the input is one row [prompt | r_1 | ... | r_G]; targets
    # and extras keep the [G, R] layout. `logit_positions` are the input positions whose logits
    # predict the concatenated response tokens; `packed_lengths` splits them back per response.
    logit_positions: Optional[torch.Tensor] = None
    packed_lengths: Optional[list[int]] = None

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

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids,
                                                    self.response_ids, self.response_mask)),
                          extras={k: v.to(device) for k, v in self.extras.items()},
                          logit_positions=None if self.logit_positions is None else self.logit_positions.to(device),
                          packed_lengths=self.packed_lengths)


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                response_masks: Optional[list[list[int]]] = None,
                per_token: Optional[dict[str, list[list[float]]]] = None,
                per_row: Optional[dict[str, list[float]]] = None) -> TokenBatch:
    """Collate sequences. `response_masks` defaults to all response tokens counting;
    `per_token` values are aligned with the response tokens and padded with 0."""
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
            m = response_masks[i] if response_masks is not None else [1] * len(r)
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


def micro_batches(n: int, size: int, lengths: Optional[list[int]] = None) -> list[list[int]]:
    """Row indices split into micro-batches of at most `size`; sorted by length when given so each
    micro-batch pads little."""
    order = sorted(range(n), key=lambda i: lengths[i]) if lengths is not None else list(range(n))
    return [order[i:i + size] for i in range(0, n, size)]


def pack_group(prompt: list[int], responses: list[list[int]], group: TokenBatch, dtype: torch.dtype) -> TokenBatch:
    """The G completions of one prompt as a single row [prompt | r_1 | ... | r_G], so the trainer
    computes the shared prompt once instead of G times (GRPO groups share their prompt).

    Each response keeps the position ids it has unpacked (P, P+1, ...) and attends to the prompt
    and to its own earlier tokens only (a prefix-shared block-causal mask), so its log-probs equal
    the unpacked ones to float tolerance. `group` is the same rows in the padded layout
    (`TokenBatch.select`): its targets, mask and extras are kept as they are.
    """
    from colo_rl.data.packing import block_causal_mask

    P, lengths = len(prompt), [len(r) for r in responses]
    if min(lengths) < 1:
        raise ValueError("pack_group needs at least one token per response")
    ids = list(prompt) + [t for r in responses for t in r]
    positions = list(range(P)) + [P + j for n in lengths for j in range(n)]
    segments = [0] * P + [i + 1 for i, n in enumerate(lengths) for _ in range(n)]
    mask = block_causal_mask(torch.tensor([segments]), dtype)
    mask[..., P:, :P] = 0.0  # every response sees the whole prompt (causality holds: P <= query)
    logit_positions, start = [], P
    for n in lengths:  # token 0 is predicted by the last prompt position, token j by start + j - 1
        logit_positions += [P - 1] + [start + j - 1 for j in range(1, n)]
        start += n
    return TokenBatch(torch.tensor([ids]), mask, torch.tensor([positions]), group.response_ids,
                      group.response_mask, extras=group.extras,
                      logit_positions=torch.tensor(logit_positions), packed_lengths=lengths)


def unpack_group(flat: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """[sum(lengths), ...] -> [len(lengths), width, ...], zero-padded (differentiable)."""
    rows = list(torch.split(flat, lengths))
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, [0, 0] * (out.dim() - 2) + [0, width - out.shape[1]])
    return out
