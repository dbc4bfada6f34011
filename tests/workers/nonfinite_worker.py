"""Run under torchrun (2 gloo ranks): non-finite losses and gradients in the real DeepSpeed actor.

For each ZeRO stage given, a fresh tiny actor takes these optimizer steps:
    1 clean                                    -> applied
    2 NaN loss on rank 1 only                  -> skipped on both ranks, weights unchanged
    3 clean                                    -> applied, the in-a-row count resets
    4 inf gradient on rank 0 only (finite loss) -> skipped on both ranks
    5, 6 NaN loss on rank 0                    -> skipped; the 3rd in a row raises NonFiniteError
Writes <out>.rank<r>.json with what happened (tests/test_faults.py asserts on it).
"""

from __future__ import annotations

import json
import sys

import torch

from colo_rl import algos, console, dist, process_exit
from colo_rl.config import ModelConfig, RunConfig, TrainerConfig
from colo_rl.train.actor import DeepSpeedActor, NonFiniteError
from colo_rl.train.batch import build_batch


def run_stage(stage: int) -> dict:
    cfg = RunConfig(model=ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"),
                    trainer=TrainerConfig(zero_stage=stage, lr=1e-2, micro_batch_size=4, max_nonfinite_steps=3))
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=10)
    g = torch.Generator().manual_seed(dist.rank())
    prompts = [[int(x) for x in torch.randint(5, 1000, (6,), generator=g)] for _ in range(2)]
    resps = [[int(x) for x in torch.randint(5, 1000, (5,), generator=g)] for _ in range(2)]
    batch = build_batch(prompts, resps, 0, per_row={"advantages": [1.0, -1.0]})
    emb = dict(actor.module.named_parameters())["model.embed_tokens.weight"]

    def weights() -> torch.Tensor:
        with actor.gathered(["model.layers.0.mlp.up_proj.weight"]) as [(_, w)]:
            return w.detach().clone()

    def step(loss_scale: float = 1.0, grad_inf: bool = False) -> dict:
        hook = emb.register_hook(lambda grad: grad * float("inf")) if grad_inf else None
        lp, _ = actor.response_logprobs(batch)
        loss, _ = algos.policy_loss(lp, lp.detach(), batch.extras["advantages"], batch.response_mask,
                                    num_tokens=float(batch.response_mask.sum()) * dist.world_size())
        before = weights()
        actor.backward(loss * loss_scale, last_micro_batch=True)
        if hook is not None:
            hook.remove()
        try:
            out = actor.step()
        except NonFiniteError as e:
            return {"error": str(e), "in_a_row": actor.nonfinite_in_a_row, "total": actor.nonfinite_total}
        return {"skipped": out["skipped"], "changed": not torch.equal(before, weights()),
                "finite": bool(torch.isfinite(weights()).all()), "lr": out["lr"], "grad_norm": out["grad_norm"],
                "in_a_row": actor.nonfinite_in_a_row, "total": actor.nonfinite_total}

    r = dist.rank()
    nan = float("nan")
    return {
        "clean": step(),
        "nan_loss_rank1": step(loss_scale=nan if r == 1 else 1.0),
        "clean_again": step(),
        "inf_grad_rank0": step(grad_inf=r == 0),
        "nan_loss_2": step(loss_scale=nan if r == 0 else 1.0),
        "nan_loss_3": step(loss_scale=nan if r == 0 else 1.0),
    }


def main(out: str, stages: str) -> None:
    dist.init()
    console.setup_logging()
    report = {int(s): run_stage(int(s)) for s in stages.split(",")}
    with open(f"{out}.rank{dist.rank()}.json", "w") as fh:
        json.dump(report, fh, indent=1)
    dist.cleanup()


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(sys.argv[1], sys.argv[2]))
