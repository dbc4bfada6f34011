"""The GRPO recipe end to end under torchrun (2 gloo ranks, tiny model): what a run leaves behind,
and golden values of its first steps (in the manner of torchtune's recipe tests).

The tiny random model never states a right answer, so the verifier rewards are all 0 and so would
be the advantages; `letter_share` (tests/workers/grpo_resume_worker.py) varies from sample to
sample, so the advantages, the gradients and the weights really move, and a KL reference is on.
"""

import json

import pytest
import torch

from conftest import WORKERS, run_torchrun
from test_metrics_doc import undocumented

pytestmark = pytest.mark.slow

KEYS = ["reward/mean", "reward/std", "reward/accuracy", "response/len_mean", "train/clip_frac", "train/entropy",
        "train/grad_norm", "train/lr", "time/generation", "time/reward", "time/update", "time/handoff",
        "time/phase_switch", "time/step", "throughput/gen_tokens_per_s", "handoff/logprob_diff_mean", "train/kl",
        "reward/zero_std_groups"]
# Steps 1 and 2 of this run on this machine's CPU (fp32, 2 gloo ranks, seed 42): loss, grad norm,
# mean reward. A change to the sampling, the advantages, the loss or the update shows up here.
GOLDEN = {"train/loss": [1.3597309589385986e-06, 5.079631591797806e-05],
          "train/grad_norm": [1.2571869143972587, 1.166116412591196],
          "reward/mean": [0.8861164152622223, 0.8811561763286591]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo") / "run"
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 ["model=tiny", "trainer.total_steps=2", "data.eval_size=8", "rollout.prompts_per_step=4",
                  "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8",
                  "algo.kl_coef=0.01", "trainer.micro_batch_size=8", "trainer.lr=1e-3",  # 2 packed groups per pass
                  "reward.functions=[letter_share]", "reward.format_weight=0",
                  "colocate.handoff_check_max_mean_abs=0.001", "trainer.profile_steps=[2]", f"run_dir={d}"],
                 timeout=600)
    return d


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_run_directory_has_every_output(run_dir):
    for name in ["metrics.jsonl", "ledger.jsonl", "reward_curve.png", "config.yaml", "summary.json",
                 "checkpoint-final/config.json"]:
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["bottleneck"]["bound"] in ("rollout", "train") and summary["steps"] == 2


def test_metrics_have_one_line_per_step_with_every_key(run_dir):
    r = rows(run_dir)
    assert [x["step"] for x in r] == [0, 1, 2]
    assert "eval/accuracy" in r[0] and "eval/accuracy" in r[-1]
    # the last evaluation followed an update: it handed the engine the new weights, and says so
    assert r[-1]["time/eval_handoff"] > 0 and r[-1]["time/eval_phase_switch"] > 0
    assert r[-1]["time/eval"] > r[-1]["time/eval_handoff"] + r[-1]["time/eval_phase_switch"]
    # the final save switched back to the update phase, and its row says what that and the save cost
    assert r[-1]["time/save"] > r[-1]["time/save_phase_switch"] > 0 and "time/save_handoff" not in r[-1]
    for row in r[1:]:
        missing = [k for k in KEYS if k not in row]
        assert not missing, missing
        assert row["handoff/logprob_diff_mean"] < 1e-3
        assert row["train/lr"] == pytest.approx(1e-3)
        # letter_share differs between a group's samples: every group carries a signal (TRL's frac_reward_zero_std)
        assert row["reward/zero_std_groups"] == 0.0
    assert not undocumented(r), f"add these to docs/metrics.md: {undocumented(r)}"


def test_first_steps_match_the_golden_values(run_dir):
    r = rows(run_dir)[1:]
    actual = {k: [row[k] for row in r] for k in GOLDEN}
    assert all(g > 0 for g in actual["train/grad_norm"]), actual  # the weights move
    for key, values in GOLDEN.items():
        assert actual[key] == pytest.approx(values, rel=1e-4, abs=1e-6), (key, actual[key])


def test_rollouts_jsonl_shows_what_the_policy_wrote_and_was_paid(run_dir):
    """log_rollout_groups=1 (default): each step's first group of rank 0's batch, one line per
    completion; the reward is the letter_share of the very text written (the verifier's input)."""
    lines = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group"], r["sample"]) for r in lines] == [(s, 0, i) for s in (1, 2) for i in range(4)]
    for r in lines:
        text = r["completion"]
        share = sum(c.isascii() and c.isalpha() for c in text) / max(1, len(text))
        assert r["sources"]["letter_share"] == pytest.approx(share) and r["reward"] == pytest.approx(share)
        assert r["policy_version"] == r["step"] - 1 and 1 <= r["tokens"] <= 8
        assert r["finish_reason"] in ("stop", "length") and r["prompt"] and r["answer"] is not None
    assert len({r["prompt"] for r in lines if r["step"] == 1}) == 1  # one group: one prompt


def test_ledger_covers_every_transition(run_dir):
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    # step-0 eval, then per step: generation->update and update->generation, then the final eval
    kinds = [r["transition"] for r in records]
    assert kinds[0] == "update->generation" and kinds.count("generation->update") == 3
    assert kinds.count("update->generation") == 3
    assert [r["step"] for r in records if r["transition"] == "generation->update"] == [0, 1, 1]


def test_final_checkpoint_holds_the_trained_weights(run_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint-final")
    tok = AutoTokenizer.from_pretrained(run_dir / "checkpoint-final")
    ids = tok("What is 1 + 1?", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
    assert model.config.num_hidden_layers == 2
    # the exported weights are the trained ones, not the seeded initial ones
    from colo_rl.config import ModelConfig
    from colo_rl.models import load_model

    initial = load_model(ModelConfig(path="embedded", random_init=True, hidden_size=64, num_layers=2),
                         torch.float32, seed=42).state_dict()
    final = load_file(str(run_dir / "checkpoint-final" / "model.safetensors"))
    moved = [n for n in final if n in initial and not torch.equal(final[n], initial[n])]
    assert len(moved) > len(final) // 2, moved


def tiny_run(steps: int) -> list[str]:
    """The 2-rank tiny GRPO run these tests vary: model=tiny, 4 prompts x 2 completions of <= 6 tokens."""
    return ["model=tiny", f"trainer.total_steps={steps}", "data.eval_size=2", "rollout.prompts_per_step=4",
            "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.eval_max_new_tokens=4"]


@pytest.mark.e2e
def test_dynamic_sampling_keeps_every_rank_in_step(tmp_path):
    """DAPO's dynamic sampling under torchrun (2 ranks): uninformative groups are set aside and
    more prompts sampled; each rank keeps the same number of groups, so the ZeRO-3 passes line up
    and the run finishes (a mismatch would hang a collective until the timeout)."""
    d = tmp_path / "run"
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 [*tiny_run(2), "trainer.micro_batch_size=4", "trainer.lr=1e-3", "reward.functions=[odd_length]",
                  "reward.format_weight=0", "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2",
                  "logger=[jsonl]", "plots=false", f"run_dir={d}"], timeout=600)
    r = rows(d)[1:]
    assert len(r) == 2
    for row in r:
        assert 1 <= row["sampling/rounds"] <= 3  # the first round plus at most max_sampling_rounds
        # the trained groups without a signal are exactly the set-aside ones that filled the batch (4 groups a step)
        assert row["reward/zero_std_groups"] == pytest.approx(row["sampling/filled_groups"] / 4)
        if row["sampling/filled_groups"] == 0:  # every kept group of 2 has one odd and one even answer
            assert row["reward/mean"] == pytest.approx(0.5) and row["train/grad_norm"] > 0
    assert max(row["sampling/rounds"] for row in r) > 1  # extra rounds were sampled


@pytest.mark.e2e
def test_groups_without_a_signal_are_counted(tmp_path):
    """The tiny random model never states a right answer: with the format reward off every reward is
    0, so every group is flat (reward/zero_std_groups = 1, TRL's frac_reward_zero_std) and nothing is learned."""
    d = tmp_path / "run"
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 [*tiny_run(1), "reward.format_weight=0", "logger=[jsonl]", "plots=false", f"run_dir={d}"], timeout=600)
    row = rows(d)[1]
    assert row["reward/mean"] == 0.0 and row["reward/zero_std_groups"] == 1.0
    assert row["train/grad_norm"] == 0.0


@pytest.mark.e2e
def test_off_policy_mini_batches_log_the_policy_loss_statistics(tmp_path):
    """Four optimizer steps per rollout batch (two mini-batches, two PPO epochs over them; one run
    for both loops) with dual-clip on: all but the first see weights the samples did not come from,
    so their importance ratios leave 1; every statistic the policy loss returns (clip fraction,
    dual-clip fraction, mean ratio, KL to pi_old) and the engine-vs-trainer check reach metrics.jsonl."""
    d = tmp_path / "run"
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 [*tiny_run(1), "trainer.micro_batch_size=2", "trainer.lr=1e-2", "trainer.mini_batches_per_step=2",
                  "trainer.ppo_epochs=2",
                  "algo.clip_ratio_c=1.5", "reward.functions=[letter_share]", "reward.format_weight=0",
                  "logger=[jsonl]", "plots=false", f"run_dir={d}"], timeout=600)
    row = rows(d)[1]
    for key in ("train/clip_frac", "train/dual_clip_frac", "train/ratio_mean", "train/approx_kl_old"):
        assert key in row, key
    # measured before the first optimizer step, so as exact as on-policy (fp32 tiny model)
    assert row["handoff/logprob_diff_mean"] < 1e-4 and "handoff/logprob_diff_max" in row
    assert row["train/ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # the second mini-batch is off-policy
    assert row["train/approx_kl_old"] > 0
    assert 0 <= row["train/dual_clip_frac"] <= 1
    # the four optimizer steps' gradient norms: their mean and the largest, not the last one's alone
    assert row["train/grad_norm_max"] > row["train/grad_norm"] > 0


@pytest.mark.e2e
def test_rollout_correction_and_the_mismatch_metrics_reach_the_log(tmp_path):
    """Issue #40 under torchrun (2 ranks): IcePop with a band of [1, 1] drops every token on which the
    engine's and the trainer's fp32 log-probs differ at all (a few float roundings), the mismatch
    metrics are logged every step, and REINFORCE++'s KL-in-reward coefficient adapts to a per-token
    target."""
    d = tmp_path / "run"
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 [*tiny_run(2), "trainer.micro_batch_size=4", "trainer.lr=1e-3", "reward.functions=[letter_share]",
                  "reward.format_weight=0", "algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.05",
                  "algo.kl_target=1e-6", "algo.kl_horizon=10", "algo.rollout_correction=icepop",
                  "algo.rollout_is_threshold=1.0", "logger=[jsonl]", "plots=false", f"run_dir={d}"], timeout=600)
    r = rows(d)[1:]
    assert len(r) == 2
    for row in r:
        assert 0 <= row["mismatch/kl_k3"] < 1e-4 and abs(row["mismatch/kl_k1"]) < 1e-4
        assert 0 <= row["mismatch/tokens_masked_frac"] <= 1 and row["mismatch/tokens_truncated_frac"] == 0
        assert 0.99 < row["mismatch/ratio_max"] < 1.01 and row["mismatch/seq_ratio_max"] > 0
    assert max(row["mismatch/tokens_masked_frac"] for row in r) > 0  # some token differs in its last bits
    assert r[0]["mismatch/seqs_masked_frac"] >= r[0]["mismatch/tokens_masked_frac"]
    # step 1: policy = reference, the observed KL ~ 0 is under target: coef * (1 - 0.2 * 8 sequences / 10)
    assert r[0]["train/kl_in_reward_coef"] == pytest.approx(0.05)
    assert r[1]["train/kl_in_reward_coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 10))


def test_the_profiled_step_says_where_its_time_went(run_dir):
    """trainer.profile_steps=[2]: both ranks' traces of step 2 (only), and rank 0's summary naming
    the recipe's sections, the phase switches and the host's time by package (ZeRO-3: DeepSpeed's)."""
    out = run_dir / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["step2-rank0.trace.json.gz", "step2-rank1.trace.json.gz",
                                                     "step2.json", "step2.md"]
    summary = json.loads((out / "step2.json").read_text())
    sections = summary["sections"]
    assert {"generation", "reward", "pack", "update", "phase switch to_generation", "phase switch to_train"} <= set(sections)
    assert summary["world_size"] == 2 and sections["update"]["wall_s"] < summary["step_s"] < summary["wall_s"]
    assert summary["step_s"] == sections["step"]["wall_s"]  # the loop's own section: shares are of it
    assert summary["host"]["by_package"]["deepspeed"] > 0 and summary["host"]["by_package"]["torch"] > 0
    assert "| update |" in (out / "step2.md").read_text()
