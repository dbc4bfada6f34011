"""Advantage estimators and policy losses beyond GRPO, against hand-computed values: unequal group
rewards, masked tokens, sequences of different lengths."""

from __future__ import annotations

import math
import pytest
import torch

from colo_rl import algos
from colo_rl.config import AlgoConfig


def algo(**kw):
    return AlgoConfig(**kw)


def test_rloo_baseline_is_the_mean_of_the_other_completions():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    adv = algos.ADV_ESTIMATORS.get("rloo")(rewards, 4, algo())
    expected = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 5 / 3, 1 - 7 / 3, 2 - 2, 2 - 2]
    assert adv.tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="group_size >= 2"):
        algos.rloo_advantages(rewards, 1)


def unbiased_whiten(values):
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return [(v - mean) / (std + 1e-8) for v in values]


def test_reinforce_pp_folds_kl_into_token_rewards_and_whitens_the_returns():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = torch.tensor([[0.5, -1.0, 9.0], [0.2, 0.0, 1.0]])  # the masked entry (9.0) must not count
    adv = algos.ADV_ESTIMATORS.get("reinforce_pp")(torch.tensor([1.0, 0.0]), 1, algo(kl_coef=0.1), mask, 0.1 * kl)
    # token rewards: seq 0 [-0.05, 1 + 0.1], seq 1 [-0.02, 0, -0.1]; returns-to-go:
    returns = [-0.05 + 1.1, 1.1, -0.02 + 0 - 0.1, 0 - 0.1, -0.1]
    w = unbiased_whiten(returns)
    assert adv[0, :2].tolist() == pytest.approx(w[:2], abs=1e-5)
    assert adv[1].tolist() == pytest.approx(w[2:], abs=1e-5)
    assert adv[0, 2].item() == 0.0


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_over_tokens():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    adv = algos.ADV_ESTIMATORS.get("reinforce_pp_baseline")(torch.tensor([2.0, 0.0, 1.0, 1.0]), 2, algo(), mask)
    centred = [1.0, -1.0, 0.0, 0.0]  # groups (2, 0) and (1, 1)
    tokens = [centred[0], centred[0], centred[1], centred[2], centred[2], centred[3], centred[3]]
    w = unbiased_whiten(tokens)
    assert adv[mask.bool()].tolist() == pytest.approx(w, abs=1e-5)
    assert adv[1, 1].item() == 0.0


def test_dual_clip_bounds_negative_advantage_tokens_only_when_on():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[5.0, 1.1, 5.0]]))  # ratios 5, 1.1, 5
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    plain, stats = algos.policy_loss(logp, old, adv, mask, loss_agg="seq-mean-token-sum")
    # -min(rA, clip(r)A): 5 for (r=5, A=-1); 1.1 for (1.1, -1); -1.2 for (5, +1)
    assert plain.item() == pytest.approx(5 + 1.1 - 1.2)
    assert stats["dual_clip_frac"].item() == 0.0
    dual, stats = algos.policy_loss(logp, old, adv, mask, loss_agg="seq-mean-token-sum", clip_ratio_c=3.0)
    assert dual.item() == pytest.approx(3 + 1.1 - 1.2)  # only the first token: min(5, c=3)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.policy_loss(logp, old, adv, mask, clip_ratio_c=0.5)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.5, 7.0], [0.3, 0.3, 0.3]], requires_grad=True)  # seq ratios exp(0.3) both
    a = algo(clip_low=1.0, clip_high=1.0, loss_agg="seq-mean-token-mean")  # no clipping here
    loss, stats = algos.POLICY_LOSSES.get("gspo")(logp, old, torch.tensor([1.0, -2.0]), mask, a)
    s = math.exp(0.3)
    assert loss.item() == pytest.approx((-s * 1.0 + s * 2.0) / 2)
    assert stats["seq_ratio_mean"].item() == pytest.approx(s)
    # a row without tokens (an empty pass's) adds nothing; sequences count by their tokens
    ragged = torch.tensor([[0.2, 0.2, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    _, stats = algos.POLICY_LOSSES.get("gspo")(ragged, torch.zeros(3, 3), torch.zeros(3),
                                               torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), a)
    assert stats["seq_ratio_mean"].item() == pytest.approx((2 * math.exp(0.2) + 3 * math.exp(0.5)) / 5)
    loss.backward()
    # d/d logp_t of -s_i A_i averaged over the sequence's tokens and the 2 sequences: -s A / (|y_i| * 2)
    assert logp.grad[0].tolist() == pytest.approx([-s / 4, -s / 4, 0.0])
    assert logp.grad[1].tolist() == pytest.approx([2 * s / 6] * 3)


def test_gspo_clips_the_sequence_ratio():
    mask = torch.ones(1, 2)
    logp = torch.tensor([[0.2, 0.2]], requires_grad=True)  # s = exp(0.2) > 1 + 4e-4
    a = algo(clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean")
    loss, stats = algos.gspo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), mask, a)
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert stats["clip_frac"].item() == 1.0
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0  # clipped: no gradient


def test_cispo_keeps_a_gradient_on_clipped_tokens_weighted_by_the_clipped_ratio():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[2.0, 1.0, 0.5]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = algos.cispo_loss(logp, old, torch.tensor([1.5]), mask, algo(clip_low=0.2, clip_high=0.28))
    w = [1.28, 1.0]  # ratio 2 clipped to 1 + 0.28; ratio 1 unchanged
    assert loss.item() == pytest.approx(-(w[0] * 1.5 * math.log(2.0) + w[1] * 1.5 * 0.0) / 2)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-w[0] * 1.5 / 2, -w[1] * 1.5 / 2, 0.0])
    assert stats["clip_frac"].item() == pytest.approx(0.5)


def test_k3_is_bounded():
    logp = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[15.0, 0.5]])  # d = 15: exp(15) - 16 would swamp everything
    k3 = algos.kl_penalty(logp, ref, "k3")
    assert k3[0, 0].item() == algos.K3_BOUND
    assert k3[0, 1].item() == pytest.approx(math.exp(0.5) - 1.5)


def test_overlong_penalty_at_inside_and_outside_the_buffer():
    lengths = torch.tensor([10, 15, 18, 20])
    pen = algos.overlong_penalty(lengths, max_len=20, buffer_len=5, penalty=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.6, -1.0])
    assert algos.overlong_penalty(lengths, 20, 0, 1.0).tolist() == [0.0] * 4


def test_dynamic_sampling_keeps_groups_with_unequal_rewards():
    keep = algos.informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert keep.tolist() == [False, True, False]


def test_kl_in_reward_and_the_adaptive_coefficient():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    penalty = 0.1 * torch.tensor([[0.2, 0.3, 5.0], [1.0, 2.0, 2.0]])
    r = algos.kl_in_reward(torch.tensor([1.0, 0.0]), penalty, mask)
    assert r.tolist() == pytest.approx([1.0 - 0.05, -0.1])
    adv = algos.ADV_ESTIMATORS.get("grpo")(torch.tensor([1.0, 0.0]), 2, algo(scale_by_std=False), mask, penalty)
    assert adv.tolist() == pytest.approx([(0.95 + 0.1) / 2, -(0.95 + 0.1) / 2])  # the group baseline sees the KL
    assert algos.kl_goes_in_reward(algo(kl_in_reward=True)) and algos.kl_goes_in_reward(algo(adv_estimator="reinforce_pp"))
    assert not algos.kl_goes_in_reward(algo())
    ctl = algos.AdaptiveKLController(coef=0.1, target=1.0, horizon=100)
    assert ctl.update(observed_kl=3.0, n_sequences=10) == pytest.approx(0.1 * (1 + 0.2 * 0.1))  # error capped at 0.2
    fixed = algos.AdaptiveKLController(coef=0.1)
    assert fixed.update(5.0, 10) == 0.1


def test_rl_loss_adds_the_entropy_bonus():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    ent = torch.tensor([[0.5, 1.5]])
    base, _ = algos.rl_loss(logp, logp, torch.tensor([1.0]), mask, algo())
    with_bonus, _ = algos.rl_loss(logp, logp, torch.tensor([1.0]), mask, algo(entropy_coef=0.1), entropy=ent)
    assert (base - with_bonus).item() == pytest.approx(0.1 * 1.0)
