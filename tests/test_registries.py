"""Registries: names are unique, a wrong name lists the right ones, and `rl_loss` is the sum of its terms."""

from __future__ import annotations

import pytest
import torch

from colo_rl import algos
from colo_rl.config import AlgoConfig
from colo_rl.registry import Registry


def test_a_name_registered_twice_is_refused():
    reg = Registry("algo.thing")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="'a' is registered twice"):
        reg.register("a")(lambda: 2)


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"algo.kl_estimator='k9' is not one of \['k1', 'k2', 'k3', 'abs', "):
        algos.KL_ESTIMATORS.get("k9")
    assert algos.LOSS_AGGREGATIONS.names() == ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                               "seq-mean-token-sum-norm"]
    assert algos.DPO_LOSSES.names() == ["sigmoid", "ipo", "hinge"]
    assert "grpo" in algos.ADV_ESTIMATORS and "ppo_clip" in algos.POLICY_LOSSES


def algo(**kw):
    return AlgoConfig(**{"clip_high": 0.28, **kw})


def case():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) - 0.1
    old = logp + 0.3 * (torch.rand(3, 5, generator=g) - 0.5)
    rollout = old + 0.1 * (torch.rand(3, 5, generator=g) - 0.5)
    ref = logp + 0.2 * (torch.rand(3, 5, generator=g) - 0.5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    return logp, old, rollout, ref, mask, adv


def test_rl_loss_is_the_policy_loss_plus_the_weighted_kl_term():
    logp, old, rollout, ref, mask, adv = case()
    a = algo(kl_coef=0.05, tis_cap=2.0, loss_agg="seq-mean-token-mean")
    loss, stats = algos.rl_loss(logp, old, adv, mask, a, rollout_logp=rollout, ref_logp=ref, num_tokens=9.0,
                                num_seqs=3.0)
    w = torch.exp(old - rollout).clamp(max=2.0)
    ratio = torch.exp(logp - old)
    surrogate = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None]) * w
    d = ref - logp
    kl = torch.exp(d) - d - 1
    per_seq = lambda x: ((x * mask).sum(-1) / mask.sum(-1)).sum() / 3.0  # noqa: E731
    assert loss.item() == pytest.approx((per_seq(surrogate) + 0.05 * per_seq(kl)).item(), rel=1e-5)
    assert stats["kl_sum"].item() == pytest.approx((kl * mask).sum().item(), rel=1e-5)


def test_rl_loss_without_reference_or_tis_is_the_plain_clipped_surrogate():
    logp, old, rollout, ref, mask, adv = case()
    loss, stats = algos.rl_loss(logp, old, adv, mask, algo(), rollout_logp=rollout, ref_logp=ref)
    plain, _ = algos.policy_loss(logp, old, adv, mask, 0.2, 0.28, "token-mean")
    assert loss.item() == pytest.approx(plain.item())
    assert stats["kl_sum"] > 0  # kl_coef = 0: no KL term in the loss, though the KL is still measured
