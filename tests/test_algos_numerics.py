"""Issue #40: numerics against hand-computed values: stable whitening (one rank and two), masked
positions that never reach a sum, GSPO's clamp, the verl KL estimators and aggregations, the
rollout corrections and their metrics, and the start-up refusals."""

from __future__ import annotations

import math

import pytest
import torch

from colo_rl import algos
from colo_rl.config import AlgoConfig, ConfigError
from colo_rl.metrics import StepSums
from conftest import WORKERS, read_json, run_torchrun
from test_validation import _cfg


def algo(**kw):
    return AlgoConfig(**kw)


def whiten_reference(values: list[float], eps: float = 1e-8) -> list[float]:
    """Two-pass, in Python floats (float64): (x - mean) / sqrt(unbiased var + eps)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + eps) for v in values]


def returns_to_go(klp: torch.Tensor) -> list[float]:
    """REINFORCE++'s returns by hand: token rewards [0, ..., 0, 1] - klp (reward 1), summed from t on."""
    out = []
    for row in klp.double().tolist():
        rho = [-k for k in row]
        rho[-1] += 1.0
        out += [sum(rho[t:]) for t in range(len(rho))]
    return out


# --- global_whiten ---------------------------------------------------------------------------------

def test_whitening_values_on_a_large_offset_is_exact():
    # the input: E[x^2] - E[x]^2 in float32 cancelled to 0 and gave +-1.5e6
    out = algos.global_whiten(torch.tensor([[1000.00, 1000.01, 1000.02, 1000.03]]), torch.ones(1, 4))
    # by hand: deviations -0.015, -0.005, 0.005, 0.015; var = 5e-4 / 3; std = 0.0129099
    assert out[0].tolist() == pytest.approx([-1.161895, -0.387298, 0.387298, 1.161895], abs=2e-3)
    assert out.dtype == torch.float32


def test_reinforce_pp_whole_batch_right_with_a_small_kl_is_not_blown_up():
    r, m = torch.ones(4), torch.ones(4, 8)
    klp = 1e-4 * torch.linspace(-0.05, 0.05, 32).view(4, 8)
    adv = algos.reinforce_pp_advantages(r, 1, None, m, klp)
    # whitened over the 32 tokens
    assert adv.flatten().tolist() == pytest.approx(whiten_reference(returns_to_go(klp)), abs=1e-3)
    assert adv.abs().max().item() < 3.0  # was ~3.3e3


def test_whitening_a_near_constant_batch_divides_by_sqrt_var_plus_eps():
    # var = 5e-11 (~ eps): 1/sqrt(var + eps) = 9.975e3, where 1/(std + eps) would be 1.4e5 (14x more)
    out = algos.global_whiten(torch.tensor([[0.0, 1e-5]]), torch.ones(1, 2))
    expected = 5e-6 / math.sqrt(5e-11 + 1e-8)  # 0.049875
    assert out[0].tolist() == pytest.approx([-expected, expected], rel=1e-4)


def test_whitening_ignores_non_finite_padding():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    out = algos.global_whiten(x, mask)
    w = whiten_reference([1.0, 2.0, 3.0, 4.0])
    assert out[mask.bool()].tolist() == pytest.approx(w, rel=1e-5)
    assert out[~mask.bool()].tolist() == [0.0, 0.0]


@pytest.mark.slow
def test_whitening_and_mismatch_metrics_over_two_ranks(tmp_path):
    out = tmp_path / "report"
    run_torchrun(WORKERS / "algos_worker.py", [str(out)], nproc=2, timeout=300)
    r0, r1 = (read_json(f"{out}.rank{r}.json") for r in (0, 1))
    # one batch of 5 values split 3 + 2 (rank 1's third entry is padding holding NaN)
    w = whiten_reference([100.00, 100.01, 100.02, 100.03, 100.04])  # +-1.2649, +-0.6325, 0
    assert r0["whitened"] + r1["whitened"][:2] == pytest.approx(w, abs=2e-3)
    assert r1["whitened"][2] == 0.0
    klp = 1e-4 * torch.linspace(-0.05, 0.05, 16).view(2, 8)
    assert r0["reinforce"] + r1["reinforce"] == pytest.approx(whiten_reference(returns_to_go(klp)), abs=1e-3)
    # tokens: ratios 3, 1 on rank 0; 0.5, 1 on rank 1
    k1 = -(math.log(3) + math.log(0.5)) / 4
    k3 = (3 - 1 - math.log(3) + 0.5 - 1 - math.log(0.5)) / 4
    for report in (r0, r1):
        m = report["mismatch"]
        assert m["mismatch/kl_k1"] == pytest.approx(k1) and m["mismatch/kl_k3"] == pytest.approx(k3)
        assert m["mismatch/ratio_max"] == pytest.approx(3.0) and m["mismatch/seq_ratio_max"] == pytest.approx(3.0)
        # all ranks' 12 tokens over the slowest rank's 4 s (rank 0's own 1 s gave 12 tok/s)
        assert report["gen_tokens_per_s"] == pytest.approx(3.0)


# --- masked positions never reach a sum ------------------------------------------------------------

def nan_padded_case(poison: float):
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    logp = -torch.rand(2, 4, generator=g) - 0.1
    old = logp + 0.2 * (torch.rand(2, 4, generator=g) - 0.5)
    rollout = old + 0.5 * (torch.rand(2, 4, generator=g) - 0.5)
    ref = logp + 0.2 * (torch.rand(2, 4, generator=g) - 0.5)
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, 0.0, 0.0]])
    ent = torch.rand(2, 4, generator=g)
    clean = [t.clone() for t in (logp, old, rollout, ref, adv, ent)]
    dirty = [torch.where(mask.bool(), t, torch.tensor(poison)) for t in clean]
    return mask, clean, dirty


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("loss_agg", algos.LOSS_AGGREGATIONS.names())
@pytest.mark.parametrize("correction", [None, *algos.ROLLOUT_CORRECTIONS.names()])
def test_non_finite_padding_changes_neither_loss_nor_gradient(poison, loss_agg, correction):
    mask, clean, dirty = nan_padded_case(poison)
    a = algo(loss_agg=loss_agg, loss_scale_factor=4.0 if loss_agg == "seq-mean-token-sum-norm" else None,
             kl_coef=0.1, entropy_coef=0.01, rollout_correction=correction)
    results = []
    for logp, old, rollout, ref, adv, ent in (clean, dirty):
        logp = logp.clone().requires_grad_(True)
        loss, stats = algos.rl_loss(logp, old, adv, mask, a, rollout_logp=rollout, ref_logp=ref, entropy=ent)
        loss.backward()
        results.append((loss.item(), logp.grad, stats))
    (clean_loss, clean_grad, clean_stats), (loss, grad, stats) = results
    assert math.isfinite(loss) and loss == pytest.approx(clean_loss, rel=1e-6)
    assert torch.isfinite(grad).all() and torch.allclose(grad, clean_grad)
    assert grad[~mask.bool()].abs().sum().item() == 0.0
    for key in ("k1", "k3", "ratio_max", "tokens_masked"):
        assert stats["mismatch"][key].item() == pytest.approx(clean_stats["mismatch"][key].item())


# --- the verl aggregations and KL estimators -------------------------------------------------------

def test_token_sum_and_seq_mean_token_sum_norm_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert algos.aggregate_loss(loss, mask, "token-sum").item() == pytest.approx(10.0)
    # (1/B) sum_i sum_t l / L with L = 4: (6 + 4) / 2 / 4
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", scale=4).item() == pytest.approx(1.25)
    assert algos.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", num_seqs=5, scale=4).item() == \
        pytest.approx(10 / 5 / 4)
    with pytest.raises(ValueError, match="algo.loss_scale_factor"):
        algos.aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


def test_abs_and_straight_through_kl_estimators():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    d = [-0.5, 1.0]  # log pi_ref - log pi
    assert algos.kl_penalty(logp, ref, "abs").tolist() == [pytest.approx([0.5, 1.0])]
    k3 = [math.exp(x) - x - 1 for x in d]
    for name, value in [("k1+", [0.5, -1.0]), ("k3+", k3), ("low_var_kl+", k3)]:
        kl = algos.kl_penalty(logp, ref, name)
        assert kl.tolist() == [pytest.approx(value)]
        (grad,) = torch.autograd.grad(kl.sum(), logp)
        assert grad.tolist() == [pytest.approx([0.5, -1.0])]  # k2's: log pi - log pi_ref
    (grad,) = torch.autograd.grad(algos.kl_penalty(logp, ref, "k3").sum(), logp)
    assert grad.tolist() == [pytest.approx([1 - math.exp(x) for x in d])]  # plain k3: its own gradient
    assert algos.kl_penalty(logp, ref, "low_var_kl").tolist() == [pytest.approx(k3)]


def test_gspo_clamps_the_sequence_log_ratio_at_10_with_no_gradient_above():
    a = algo(clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean")
    mask = torch.ones(2, 2)
    old = torch.zeros(2, 2)
    logp = torch.tensor([[12.0, 12.0], [9.0, 9.0]], requires_grad=True)  # log s_i = 12 and 9
    loss, _ = algos.gspo_loss(logp, old, torch.tensor([-1.0, -1.0]), mask, a)
    # A < 0: -min(s A, clip(s) A) = s |A|; s = e^10 (clamped) and e^9, averaged over the 2 sequences
    assert loss.item() == pytest.approx((math.exp(10) + math.exp(9)) / 2, rel=1e-5)
    loss.backward()
    assert logp.grad[0].tolist() == [0.0, 0.0]  # above the clamp: no gradient
    assert logp.grad[1].tolist() == pytest.approx([math.exp(9) / 4] * 2, rel=1e-5)


# --- rollout correction ----------------------------------------------------------------------------

# rho = pi_old / pi_rollout: sequence 0 [3, 1, 0.5] (product 1.5), sequence 1 [1.5, 0.25] + padding
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
RHO = torch.tensor([[3.0, 1.0, 0.5], [1.5, 0.25, float("nan")]])


def correct(name, upper, lower=None):
    return algos.rollout_correction(RHO.log(), torch.zeros(2, 3), MASK, name, upper, lower)


def kept(c):
    return c.keep[MASK.bool()].tolist()


def weights(c):
    return c.weights[MASK.bool()].tolist()


def test_token_and_sequence_tis_by_hand():
    c = correct("tis_token", 2.0)
    assert weights(c) == pytest.approx([2.0, 1.0, 0.5, 1.5, 0.25]) and all(kept(c))
    assert c.truncated[MASK.bool()].tolist() == [True, False, False, False, False]
    c = correct("tis_seq", 1.2)  # rho_0 = 1.5 -> 1.2; rho_1 = 0.375
    assert weights(c) == pytest.approx([1.2] * 3 + [0.375] * 2) and all(kept(c))
    assert c.truncated[MASK.bool()].tolist() == [True] * 3 + [False] * 2


def test_masked_is_geometric_and_icepop_by_hand():
    c = correct("mis_token", 2.0)
    assert kept(c) == [False, True, True, True, True] and weights(c) == pytest.approx([3, 1, 0.5, 1.5, 0.25])
    c = correct("mis_seq", 1.2)  # 1.5 > 1.2 dropped, 0.375 kept
    assert kept(c) == [False] * 3 + [True] * 2 and weights(c) == pytest.approx([1.5] * 3 + [0.375] * 2)
    # geometric means 1.5^(1/3) = 1.145 and 0.375^(1/2) = 0.612
    assert all(kept(correct("mis_geo", 2.0)))  # band [0.5, 2]
    assert kept(correct("mis_geo", 1.2, 0.7)) == [True] * 3 + [False] * 2
    assert kept(correct("mis_geo", 1.1)) == [False] * 5  # band [1/1.1, 1.1]
    assert weights(correct("mis_geo", 2.0)) == [1.0] * 5
    c = correct("icepop", 2.0)  # band [0.5, 2]: 3 and 0.25 dropped, 0.5 kept (edge)
    assert kept(c) == [False, True, True, True, False] and weights(c) == pytest.approx([3, 1, 0.5, 1.5, 0.25])


def test_rl_loss_applies_the_correction_and_reports_the_mismatch():
    old = torch.where(MASK.bool(), RHO.log(), torch.tensor(0.0))
    logp = old.clone()  # on-policy: r = 1, the token loss is -A
    loss, stats = algos.rl_loss(logp, old, torch.tensor([1.0, -2.0]), MASK, algo(rollout_correction="icepop"),
                                rollout_logp=torch.zeros(2, 3))
    # kept: seq 0 tokens 2 (w 1) and 3 (w 0.5): -(1 + 0.5); seq 1 token 1 (w 1.5): +2 * 1.5; token-mean over 5
    assert loss.item() == pytest.approx((-1.5 + 3.0) / 5)
    metrics = algos.mismatch_metrics(stats["mismatch"])
    logs = [math.log(x) for x in (3.0, 1.0, 0.5, 1.5, 0.25)]
    assert metrics["mismatch/kl_k1"] == pytest.approx(-sum(logs) / 5)
    assert metrics["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 5)
    assert metrics["mismatch/tokens_masked_frac"] == pytest.approx(2 / 5)
    assert metrics["mismatch/seqs_masked_frac"] == 1.0
    assert metrics["mismatch/tokens_truncated_frac"] == 0.0
    assert metrics["mismatch/ratio_max"] == pytest.approx(3.0)
    assert metrics["mismatch/seq_ratio_max"] == pytest.approx(1.5)
    # tis_cap is tis_token: the same loss either way
    a, b = (algos.rl_loss(logp, old, torch.tensor([1.0, -2.0]), MASK, algo(**kw), rollout_logp=torch.zeros(2, 3))
            for kw in ({"tis_cap": 2.0}, {"rollout_correction": "tis_token"}))
    assert a[0].item() == pytest.approx(b[0].item()) == pytest.approx((-(2 + 1 + 0.5) + 2 * (1.5 + 0.25)) / 5)
    total = StepSums(maxima=algos.MISMATCH_MAX_KEYS)  # accumulated over two micro-batches
    total.add(a[1]["mismatch"])
    total.add(b[1]["mismatch"])
    twice = algos.mismatch_metrics(total.totals())
    assert twice["mismatch/tokens_truncated_frac"] == pytest.approx(1 / 5)
    assert twice["mismatch/seqs_truncated_frac"] == pytest.approx(1 / 2)
    assert twice["mismatch/ratio_max"] == pytest.approx(3.0)


# --- start-up refusals -----------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (["algo.policy_loss=cispo", "algo.clip_ratio_c=3.0"],
     r"algo.clip_ratio_c=3.0 \(dual-clip\) bounds ppo_clip's token loss; algo.policy_loss=cispo"),
    (["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.clip_ratio_c=3.0"],
     r"algo.policy_loss=gspo has no such term"),
    (["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean",
      "algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.01"],
     r"algo.adv_estimator=reinforce_pp with algo.kl_coef=0.01 gives each token its own"),
    (["algo.dynamic_sampling=true", "algo.adv_estimator=reinforce_pp"],
     r"algo.adv_estimator=reinforce_pp's baseline is the whole batch"),
    (["model.attn_implementation=flash_attention_2"],
     r"model.attn_implementation=flash_attention_2 does not take: use one of \['sdpa', 'eager', 'flex_attention'\]"),
    (["algo.loss_agg=seq-mean-token-sum-norm"], r"needs it \(e.g. algo.loss_scale_factor=40"),
    (["algo.loss_scale_factor=256"], r"no other aggregation reads algo.loss_scale_factor"),
    (["algo.tis_cap=2.0", "algo.rollout_correction=icepop"], r"algo.tis_cap=2.0 and algo.rollout_correction=icepop"),
    (["algo.rollout_correction=tis_seq", "algo.rollout_is_threshold_lower=0.5"],
     r"algo.rollout_correction=tis_seq does not read it"),
    (["algo.rollout_is_threshold=5.0"], r"algo.rollout_is_threshold=5.0 is read only with algo.rollout_correction"),
    (["algo.rollout_correction=icepop", "algo.rollout_is_threshold=0.8"], r"algo.rollout_is_threshold=0.8 must be >= 1"),
    (["algo.rollout_correction=tis"], r"algo.rollout_correction='tis' is not one of \[None, 'tis_token'"),
])
def test_inconsistent_options_are_refused_at_start_up(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(overrides)


def test_reinforce_pp_takes_a_kl_target_without_kl_in_reward():
    # REINFORCE++ puts the KL in the reward by definition: its coefficient adapts without algo.kl_in_reward
    cfg = _cfg(["algo.adv_estimator=reinforce_pp", "algo.kl_coef=0.05", "algo.kl_target=0.01"])
    assert cfg.algo.kl_target == 0.01


def test_consistent_new_options_are_accepted():
    cfg = _cfg(["algo.rollout_correction=icepop", "algo.rollout_is_threshold=3.0",
                "algo.rollout_is_threshold_lower=0.4", "algo.loss_agg=seq-mean-token-sum-norm",
                "algo.loss_scale_factor=40", "algo.kl_estimator=low_var_kl+", "algo.clip_ratio_c=3.0"])
    assert (cfg.algo.rollout_correction, cfg.algo.rollout_is_threshold_lower) == ("icepop", 0.4)


def test_the_adaptive_controller_observes_a_per_token_kl():
    # k1 per token: sequence 0 [0.2, 0.4] (mean 0.3), sequence 1 [0.1, 0.1, 0.1, 0.1] (mean 0.1) + padding
    k1 = torch.tensor([[0.2, 0.4, float("nan"), 0.0], [0.1, 0.1, 0.1, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    per_seq = algos.sequence_mean_kl(k1, mask)
    assert per_seq.tolist() == pytest.approx([0.3, 0.1])
    ctl = algos.AdaptiveKLController(coef=0.1, target=0.2, horizon=10)  # verl-sized target: 0.2 per token
    observed = per_seq.mean().item()  # 0.2: on target, no change (a per-sequence sum, 1.0, would be 5x over)
    assert ctl.update(observed, 2) == pytest.approx(0.1)
