"""Multi-turn GRPO under torchrun: 2 gloo ranks, ZeRO-3, episodes of different lengths and turn
counts per rank (tests/workers/grpo_env_worker.py); the run must neither hang nor fail the
engine-vs-trainer log-prob check over the policy tokens."""

import json

import pytest

from conftest import WORKERS, run_torchrun

pytestmark = pytest.mark.slow


def test_zero3_two_ranks_with_different_episode_lengths(tmp_path):
    d = tmp_path / "run"
    run_torchrun(WORKERS / "grpo_env_worker.py",
                 ["model=tiny", "env.name=rank_turns", "env.max_turns=3", "env.max_total_tokens=120",
                  "trainer.total_steps=2", "data.eval_size=4", "rollout.prompts_per_step=4", "rollout.group_size=2",
                  "rollout.max_new_tokens=6", "rollout.eval_max_new_tokens=6", "trainer.micro_batch_size=4",
                  "trainer.lr=1e-3", "reward.functions=[policy_letters]", "reward.format_weight=0",
                  "colocate.handoff_check_max_mean_abs=0.001", "plots=false", "logger=[jsonl]", f"run_dir={d}"],
                 timeout=600)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # rank 0: 1 turn per episode, rank 1: 3 turns (the last one's request not run: env.max_turns)
        assert r["env/turns"] == 2.0 and r["env/tool_calls"] == 2.0 and r["env/hit_max_turns"] == 0.5
        assert r["env/tool_error_rate"] == 0.5  # rank 1 answers 2 of its 3 asks with an "error" observation
        assert r["handoff/logprob_diff_mean"] < 1e-3 and r["train/grad_norm"] > 0
        # responses: rank 0's 1..6 tokens, rank 1's 3 turns plus two observations of ~20 tokens
        assert r["response/len_mean"] > 20
    assert "eval_no_tools/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
