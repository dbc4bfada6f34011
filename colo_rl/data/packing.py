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
    """k preference pairs (.prompt_ids, .chosen_ids/.chosen_mask, .rejected_ids/.rejected_mask) as
    one row [p_1 | c_1 | r_1 | p_2 | c_2 | r_2 | ...]: every prompt is computed once instead of
    twice. Each response attends to its own prompt and its own earlier tokens only and keeps its
    unpacked position ids, so its log-probs equal the padded layout's to float tolerance.

    Targets, masks and the returned log-probs keep the padded pair layout [2k, R]: chosen rows
    first, then rejected (as `build_batch(prompts * 2, chosen + rejected)`); the actor reads the
    logits at `logit_positions` and splits them back per response (`packed_lengths`)."""
    from colo_rl.train.batch import build_batch

    ids: list[int] = []
    positions: list[int] = []
    segments: list[int] = []
    shares: list[tuple[int, int]] = []  # (response segment, its prompt's segment)
    where = {"chosen": [], "rejected": []}
    lengths = {"chosen": [], "rejected": []}
    seg = 0
    for p in pairs:
        start, P = len(ids), len(p.prompt_ids)
        ids += p.prompt_ids
        positions += range(P)
        segments += [seg] * P
        prompt_seg, seg = seg, seg + 1
        for side, resp in (("chosen", p.chosen_ids), ("rejected", p.rejected_ids)):
            if not resp:
                raise ValueError("packed_pairs needs at least one token per response")
            r0 = len(ids)
            ids += resp
            positions += range(P, P + len(resp))
            segments += [seg] * len(resp)
            shares.append((seg, prompt_seg))
            # response token 0 is predicted by the prompt's last position, token j by r0 + j - 1
            where[side] += [start + P - 1] + [r0 + j - 1 for j in range(1, len(resp))]
            lengths[side].append(len(resp))
            seg += 1
    seg_t = torch.tensor([segments])
    mask = block_causal_mask(seg_t, dtype)
    for resp_seg, prompt_seg in shares:  # a response sees its whole prompt (which precedes it)
        rows, cols = seg_t[0] == resp_seg, seg_t[0] == prompt_seg
        mask[0, 0][rows[:, None] & cols[None, :]] = 0.0
    padded = build_batch([p.prompt_ids for p in pairs] * 2, [p.chosen_ids for p in pairs] +
                         [p.rejected_ids for p in pairs], pad_id,
                         response_masks=[p.chosen_mask for p in pairs] + [p.rejected_mask for p in pairs])
    return TokenBatch(torch.tensor([ids]), mask, torch.tensor([positions]), padded.response_ids, padded.response_mask,
                      logit_positions=torch.tensor(where["chosen"] + where["rejected"]),
                      packed_lengths=lengths["chosen"] + lengths["rejected"])
