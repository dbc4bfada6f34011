"""update_mfu.py's work: random GRPO groups (a shared prompt, random responses), laid out as a step
lays them out (a row per group, or per sequence without packing) in micro-batches planned as a GRPO
step plans them."""

from __future__ import annotations


def random_groups(args, vocab_size: int) -> list:
    """`args.sequences` random responses in groups sharing a random prompt, seeded: (prompt,
    responses, their padded batch) per group."""
    import torch

    from colo_rl.train.batch import build_batch

    g = torch.Generator().manual_seed(0)
    parts = []
    for _ in range(args.sequences // args.group_size):
        prompt = torch.randint(3, vocab_size, (args.prompt_len,), generator=g).tolist()
        rs = [torch.randint(3, vocab_size, (args.response_len,), generator=g).tolist() for _ in range(args.group_size)]
        parts.append((prompt, rs, build_batch([prompt] * args.group_size, rs, 0).select(list(range(args.group_size)))))
    return parts


def laid_out(parts: list, packing: bool, setting, actor, dtype) -> list:
    """The groups `parts` ((prompt, responses, their padded batch) each) as host micro-batches: a row
    per group (`pack_groups`) or, not packing, a padded row per sequence, its prompt's tokens counted
    once per sequence in the plan's costs."""
    from colo_rl.train.batch import build_batch
    from colo_rl.train.packing import pack_groups

    if packing:
        costs = [len(p) + sum(map(len, rs)) for p, rs, _ in parts]
    else:
        costs = [sum(len(p) + len(r) for r in rs) for p, rs, _ in parts]
    plan = micro_batch_plan(setting, costs, actor)
    if packing:
        return [pack_groups([parts[i] for i in rows], dtype) for rows in plan]
    return [build_batch([parts[i][0] for i in rows for _ in parts[i][1]], [r for i in rows for r in parts[i][1]], 0)
            for rows in plan]


def micro_batch_plan(setting, row_tokens: list[int], actor) -> list[list[int]]:
    """The rows of each micro-batch: `auto` as a GRPO step plans its groups (recipes/grpo.py `pack`:
    whole rows up to `actor.micro_batch_tokens()`, the trainer's budget), or `setting` rows each."""
    from colo_rl.train.batch import agreed_micro_batches

    if setting == "auto":
        return agreed_micro_batches(row_tokens, actor.micro_batch_tokens())
    return [list(range(k, min(k + setting, len(row_tokens)))) for k in range(0, len(row_tokens), setting)]
