"""rollouts.jsonl (metrics.RolloutLog): one line per completion of the first groups of the step's
batch, with what the verifier read, the rewards by source and shaping, and an episode's transcript."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from colo_rl.metrics import RolloutLog
from colo_rl.samples import Completion, Rollout, groups_of


def _rollout() -> Rollout:
    problems = [SimpleNamespace(answer="4", q="2+2"), SimpleNamespace(answer="9", q="3*3")]
    completions = [Completion([1, 2], [5, 6], [-0.1, -0.2], "stop"),
                   Completion([1, 2], [7, 8, 9], [-0.1, -0.2, -0.3], "length", policy_mask=[1, 0, 1]),
                   Completion([3], [5], [-0.5], "stop"), Completion([3], [6], [-0.6], "stop")]
    groups = groups_of(problems, 2, {"math": [1.0, 0.0, float("nan"), 1.0]}, completions=completions,
                       rewards=[1.0, 0.0, float("nan"), 1.0], correct=[True, False, False, True],
                       texts=["4", "five", "?", "9"])
    rollout = Rollout(policy_version=3)
    rollout.keep(groups)
    rollout.add_shaping("overlong", torch.tensor([0.0, -0.5, 0.0, 0.0]))
    return rollout


def test_each_completion_of_the_first_groups_is_a_json_line(tmp_path):
    log = RolloutLog(tmp_path, 1, prompt_text=lambda p: f"Q: {p.q}", decode=lambda ids: " ".join(map(str, ids)))
    log.write(4, _rollout())
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["group"], r["sample"], r["policy_version"]) for r in rows] == [(4, 0, 0, 3), (4, 0, 1, 3)]
    assert [r["completion"] for r in rows] == ["4", "five"] and rows[0]["prompt"] == "Q: 2+2"
    assert [r["sources"] for r in rows] == [{"math": 1.0}, {"math": 0.0}]
    assert [r["shaping"] for r in rows] == [{"overlong": 0.0}, {"overlong": -0.5}]
    assert [(r["tokens"], r["finish_reason"], r["correct"]) for r in rows] == [(2, "stop", True), (3, "length", False)]
    assert "transcript" not in rows[0] and rows[1]["transcript"] == "7 8 9"  # an episode: tool results too


def test_a_non_finite_reward_is_null_and_zero_groups_write_nothing(tmp_path):
    RolloutLog(tmp_path, 5, prompt_text=lambda p: p.q, decode=str).write(1, _rollout())
    text = (tmp_path / "rollouts.jsonl").read_text()
    assert "NaN" not in text and json.loads(text.splitlines()[2])["reward"] is None  # jq reads the file
    RolloutLog(tmp_path / "none", 0, prompt_text=str, decode=str).write(1, _rollout())
    assert not (tmp_path / "none").exists()
