"""A step's batch metrics (colo_rl/rollout/batch_metrics.py) against hand-computed values, one rank."""

import pytest
import torch

from colo_rl.rollout.batch_metrics import batch_metrics
from colo_rl.samples import Completion, Rollout, groups_of


def rollout() -> Rollout:
    """Two groups of two: the first all right (1, 1: no signal), the second split (0, 1)."""
    lengths, reasons = [3, 5, 2, 6], ["stop", "stop", "length", "stop"]
    completions = [Completion([1, 2], list(range(n)), [-0.5] * n, why) for n, why in zip(lengths, reasons)]
    groups = groups_of(["p", "q"], 2, {"math_verify": [1.0, 1.0, 0.0, 1.0]}, completions=completions,
                       rewards=[1.0, 1.0, 0.0, 1.0], correct=[True, True, False, True],
                       lenient=[True, True, True, True], formatted=[True, False, False, True], texts=["a"] * 4)
    return Rollout(groups=groups, rounds=2, filled=1)


def test_batch_metrics_match_hand_computed_values():
    out = batch_metrics(rollout(), generation_seconds=2.0, dynamic_sampling=True)
    assert out["reward/mean"] == pytest.approx(0.75)
    assert out["reward/std"] == pytest.approx((0.75 - 0.75 ** 2) ** 0.5)  # population std of 1, 1, 0, 1
    assert out["reward/accuracy"] == 0.75 and out["reward/accuracy_lenient"] == 1.0 and out["reward/format_rate"] == 0.5
    assert out["reward/zero_std_groups"] == 0.5  # the first group: one reward for both
    assert out["response/len_mean"] == 4.0 and out["response/stop_rate"] == 0.75
    assert out["throughput/gen_tokens_per_s"] == 8.0  # 16 tokens in 2 s
    assert out["reward_source/math_verify"] == 0.75
    assert out["sampling/rounds"] == 2.0 and out["sampling/filled_groups"] == 1.0
    assert "reward/overlong_penalty" not in out and not any(k.startswith("env/") for k in out)


def test_throughput_counts_the_policys_tokens_not_an_environments():
    r = rollout()
    r.groups[1].completions[1].policy_mask = [1, 1, 0, 0, 0, 1]  # 3 of its 6 tokens an observation
    out = batch_metrics(Rollout(groups=r.groups), generation_seconds=2.0)
    assert out["throughput/gen_tokens_per_s"] == 6.5  # 13 generated tokens in 2 s
    assert out["response/len_mean"] == 4.0  # the episode's length, observations included


def test_throughput_counts_every_rounds_tokens_under_dynamic_sampling():
    """DAPO: the engine generated groups that were set aside or cut; the generation time paid for
    them, so tokens per second counts them (it fell with the share of flat groups before)."""
    r = Rollout()
    r.keep(rollout().groups, [False, True])  # round 1: the flat group set aside
    r.keep(rollout().groups, [False, True])  # round 2
    r.fill(1)  # one group trains
    out = batch_metrics(r, generation_seconds=2.0, dynamic_sampling=True)
    assert r.generated_tokens == 32 and out["throughput/gen_tokens_per_s"] == 16.0  # 2 x 16 tokens in 2 s
    assert out["response/len_mean"] == 4.0  # the trained batch's own: the second group's 2 and 6 tokens


def test_shaping_decides_which_groups_carry_a_signal():
    r = rollout()
    r.add_shaping("overlong", torch.tensor([0.0, -0.5, 0.0, 0.0]))  # the all-right group now differs
    out = batch_metrics(r, generation_seconds=1.0, overlong_shaping=True)
    assert out["reward/zero_std_groups"] == 0.0
    assert out["reward/overlong_penalty"] == pytest.approx(-0.125) and out["reward/mean"] == pytest.approx(0.75)
