"""Run under torchrun (2 gloo ranks): the gradient of GRPORecipe.update does not depend on how the
step is split into micro-batches.

Rank 0 holds 8 groups of 4 completions (responses of 3, 5, 7 and 9 tokens, so every group is one
30-token packed row but the sequences differ in length), rank 1 three (`make_rollout`); the real DeepSpeed ZeRO-3 actor (fp32,
tiny model) runs the recipe's update with trainer.micro_batch_tokens = 10^6, 120 and 1: 1, 2 and
8 micro-batches per rank, for every algo.loss_agg mode. The optimizer step is replaced by a capture
of the full (all-rank) gradient, then the gradient is discarded, so every split sees the same weights.
Writes <out>.rank<r>.json: per mode and split, the micro-batch count and the largest gradient
difference to the 1-micro-batch split relative to the gradient's largest entry (test_micro_batches.py).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from deepspeed.utils import safe_get_full_grad

from colo_rl import algos, dist
from colo_rl.config import ModelConfig, RunConfig, TrainerConfig
from colo_rl.metrics import Timer
from colo_rl.samples import Rollout
from colo_rl.train.actor import DeepSpeedActor
from worker_support import load_recipe, scripted_rollout

G, GROUPS = 4, 8
SPLITS = {1_000_000: 1, 120: 2, 1: 8}  # micro_batch_tokens -> micro-batches per rank


def make_rollout(rank: int) -> Rollout:
    """Rank 0: 8 groups. Rank 1: 3, so it runs empty passes to keep the collectives in step (the
    8-micro-batch split), with a 1-token response and a completion whose policy mask is all zero
    (an episode of observations only): it counts in no loss mode's tokens."""
    gen = torch.Generator().manual_seed(100 + rank)
    ids = lambda n: [int(x) for x in torch.randint(5, 1000, (n,), generator=gen)]  # noqa: E731
    groups = []
    for j in range(GROUPS if rank == 0 else 3):
        prompt = ids(6)
        lengths = [3, 5, 7, 9][j % 4:] + [3, 5, 7, 9][:j % 4]
        if rank == 1 and j == 0:
            lengths[0] = 1
        groups.append((prompt, [ids(n) for n in lengths]))
    rollout = scripted_rollout(groups, torch.rand(len(groups) * G, generator=gen).tolist(), -2.0)
    if rank == 1:
        rollout.completions[-1].policy_mask = [0] * len(rollout.completions[-1].token_ids)
    return rollout


def main(out: str) -> None:
    cfg = RunConfig(model=ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"),
                    trainer=TrainerConfig(zero_stage=3, lr=1e-2))
    cfg.rollout.group_size = G
    cfg.colocate.handoff_check_max_mean_abs = 1e9  # the scripted log-probs are not the model's
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=10)
    cls = load_recipe()
    recipe = cls.__new__(cls)  # what update() reads, without __init__'s engine
    recipe.cfg, recipe.colo, recipe.timer = cfg, SimpleNamespace(actor=actor, ref=None), Timer()
    recipe.tokenizer = SimpleNamespace(pad_token_id=0)
    recipe.kl_ctl = algos.AdaptiveKLController(0.0, None, 1)
    captured: dict = {}

    def capture_gradient_then_discard() -> dict:
        captured["grad"] = torch.cat([safe_get_full_grad(p).detach().float().flatten().clone()
                                      for p in actor.module.parameters()])
        actor.engine.optimizer.zero_grad()  # ZeRO-3's own: the next pass copies into the gradient partitions
        return {"grad_norm": float(captured["grad"].norm()), "lr": 0.0, "skipped": 0.0}

    actor.step = capture_gradient_then_discard
    packs = []
    pack = recipe.pack
    recipe.pack = lambda rollout: packs.append(pack(rollout)) or packs[-1]
    rollout = make_rollout(dist.rank())
    report = {}
    for mode in algos.LOSS_AGGREGATIONS.names():
        cfg.algo.loss_agg = mode
        # the one mode that divides by a constant length (the same value on every split)
        cfg.algo.loss_scale_factor = float(cfg.rollout.max_new_tokens) if mode == "seq-mean-token-sum-norm" else None
        grads = {}
        for budget, _ in SPLITS.items():
            cfg.trainer.micro_batch_tokens = str(budget)
            actor._micro_batch_tokens = None  # sized anew for this split
            stats = recipe.update(copy.deepcopy(rollout))
            grads[budget] = (captured["grad"], len(packs[-1].micro), stats["train/loss"])
        whole, _, loss_whole = grads[1_000_000]
        scale = float(whole.abs().max())
        report[mode] = {str(budget): {"micro_batches": n, "max_rel_diff": float((g - whole).abs().max()) / scale,
                                      "loss_diff": abs(loss - loss_whole),
                                      "loss": abs(loss_whole), "grad_max": scale}
                        for budget, (g, n, loss) in grads.items()}
    Path(f"{out}.rank{dist.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    dist.init()
    main(sys.argv[1])
