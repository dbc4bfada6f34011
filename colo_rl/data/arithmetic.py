"""The embedded default task: seeded integer arithmetic with disjoint train / held-out splits."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticTask:
    min_operand: int = 1
    max_operand: int = 30
    three_operand_fraction: float = 0.2
    max_operations: int = 2  # a multi-operand problem has 2 .. max_operations operations
    max_factor: int = 12  # multiplication operands are kept to 2 .. max_factor

    def sample(self, rng: random.Random) -> tuple[str, int]:
        """One problem: the expression text and its integer value.

        Multiplication operands are kept to 2..max_factor so products stay in the range a small model
        can learn (12 by default); subtraction never goes below zero.
        """
        n_ops = 1
        if rng.random() < self.three_operand_fraction:  # no extra draw at the default: splits stay as they were
            n_ops = 2 if self.max_operations == 2 else rng.randint(2, self.max_operations)
        terms = [rng.randint(self.min_operand, self.max_operand)]
        ops = []
        for _ in range(n_ops):
            op = rng.choice(OPS)
            if op == "*":
                terms[-1] = min(max(terms[-1], 2), self.max_factor)
                nxt = rng.randint(2, self.max_factor)
            else:
                nxt = rng.randint(self.min_operand, self.max_operand)
            ops.append(op)
            terms.append(nxt)
        expr = str(terms[0])
        for op, t in zip(ops, terms[1:]):
            expr += f" {op} {t}"
        value = eval(expr)  # noqa: S307 - expr is built from ints and + - * only
        if value < 0:  # flip a - b into b - a for two-term problems, re-sample otherwise
            if n_ops == 1:
                expr = f"{terms[1]} - {terms[0]}"
                value = -value
            else:
                return self.sample(rng)
        return expr, value


# The embedded task's training problems when data.train_size is not set (null or 0).
EMBEDDED_TRAIN_SIZE = 20000


def make_arithmetic_splits(task: ArithmeticTask, train_size: Optional[int], eval_size: int, seed: int
                           ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Seeded train and held-out problem lists with no expression in both; `train_size` null or 0:
    EMBEDDED_TRAIN_SIZE.

    The held-out split is drawn first from its own stream, so it does not change when
    `train_size` changes: step-0 and final evaluations of different runs are comparable.
    """
    eval_rng = random.Random(seed * 1_000_003 + 17)  # not the training stream (Random(seed)) of any usual seed
    held_out: dict[str, int] = {}
    tries = 0
    while len(held_out) < eval_size:
        expr, value = task.sample(eval_rng)
        held_out.setdefault(expr, value)
        tries += 1
        if tries > 100 * max(eval_size, 1):
            raise ValueError("data: the operand range is too small for that many distinct held-out problems")
    train_size = train_size or EMBEDDED_TRAIN_SIZE
    train_rng = random.Random(seed)
    train: list[tuple[str, int]] = []
    tries = 0
    while len(train) < train_size:
        expr, value = task.sample(train_rng)
        tries += 1
        if expr not in held_out:
            train.append((expr, value))
        if tries > 100 * max(train_size, 1):
            raise ValueError("data: the operand range is too small for that many training problems")
    return train, list(held_out.items())
