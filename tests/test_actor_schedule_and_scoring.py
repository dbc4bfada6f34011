"""The DeepSpeed actor's learning rate after a resume (colo_rl/train/ds_config.schedule_rates: the
next step takes this run's schedule at the restored position, not the optimizer's saved rate) and
its no-grad scoring (no dropout noise). Real ZeRO-3 actors in child processes (a world of one)."""

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


DROPOUT_PROBE = """
import json, torch
from colo_rl import dist
dist.init()
from colo_rl.config import ModelConfig, RunConfig
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.batch import build_batch

cfg = RunConfig()
cfg.model = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")
actor = DeepSpeedActor(cfg, torch.float32, total_steps=2, grad_accum=1)
plain = actor._dropout
for layer in actor.module.model.layers:  # as a model whose config has attention_dropout > 0
    layer.self_attn.attention_dropout = 0.5
actor.module.config.attention_dropout = 0.5
actor._dropout = True
batch = build_batch([[5, 6, 7, 8]] * 2, [[9, 10, 11], [12, 13, 14]], 0)
scored = [actor.response_logprobs(batch, grad=False)[0] for _ in range(2)]
trained = [actor.response_logprobs(batch)[0].detach() for _ in range(2)]
print(json.dumps({"plain_model_has_dropout": plain, "scoring_equal": bool(torch.equal(*scored)),
                  "training_equal": bool(torch.equal(*trained)), "still_training": actor.module.training}))
"""


def test_scoring_runs_without_dropout_and_training_with_it():
    """Old / reference log-probs and held-out losses are no-grad scoring: a model with dropout (GPT-2,
    OPT) gave a different draw each time, so a cached DPO reference was one noisy sample."""
    proc = subprocess.run([sys.executable, "-c", DROPOUT_PROBE], capture_output=True, text=True,
                          env=child_env(PYTHONPATH=child_python_path(), CUDA_VISIBLE_DEVICES=""), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"plain_model_has_dropout": False, "scoring_equal": True, "training_equal": False,
                   "still_training": True}
