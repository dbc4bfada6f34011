"""recipes/eval.py: pass@k against hand counts, what the recipe accepts, and a real evaluation of the
embedded model under torchrun (2 gloo ranks) given as a run directory."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from omegaconf import OmegaConf
from test_metrics_doc import undocumented

from colo_rl.checkpoint import CheckpointError, hf_model_dir
from colo_rl.config import ConfigError, RunConfig, validate
from colo_rl.evaluation import pass_at_k, pass_at_k_metrics
from colo_rl.models import embedded_model_dir
from conftest import ROOT, run_torchrun


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (c of them correct) that hold a correct one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_against_hand_counts():
    # 5 samples, 2 right: of the 10 pairs, the 3 drawn from the 3 wrong ones miss -> 7/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the share right
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)  # only 1 of the 10 triples is all wrong
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0  # any 4 hold a right one; none right
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 9)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k)), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_pass_at_k_is_averaged_per_problem():
    counts = [(4, 0, 10), (4, 1, 20), (4, 4, 30)]  # (samples, correct, response tokens)
    m = pass_at_k_metrics(counts, [1, 2])
    assert m["eval/pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert m["eval/pass@2"] == pytest.approx((0 + (1 - 3 / 6) + 1) / 3)  # C(3,2)/C(4,2) of the pairs miss
    assert m["eval/sampled_accuracy"] == pytest.approx(5 / 12) and m["eval/sampled_response_len"] == 5.0


def checked(recipe: str, overrides: list[str] = (), **values) -> None:
    cfg = OmegaConf.structured(RunConfig)
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    validate(cfg, recipe, overrides)


def test_eval_options_are_checked_at_start_up():
    checked("eval", eval__samples=8, eval__pass_k=[1, 8])
    checked("eval", eval__samples=0, eval__pass_k=[1, 64])  # greedy only: pass_k is not read
    with pytest.raises(ConfigError, match=r"eval.pass_k=\[1, 16\]: every k must be in \[1, eval.samples=8\]"):
        checked("eval", eval__samples=8, eval__pass_k=[1, 16])
    with pytest.raises(ConfigError, match=r"trainer.lr is not read by recipes/eval.py \(recipes/eval.py trains"):
        checked("eval", ["trainer.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"rollout.group_size is not read by recipes/eval.py \(set eval.samples\)"):
        checked("eval", ["rollout.group_size=4"])
    with pytest.raises(ConfigError, match=r"eval.samples is not read by recipes/grpo.py"):
        checked("grpo", ["eval.samples=4"])


def test_model_path_may_name_a_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-final").mkdir(parents=True)
    assert hf_model_dir(str(run)) == str(run)  # no export yet, no checkpoint: model.path's own check names it
    (run / "checkpoint-final" / "config.json").write_text("{}")
    assert hf_model_dir(str(run)) == str(run / "checkpoint-final")
    assert hf_model_dir(str(run / "checkpoint-final")) == str(run / "checkpoint-final")
    assert hf_model_dir("embedded") == "embedded"
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints" / "step-000004").mkdir(parents=True)
    (stopped / "checkpoints" / "step-000004" / "COMPLETE").write_text("")
    with pytest.raises(CheckpointError, match=r"without checkpoint-final/.*step-000004.*python -m colo_rl.checkpoint"):
        hf_model_dir(str(stopped))
    # a checkpoint itself: exported beside the run's checkpoints, not into the checkpoint's own directory
    step = stopped / "checkpoints" / "step-000004"
    with pytest.raises(CheckpointError, match=rf"is a training checkpoint .*python -m colo_rl.checkpoint {step} "
                                              rf"{stopped / 'export-step-000004'}`"):
        hf_model_dir(str(step))


@pytest.mark.slow  # the embedded 135M model under DeepSpeed on 2 ranks, 8 problems x (1 + 4) completions: ~1 min
@pytest.mark.e2e
def test_evaluating_a_run_directory_of_the_embedded_model(tmp_path):
    run = tmp_path / "grpo-run"
    run.mkdir()
    (run / "checkpoint-final").symlink_to(embedded_model_dir())  # what a finished run leaves: an HF directory
    out = tmp_path / "eval"
    run_torchrun(ROOT / "recipes" / "eval.py",
                 [f"model.path={run}", "model.dtype=fp32", "data.eval_size=8", "eval.samples=4", "eval.pass_k=[1,2,4]",
                  "rollout.eval_max_new_tokens=40", "logger=[jsonl]", f"run_dir={out}"], timeout=900)
    report = json.loads((out / "eval.json").read_text())
    f = report["figures"]
    assert report["model"] == str(run / "checkpoint-final") and report["problems"] == 8 and report["ranks"] == 2
    counts = [(p["samples"], p["correct"], 0) for p in report["per_problem"]]
    assert len(counts) == 8 and all(n == 4 for n, _, _ in counts)
    for k in (1, 2, 4):  # the figures are the estimator over the report's own per-problem counts
        assert f[f"eval/pass@{k}"] == pytest.approx(sum(pass_at_k(n, c, k) for n, c, _ in counts) / 8)
    assert f["eval/pass@1"] == pytest.approx(f["eval/sampled_accuracy"])
    assert f["eval/pass@1"] <= f["eval/pass@2"] <= f["eval/pass@4"] and f["eval/pass@4"] > 0  # it answers some
    assert 0 < f["eval/response_len"] <= 40 and 0 < f["eval/sampled_response_len"] <= 40
    assert "| pass@4 (4 samples" in (out / "eval.md").read_text()
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["eval/pass@4"] == f["eval/pass@4"]
    assert not undocumented([row]), f"add these to docs/metrics.md: {undocumented([row])}"


@pytest.mark.slow
@pytest.mark.e2e
def test_evaluating_with_an_environment_gives_episodes_and_the_single_answer_figures(tmp_path):
    """env=retry: greedy episodes (a wrong answer is told so and tried again), beside the same problems
    answered once. Greedy first turns are the same in both, and the verifier reads the last stated
    answer, so a retry can only add right answers. A reward function of the user's own, which needs
    a record field, is reported beside the verifier's accuracy in both."""
    out = tmp_path / "eval"
    (tmp_path / "mine.py").write_text("def score(completion, truth, question):\n"  # the truth anywhere in the text
                                      "    return 1.0 if question and truth in completion else 0.0\n")
    run_torchrun(ROOT / "recipes" / "eval.py",
                 ["model.dtype=fp32", "env=retry", "data.eval_size=8", "rollout.eval_max_new_tokens=40",
                  "eval.samples=2", "eval.pass_k=[1,2]", "logger=[jsonl]", f"run_dir={out}",
                  f"reward.functions=[{tmp_path}/mine.py:score]"], timeout=900)
    report = json.loads((out / "eval.json").read_text())
    f = report["figures"]
    assert report["environment"] == "retry" and report["problems"] == 8
    assert report["reward_functions"] == ["mine:score"]
    for prefix in ("eval/", "eval_no_tools/"):  # the field reached the function: no call failed
        assert f[prefix + "reward_failures"] == 0
        assert f[prefix + "accuracy"] <= f[prefix + "reward_source/mine:score"] <= 1  # a right stated answer holds it
    assert "| greedy mean score of your reward function mine:score" in (out / "eval.md").read_text()
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not undocumented([row]), f"add these to docs/metrics.md: {undocumented([row])}"
    assert f["eval/accuracy"] >= f["eval_no_tools/accuracy"]
    assert f["eval_no_tools/response_len"] <= 40 < f["eval/response_len"]  # one turn is capped at 40: episodes went on
    assert f["eval/sampled_response_len"] > 40 and f["eval/pass@1"] <= f["eval/pass@2"]  # samples are episodes too
    assert "environment retry (episodes)" in (out / "eval.md").read_text()
