"""One rank: a bf16 DeepSpeedActor on an fp32 checkpoint (tests/test_master_weights.py) writes what its
fp32 master weights and bf16 weights hold against the checkpoint's values, before and after one step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from colo_rl import dist, process_exit
from colo_rl.config import ModelConfig, RunConfig  # noqa: E402
from colo_rl.train.actor import DeepSpeedActor  # noqa: E402
from tests.workers.worker_support import scripted_batch  # noqa: E402


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    dist.init()
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import load_file

    cfg = RunConfig()
    cfg.model = ModelConfig(path=model_dir, dtype="bf16")
    cfg.trainer.lr = 1e-5
    actor = DeepSpeedActor(cfg, torch.bfloat16, total_steps=4)
    ckpt = load_file(str(Path(model_dir) / "model.safetensors"))
    params = dict(actor.module.named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    master = safe_get_full_fp32_param(params[name]).cpu()
    with torch.no_grad():
        import deepspeed
        with deepspeed.zero.GatheredParameters([params[name]]):
            low = params[name].detach().float().cpu().clone()
    b = scripted_batch(0)
    lp, _ = actor.response_logprobs(b)
    actor.backward(-(lp * b.response_mask).sum() / b.response_mask.sum(), last_micro_batch=True)
    actor.step()
    after = safe_get_full_fp32_param(params[name]).cpu()
    Path(out).write_text(json.dumps({
        "master_equals_checkpoint": bool(torch.equal(master, ckpt[name])),
        "checkpoint_off_grid_share": float((ckpt[name].bfloat16().float() != ckpt[name]).float().mean()),
        "low_is_rounded_checkpoint": bool(torch.equal(low, ckpt[name].bfloat16().float())),
        "master_moved": float((after - master).abs().max()),
    }))


if __name__ == "__main__":
    process_exit.run_and_exit(main)
