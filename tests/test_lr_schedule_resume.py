"""The learning rate after a resume (colo_rl/train/ds_config.schedule_rates): DeepSpeed restores the
optimizer's saved rate, the checkpoint's schedule's; the next step must take this run's schedule at
the restored position. Real ZeRO-3 actors in a child process (a world of one)."""

import json
import math
import subprocess
import sys

import pytest
from conftest import child_env, child_python_path

PROBE = """
import json, sys, torch
from colo_rl import dist
dist.init()
from colo_rl.config import ModelConfig, RunConfig
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.batch import build_batch

def actor(total):
    cfg = RunConfig()
    cfg.model = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")
    cfg.trainer.lr, cfg.trainer.lr_schedule, cfg.trainer.warmup_steps, cfg.trainer.min_lr_ratio = 1e-3, "cosine", 0, 0.0
    return DeepSpeedActor(cfg, torch.float32, total_steps=total, grad_accum=1)

first = actor(10)
batch = build_batch([[5, 6, 7]] * 2, [[8, 9], [10, 11]], 0)
for _ in range(2):
    logp, _ = first.response_logprobs(batch, 1.0)
    first.backward(-(logp * batch.response_mask).sum(), last_micro_batch=True)
    first.step()
first.save_checkpoint(sys.argv[1], "t")
out = {"saved": first.engine.get_lr()[0]}
for total in (10, 20):
    again = actor(total)
    again.load_checkpoint(sys.argv[1], "t")
    out[str(total)] = again.engine.get_lr()[0]
print(json.dumps(out))
"""


def test_a_resumed_run_takes_its_own_schedule_from_the_next_step(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          env=child_env(PYTHONPATH=child_python_path(), CUDA_VISIBLE_DEVICES=""), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lr = json.loads(proc.stdout.strip().splitlines()[-1])
    cosine = lambda step, total: 1e-3 * 0.5 * (1 + math.cos(math.pi * step / total))  # noqa: E731
    assert lr["saved"] == lr["10"] == pytest.approx(cosine(2, 10), rel=1e-12)  # the same config: the same float
    assert lr["20"] == pytest.approx(cosine(2, 20), rel=1e-12)  # trained on: the longer schedule from the first step
    assert "lr 0.0009045 -> 0.0009755 from this step" in proc.stderr
