"""A verl or TRL user's data and reward functions, as they are: verl's parquet layout (prompt as a
message list, reward_model.ground_truth, data_source, extra_info) with its compute_score, a TRL
dataset (prompt messages + solution column) with a TRL reward function, data.prompt_key /
data.answer_key for other layouts, and data.eval_path."""

from __future__ import annotations

import json

import pytest

from colo_rl.config import ConfigError, DataConfig, RewardConfig
from colo_rl.data import DataError, load_problems
from colo_rl.rewards import RewardScorer
from colo_rl.rewards.sources import load_source

pq = pytest.importorskip("pyarrow.parquet")
import pyarrow as pa  # noqa: E402

# verl's examples/data_preprocess/gsm8k.py writes rows like these
VERL_ROWS = [{"data_source": "openai/gsm8k",
              "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the "
                                                     f"final answer after \"####\"."}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
              "extra_info": {"split": "train", "index": i}} for i in range(12)]

# verl's reward_score/gsm8k.py shape (a custom_reward_function has the same signature)
REWARDS = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, score=1.0):
    assert data_source == "openai/gsm8k" and extra_info["split"] == "train"
    found = re.findall(r"#### (-?[0-9.,]+)", solution_str)
    return score if found and found[-1] == ground_truth else format_score

def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if ground_truth in solution_str else 0.0, "acc": True}

# TRL's accuracy_reward shape: completions as chat messages, dataset columns by name
def accuracy_reward(completions, solution, **kwargs):
    contents = [c[0]["content"] for c in completions]
    return [1.0 if s in c else 0.0 for c, s in zip(contents, solution)]

def trl_any(completions, **kwargs):
    return [float(len(kwargs["prompts"][i])) if "level" in kwargs else None for i in range(len(completions))]
'''


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), path)
    return path


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def test_verls_parquet_layout_is_read_as_it_is(verl_file):
    train, held = load_problems(DataConfig(path=str(verl_file), eval_size=2))
    assert len(train) == 10 and len(held) == 2
    p = next(p for p in train + held if p.fields["extra_info"]["index"] == 3)
    assert p.messages == VERL_ROWS[3]["prompt"] and p.answer == "6"
    assert p.fields["data_source"] == "openai/gsm8k"


@pytest.mark.parametrize("workers", [0, 1])
def test_verls_compute_score_takes_the_record_as_verl_gives_it(verl_file, rewards, workers):
    train, _ = load_problems(DataConfig(path=str(verl_file), eval_size=2))
    scorer = RewardScorer(RewardConfig(functions=[f"{rewards}:compute_score", f"{rewards}:verl_dict"],
                                       format_weight=0.0, workers=workers))
    truths = [p.answer for p in train[:2]]
    res = scorer.score([f"so #### {truths[0]}", "no idea"], truths, [p.fields for p in train[:2]])
    assert res.failures == 0, res.failure_messages
    assert res.rewards == [2.0, 0.0]  # compute_score 1 + verl_dict's "score" 1, then 0 + 0
    scorer.close()


def test_a_trl_dataset_and_reward_function_work_as_they_are(tmp_path, rewards):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}], "solution": str(i),
                                        "level": i % 3}) + "\n" for i in range(6)))
    train, _ = load_problems(DataConfig(path=str(path), eval_size=1))
    assert train[0].answer == train[0].fields["solution"]  # `solution` is the truth when no `answer` is there
    src = load_source(f"{rewards}:accuracy_reward")
    assert (src.style, src.batched) == ("trl", True)
    scorer = RewardScorer(RewardConfig(functions=[f"{rewards}:accuracy_reward", f"{rewards}:trl_any"],
                                       format_weight=0.0))
    batch = train[:3]
    res = scorer.score([f"The answer is {batch[0].answer}.", "nothing", f"= {batch[2].answer}"],
                       [p.answer for p in batch], [p.fields for p in batch])
    assert res.failures == 0, res.failure_messages
    # accuracy 1/0/1 plus trl_any's len(prompt messages) = 1 each
    assert res.rewards == [2.0, 1.0, 2.0]
    alone = RewardScorer(RewardConfig(functions=[f"{rewards}:trl_any"], format_weight=0.0))
    no_level = alone.score(["x"], ["1"], [{"prompt": "q", "solution": "1"}])  # None: does not apply -> 0
    assert no_level.rewards == [0.0] and no_level.failures == 0


def test_a_trl_function_needing_a_column_the_data_lacks_is_named(rewards):
    scorer = RewardScorer(RewardConfig(functions=[f"{rewards}:accuracy_reward"], format_weight=0.0))
    with pytest.raises(Exception, match=r"accuracy_reward requires the record field 'solution'"):
        scorer.check_on_records(["1"], [{"prompt": "q", "answer": "1"}], ["f.jsonl:1"])


def test_other_layouts_name_their_keys_and_a_missing_key_says_which_setting(tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text("".join(json.dumps({"query": {"text": f"q{i}"}, "target": {"value": i}}) + "\n" for i in range(5)))
    with pytest.raises(DataError, match=r"custom.jsonl:1: needs one of the keys \['prompt', 'question', 'messages', 'input'\] "
                                        r".*; or set data.prompt_key=<its key>"):
        load_problems(DataConfig(path=str(path), eval_size=1))
    train, held = load_problems(DataConfig(path=str(path), eval_size=1, prompt_key="query.text",
                                           answer_key="target.value"))
    assert sorted(p.question for p in train + held) == [f"q{i}" for i in range(5)]
    assert {p.answer for p in train + held} == {str(i) for i in range(5)}


def test_data_eval_path_is_the_held_out_set_and_data_path_is_trained_on_whole(verl_file, tmp_path):
    val = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS[:3]), val)
    train, held = load_problems(DataConfig(path=str(verl_file), eval_path=str(val), eval_size=200))
    assert len(train) == 12 and [p.answer for p in held] == ["0", "2", "4"]
    assert [p.answer for p in load_problems(DataConfig(path=str(verl_file), eval_path=str(val), eval_size=2))[1]] \
        == ["0", "2"]


def test_data_eval_path_is_checked_at_start_up(tmp_path, verl_file):
    from colo_rl.config import RunConfig
    from colo_rl.runtime import check_input_paths

    cfg = RunConfig()
    cfg.data.path, cfg.data.eval_path = str(verl_file), str(tmp_path / "nope.parquet")
    with pytest.raises(DataError, match=r"data.eval_path='.*nope.parquet' does not exist"):
        check_input_paths(cfg)
    cfg.data.path = None
    with pytest.raises(ConfigError, match="data.eval_path is a held-out file for data.path's records"):
        check_input_paths(cfg)


def test_pass_at_k_needs_no_reward_function_so_none_is_called_without_its_columns(rewards):
    """recipes/eval.py's sampled accuracy called every reward function without the record's fields:
    a TRL function needing a column failed there."""
    from colo_rl.evaluation import sample_counts
    from colo_rl.rollout.base import Completion, SamplingParams

    class Engine:
        def generate(self, prompts, params):
            return [Completion(p, [5], [0.0], "stop") for p in prompts for _ in range(params.n)]

    class Tokenizer:
        def batch_decode(self, ids, skip_special_tokens=True):
            return ["The answer is 3."] * len(ids)

    scorer = RewardScorer(RewardConfig(functions=[f"{rewards}:accuracy_reward"]))
    counts = sample_counts(Engine(), Tokenizer(), [[1, 2]], ["3"], scorer, SamplingParams(max_new_tokens=4, n=2))
    assert counts == [(2, 2, 2)]
