"""The GRPO recipe end to end under torchrun (2 gloo ranks, tiny model): what a run leaves behind."""

import json

import pytest
import torch

from conftest import ROOT, run_torchrun

pytestmark = pytest.mark.slow

KEYS = ["reward/mean", "reward/std", "reward/accuracy", "response/len_mean", "train/clip_frac", "train/entropy",
        "train/grad_norm", "train/lr", "time/generation", "time/reward", "time/update", "time/handoff",
        "time/phase_switch", "time/step", "throughput/gen_tokens_per_s", "handoff/logprob_diff_mean"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo") / "run"
    run_torchrun(ROOT / "recipes" / "grpo.py",
                 ["model=tiny", "trainer.total_steps=2", "data.eval_size=8", "rollout.prompts_per_step=4",
                  "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8",
                  "algo.kl_coef=0.01", "trainer.micro_batch_size=8", "trainer.lr=1e-3",  # 2 packed groups per pass
                  "rollout.handoff_check_max_mean_abs=0.001", f"run_dir={d}"], timeout=600)
    return d


def test_run_directory_has_every_output(run_dir):
    for name in ["metrics.jsonl", "ledger.jsonl", "reward_curve.png", "config.yaml", "checkpoint-final/config.json"]:
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_metrics_have_one_line_per_step_with_every_key(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for row in rows[1:]:
        missing = [k for k in KEYS + ["train/kl"] if k not in row]
        assert not missing, missing
        assert row["handoff/logprob_diff_mean"] < 1e-3
        assert row["train/lr"] == pytest.approx(1e-3)


def test_ledger_covers_every_transition(run_dir):
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    # step-0 eval, then per step: generation->update and update->generation, then the final eval
    kinds = [r["transition"] for r in records]
    assert kinds[0] == "update->generation" and kinds.count("generation->update") == 3
    assert kinds.count("update->generation") == 3


def test_final_checkpoint_loads_with_transformers(run_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint-final")
    tok = AutoTokenizer.from_pretrained(run_dir / "checkpoint-final")
    ids = tok("What is 1 + 1?", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
    assert model.config.num_hidden_layers == 2
