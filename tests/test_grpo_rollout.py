"""GRPO's rollout (recipes/grpo.py GRPORecipe.rollout) on one rank with a scripted engine and scorer:
how the G completions of each prompt stay together with their problem, rewards and sources, and
what DAPO's dynamic sampling keeps and counts over its rounds; what its resume restores of the KL
controller. The recipe under torchrun with the real engine and verifiers: test_grpo_recipe.py."""

from __future__ import annotations

import pytest

from colo_rl.config import RunConfig
from colo_rl.data import Problem
from colo_rl.data.sampler import EpochSampler
from colo_rl.metrics import Timer
from colo_rl.rewards import RewardResult
from colo_rl.rollout.base import Completion, SamplingParams
from workers.worker_support import load_recipe

G = 2


class EchoEngine:
    """Completion k of a prompt [i] is the tokens [i, k]."""

    def generate(self, prompts, params):
        return [Completion(p, [p[0], k], [0.0, 0.0], "stop") for p in prompts for k in range(params.n)]


class Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [f"{i} {k}" for i, k in ids]


class ScriptedScorer:
    """Round r: problem i's completion k scores rewards[r][i][k]; `failures[r]` calls failed."""

    def __init__(self, rewards, failures):
        self.rewards, self.failures, self.round = rewards, failures, 0

    def score(self, texts, truths, fields):
        table = self.rewards[self.round]
        values = [float(table[int(t.split()[0])][int(t.split()[1])]) for t in texts]
        result = RewardResult(values, [v > 0 for v in values], [v > 0 for v in values], [True] * len(values),
                              failures=self.failures[self.round],
                              failure_messages=["boom"] * self.failures[self.round],
                              per_source={"verifier": [2 * v for v in values]})
        self.round += 1
        return result


def recipe(problems: int, prompts_per_step: int, scorer: ScriptedScorer, env=None, **algo):
    cfg = RunConfig()
    cfg.rollout.group_size, cfg.rollout.prompts_per_step = G, prompts_per_step
    for key, value in algo.items():
        setattr(cfg.algo, key, value)
    cls = load_recipe()
    r = cls.__new__(cls)  # the attributes rollout() reads, without __init__'s model and engine
    r.cfg, r.tokenizer, r.scorer, r.timer, r.multiturn, r.env = cfg, Tokenizer(), scorer, Timer(), None, env
    r.train = [(Problem(id=str(i), question=f"q{i}", answer=str(i)), [i]) for i in range(problems)]
    r.sampler = EpochSampler(problems, seed=0, shuffle=False)
    r.colo = type("Colocated", (), {"engine": EchoEngine()})()
    r.sampling = SamplingParams(n=G)
    r.prompts_per_rank = prompts_per_step
    r.split = None  # colocated: rollout() agrees its dynamic-sampling rounds with the other ranks
    return r


def test_each_group_keeps_its_problem_rewards_and_sources():
    scorer = ScriptedScorer([{0: [1, 0], 1: [0, 0]}], failures=[1])
    out = recipe(2, 2, scorer).rollout(policy_version=3)
    assert [(c.prompt_ids, c.token_ids) for c in out.completions] == [([0], [0, 0]), ([0], [0, 1]),
                                                                       ([1], [1, 0]), ([1], [1, 1])]
    assert [g.problem.id for g in out.groups] == ["0", "1"] and [g.prompt_ids for g in out.groups] == [[0], [1]]
    assert [p.id for p in out.problems] == ["0", "0", "1", "1"]
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.sources() == {"verifier": [2.0, 0.0, 0.0, 0.0]}
    assert out.groups[0].sources == {"verifier": [2.0, 0.0]}
    assert out.flat("texts") == ["0 0", "0 1", "1 0", "1 1"]
    assert (out.failures, out.rounds, out.filled, out.policy_version) == (1, 1, 0, 3)


def test_dynamic_sampling_keeps_informative_groups_and_counts_every_rounds_failures():
    # round 1: problem 0 informative, 1 not; round 2: 2 not, 3 informative -> groups of problems 0 and 3
    scorer = ScriptedScorer([{0: [1, 0], 1: [1, 1]}, {2: [0, 0], 3: [0, 1]}], failures=[2, 1])
    out = recipe(4, 2, scorer, dynamic_sampling=True, max_sampling_rounds=3).rollout()
    assert [p.id for p in out.problems] == ["0", "0", "3", "3"]
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.sources() == {"verifier": [2.0, 0.0, 0.0, 2.0]}
    assert (out.failures, out.rounds, out.filled) == (3, 2, 0)


def test_a_split_generator_decides_its_dynamic_sampling_rounds_alone(monkeypatch):
    """In split placement a generation rank asks no other rank how many rounds to sample: a
    collective between generators could wait on one that is blocked on queue space while the
    trainer waits on the first (colo_rl/split/NOTES.md)."""
    from colo_rl import dist

    def no_collective(values):
        raise AssertionError("a generation rank called a collective")

    scorer = ScriptedScorer([{0: [1, 0], 1: [1, 1]}, {2: [0, 0], 3: [0, 1]}], failures=[0, 0])
    r = recipe(4, 2, scorer, dynamic_sampling=True, max_sampling_rounds=3)
    r.split = type("SplitRole", (), {"generates": True})()
    monkeypatch.setattr(dist, "all_reduce_max", no_collective)
    out = r.rollout()
    assert [p.id for p in out.problems] == ["0", "0", "3", "3"] and (out.rounds, out.filled) == (2, 0)
    r.split = None  # colocated: the rounds are agreed over the ranks
    with pytest.raises(AssertionError, match="called a collective"):
        recipe(4, 2, ScriptedScorer([{0: [1, 0], 1: [1, 1]}], failures=[0]), dynamic_sampling=True).rollout()


def test_dynamic_sampling_fills_with_set_aside_groups_when_rounds_run_out():
    scorer = ScriptedScorer([{0: [1, 0], 1: [1, 1]}, {0: [0, 0], 1: [1, 1]}], failures=[0, 0])
    out = recipe(2, 2, scorer, dynamic_sampling=True, max_sampling_rounds=1).rollout()
    assert [p.id for p in out.problems] == ["0", "0", "1", "1"]  # the kept group, then the first set aside
    assert (out.rounds, out.filled) == (2, 1)


def test_your_environments_reward_is_a_source_on_every_rank_even_when_no_episode_gave_one():
    # a rank whose episodes all failed (or whose class has no reward()) still sums the same sources
    # as the others: the sums over ranks go by key
    env = type("ConversationEnvironment", (), {"answers_every_turn": True, "scores_episodes": True})()
    out = recipe(2, 2, ScriptedScorer([{0: [1, 0], 1: [0, 0]}], failures=[0]), env=env).rollout()
    assert out.sources() == {"verifier": [2.0, 0.0, 0.0, 0.0], "env": [0.0, 0.0, 0.0, 0.0]}
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    from colo_rl import dist

    monkeypatch.setattr(dist, "world_size", lambda: 1)
    monkeypatch.setattr(dist, "rank", lambda: 0)


@pytest.mark.parametrize("kl_target,saved,expected", [
    (None, 0.05, 0.5),  # a fixed coefficient: the config's (the user changed it on resume)
    (1e-3, 0.0421, 0.0421),  # adaptive: its adapted state goes on
    (1e-3, None, 0.5),  # a checkpoint without one
])
def test_resume_keeps_an_adapted_kl_coefficient_but_not_a_fixed_one(kl_target, saved, expected):
    import contextlib
    import types

    from colo_rl.algos import AdaptiveKLController

    cfg = RunConfig()
    cfg.algo.kl_in_reward, cfg.algo.kl_coef, cfg.algo.kl_target = True, 0.5, kl_target
    recipe = load_recipe().__new__(load_recipe())
    recipe.cfg, recipe.split, recipe.sampler = cfg, None, None
    recipe.kl_ctl = AdaptiveKLController(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
    recipe.colo = types.SimpleNamespace(switch=types.SimpleNamespace(update=contextlib.nullcontext), actor=None,
                                        engine=None)
    ckpt = types.SimpleNamespace(maybe_resume=lambda *a: 3, extra={} if saved is None else {"kl_in_reward_coef": saved})
    assert recipe.resume(ckpt) == 3
    assert recipe.kl_ctl.coef == expected
