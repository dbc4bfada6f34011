"""Multi-turn GRPO under torchrun: 2 gloo ranks, ZeRO-3, an environment class from the user's own
file (env.name=path/to/file.py:Name) whose episodes differ per rank: rank 0's end after their first
turn, rank 1's are answered every turn up to env.max_turns. The run must neither hang nor fail the
engine-vs-trainer log-prob check over the policy tokens, and every episode must get its own object,
made from its own problem and closed once, whose reward() is added to the verifiers'."""

import json

import pytest

from conftest import ROOT, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ENV_FILE = '''
import json, os
from pathlib import Path


class RankTurns:
    """One object per episode: rank 0 ends the episode at once, rank 1 answers every turn."""

    def __init__(self, problem):
        self.rank, self.answer, self.turns = int(os.environ["RANK"]), problem.answer, 0

    def step(self, turn):
        self.turns += 1
        if self.rank == 0:
            return None
        return f"turn {self.turns} of {self.answer}" + " more" * 8

    def reward(self):
        return float(self.turns)  # the environment's own score, added to the verifiers' (env.reward_weight)

    def close(self):
        with open(Path(__file__).parent / f"sessions.rank{self.rank}.jsonl", "a") as fh:
            fh.write(json.dumps({"answer": self.answer, "turns": self.turns}) + "\\n")


def policy_letters(completion, truth):
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))
'''


steps, prompts, group, held_out = 2, 4, 2, 4


def run_env(tmp_path, extra: list[str]) -> list[dict]:
    """recipes/grpo.py on 2 gloo ranks with ENV_FILE's RankTurns environment; its metrics rows."""
    (tmp_path / "my_env.py").write_text(ENV_FILE)
    d = tmp_path / "run"
    run_torchrun(ROOT / "recipes" / "grpo.py",
                 ["model=tiny", f"env.name={tmp_path}/my_env.py:RankTurns", "env.max_turns=3",
                  "env.max_total_tokens=120", f"trainer.total_steps={steps}", f"data.eval_size={held_out}",
                  f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}", "rollout.max_new_tokens=6",
                  "rollout.eval_max_new_tokens=6", "trainer.lr=1e-3",
                  f"reward.functions=[{tmp_path}/my_env.py:policy_letters]", "reward.format_weight=0",
                  "colocate.handoff_check_max_mean_abs=0.001", "env.reward_weight=0.5", "plots=false", "logger=[jsonl]",
                  *extra, f"run_dir={d}"],
                 timeout=600)
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def test_zero3_two_ranks_with_different_episode_lengths(tmp_path):
    rows = run_env(tmp_path, ["trainer.micro_batch_size=4"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # rank 0: 1 turn per episode; rank 1: 3 turns, the third one answered too, so at env.max_turns
        assert r["env/turns"] == 2.0 and r["env/hit_max_turns"] == 0.5
        assert r["env/tool_errors"] == 0.0 and r["env/tool_calls"] == 0.0 and "env/tool_error_rate" not in r
        # reward(): each episode's turns (1 on rank 0, 3 on rank 1), weighted 0.5 beside the verifier's
        assert r["reward_source/env"] == 2.0
        assert r["reward/mean"] == pytest.approx(r["reward_source/my_env:policy_letters"] + 0.5 * 2.0, rel=1e-6)
        assert r["handoff/logprob_diff_mean"] < 1e-3 and r["train/grad_norm"] > 0
        # responses: rank 0's 1..6 tokens, rank 1's 3 turns plus two user messages of ~20 tokens
        assert r["response/len_mean"] > 20
    assert "eval_no_tools/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    # One object per episode, closed once: per rank, steps x its prompts x group training episodes
    # and one per held-out problem of its share at each evaluation (greedy: one episode each).
    evaluations = sum("eval/accuracy" in r for r in rows)
    assert evaluations == 2  # the start and the end
    per_rank = steps * prompts // 2 * group + evaluations * held_out // 2
    for rank, turns in ((0, 1), (1, 3)):
        sessions = [json.loads(line) for line in (tmp_path / f"sessions.rank{rank}.jsonl").read_text().splitlines()]
        assert len(sessions) == per_rank
        assert {s["turns"] for s in sessions} == {turns}  # state per episode, never shared
        assert all(s["answer"] for s in sessions)  # each made from its problem


def test_split_placement_runs_the_episodes_on_the_generation_rank(tmp_path):
    """placement.mode=split (1 generation rank + 1 trainer rank): the episodes, their tools and
    their reward() run where the engine is; the trainer trains on their policy tokens (the log-prob
    check over them holds) and reports their metrics; the held-out set is evaluated with and without
    the environment, as in a colocated run."""
    rows = run_env(tmp_path, ["placement.mode=split", "rollout.max_staleness=0"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:  # every episode ran on rank 0, the generation rank: its episodes end at once
        assert r["env/turns"] == 1.0 and r["reward_source/env"] == 1.0 and r["split/staleness_max"] == 0
        assert r["reward/mean"] == pytest.approx(r["reward_source/my_env:policy_letters"] + 0.5, rel=1e-6)
        assert r["handoff/logprob_diff_mean"] < 1e-3 and r["train/grad_norm"] > 0
    for r in (rows[0], rows[-1]):
        assert r["eval/count"] == r["eval_no_tools/count"] == held_out
    # one object per episode, all on the generation rank: training episodes and one per held-out
    # problem at each evaluation with the environment
    sessions = (tmp_path / "sessions.rank0.jsonl").read_text().splitlines()
    assert len(sessions) == steps * prompts * group + 2 * held_out
    assert not (tmp_path / "sessions.rank1.jsonl").exists()

