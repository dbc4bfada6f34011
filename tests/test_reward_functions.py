"""User reward functions from a file (`reward.functions=[path/file.py:fn]`): every kind of mistake is
a clear error naming the file and the function; per-sample vs batched by signature; record fields
passed through; weights; the worker pool's timeout counted as a failure."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from colo_rl.config import ConfigError, DataConfig, RewardConfig, RewardModelConfig, RunConfig, validate
from colo_rl.data import load_problems
from colo_rl.rewards import RewardError, RewardScorer
from conftest import ROOT, child_env

USER_FILE = '''
import math, time

def length(completion, truth, **fields):
    return float(len(completion))

def batch_size(completions, truths, **fields):
    return [float(len(completions))] * len(completions)  # equal to the batch: one call saw all of it

def annotated(texts: list[str], answers: list[str]) -> list[float]:
    return [1.0 if t == a else 0.0 for t, a in zip(texts, answers)]

def annotated_one(text: str, answer: str) -> float:
    return 1.0 if text == answer else 0.0

def with_fields(completion, truth, **fields):
    return float(fields["difficulty"]) + (0.5 if fields["question"] in completion else 0.0)

def named_field(completion, truth, difficulty=0):  # takes only the field it names
    return float(difficulty)

def batched_fields(completions, truths, difficulty):
    return [float(d) * 10 for d in difficulty]

def needs_missing(completion, truth, *, topic):
    return 1.0

def flaky(completion, truth):
    if "boom" in completion:
        raise RuntimeError("verifier crashed")
    if "nan" in completion:
        return math.nan
    return 1.0

def hangs(completion, truth):
    if completion == "hang":
        time.sleep(600)
    return 2.0

def returns_text(completion, truth):
    return "1.0"

def returns_scalar(completions, truths):
    return 1.0

def returns_short(completions, truths):
    return [1.0]

def one_param(completion):
    return 0.0

def exits_later(completion, truth):  # a library thread that ends the process after the call returned
    import os, threading
    if completion == "exit":
        threading.Timer(0.2, os._exit, (9,)).start()
    return 1.0

def odd_names(a, b):
    return 0.0

def numpy_verdict(completion, truth):
    import numpy as np
    return np.int64(len(completion)) == np.int64(len(truth))  # np.bool_, not a Python bool

def numpy_batch(completions, truths):
    import numpy as np
    return [np.float32(0.5), np.bool_(True)] + [np.int64(2)] * (len(completions) - 2)

def exits(completion, truth):
    import sys
    if completion == "quit":
        sys.exit(0)  # would end the trainer with status 0 and no word
    return 1.0

def exits_batched(completions, truths):
    raise SystemExit("bye")

not_a_function = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    return path


def scorer(*functions, **kw):
    return RewardScorer(RewardConfig(functions=list(functions), format_weight=0.0, **kw))


# ---------------------------------------------------------------- mistakes seen at start-up
def test_bad_path_is_refused_at_start_up_with_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(reward=RewardConfig(functions=["rewards/nope.py:score"]))
    with pytest.raises(ConfigError, match=r"'rewards/nope.py:score': no file .*rewards/nope.py \(a relative path "
                                          r"is taken from the directory the run is launched in\)"):
        validate(cfg)


def test_relative_path_is_taken_from_the_launch_directory(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    validate(RunConfig(reward=RewardConfig(functions=["my_rewards.py:length", "math_verify"])))
    assert scorer("my_rewards.py:length").score(["abc"], ["1"]).rewards == [3.0]


@pytest.mark.parametrize("name,message", [
    ("missing", r"'missing' is not defined in .*my_rewards.py \(it defines: \[.*'length'.*\]\)"),
    ("not_a_function", r"'not_a_function' is not callable in .*my_rewards.py"),
    ("one_param", r"my_rewards.py:one_param\(completion\) must take the completion\(s\) and the truth\(s\)"),
    ("odd_names", r"my_rewards.py:odd_names\(a, b\): name its first parameter `completion` \(per-sample\) or "
                  r"`completions` \(batched\)"),
])
def test_missing_function_and_wrong_signature_are_refused_at_start_up(user_file, name, message):
    with pytest.raises(ConfigError, match=message):
        validate(RunConfig(reward=RewardConfig(functions=[f"{user_file}:{name}"])))


def test_a_file_that_fails_to_import_is_named(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import definitely_not_a_module_xyz\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py failed: ModuleNotFoundError"):
        validate(RunConfig(reward=RewardConfig(functions=[f"{bad}:score"])))


def test_unknown_registered_name_lists_the_choices():
    with pytest.raises(ConfigError, match=r"unknown reward function 'math_verfy'.*'math_verify'.*path/to/file.py"):
        validate(RunConfig(reward=RewardConfig(functions=["math_verfy"])))


def test_weights_need_one_value_per_source(user_file):
    with pytest.raises(ConfigError, match=r"reward.weights has 1 value\(s\) for 3 reward source\(s\) "
                                          r"\['math_verify', '.*:length', 'reward.model.path'\]"):
        validate(RunConfig(reward=RewardConfig(functions=["math_verify", f"{user_file}:length"], weights=[1.0],
                                               model=RewardModelConfig(path="/some/rm"))))


def test_a_source_listed_twice_is_refused_before_its_metrics_collide(user_file, tmp_path):
    """reward_source/<name> is one metric per name: a function listed twice (or two files of one
    stem with one function name) would show one source's scores and drop the other's."""
    other = tmp_path / "other" / user_file.name
    other.parent.mkdir()
    other.write_text(user_file.read_text())
    for functions, twice in ((["math_verify", "math_verify"], "math_verify"),
                             ([f"{user_file}:length", f"{other}:length"], f"{user_file.stem}:length")):
        with pytest.raises(ConfigError, match=rf"\['{twice}'\] more than once.*reward.weights"):
            validate(RunConfig(reward=RewardConfig(functions=functions)))
    validate(RunConfig(reward=RewardConfig(functions=["math_verify", f"{user_file}:length"])))


# ---------------------------------------------------------------- per-sample / batched, weights, fields
def test_per_sample_and_batched_are_told_apart_by_signature(user_file):
    texts, truths = ["a", "bb", "ccc"], ["a", "x", "ccc"]
    s = scorer(f"{user_file}:length", f"{user_file}:batch_size", f"{user_file}:annotated",
               f"{user_file}:annotated_one")
    assert [src.batched for src in s.sources] == [False, True, True, False]
    res = s.score(texts, truths)
    assert res.per_source == {"my_rewards:length": [1.0, 2.0, 3.0], "my_rewards:batch_size": [3.0, 3.0, 3.0],
                              "my_rewards:annotated": [1.0, 0.0, 1.0], "my_rewards:annotated_one": [1.0, 0.0, 1.0]}
    assert res.rewards == [1 + 3 + 1 + 1, 2 + 3 + 0 + 0, 3 + 3 + 1 + 1]


def test_weights_scale_each_source(user_file):
    s = RewardScorer(RewardConfig(functions=["math_verify", f"{user_file}:length"], weights=[2.0, 0.5],
                                  format_weight=0.1))
    res = s.score(["The answer is 7.", "nope"], ["7", "7"])
    assert res.rewards == pytest.approx([2.0 * 1 + 0.5 * 16 + 0.1, 0.5 * 4])


def test_the_format_bonus_on_top_of_your_own_rewards_is_announced(user_file, caplog):
    """reward.format_weight (0.1 by default) adds the built-in bonus for "The answer is N" to your own
    functions' scores: a user who brings a reward function was not told (a new user's trial)."""
    with caplog.at_level("WARNING", logger="colo_rl"):
        RewardScorer(RewardConfig(functions=[f"{user_file}:length"], format_weight=0.1))
    (record,) = [r for r in caplog.records if "format_weight" in r.getMessage()]
    assert "reward.format_weight=0.1 adds a bonus" in record.getMessage()
    assert f"to what {user_file}:length scores; reward.format_weight=0 leaves" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="colo_rl"):
        RewardScorer(RewardConfig(functions=[f"{user_file}:length"], format_weight=0.0))
        RewardScorer(RewardConfig(functions=["math_verify"], format_weight=0.1))  # the built-in task's own bonus
    assert not [r for r in caplog.records if "format_weight" in r.getMessage()]


def test_record_fields_reach_the_function(user_file, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i), "difficulty": i}) for i in range(4)))
    train, _ = load_problems(DataConfig(path=str(data), eval_size=1, train_size=0))
    problems = sorted(train, key=lambda p: p.answer)
    fields = [p.fields for p in problems]
    assert fields[0] == {"question": fields[0]["question"], "answer": problems[0].answer,
                         "difficulty": int(problems[0].answer)}
    texts = [f"about {p.question}" if i % 2 else "other" for i, p in enumerate(problems)]
    d = [float(p.fields["difficulty"]) for p in problems]
    s = scorer(f"{user_file}:with_fields", f"{user_file}:named_field", f"{user_file}:batched_fields")
    res = s.score(texts, [p.answer for p in problems], fields)
    assert res.per_source["my_rewards:with_fields"] == [x + (0.5 if i % 2 else 0.0) for i, x in enumerate(d)]
    assert res.per_source["my_rewards:named_field"] == d
    assert res.per_source["my_rewards:batched_fields"] == [10 * x for x in d]


def test_the_embedded_task_passes_its_question(user_file):
    train, _ = load_problems(DataConfig(train_size=3, eval_size=2))
    assert train[0].fields == {"question": train[0].question, "answer": train[0].answer}


def test_a_field_the_function_requires_but_the_records_lack_is_named(user_file):
    with pytest.raises(RewardError, match=r"my_rewards.py:needs_missing requires the record field 'topic', but the "
                                          r"records have \['question'\]"):
        scorer(f"{user_file}:needs_missing").score(["x"], ["1"], [{"question": "q"}])


# ---------------------------------------------------------------- wrong returns, failures
@pytest.mark.parametrize("name,message", [
    ("returns_text", r"my_rewards.py:returns_text returned str '1.0'; a per-sample reward function returns a float"),
    ("returns_scalar", r"my_rewards.py:returns_scalar returned float 1.0; a batched reward function returns a list "
                       r"of 2 floats"),
    ("returns_short", r"my_rewards.py:returns_short returned 1 values for 2 completions"),
])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_wrong_return_stops_on_the_first_batch_naming_the_function(user_file, name, message, workers):
    with pytest.raises(RewardError, match=message):
        scorer(f"{user_file}:{name}", workers=workers).score(["a", "b"], ["1", "1"])


@pytest.mark.parametrize("workers", [0, 2])
def test_exceptions_and_nan_are_counted_failures(user_file, workers):
    s = scorer(f"{user_file}:flaky", max_failure_rate=0.5, workers=workers)
    res = s.score(["ok", "boom", "nan", "ok"], ["1"] * 4)
    assert res.rewards == [1.0, 0.0, 0.0, 1.0]
    assert res.failures == 2
    assert any("my_rewards.py:flaky: RuntimeError: verifier crashed" in m for m in res.failure_messages)
    assert any("returned nan" in m for m in res.failure_messages)
    strict = scorer(f"{user_file}:flaky", max_failure_rate=0.25, workers=workers)
    with pytest.raises(RewardError, match=r"2/4 reward calls failed in this batch \(> reward.max_failure_rate=0.25\)"):
        strict.score(["boom", "nan", "ok", "ok"], ["1"] * 4)


@pytest.mark.parametrize("workers", [0, 1])
def test_sys_exit_in_a_reward_function_is_a_counted_failure_not_the_end_of_the_trainer(user_file, workers):
    s = scorer(f"{user_file}:exits", f"{user_file}:exits_batched", max_failure_rate=1.0, workers=workers)
    res = s.score(["ok", "quit", "ok"], ["1"] * 3)
    assert res.per_source["my_rewards:exits"] == [1.0, 0.0, 1.0]
    assert res.failures == 1 + 3  # one sample of exits, the whole batch of exits_batched
    assert any(m.endswith("my_rewards.py:exits: it called sys.exit(0); return a value or raise an exception instead")
               for m in res.failure_messages), res.failure_messages
    assert any("exits_batched: it called sys.exit('bye')" in m for m in res.failure_messages)


@pytest.mark.parametrize("workers", [0, 1])
def test_numpy_scalars_are_numbers(user_file, workers):
    res = scorer(f"{user_file}:numpy_verdict", f"{user_file}:numpy_batch", workers=workers).score(["ab", "a", "x"],
                                                                                                 ["cd", "cd", "y"])
    assert res.per_source["my_rewards:numpy_verdict"] == [1.0, 0.0, 1.0]
    assert res.per_source["my_rewards:numpy_batch"] == [0.5, 1.0, 2.0] and res.failures == 0


def test_sys_exit_while_a_reward_file_imports_names_the_file(tmp_path):
    bad = tmp_path / "leaves.py"
    bad.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=r"importing .*leaves.py failed: it called sys.exit\(0\)"):
        validate(RunConfig(reward=RewardConfig(functions=[f"{bad}:score"])))


def test_a_reward_worker_starts_without_torch():
    # every worker (and every replacement after a timeout) is a fresh interpreter: torch's import
    # would add seconds to each start
    out = subprocess.run([sys.executable, "-c", "import sys, colo_rl.rewards.worker; "
                          "print([m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules])"],
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_call_past_the_timeout_is_a_failure_and_the_pool_goes_on(user_file):
    s = scorer(f"{user_file}:hangs", f"{user_file}:length", workers=2, timeout_s=1.0, max_failure_rate=0.5)
    s.score(["warm"], ["1"])  # workers started
    t0 = time.perf_counter()
    res = s.score(["a", "hang", "bb", "c"], ["1"] * 4)
    took = time.perf_counter() - t0
    assert took < 10, took  # one timeout (1 s) and a replacement worker, not the 600 s sleep
    assert res.per_source["my_rewards:hangs"] == [2.0, 0.0, 2.0, 2.0]
    assert res.per_source["my_rewards:length"] == [1.0, 4.0, 2.0, 1.0]
    assert res.failures == 1 and "timed out after 1s (reward.timeout_s)" in res.failure_messages[0]
    assert s.score(["x", "yy"], ["1", "1"]).rewards == [3.0, 4.0]  # the killed worker was replaced
    with pytest.raises(RewardError, match="reward.max_failure_rate"):
        scorer(f"{user_file}:hangs", workers=1, timeout_s=0.5, max_failure_rate=0.2).score(["hang", "ok"], ["1"] * 2)
    s.close()


def test_a_worker_that_died_between_calls_is_replaced_not_a_crash(user_file):
    s = scorer(f"{user_file}:exits_later", workers=1)
    assert s.score(["exit"], ["1"]).rewards == [1.0]
    time.sleep(1.0)  # the worker is gone now, idle
    res = s.score(["a", "b"], ["1", "1"])
    assert res.rewards == [1.0, 1.0] and res.failures == 0
    s.close()


def test_the_pool_works_when_the_trainer_holds_over_1024_files(user_file):
    """select(2) refuses fds above 1023; a trainer with many files and sockets open gets such fds."""
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("this machine's open-file limit is under 1200")
    held = [os.pipe() for _ in range(550)]
    try:
        s = scorer(f"{user_file}:length", workers=1)
        assert s.score(["ab", "c"], ["1", "1"]).rewards == [2.0, 1.0]
        assert s.pool.workers[0].fd > 1023
        s.close()
    finally:
        for r, w in held:
            os.close(r), os.close(w)


def test_pool_and_in_process_scores_agree(user_file):
    texts, truths = ["a", "bb", "ccc", "dddd", "e"], ["a", "x", "ccc", "y", "e"]
    fns = [f"{user_file}:length", f"{user_file}:batch_size", f"{user_file}:annotated", "math_verify"]
    here, pooled = scorer(*fns).score(texts, truths), scorer(*fns, workers=2).score(texts, truths)
    assert pooled.per_source["my_rewards:batch_size"] == [3.0, 3.0, 3.0, 2.0, 2.0]  # split over the 2 workers
    here.per_source.pop("my_rewards:batch_size"), pooled.per_source.pop("my_rewards:batch_size")
    assert pooled.per_source == here.per_source
    assert all(math.isfinite(r) for r in pooled.rewards)


def test_reward_model_seconds_count_as_training_in_the_bottleneck_report():
    from colo_rl.bottleneck import phase_means

    rows = [{"step": 1, "time/step": 10.0, "time/generation": 4.0, "time/logprobs": 1.0, "time/update": 2.0,
             "time/reward_model": 1.5, "time/reward": 0.5}]
    means = phase_means(rows, skip=0)
    assert means["train"] == 4.5 and means["generation"] == 4.0
    assert means["other"] == pytest.approx(1.5)  # time/reward 0.5 + the step's 1.0 s outside every timer


def test_a_callable_object_is_named_by_its_entry(tmp_path):
    path = tmp_path / "objects.py"
    path.write_text("class Scorer:\n    def __call__(self, completion, truth):\n        return 'high'\n\nscore = Scorer()\n")
    s = scorer(f"{path}:score")
    assert s.sources[0].batched is False
    with pytest.raises(RewardError, match=r"objects.py:score returned str 'high'"):
        s.score(["a"], ["1"])


# ---------------------------------------------------------------- tried on real records at start-up
CHECKED = '''
def uses_solution(completion, truth, **kwargs):
    return float(kwargs["solution"] in completion)  # a key the records lack: KeyError on every record

def sometimes(completion, truth, **kwargs):
    if truth == "1":
        raise ValueError("no")
    return 1.0
'''


@pytest.mark.parametrize("name,message", [
    ("returns_text", r"the reward check on 2 record\(s\) of the data \(f.jsonl:1, f.jsonl:2\): reward function "
                     r".*my_rewards.py:returns_text returned str '1.0'"),
    ("needs_missing", r"the reward check .*: reward function .*my_rewards.py:needs_missing requires the record field "
                      r"'topic', but the records have \['question'\]"),
    ("uses_solution", r"the reward check .*: reward function .*checked.py:uses_solution failed on every one: "
                      r"KeyError: 'solution'"),
])
@pytest.mark.parametrize("workers", [0, 1])
def test_reward_functions_are_tried_on_real_records_before_the_run(user_file, name, message, workers):
    (user_file.parent / "checked.py").write_text(CHECKED)
    spec = f"{user_file.parent / 'checked.py' if name == 'uses_solution' else user_file}:{name}"
    with pytest.raises(RewardError, match=message):
        scorer(spec, workers=workers).check_on_records(["1", "2"], [{"question": "q"}] * 2, ["f.jsonl:1", "f.jsonl:2"])


def test_the_reward_check_passes_a_function_that_fails_on_some_records(user_file):
    (user_file.parent / "checked.py").write_text(CHECKED)
    s = scorer(f"{user_file.parent / 'checked.py'}:sometimes", max_failure_rate=0.0)
    s.check_on_records(["1", "2"], [{}, {}], ["a", "b"])  # one failure of two: the run decides, as it goes
    assert s.max_failure_rate == 0.0  # restored


def test_grpo_refuses_a_wrong_reward_function_before_the_model_loads(user_file, tmp_path):
    """It was said only at step 1, after the model, the engine and the step-0 held-out evaluation."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "recipes/grpo.py", f"reward.functions=[{user_file}:returns_text]",
                           f"run_dir={tmp_path}/run", "model=tiny"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=child_env(OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "error: the reward check on 4 record(s) of the data (arithmetic:train[0], " in out, out
    assert "returns_text returned str '1.0'" in out, out
    assert "step 0" not in out and "actor" not in out.lower(), out  # nothing slow started
    print(f"refused in {seconds:.1f}s")
