"""The real GRPO recipe (recipes/grpo.py, under torchrun) with a test environment whose episodes
differ per rank: a tiny random model never calls a real tool, so `rank_turns` decides itself: on
rank 0 every episode ends after its first turn, on rank 1 every turn is answered with an
observation (3 turns with env.max_turns=3: more engine calls and longer responses there). Arguments are the recipe's Hydra overrides."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from colo_rl.envs import ENVIRONMENTS, Step  # noqa: E402  (registered before colo_rl.config reads the names)
from colo_rl.envs.calls import ParsedTurn  # noqa: E402
from colo_rl.rewards import register_reward  # noqa: E402


class RankTurns:
    def __init__(self, cfg, chat_template):
        self.rank = int(os.environ.get("RANK", "0"))

    def first_messages(self, messages):
        return messages

    def chat_template_kwargs(self):
        return {}

    def parse(self, text):
        return ParsedTurn(error="every turn asks", end=None)

    def step(self, text, closed):
        if self.rank == 0:
            return Step()  # done after its first turn
        return Step(observation="<|im_end|>\n<|im_start|>user\nobservation" + " more" * 8 + "<|im_end|>\n"
                                "<|im_start|>assistant\n", error="every turn asks")


@register_reward("policy_letters")
def policy_letters(completion: str, truth: str) -> float:
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


if __name__ == "__main__":
    ENVIRONMENTS.register("rank_turns")(RankTurns)
    sys.argv[0] = str(ROOT / "recipes" / "grpo.py")
    runpy.run_path(str(ROOT / "recipes" / "grpo.py"), run_name="__main__")
