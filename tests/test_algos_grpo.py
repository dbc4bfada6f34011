"""GRPO math against hand-computed values."""

import math

import pytest
import torch

from colo_rl import algos


def test_group_advantages_match_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = algos.group_advantages(rewards, group_size=4, scale_by_std=True, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv[:4], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]), atol=1e-6)
    # group 2: identical rewards carry no signal
    assert torch.equal(adv[4:], torch.zeros(4))


def test_group_advantages_without_std_scaling_is_mean_centred():
    adv = algos.group_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0]), group_size=2, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        algos.group_advantages(torch.zeros(4), group_size=3)


def test_kl_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    d = ref - logp  # [-0.5, 1.0]
    assert torch.allclose(algos.kl_penalty(logp, ref, "k1"), -d)
    assert torch.allclose(algos.kl_penalty(logp, ref, "k2"), 0.5 * d ** 2)
    assert torch.allclose(algos.kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    assert (algos.kl_penalty(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="k4"):
        algos.kl_penalty(logp, ref, "k4")


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert algos.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # global denominators (gradient accumulation / several ranks)
    assert algos.aggregate_loss(loss, mask, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum", num_seqs=5).item() == pytest.approx(10 / 5)


def test_sequence_means_skip_sequences_without_loss_tokens():
    # a third row with an all-0 mask (and garbage in it) is not a sequence of the mean: (2 + 4) / 2, not / 3
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, float("nan"), 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert algos.loss_sequences(mask).item() == 2
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", scale=3).item() == pytest.approx((6 + 4) / 2 / 3)
    assert algos.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)


def test_policy_loss_clipping_hand_computed():
    # token 0: ratio e^0.5 = 1.6487 > 1 + 0.28 with A > 0 -> clipped at 1.28
    # token 1: ratio e^-0.5 = 0.6065 < 1 - 0.2 with A < 0 -> clipped at 0.8
    # token 2: ratio 1 -> unclipped
    logp = torch.tensor([[0.5, -0.5, 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    loss, stats = algos.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    expected = (-(1.28 * 1.0) - (0.8 * -1.0) - (1.0 * 2.0)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)


def test_policy_loss_gradient_is_advantage_weighted_on_policy():
    # On-policy (old = logp.detach()), d loss / d logp_t = -A / num_tokens.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = algos.policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))


def test_truncated_is_weights_are_capped():
    w = algos.rollout_correction(torch.zeros(1, 2), torch.tensor([[-0.1, -5.0]]), torch.ones(1, 2), "tis_token",
                                 2.0).weights[0]
    assert w[0].item() == pytest.approx(math.exp(0.1))
    assert w[1].item() == 2.0


def test_logprobs_from_logits_divides_by_temperature():
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])
    labels = torch.tensor([[2]])
    lp = algos.logprobs_from_logits(logits, labels, temperature=2.0)
    z = torch.tensor([0.5, 1.0, 1.5])
    assert lp.item() == pytest.approx((z[2] - torch.logsumexp(z, 0)).item())
    ent = algos.entropy_from_logits(torch.zeros(1, 1, 4))
    assert ent.item() == pytest.approx(math.log(4))


def test_entropy_matches_definition_across_chunks():
    torch.manual_seed(0)
    logits = torch.randn(3, 50, 17) * 3  # 150 positions: three chunks of 64, the last partial
    p = torch.softmax(logits, -1)
    expected = -(p * torch.log(p)).sum(-1)
    assert torch.allclose(algos.entropy_from_logits(logits), expected, atol=1e-5)
    logz = torch.logsumexp(logits, -1)
    assert torch.allclose(algos.entropy_from_logits(logits, logz, chunk=7), expected, atol=1e-5)
