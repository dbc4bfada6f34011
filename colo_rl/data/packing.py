"""Sequence packing for SFT: several examples per row, no attention across their boundaries.

A packed row is [ex_0 | ex_1 | ... | padding]. Each example keeps the position ids it has
unpacked (0, 1, 2, ...), and the attention mask is 4D and block-diagonal causal: a token attends
only to earlier tokens of its own example. With both, every example's logits equal its unpacked
logits (to float tolerance), so the loss is the same; only padding is saved.

The row is laid out as a TokenBatch whose "prompt" is the first token and whose "response" is
the rest (targets are the next tokens), so `DeepSpeedActor.response_logprobs` runs it unchanged.
The 4D mask is additive (0 = attend, dtype-min = masked) in the model's dtype, which SDPA and
eager attention both take; flash-attention kernels would need position-id packing instead.
"""

from __future__ import annotations

import torch

from colo_rl.train.batch import TokenBatch


def pack_bins(lengths: list[int], max_len: int) -> list[list[int]]:
    """First-fit decreasing: indices grouped into bins of total length <= max_len (an item longer
    than max_len gets a bin of its own). Deterministic: ties keep index order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_len - lengths[i])
    return [sorted(b) for b in bins]


def block_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] segment ids (distinct per example; padding positions each their own) -> additive
    [B, 1, L, L] mask: 0 where key k <= query q in the same segment, dtype-min elsewhere."""
    L = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = same & causal[None]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def packed_batch(rows: list[list[tuple[list[int], list[int]]]], pad_id: int, dtype: torch.dtype = torch.float32,
                 example_ids: list[list[int]] | None = None) -> TokenBatch:
    """rows: per row, its examples as (token ids, loss mask per token). A token's mask says whether
    predicting it counts; an example's first token never counts (nothing of its own precedes it).

    extras["example"] [B, L-1]: the `example_ids` entry (default: running index) of each target
    token's example, -1 on padding, for per-example losses."""
    B = len(rows)
    L = max(2, max(sum(len(ids) for ids, _ in row) for row in rows))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    target_mask = torch.zeros((B, L), dtype=torch.float32)
    owner = torch.full((B, L), -1, dtype=torch.float32)
    segments = -torch.arange(1, L + 1, dtype=torch.long).repeat(B, 1)  # padding: one segment per position
    k = 0
    for b, row in enumerate(rows):
        col = 0
        for j, (tok, m) in enumerate(row):
            n = len(tok)
            ids[b, col:col + n] = torch.tensor(tok, dtype=torch.long)
            pos[b, col:col + n] = torch.arange(n)
            target_mask[b, col:col + n] = torch.tensor(m, dtype=torch.float32)
            target_mask[b, col] = 0.0
            owner[b, col:col + n] = float(example_ids[b][j] if example_ids is not None else k)
            segments[b, col:col + n] = k
            col += n
            k += 1
    attn = block_causal_mask(segments, dtype)
    return TokenBatch(ids, attn, pos, ids[:, 1:].clone(), target_mask[:, 1:].clone(),
                      extras={"example": owner[:, 1:].clone()})


def packed_pairs(pairs: list, pad_id: int, dtype: torch.dtype = torch.float32) -> TokenBatch:
    """k preference pairs (.prompt_ids, .chosen_ids/.chosen_mask, .rejected_ids/.rejected_mask)
    as k rows [prompt | chosen | p' | rejected]: each prompt is computed once instead of twice.

    p' is a copy of the prompt's last token at its position (P - 1) that attends to the rest of
    the prompt only, so its output is the prompt's last output again and predicts the rejected
    response's first token. Chosen attends to the prompt and itself; rejected to the prompt's
    first P - 1 tokens, p' and itself; both keep their unpacked position ids (P, P + 1, ...).
    So every log-prob equals the padded layout's (to float tolerance) while a pair costs
    P + C + 1 + R tokens instead of 2P + C + R.

    The rows use the standard [left-padded prompt | response] layout with a 4D additive mask;
    extras chosen_mask / rejected_mask [k, R] pick each side's trained tokens (see
    `offline.split_pair_logps`)."""
    from colo_rl.train.batch import build_batch

    responses, masks, chosen_masks, rejected_masks = [], [], [], []
    for p in pairs:
        if not p.prompt_ids or not p.chosen_ids or not p.rejected_ids:
            raise ValueError("packed_pairs needs a prompt and at least one token per response")
        C, R = len(p.chosen_ids), len(p.rejected_ids)
        responses.append(p.chosen_ids + [p.prompt_ids[-1]] + p.rejected_ids)
        masks.append(list(p.chosen_mask) + [0] + list(p.rejected_mask))
        chosen_masks.append(list(p.chosen_mask) + [0] * (1 + R))
        rejected_masks.append([0] * (C + 1) + list(p.rejected_mask))
    batch = build_batch([p.prompt_ids for p in pairs], responses, pad_id, response_masks=masks,
                        per_token={"chosen_mask": chosen_masks, "rejected_mask": rejected_masks})
    B, L = batch.input_ids.shape
    Pmax = L - batch.response_len
    allowed = torch.eye(L, dtype=torch.bool).repeat(B, 1, 1)  # padding attends to itself only
    positions = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(pairs):
        P, C, R = len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)
        s, c0 = Pmax - P, Pmax  # prompt start, chosen start
        b = c0 + C  # p'
        r0 = b + 1
        tril = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
        allowed[i, s:c0, s:c0] = tril(P)
        allowed[i, c0:b, s:c0] = True
        allowed[i, c0:b, c0:b] = tril(C)
        allowed[i, b:r0 + R, s:c0 - 1] = True  # p' and rejected see the prompt but its last token
        allowed[i, b:r0 + R, b:r0 + R] = tril(R + 1)
        positions[i, s:c0] = torch.arange(P)
        positions[i, c0:b] = torch.arange(P, P + C)
        positions[i, b] = P - 1
        positions[i, r0:r0 + R] = torch.arange(P, P + R)
    mask = torch.zeros((B, 1, L, L), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return TokenBatch(batch.input_ids, mask, positions, batch.response_ids, batch.response_mask, extras=batch.extras)
