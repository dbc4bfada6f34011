"""Embedded SFT and DPO data for the arithmetic task, generated here (no download).

The problems are the arithmetic task's own seeded splits (`make_arithmetic_splits`), so the SFT /
DPO held-out problems are the very problems GRPO evaluates on with the same data settings. Each
target is a short worked answer in the format the GRPO verifier reads:

    12 + 7 = 19. The answer is 19.
    3 + 4 * 5 = 3 + 20 = 23. The answer is 23.

DPO pairs prefer that answer over a plausible wrong one in the same format (an off-by-one or
off-by-ten slip in the last step, or a neighbouring multiplication-table entry).
"""

from __future__ import annotations

import random

from colo_rl.data.arithmetic import ArithmeticTask, make_arithmetic_splits
from colo_rl.data.files import Record

_PREC = {"+": 1, "-": 1, "*": 2}


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def worked_steps(expr: str) -> tuple[list[str], int]:
    """The intermediate expressions after each evaluation step (precedence, then left to right)
    and the value: '3 + 4 * 5' -> (['3 + 20'], 23)."""
    tokens = expr.split()
    nums = [int(t) for t in tokens[0::2]]
    ops = tokens[1::2]
    steps = []
    while ops:
        k = max(range(len(ops)), key=lambda i: (_PREC[ops[i]], -i))  # leftmost highest precedence
        nums[k:k + 2] = [_apply(nums[k], ops[k], nums[k + 1])]
        del ops[k]
        if ops:
            steps.append(" ".join(str(x) for pair in zip(nums, ops + [""]) for x in pair if x != ""))
    return steps, nums[0]


def worked_answer(expr: str, value: int | None = None) -> str:
    """'<expr> = <steps> = v. The answer is v.' (value overrides the computed result: wrong answers)."""
    steps, v = worked_steps(expr)
    v = v if value is None else value
    return " = ".join([expr, *steps, str(v)]) + f". The answer is {v}."


def wrong_value(expr: str, value: int, rng: random.Random) -> int:
    """A plausible wrong result: off by one or two, off by ten, or for a product a neighbouring
    table entry. Never negative, never the right value."""
    candidates = {value + d for d in (-2, -1, 1, 2, -10, 10)}
    if "*" in expr and len(expr.split()) == 3:
        a, _, b = expr.split()
        a, b = int(a), int(b)
        candidates |= {(a + 1) * b, (a - 1) * b, a * (b + 1), a * (b - 1)}
    candidates = sorted(c for c in candidates if c >= 0 and c != value)
    return rng.choice(candidates)


def question(expr: str, instruction: str) -> str:
    """The user turn: the question GRPO's PromptBuilder asks for the same problem."""
    text = f"What is {expr}?"
    return f"{text}\n{instruction}" if instruction else text


def _task(data_cfg) -> ArithmeticTask:
    return ArithmeticTask(data_cfg.min_operand, data_cfg.max_operand, data_cfg.three_operand_fraction,
                          data_cfg.max_operations, data_cfg.max_factor)


def sft_records(data_cfg) -> tuple[list[Record], list[Record]]:
    """Train / held-out records {prompt, completion, answer} for the arithmetic task."""
    train, held = make_arithmetic_splits(_task(data_cfg), data_cfg.train_size, data_cfg.eval_size,
                                         data_cfg.split_seed)

    def rec(split: str, i: int, expr: str, value: int) -> Record:
        return Record({"id": f"{split}-{i}", "prompt": question(expr, data_cfg.instruction),
                       "completion": worked_answer(expr), "answer": str(value)}, f"arithmetic:{split}[{i}]")

    return ([rec("train", i, e, v) for i, (e, v) in enumerate(train)],
            [rec("eval", i, e, v) for i, (e, v) in enumerate(held)])


def preference_records(data_cfg) -> tuple[list[Record], list[Record]]:
    """Train / held-out records {prompt, chosen, rejected, answer}: the right worked answer is
    preferred over a wrong one."""
    train, held = make_arithmetic_splits(_task(data_cfg), data_cfg.train_size, data_cfg.eval_size,
                                         data_cfg.split_seed)

    def recs(split: str, items: list[tuple[str, int]], seed: int) -> list[Record]:
        rng = random.Random(seed)
        out = []
        for i, (expr, value) in enumerate(items):
            out.append(Record({"id": f"{split}-{i}", "prompt": question(expr, data_cfg.instruction),
                               "chosen": worked_answer(expr),
                               "rejected": worked_answer(expr, wrong_value(expr, value, rng)),
                               "answer": str(value)}, f"arithmetic:{split}[{i}]"))
        return out

    return recs("train", train, data_cfg.split_seed * 7 + 1), recs("eval", held, data_cfg.split_seed * 7 + 2)
