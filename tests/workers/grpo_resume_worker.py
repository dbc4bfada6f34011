"""The real GRPO recipe (recipes/grpo.py, under torchrun) with one extra reward function.

A tiny random model never states a correct answer, so math_verify would score every sample 0, the
advantages would all be 0 and the weights would never move: a resume test could not tell a
restored optimizer from a fresh one. `letter_share` (the share of ASCII letters in the completion)
varies from sample to sample, so every step changes the weights, the optimizer state and what the
engine samples next. Arguments are the recipe's Hydra overrides.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colo_rl.rewards import register_reward  # noqa: E402


@register_reward("letter_share")
def letter_share(completion: str, truth: str) -> float:
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


@register_reward("odd_length")
def odd_length(completion: str, truth: str) -> float:
    """1 for an odd number of characters: some groups of a tiny model's samples score all alike,
    others not, and differently on each rank (DAPO's dynamic sampling then has work to do)."""
    return float(len(completion) % 2)


if __name__ == "__main__":
    sys.argv[0] = str(ROOT / "recipes" / "grpo.py")
    runpy.run_path(str(ROOT / "recipes" / "grpo.py"), run_name="__main__")
