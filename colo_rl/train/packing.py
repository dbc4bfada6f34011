"""Packed layouts: several sequences per row, no attention across their boundaries (SFT bins, DPO
pair rows, GRPO group rows).

A packed row is [ex_0 | ex_1 | ... | padding]. Each example keeps the position ids it has
unpacked (0, 1, 2, ...), and the attention mask is 4D and block-diagonal causal: a token attends
only to earlier tokens of its own example. With both, every example's logits equal its unpacked
logits (to float tolerance), so the loss is the same; only padding is saved.

The row is laid out as a TokenBatch whose "prompt" is the first token and whose "response" is
the rest (targets are the next tokens), so `DeepSpeedActor.response_logprobs` runs it unchanged.
The 4D mask is additive (0 = attend, dtype-min = masked) in the model's dtype, which SDPA and
eager attention both take. GRPO group rows carry segment ids instead and get their mask on the
device when they run: dense, or a FlexAttention block mask (`group_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colo_rl.samples import Rollout
from colo_rl.train.batch import TokenBatch, build_batch, empty_batch


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
    causal = torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    allowed = same & causal[None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segments.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


FLEX_BLOCK = 128  # FlexAttention's default sparse block (query and key)
BAND_ELEMENTS = 1 << 22  # (query, key) pairs evaluated at once when classifying blocks


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [B, H, QB, KB] 0/1 block map as FlexAttention's (count per query block, key block indices
    with the set ones first, in order): torch's `_dense_to_ordered`."""
    blocks = blocks.to(torch.int32)
    return (blocks.sum(-1).to(torch.int32).contiguous(),
            torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())


def banded_block_mask(rule, B: int, L: int, device):
    """The BlockMask of the mask_mod `rule` over [B, L] rows, built as `create_block_mask` builds it
    (blocks past L padded as masked, full blocks apart from partial ones) but a band of query blocks
    at a time: O(band x L) working memory, not O(L^2). `rule` is evaluated on broadcast index
    tensors (positions past L clamped to L - 1, then masked)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_blocks = -(-L // FLEX_BLOCK)
    Lp = n_blocks * FLEX_BLOCK
    b = torch.arange(B, device=device)[:, None, None]
    k = torch.arange(Lp, device=device)[None, None, :]
    partial = torch.empty((B, 1, n_blocks, n_blocks), dtype=torch.bool, device=device)
    full = torch.empty_like(partial)
    band = max(1, BAND_ELEMENTS // (FLEX_BLOCK * Lp * B))  # query blocks per pass
    for qb in range(0, n_blocks, band):
        q = torch.arange(qb * FLEX_BLOCK, min(n_blocks, qb + band) * FLEX_BLOCK, device=device)[None, :, None]
        allowed = rule(b, 0, q.clamp(max=L - 1), k.clamp(max=L - 1)) & (q < L) & (k < L)
        tiles = allowed.expand(B, -1, -1).reshape(B, -1, FLEX_BLOCK, n_blocks, FLEX_BLOCK)
        some, every = tiles.any(dim=4).any(dim=2), tiles.all(dim=4).all(dim=2)
        partial[:, 0, qb:qb + band] = some & ~every
        full[:, 0, qb:qb + band] = every
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
                                    mask_mod=rule, seq_lengths=(L, L))


def group_attention(segments: torch.Tensor, prompt_end: int, dtype: torch.dtype, flex: bool = False):
    """The attention of group-packed rows (`pack_groups`) from their segment ids [B, L] (0 = the
    group's prompt, i = its response i, negative = padding, one segment per position). Query q may
    attend key k iff

        (k <= q and seg[q] == seg[k])  or  (q >= prompt_end and seg[k] == 0)

    i.e. causally within its own segment, and every response position sees the whole prompt.
    Built on `segments`' device, when the micro-batch runs.

    flex=False: the additive [B, 1, L, L] mask in `dtype` (0 = attend, dtype-min = masked) that SDPA
    and eager attention take: O(L^2) memory (256 MiB in float32 for one 8k-token row) and no
    flash kernel. flex=True: a FlexAttention BlockMask (model.attn_implementation=flex_attention):
    per 128 x 128 block whether it is empty, full or partial, O((L/128)^2); the kernel skips empty
    blocks and evaluates the rule above inside partial ones. The blocks are classified a band of
    query rows at a time (`banded_block_mask`): torch's eager `create_block_mask` evaluates the rule
    at all L^2 pairs at once (0.8 GiB for one 8k-token row on the CPU)."""
    if flex:
        def rule(b, h, q, k):
            return ((k <= q) & (segments[b, q] == segments[b, k])) | ((q >= prompt_end) & (segments[b, k] == 0))

        return banded_block_mask(rule, *segments.shape, segments.device)
    mask = block_causal_mask(segments, dtype)
    mask[:, :, prompt_end:, :prompt_end] = torch.where(segments[:, None, :prompt_end] == 0, 0.0,
                                                       torch.finfo(dtype).min)[:, :, None, :]
    return mask


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


def pack_groups(groups: list[tuple[list[int], list[list[int]], TokenBatch]], dtype: torch.dtype) -> TokenBatch:
    """Several GRPO groups as one micro-batch, each group one row [pad | prompt | r_1 | ... | r_G | pad],
    so the trainer computes each shared prompt once and runs few, large forward passes (on one CPU
    process, 4 groups of 8 per pass instead of 1 cut a ZeRO-3 update from 34 to 24 s: fewer ZeRO
    gathers and partitioned-gradient copies, larger matrix multiplies).

    `groups`: per group its prompt, its G responses and the same rows in the padded layout
    (`TokenBatch.select`), whose targets, masks and extras are kept: the result's response-side
    tensors are the groups' rows stacked in order, [sum G, R].

    Each response keeps the position ids it has unpacked (P, P+1, ...) and attends to its prompt
    and to its own earlier tokens only (a prefix-shared block-causal mask), so its log-probs equal
    the unpacked ones to float tolerance. Prompts are left-padded to end at the same column, so the
    positions whose logits are needed (`logit_positions`, passed as `logits_to_keep`) are nearly
    the same columns in every row; `logit_index` [sum G, R] says which of the kept [B, U] logits
    predicts each response token (-1 on padding). See `response_logprobs`.
    """
    P = max(len(prompt) for prompt, _, _ in groups)
    totals = []
    for prompt, responses, _ in groups:
        if not prompt or min(len(r) for r in responses) < 1:
            raise ValueError("pack_groups needs a prompt and at least one token per response")
        totals.append(sum(len(r) for r in responses))
    B, L = len(groups), P + max(totals)
    ids = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, L), dtype=torch.long)
    segments = -torch.arange(1, L + 1, dtype=torch.long).repeat(B, 1)  # padding: one segment per position
    predictors: list[list[list[int]]] = []  # per group, per response: the column predicting each token
    for b, (prompt, responses, _) in enumerate(groups):
        p0, col, cols = P - len(prompt), P, []
        ids[b, p0:P] = torch.tensor(prompt)
        positions[b, p0:P] = torch.arange(len(prompt))
        segments[b, p0:P] = 0
        for i, r in enumerate(responses):
            n = len(r)
            ids[b, col:col + n] = torch.tensor(r)
            positions[b, col:col + n] = torch.arange(len(prompt), len(prompt) + n)
            segments[b, col:col + n] = i + 1
            cols.append([P - 1] + list(range(col, col + n - 1)))  # token 0 from the prompt's last column
            col += n
        predictors.append(cols)
    kept = sorted({c for cols in predictors for resp in cols for c in resp})
    column = {c: u for u, c in enumerate(kept)}
    R = max(g.response_len for _, _, g in groups)
    index = torch.full((sum(len(g) for _, _, g in groups), R), -1, dtype=torch.long)
    row = 0
    for b, cols in enumerate(predictors):
        for resp in cols:
            index[row, :len(resp)] = torch.tensor([b * len(kept) + column[c] for c in resp])
            row += 1
    widen = lambda t: torch.nn.functional.pad(t, (0, R - t.shape[1]))  # noqa: E731
    parts = [g for _, _, g in groups]
    extras = {k: torch.cat([widen(g.extras[k]) if g.extras[k].dim() == 2 else g.extras[k] for g in parts])
              for k in parts[0].extras}
    # no [L, L] mask here: `response_logprobs` builds it from the segments on the device, dense or
    # as a FlexAttention block mask, whichever the model's attention takes (`group_attention`)
    return TokenBatch(ids, None, positions, torch.cat([widen(g.response_ids) for g in parts]),
                      torch.cat([widen(g.response_mask) for g in parts]), extras=extras,
                      logit_positions=torch.tensor(kept), logit_index=index, segments=segments, prompt_end=P)


@dataclass
class PackedRollout:
    """A rollout as the trainer reads it, built once per step (`pack_rollout`).

    `table`: every completion in the rollout's order, padded ([N, R]: response masks and per-token
    columns such as the engine's log-probs). `micro[j]`: micro-batch j, rows `rows[j]` of the table
    (whole groups, in order), packed or padded; what a micro-batch's forward needs plus the columns
    attached to it (`attach`): old / reference log-probs, advantages. `steps[k]`: the micro-batches
    (a slice of `micro` and `rows`) of optimizer step k of a pass (a mini-batch)."""
    table: TokenBatch
    rows: list[list[int]]
    micro: list[TokenBatch]
    steps: list[slice]

    def attach(self, name: str, column: torch.Tensor) -> None:
        """A column in the table's order ([N] per completion, or [N, R] per token) joins each
        micro-batch as extras[name], in the micro-batch's layout."""
        for rows, mb in zip(self.rows, self.micro):
            if not rows:  # an empty pass: zeros in its one-row shape
                mb.extras[name] = torch.zeros((1,) + ((mb.response_len,) if column.dim() == 2 else ()))
                continue
            part = column[rows]
            mb.extras[name] = part if part.dim() == 1 else part[:, :mb.response_len]

    def logprobs(self, model, temperature: float, check=None) -> torch.Tensor:
        """Log-probs [N, R] of every response under `model` (a DeepSpeedActor or reference; no
        gradient), micro-batch by micro-batch (every rank the same count: collectives); `check`
        (the handoff's LogprobAgreement) sees each micro-batch's engine and trainer log-probs."""
        out = []
        for mb in self.micro:
            mb = model.to_device(mb)  # pinned, non-blocking on a GPU
            logp, _ = model.response_logprobs(mb, temperature, grad=False)
            if check is not None:
                check.add(mb.extras["rollout_logp"], logp, mb.response_mask)
            out.append(logp)
        return self.collect(out)

    def collect(self, per_micro: list[torch.Tensor]) -> torch.Tensor:
        """Per-token values of each micro-batch ([rows, <= R]) back in the table's order, [N, R] (0
        elsewhere), on the host: one device-to-host transfer for the whole pass, then placed on the
        host (a list index into a device tensor would copy it there, blocking, once per micro-batch)."""
        out = torch.zeros(self.table.response_mask.shape, dtype=torch.float32)
        if not per_micro:
            return out
        flat = torch.cat([v.reshape(-1).float() for v in per_micro]).cpu()
        for rows, values, part in zip(self.rows, per_micro, flat.split([v.numel() for v in per_micro])):
            if rows:
                out[rows, :values.shape[1]] = part.view(values.shape)
        return out


def pack_rollout(rollout: Rollout, plan: list[list[list[int]]], pad_id: int, dtype: torch.dtype,
                 packing: bool = True) -> PackedRollout:
    """The rollout's micro-batches, each built once: `plan[k]` lists the micro-batches of mini-batch
    (optimizer step) k, each micro-batch its groups (indices into rollout.groups; [] = an empty pass
    that adds nothing, for ranks with fewer micro-batches). Packed: one row per group
    [prompt | r_1 | ... | r_G] (`pack_groups`); else padded rows."""
    completions = rollout.completions
    masks = [c.policy_mask for c in completions]  # episodes: only the policy's tokens count
    table = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], pad_id,
                        response_masks=None if all(m is None for m in masks) else masks,
                        per_token={"rollout_logp": [c.logprobs for c in completions]})
    group_rows = rollout.group_rows()
    rows, micro, steps = [], [], []
    for mini_batch in plan:
        steps.append(slice(len(micro), len(micro) + len(mini_batch)))
        for groups in mini_batch:
            rows.append([i for g in groups for i in group_rows[g]])
            if not groups:
                micro.append(empty_batch(pad_id, per_token=("rollout_logp",)))
            elif packing:
                micro.append(pack_groups([(rollout.groups[g].prompt_ids,
                                           [c.token_ids for c in rollout.groups[g].completions],
                                           table.select(group_rows[g])) for g in groups], dtype))
            else:
                micro.append(table.select(rows[-1]))
    return PackedRollout(table, rows, micro, steps)
