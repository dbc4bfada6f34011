"""Issue #19: every setting is checked before the model loads (one pass, `config.validate`), a run
directory keeps its config and its metrics honest, and a failure is one clean line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from colo_rl.config import RECIPES, ConfigError, RunConfig, TrainerConfig, register_configs, to_object
from colo_rl.data import load_problems
from colo_rl.rollout.sglang.compat import NO_GPU, NOT_INSTALLED
from conftest import ROOT, child_env, child_python_path

register_configs()
NAMES = {"grpo": "config", "sft": "sft", "dpo": "dpo", "eval": "eval"}


def _cfg(overrides, recipe="grpo"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose(config_name=NAMES[recipe], overrides=overrides)
    return to_object(composed, recipe, overrides)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_default_config_passes(recipe):
    assert _cfg([], recipe).recipe == recipe


@pytest.mark.parametrize("override,message", [
    ("+trainer.lrr=1e-5", r"\+trainer.lrr: trainer has no key 'lrr'; did you mean trainer.lr\?"),
    ("+wandb.project=x", r"\+wandb: the config has no key 'wandb'"),
    ("+model.lora_rank=8", r"\+model.lora_rank: model has no key 'lora_rank'"),
])
def test_plus_key_the_schema_does_not_have_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg([override])


def test_tensor_parallel_engine_is_accepted_with_sglang():
    assert _cfg(["rollout=sglang", "rollout.tp_size=2"]).rollout.tp_size == 2


def test_sglang_kwargs_stay_a_free_dict():
    cfg = _cfg(["+rollout.sglang_kwargs.disable_cuda_graph=true"])
    assert cfg.rollout.sglang_kwargs["disable_cuda_graph"] is True


@pytest.mark.parametrize("override,message", [
    ("trainer.lr=-1e-5", r"trainer.lr=-1e-05 must be > 0"),
    ("trainer.lr=0", r"trainer.lr=0.0 must be > 0"),
    ("rollout.top_p=0", r"rollout.top_p=0.0 must be in \(0, 1\]"),
    ("rollout.top_p=1.5", r"rollout.top_p=1.5 must be in \(0, 1\]"),
    ("algo.kl_coef=-0.1", r"algo.kl_coef=-0.1 must be >= 0"),
    ("rollout.group_size=1", r"rollout.group_size=1: algo.adv_estimator=grpo's baseline .* use rollout.group_size>=2"),
    ("rollout.tp_size=2", r"rollout.tp_size=2 splits SGLang's engine .* rollout.engine=hf .* would ignore it"),
    ("trainer.micro_batch_tokens=lots", r"trainer.micro_batch_tokens='lots' must be auto or a positive number"),
    ("trainer.micro_batch_tokens=0", r"trainer.micro_batch_tokens='0' must be auto or a positive number"),
    ("trainer.micro_batch_size=-1", r"trainer.micro_batch_size=-1 must be >= 0 \(0 = no cap"),
    ("data.min_operand=50", r"data.min_operand=50 > data.max_operand=30: .* raise data.max_operand"),
    ("data.three_operand_fraction=1.5", r"data.three_operand_fraction=1.5 must be in \[0, 1\]"),
])
def test_out_of_range_value_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg([override])


@pytest.mark.parametrize("overrides,message", [
    (["algo.adv_estimator=ppo"], r"algo.adv_estimator='ppo' is not one of \['grpo', 'rloo', 'reinforce_pp'"),
    (["algo.policy_loss=gspo"], r"algo.policy_loss=gspo clips a sequence-level ratio"),
    (["algo.policy_loss=gspo", "algo.clip_high=4e-4"], r"not 0.2 / 0.0004. Set algo.clip_low=3e-4"),
    (["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4"],
     r"algo.loss_agg=token-mean would weigh sequences differently. Set algo.loss_agg=seq-mean-token-mean"),
    (["algo.tis_cap=0.5"], r"algo.tis_cap=0.5 must be >= 1 \(a ratio of 1"),
    (["algo.adv_estimator=reinforce_pp", "algo.kl_target=0.01"], r"algo.kl_target=0.01 adapts algo.kl_coef, which is 0"),
    (["env=calculator", "rollout.max_new_tokens=512", "algo.overlong_buffer_len=300"],
     r"algo.overlong_buffer_len=300 must be smaller than env.max_total_tokens="),
    (["algo.adv_estimator=reinforce_pp", "rollout.group_size=1", "algo.dynamic_sampling=true"],
     r"algo.dynamic_sampling=true keeps groups whose rewards differ; with rollout.group_size=1"),
    (["algo.clip_ratio_c=1.0"], r"algo.clip_ratio_c=1.0 must be > 1"),
    (["algo.kl_in_reward=true"], r"algo.kl_in_reward=true needs algo.kl_coef > 0"),
    (["algo.kl_target=0.1"], r"algo.kl_target adapts the KL-in-reward coefficient"),
    (["algo.overlong_buffer_len=40"], r"algo.overlong_buffer_len=40 must be smaller than rollout.max_new_tokens=40"),
    (["algo.adv_estimator=rloo", "rollout.group_size=1"], r"algo.adv_estimator=rloo's baseline"),
    (["colocate.paging=always"], r"colocate.paging='always' is not one of \['auto', 'on', 'off'\]"),
])
def test_algorithm_options_are_checked_with_the_rest(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(overrides)


def test_a_batch_baseline_estimator_accepts_groups_of_one():
    cfg = _cfg(["algo.adv_estimator=reinforce_pp", "rollout.group_size=1", "algo.policy_loss=gspo",
                "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean"])
    assert (cfg.algo.adv_estimator, cfg.rollout.group_size, cfg.algo.policy_loss) == ("reinforce_pp", 1, "gspo")


@pytest.mark.parametrize("recipe,override,message", [
    ("sft", "trainer.total_steps=2", r"trainer.total_steps is not read by recipes/sft.py \(set trainer.max_steps"),
    ("dpo", "trainer.total_steps=2", r"trainer.total_steps is not read by recipes/dpo.py"),
    ("grpo", "trainer.max_steps=3", r"trainer.max_steps is not read by recipes/grpo.py \(set trainer.total_steps\)"),
    ("sft", "algo.kl_coef=0.1", r"algo.kl_coef is not read by recipes/sft.py"),
    ("grpo", "algo.beta=0.2", r"algo.beta is not read by recipes/grpo.py"),
    ("sft", "colocate.paging=off", r"colocate.paging is not read by recipes/sft.py \(only GRPO pages"),
])
def test_setting_a_key_the_recipe_does_not_read_is_refused(recipe, override, message):
    with pytest.raises(ConfigError, match=message):
        _cfg([override], recipe)


def test_algo_group_of_another_recipe_is_refused():
    with pytest.raises(ConfigError, match=r"algo=dpo is not grpo's algo group: recipes/grpo.py runs algo=grpo "
                                          r"\(for DPO run recipes/dpo.py\)"):
        _cfg(["algo=dpo"])


def test_unknown_reward_is_refused_by_the_config_check():
    with pytest.raises(ConfigError, match=r"reward.functions: unknown reward function 'nope'"):
        _cfg(["reward.functions=[nope]"])


# ---- one seed for the whole run
def test_trainer_seed_seeds_data_order_and_sampling_unless_they_are_set():
    cfg = _cfg(["trainer.seed=5"])
    assert (cfg.data.seed, cfg.rollout.seed) == (5, 5)
    assert _cfg(["trainer.seed=6"]).data.seed == 6
    cfg = _cfg(["trainer.seed=5", "data.seed=9", "rollout.seed=11"])
    assert (cfg.data.seed, cfg.rollout.seed) == (9, 11)
    assert RunConfig(trainer=TrainerConfig(seed=3)).data.seed == 3


def test_held_out_problems_do_not_depend_on_the_run_seed():
    """Every recipe and every seed evaluates on the same held-out problems (data.split_seed)."""
    a = [p.question for p in load_problems(_cfg(["trainer.seed=1", "data.eval_size=20", "data.train_size=50"]).data)[1]]
    b = [p.question for p in load_problems(_cfg(["trainer.seed=2", "data.eval_size=20", "data.train_size=50"]).data)[1]]
    assert a == b


# ---- the real command line: refused in seconds, one line, nothing written
def _run(script, args, timeout=120, env=None):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, f"recipes/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=child_env(**(env or {})))
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("script,args,message", [
    ("grpo.py", ["+trainer.lrr=1e-5"], "+trainer.lrr: trainer has no key 'lrr'"),
    ("grpo.py", ["algo=dpo"], "algo=dpo is not grpo's algo group"),
    ("grpo.py", ["rollout.top_p=2"], "rollout.top_p=2.0 must be in (0, 1]"),
    ("grpo.py", ["reward.functions=[nope]"], "unknown reward function 'nope'"),
    ("sft.py", ["trainer.total_steps=2"], "trainer.total_steps is not read by recipes/sft.py"),
    ("grpo.py", ["-m", "trainer.lr=1e-5,2e-5"], "Hydra multirun (-m) is not supported"),
    # both after the model had loaded (a LoRA typo: PEFT's traceback), or with no hint (a hub id)
    ("grpo.py", ["model.lora.rank=4", "model.lora.target_modules=[qproj,vproj]"],
     "['qproj', 'vproj'] match no linear layer of this model; its linear layers are ['down_proj', 'gate_proj', "),
    ("grpo.py", ["model.path=Qwen/Qwen2.5-0.5B-Instruct"], "It looks like a Hugging Face hub id: colo_rl never"),
    # it failed after the actor was built, on `Torch not compiled with CUDA enabled`
    pytest.param("grpo.py", ["rollout.engine=sglang"], "<the SGLang refusal that applies here>",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")),
])
def test_command_line_refusal_is_one_line_in_seconds_before_anything_loads(tmp_path, script, args, message):
    if message.startswith("<the SGLang refusal"):  # decided when the test runs, not at collection (an
        message = NO_GPU if importlib.util.find_spec("sglang") else NOT_INSTALLED  # install may land between)
    proc, seconds = _run(script, [*args, f"hydra.sweep.dir={tmp_path}/sweep", f"output_root={tmp_path}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert [ln for ln in out.splitlines() if ln.strip()] == [f"error: {ln}" for ln in [out.split("error: ", 1)[1].strip()]]
    assert message in out and "Traceback" not in out
    assert not any(tmp_path.glob("grpo-*")) and not any(tmp_path.glob("sft-*"))  # no run directory
    assert seconds < 30, seconds  # measured ~2-3 s on 2 cores: nothing heavy starts
    print(f"{args}: refused in {seconds:.1f}s")


def test_sglang_start_check_names_what_is_missing(monkeypatch):
    import importlib.util

    from colo_rl.rollout.sglang import compat

    compat.check_engine_runs_here("hf")  # the HF engine needs neither
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="not installed"):
        compat.check_engine_runs_here("sglang")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="torch sees none here"):
        compat.check_engine_runs_here("sglang", {"attention_backend": "triton"})
    compat.check_engine_runs_here("sglang", {"device": "cpu"})  # SGLang's CPU engine (test support) passes on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    compat.check_engine_runs_here("sglang")


def test_debug_adds_the_traceback(tmp_path):
    proc, _ = _run("grpo.py", ["trainer.lr=0", "debug=true"])
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "error: trainer.lr=0.0 must be > 0" in proc.stderr


# ---- the run directory: config.yaml only once accepted, metrics of one run per file
def _fake_checkpoint(run_dir, lr):
    step = run_dir / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"world_size": 1, "step": 2}))
    (step / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(
        RunConfig(trainer=TrainerConfig(lr=lr)))))
    (step / "COMPLETE").write_text("")
    (run_dir / "config.yaml").write_text("the first run's config\n")


@pytest.mark.parametrize("args,message", [
    ([], "already holds checkpoints"),                       # a new run pointed at an existing run
    (["resume=auto", "trainer.lr=3e-5"], "cannot resume"),  # a refused resume
])
def test_refused_run_leaves_the_existing_config_yaml_alone(tmp_path, args, message):
    _fake_checkpoint(tmp_path, lr=2e-5)
    proc, _ = _run("grpo.py", [f"run_dir={tmp_path}", *args], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert (tmp_path / "config.yaml").read_text() == "the first run's config\n"


START = """
import sys
from hydra import compose, initialize_config_dir
from colo_rl import runtime
from colo_rl.config import register_configs
register_configs()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[2:])
ctx = runtime.start(cfg, "grpo", overrides=[])
print("seed", ctx.cfg.data.seed)
"""


def test_fresh_start_in_a_dead_runs_directory_moves_its_step_logs_aside(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    (tmp_path / "rollouts.jsonl").write_text(json.dumps({"step": 1, "completion": "x"}) + "\n")
    (tmp_path / "ledger.jsonl").write_text(json.dumps({"step": 0, "moves": []}) + "\n")
    proc = subprocess.run([sys.executable, "-c", START, str(ROOT / "conf"), f"run_dir={tmp_path}", "trainer.seed=3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # the new run starts a file of its own
    assert json.loads((tmp_path / "metrics.previous-1.jsonl").read_text())["step"] == 1
    assert not (tmp_path / "rollouts.jsonl").exists() and not (tmp_path / "ledger.jsonl").exists()
    assert json.loads((tmp_path / "rollouts.previous-1.jsonl").read_text())["completion"] == "x"
    assert json.loads((tmp_path / "ledger.previous-1.jsonl").read_text())["step"] == 0
    written = OmegaConf.load(tmp_path / "config.yaml")
    assert written.trainer.seed == 3 and written.data.seed == 3  # the resolved, accepted config


# ---- held-out evaluation with fewer problems than ranks (or none)
class _Engine:
    def generate(self, prompts, params):  # an engine that answers an empty batch with one empty completion
        from colo_rl.rollout.base import Completion
        return [Completion(p, [5], [0.0], "stop") for p in prompts] or [Completion([], [], [], "length")]


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["The answer is 3." if i else "" for i in ids]


@pytest.mark.parametrize("rank,problems,count", [(0, 0, 0.0), (0, 1, 0.0), (1, 1, 1.0)])
def test_evaluate_counts_only_real_held_out_problems(monkeypatch, rank, problems, count):
    """data.eval_size=0, or 1 on 2 ranks (rank 0's share is empty): no phantom problem is scored."""
    from colo_rl import dist
    from colo_rl.evaluation import evaluate
    from colo_rl.rewards import RewardScorer
    from colo_rl.config import RewardConfig

    monkeypatch.setattr(dist, "rank", lambda: rank)
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce_sum", lambda sums: dict(sums))  # this rank's share only
    res = evaluate(_Engine(), _Tokenizer(), [[1, 2]] * problems, ["3"] * problems, RewardScorer(RewardConfig()), 8)
    assert res["eval/count"] == count
    assert ("eval/accuracy" in res) == bool(count)


def test_held_out_log_line_shows_an_example_beside_its_answer(monkeypatch, caplog):
    import contextlib
    import logging
    from types import SimpleNamespace

    from colo_rl import dist
    from colo_rl.config import RewardConfig
    from colo_rl.evaluation import held_out_accuracy
    from colo_rl.rewards import RewardScorer

    monkeypatch.setattr(dist, "all_reduce_sum", lambda sums: dict(sums))
    colo = SimpleNamespace(engine=_Engine(), switch=SimpleNamespace(generation=contextlib.nullcontext,
                                                                  timed_phase_seconds=dict))
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        res = held_out_accuracy(colo, _Tokenizer(), [[1, 2]], ["4"], RewardScorer(RewardConfig()), 8, step=5)
    assert res["eval/accuracy"] == 0.0 and res["eval/count"] == 1.0
    assert caplog.records[-1].getMessage() == ("eval @ step 5: accuracy 0.000 (lenient 0.000, format 1.000) on 1 "
                                               "held-out problems; e.g. 'The answer is 3.' for answer 4")


def test_held_out_evaluation_reports_the_users_own_reward_functions(monkeypatch, tmp_path, caplog):
    """A run trained on reward functions of its own sees them on the held-out answers too
    (eval/reward_source/<name>, unweighted means, with the record fields): accuracy stays the
    built-in verifier's. A call that fails scores 0 and is counted, and the evaluation goes on; an
    empty share reports the same keys (the ranks' collectives line up)."""
    import logging

    from colo_rl import dist
    from colo_rl.config import RewardConfig
    from colo_rl.data.prompts import Problem
    from colo_rl.evaluation import evaluate, evaluate_shard
    from colo_rl.rewards import RewardScorer

    (tmp_path / "mine.py").write_text(
        "def score(completion, truth, bonus=0.0):\n"
        "    if bonus < 0:\n"
        "        raise ValueError('negative bonus')\n"
        "    return 0.5 + bonus if completion.endswith('3.') else 0.0\n")
    scorer = RewardScorer(RewardConfig(functions=[f"{tmp_path}/mine.py:score", "math_verify"], weights=[2.0, 1.0]))
    problems = [Problem("a", "q", "3", fields={"bonus": 0.25}), Problem("b", "q", "3", fields={"bonus": -1.0}),
                Problem("c", "q", "4", fields={"bonus": 0.0})]
    monkeypatch.setattr(dist, "all_reduce_sum", lambda sums: dict(sums))
    with caplog.at_level(logging.WARNING, logger="colo_rl"):
        res = evaluate(_Engine(), _Tokenizer(), [[1, 2]] * 3, ["3", "3", "4"], scorer, 8, problems=problems)
    assert res["eval/reward_source/mine:score"] == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    assert res["eval/reward_failures"] == 1.0
    assert res["eval/accuracy"] == pytest.approx(2 / 3)  # the verifier, not the functions
    assert "eval/reward_source/math_verify" not in res  # the built-in ones are accuracy already
    assert "negative bonus" in caplog.text
    monkeypatch.setattr(dist, "rank", lambda: 0)  # 1 problem on 2 ranks: rank 0's share is empty
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    empty, _ = evaluate_shard(_Engine(), _Tokenizer(), [[1, 2]], ["3"], scorer, 8, problems=problems[:1])
    assert empty == {"count": 0.0, "correct": 0.0, "lenient": 0.0, "formatted": 0.0, "response_tokens": 0.0,
                     "reward_source/mine:score": 0.0, "reward_failures": 0.0}
    plain, _ = evaluate_shard(_Engine(), _Tokenizer(), [[1, 2]], ["3"], RewardScorer(RewardConfig()), 8)
    assert set(plain) == {"count", "correct", "lenient", "formatted", "response_tokens"}
    monkeypatch.setattr(dist, "rank", lambda: 1)  # SFT / DPO: examples, no records: the functions are not called
    sft, _ = evaluate_shard(_Engine(), _Tokenizer(), [[1, 2]], ["3"], scorer, 8)
    assert set(sft) == set(plain) and sft["count"] == 1


def test_an_evaluation_reports_the_switch_into_generation_it_paid(monkeypatch):
    """After an update the evaluation pays the handoff that the next step would have paid: its row
    says so (time/eval_handoff, time/eval_phase_switch) so that the bottleneck report can charge it
    to that step; a second evaluation in the same phase (eval_no_tools/) paid nothing and says nothing."""
    from types import SimpleNamespace

    from colo_rl import dist
    from colo_rl.colocate.switch import PhaseSwitcher
    from colo_rl.config import RewardConfig
    from colo_rl.evaluation import held_out_accuracy
    from colo_rl.phase import PhaseGuard
    from colo_rl.rewards import RewardScorer

    class Manager:
        def to_generation(self, step):
            return {"seconds": 1.0, "moves": [{"what": "weights handoff", "seconds": 0.25}]}

        def to_train(self, step):
            return {"seconds": 0.5, "moves": []}

    monkeypatch.setattr(dist, "all_reduce_sum", lambda sums: dict(sums))
    switch = PhaseSwitcher(Manager(), PhaseGuard())
    switch.begin_step(3)
    with switch.generation():
        pass
    with switch.update():
        pass
    colo = SimpleNamespace(engine=_Engine(), switch=switch)
    first = held_out_accuracy(colo, _Tokenizer(), [[1, 2]], ["4"], RewardScorer(RewardConfig()), 8, step=4)
    assert first["time/eval_handoff"] == 0.25
    assert first["time/eval_phase_switch"] == pytest.approx(0.75, abs=0.05)
    second = held_out_accuracy(colo, _Tokenizer(), [[1, 2]], ["4"], RewardScorer(RewardConfig()), 8, step=4,
                               prefix="eval_no_tools/")
    assert not [k for k in second if k.startswith("time/")]


def test_console_line_names_are_unique_stable_and_say_what_they_are(tmp_path, caplog):
    import logging

    from colo_rl.metrics import MetricsLogger, console_names

    keys = ["reward/mean", "reward/accuracy", "response/len_mean", "time/step", "eval/accuracy"]
    m = MetricsLogger(tmp_path, loggers=["jsonl"], console_keys=keys)
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        m.log(3, {"reward/mean": 0.5, "reward/accuracy": 0.25, "response/len_mean": 20.0, "time/step": 12.0,
                  "eval/accuracy": 0.75})
        m.log(4, {"reward/mean": 0.5, "reward/accuracy": 0.25, "response/len_mean": 20.0, "time/step": 12.0})
    first, second = (r.getMessage() for r in caplog.records[-2:])
    assert first == "step 3 | reward/mean=0.5  reward/accuracy=0.25  len_mean=20  time/step=12  eval/accuracy=0.75"
    # a step without the held-out score names reward/accuracy as the step with it does
    assert second == "step 4 | reward/mean=0.5  reward/accuracy=0.25  len_mean=20  time/step=12"
    # a held-out score keeps its prefix even where no training metric shares its last part (SFT's line)
    assert console_names(["train/loss", "time/total", "eval/accuracy"]) == {
        "train/loss": "loss", "time/total": "time/total", "eval/accuracy": "eval/accuracy"}


def test_jit_ops_are_built_inside_the_project_environment():
    proc = subprocess.run([sys.executable, "-c", "import colo_rl, os, sys; print(os.environ['TORCH_EXTENSIONS_DIR'])"],
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                               if k != "TORCH_EXTENSIONS_DIR"})
    assert proc.stdout.strip() == os.path.join(sys.prefix, "torch_extensions")


def test_missing_model_path_and_missing_tokenizer_files_say_so(tmp_path):
    from colo_rl.models import load_tokenizer, resolve_model_path

    with pytest.raises(FileNotFoundError, match=r"model.path='.*nope' does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files \(tokenizer.json, .*Copy them from the base model"):
        load_tokenizer(str(tmp_path / "weights-only"))


def test_data_paths_resolve_from_the_project_root_and_empty_files_are_refused(tmp_path, monkeypatch):
    from colo_rl.data.files import DataError, read_records, resolve_data_path

    monkeypatch.chdir(tmp_path)  # not the project: a relative path falls back to the project root
    assert resolve_data_path("conf/config.yaml") == ROOT / "conf" / "config.yaml"
    with pytest.raises(DataError, match=r"data.path='../nowhere/gsm8k.jsonl' does not exist \(looked for .* or .*\)"
                                        r"\. data=gsm8k reads the GSM8K train split"):
        resolve_data_path("../nowhere/gsm8k.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"holds no records \(the file is empty\)"):
        read_records("empty.jsonl")


def test_missing_inputs_are_refused_before_anything_starts(tmp_path):
    from colo_rl.data.files import DataError
    from colo_rl.runtime import check_input_paths

    with pytest.raises(FileNotFoundError, match="model.path"):
        check_input_paths(_cfg([f"model.path={tmp_path / 'none'}"]))
    with pytest.raises(DataError, match="data.path"):
        check_input_paths(_cfg([f"data.path={tmp_path / 'none.jsonl'}"]))


@pytest.mark.parametrize("config, length", [
    ({"max_position_embeddings": 2048}, 2048),
    ({"max_position_embeddings": 2048, "seq_length": 1024}, 1024),  # SGLang's order of preference
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 16384),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
    ({"max_position_embeddings": 8192,
      "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 2048}}, 8192),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 8192),
    ({"hidden_size": 64}, None),
])
def test_context_length_is_read_as_sglang_reads_it(config, length):
    from colo_rl.models import context_length

    assert context_length(config) == length


@pytest.mark.parametrize("recipe, overrides, message", [
    ("grpo", ["rollout.max_new_tokens=400"],
     "data.max_prompt_tokens=256 + rollout.max_new_tokens=400 = 656 tokens is more than"),
    # a later turn: the episode so far (up to env.max_total_tokens) as input, and up to a turn more asked for
    ("grpo", ["env=calculator", "env.max_total_tokens=250"],
     "data.max_prompt_tokens=256 + env.max_total_tokens=250 + rollout.max_new_tokens=40 = 546 tokens"),
    ("eval", ["rollout.eval_max_new_tokens=300"], "+ rollout.eval_max_new_tokens=300 = 556 tokens"),
    ("sft", ["data.max_seq_len=1024"], "data.max_seq_len=1024 = 1024 tokens is more than"),
])
def test_sequences_longer_than_the_models_context_are_refused(recipe, overrides, message):
    from colo_rl.config.validation import check_context_length

    cfg = _cfg(overrides, recipe)
    cfg.recipe = recipe
    with pytest.raises(ConfigError, match=r"takes: its context length is 512 \(config.json\); lower ") as err:
        check_context_length(cfg, 512)
    assert message in str(err.value)
    check_context_length(_cfg([], recipe), 8192)  # the defaults fit the embedded model


def test_sglangs_own_context_length_is_the_one_checked(tmp_path):
    from colo_rl.runtime import check_input_paths

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    with pytest.raises(ConfigError, match=r"context length is 512 \(rollout.sglang_kwargs.context_length\)"):
        check_input_paths(_cfg([f"model.path={model}", "rollout=sglang", "+rollout.sglang_kwargs.context_length=512"]))
    check_input_paths(_cfg([f"model.path={model}", "rollout=sglang"]))  # 256 + 1024 of 8192


def _model_dir(tmp_path, config: dict):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("config, length", [
    ({"model_type": "gpt2", "n_positions": 1024}, 1024),  # an alias: transformers' attribute_map, as SGLang reads it
    ({"model_type": "llava", "text_config": {"model_type": "llama", "max_position_embeddings": 4096}}, 4096),
    ({"model_type": "qwen2", "max_position_embeddings": 32768,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}, 32768),
    ({"model_type": "not-a-transformers-type", "seq_length": 3000}, 3000),  # remote code: config.json's keys
    ({"model_type": "not-a-transformers-type", "auto_map": {"AutoConfig": "x.Y"}, "max_seq_len": 4096.0}, 4096),
])
def test_a_model_directorys_context_length_is_read_through_transformers(tmp_path, config, length):
    from colo_rl.models import known_context_length

    assert known_context_length(str(_model_dir(tmp_path, config))) == length


def test_the_embedded_models_context_length_is_known_before_its_conversion(tmp_path, monkeypatch):
    from colo_rl import models

    converted = models.context_length(json.loads((models.embedded_model_dir() / "config.json").read_text()))
    monkeypatch.setenv("COLO_RL_CACHE", str(tmp_path))  # nothing converted here
    assert not (tmp_path / models.EMBEDDED_NAME).exists()
    assert models.known_context_length("embedded") == models.EMBEDDED_CONTEXT_LENGTH == converted
    assert not (tmp_path / models.EMBEDDED_NAME).exists()  # and the check converted nothing


def test_sglang_context_length_longer_than_the_models_is_refused_unless_allowed(tmp_path, monkeypatch):
    from colo_rl.rollout.sglang.compat import SGLANG_LONGER_CONTEXT_VARIABLE
    from colo_rl.runtime import check_input_paths, run_context_length

    model = _model_dir(tmp_path, {"model_type": "llama", "max_position_embeddings": 1024})
    longer = _cfg([f"model.path={model}", "rollout=sglang", "+rollout.sglang_kwargs.context_length=4096"])
    monkeypatch.delenv(SGLANG_LONGER_CONTEXT_VARIABLE, raising=False)
    with pytest.raises(ConfigError, match=r"rollout.sglang_kwargs.context_length=4096 is more than model.path=.* "
                                          r"takes \(1024, config.json\): SGLang would refuse to start. Lower it, "
                                          r"or set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
        check_input_paths(longer)
    monkeypatch.setenv(SGLANG_LONGER_CONTEXT_VARIABLE, "1")
    assert run_context_length(longer) == (4096, "rollout.sglang_kwargs.context_length")
    # the HF engine reads the model's own figure; SGLang takes 2048 where config.json names none
    assert run_context_length(_cfg([f"model.path={model}"])) == (1024, "config.json")
    bare = _model_dir(tmp_path, {"model_type": "unknown-type"})
    assert run_context_length(_cfg([f"model.path={bare}"])) == (None, "config.json")
    with pytest.raises(ConfigError, match=r"= 2296 tokens is more than .* its context length is 2048 "
                                          r"\(SGLang's default: config.json names none\)"):
        check_input_paths(_cfg([f"model.path={bare}", "rollout=sglang", "rollout.max_new_tokens=2040"]))


@pytest.mark.parametrize("recipe", ["sft", "dpo"])
def test_sft_and_dpo_generation_eval_must_fit_the_context(tmp_path, recipe):
    from colo_rl.runtime import check_held_out_generation

    model = _model_dir(tmp_path, {"model_type": "llama", "max_position_embeddings": 512})
    cfg = _cfg([f"model.path={model}", "rollout.eval_max_new_tokens=64", "data.max_seq_len=512"], recipe)
    check_held_out_generation(cfg, [[1] * 448, [1] * 20])  # 448 + 64 = 512: fits
    with pytest.raises(ConfigError, match=r"trainer.eval_generate: the longest held-out prompt \(449 tokens\) \+ "
                                          r"rollout.eval_max_new_tokens=64 = 513 tokens is more than model.path=.* "
                                          r"takes: its context length is 512 \(config.json\); lower "
                                          r"rollout.eval_max_new_tokens or data.max_seq_len, or set "
                                          r"trainer.eval_generate=false"):
        check_held_out_generation(cfg, [[1] * 20, [1] * 449])


def test_a_run_longer_than_the_models_context_is_refused_in_seconds(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512}))
    proc, seconds = _run("grpo.py", [f"model.path={model}", "rollout.max_new_tokens=300", f"output_root={tmp_path}"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert (f"error: data.max_prompt_tokens=256 + rollout.max_new_tokens=300 = 556 tokens is more than "
            f"model.path='{model}' takes: its context length is 512 (config.json); lower data.max_prompt_tokens or "
            f"rollout.max_new_tokens to fit") in out
    assert seconds < 30, seconds


def test_log_lines_follow_stdout_so_the_progress_bar_is_not_glued_in_front(monkeypatch):
    import io
    import logging

    from colo_rl import console

    console.setup_logging()
    proxy = io.StringIO()  # what rich's live progress display puts in sys.stdout's place
    monkeypatch.setattr("sys.stdout", proxy)
    logging.getLogger("colo_rl").info("step 1 | loss=0.5")
    assert "step 1 | loss=0.5" in proxy.getvalue()


def test_a_coming_op_build_is_announced(tmp_path, monkeypatch, caplog):
    import logging

    from colo_rl.train.ds_config import announce_op_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        assert announce_op_build("fused_adam", "the optimizer op")
    assert "building the optimizer op into" in caplog.text
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").write_bytes(b"")
    assert not announce_op_build("fused_adam", "the optimizer op")  # built: nothing to say


def test_fewer_held_out_examples_than_ranks_is_warned(caplog):
    import logging

    from colo_rl.evaluation import check_held_out_size

    with caplog.at_level(logging.WARNING, logger="colo_rl"):
        assert check_held_out_size(1, 2) and "only 1 held-out example(s) for 2 ranks" in caplog.text
    assert not check_held_out_size(0, 2) and not check_held_out_size(8, 2)


def test_the_launcher_ends_a_refused_run_with_one_line_and_its_code():
    proc = subprocess.run([sys.executable, "-m", "colo_rl.launch", "--standalone", "--nproc_per_node=2",
                           "recipes/grpo.py", "trainer.lr=0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=child_env())
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, lines
    assert lines == ["error: trainer.lr=0.0 must be > 0"], lines  # no torchrun report, no banner


def test_an_error_only_one_rank_meets_is_said_by_that_rank():
    """Only rank 1 fails while rank 0 works on: rank 1 says it (no rank 0 line to wait for), and the
    launcher ends with its code."""
    proc = subprocess.run([sys.executable, "-m", "colo_rl.launch", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests/workers/clean_error_worker.py"), "1", "60"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=child_env())
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, lines
    assert lines == ["error (rank 1): data shard 1 holds no records"], lines



@pytest.mark.parametrize("recipe,attention,refused", [("sft", "flex_attention", True), ("dpo", "flash_attention_2", True),
                                                      ("grpo", "flex_attention", False), ("sft", "eager", False)])
def test_packing_needs_an_attention_that_takes_its_mask(recipe, attention, refused):
    """SFT / DPO rows carry a 4-D mask; GRPO's group rows a 4-D or FlexAttention block mask."""
    overrides = [f"model.attn_implementation={attention}", "trainer.packing=true"]  # SFT's group: false
    if refused:
        with pytest.raises(ConfigError, match=f"model.attn_implementation={attention} does not take"):
            _cfg(overrides, recipe)
        assert _cfg(overrides + ["trainer.packing=false"], recipe).trainer.packing is False
    else:
        assert _cfg(overrides, recipe).model.attn_implementation == attention


def test_held_out_accuracy_off_for_missing_answers_is_said(caplog):
    """SFT / DPO: one held-out record without an answer turned greedy accuracy off without a word."""
    import logging
    from types import SimpleNamespace

    from colo_rl.evaluation import generates_for_accuracy

    held = [SimpleNamespace(answer="4", origin="d.jsonl:1", id="0"), SimpleNamespace(answer=None, origin="d.jsonl:7",
                                                                                     id="1")]
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        assert generates_for_accuracy(True, held[:1])
        assert not generates_for_accuracy(False, held[:1]) and not caplog.records
        assert not generates_for_accuracy(True, held)
        assert "1 of 2 held-out examples have no answer (first: d.jsonl:7)" in caplog.records[-1].getMessage()
        assert caplog.records[-1].levelno == logging.WARNING
        assert not generates_for_accuracy(True, held[1:])
        assert "carry no answer" in caplog.records[-1].getMessage()
