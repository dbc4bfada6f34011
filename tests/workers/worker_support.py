"""What several workers build the same way: a recipe (the GRPO recipe class) loaded from its
file, a scripted padded batch and a scripted rollout. Workers run as scripts (torchrun puts this folder first on
sys.path), so they import it as `worker_support`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from colo_rl import dist
from colo_rl.samples import Completion, Rollout, groups_of
from colo_rl.train.batch import TokenBatch, build_batch

ROOT = Path(__file__).resolve().parents[2]


def load_recipe_module(name: str):
    """recipes/<name>.py as a module (a recipe is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location(f"{name}_recipe_under_test", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe():
    """recipes/grpo.py's GRPORecipe."""
    return load_recipe_module("grpo").GRPORecipe


def scripted_batch(step: int) -> TokenBatch:
    """4 random prompts of 6 tokens and responses of 5, different per step and rank."""
    g = torch.Generator().manual_seed(100 * step + dist.rank())
    prompts = torch.randint(3, 400, (4, 6), generator=g).tolist()
    responses = torch.randint(3, 400, (4, 5), generator=g).tolist()
    return build_batch(prompts, responses, pad_id=0)


def scripted_rollout(groups: list[tuple[list[int], list[list[int]]]], rewards: list[float], logprob: float) -> Rollout:
    """A rollout of (prompt, responses) groups, every response token sampled at `logprob`."""
    completions = [Completion(prompt, r, [logprob] * len(r), "stop") for prompt, rs in groups for r in rs]
    n, out = len(completions), Rollout()
    out.keep(groups_of([f"problem {j}" for j in range(len(groups))], len(groups[0][1]), {}, completions=completions,
                       rewards=rewards, correct=[False] * n, lenient=[False] * n, formatted=[False] * n, texts=[""] * n))
    return out
