"""The command line's override keys, checked before Hydra (colo_rl/config/command_line.py): a verl,
TRL, OpenRLHF or slime option's name gets colo_rl's, a misspelt key the closest option, any other
unknown key where the options are listed, an argparse-style `--name value` the key=value to write;
the mapping and docs/data.md's tables say the same."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from colo_rl.config import OPTIONS, ConfigError
from colo_rl.config.command_line import HYDRA_FLAGS, check_override_keys, override_key
from colo_rl.config.peer_names import NO_EQUIVALENT, PEER_KEYS, RECIPE_PEER_KEYS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arg,message", [
    ("actor_rollout_ref.actor.optim.lr=1e-6", r"is verl's option; colo_rl's is trainer.lr: write trainer.lr=1e-6"),
    ("beta=0.04", r"beta is TRL's option; colo_rl's is algo.kl_coef: write algo.kl_coef=0.04"),
    ("data.train_batch_size=64", r"colo_rl's is rollout.prompts_per_step \(prompts per step, all ranks\)"),
    ("trainer.lrr=1e-5", r"trainer.lrr: colo_rl has no such option; did you mean trainer.lr\? \(trainer.lr=1e-5"),
    ("rollout.temprature=0.7", r"did you mean rollout.temperature\?"),
    ("+learning_rate=1e-5", r"learning_rate is TRL's option; colo_rl's is trainer.lr"),
    ("rollout.n=4", r"rollout.n is verl's option; colo_rl's is rollout.group_size .*write rollout.group_size=4"),
    ("trainer.n_gpus_per_node=8", r"colo_rl has none like it: the GPUs are torchrun's: --nproc_per_node=N. Drop it"),
    ("trainer.project_name=x", r"set WANDB_PROJECT \(wandb\) or MLFLOW_EXPERIMENT_NAME"),
    # a list option given a bare value failed in Hydra ("str is not a ListConfig"), once per rank
    ("reward.functions=r.py:fn", r"reward.functions takes a list: write reward.functions=\[r.py:fn\]"),
    ("logger=wandb", r"logger takes a list: write logger=\[wandb\]"),
])
def test_a_peers_name_or_a_typo_is_refused_with_the_key_to_write(arg, message):
    with pytest.raises(ConfigError, match=message):
        check_override_keys(["model=tiny", arg])


def test_a_peers_name_means_what_it_means_in_that_recipe():
    # TRL's beta: GRPOConfig's KL coefficient, DPOConfig's inverse temperature
    with pytest.raises(ConfigError, match=r"colo_rl's is algo.kl_coef"):
        check_override_keys(["beta=0.1"], "grpo")
    with pytest.raises(ConfigError, match=r"colo_rl's is algo.beta \(DPO's inverse temperature\)"):
        check_override_keys(["beta=0.1"], "dpo")
    with pytest.raises(ConfigError, match=r"colo_rl's is trainer.epochs: write trainer.epochs=3"):
        check_override_keys(["num_train_epochs=3"], "sft")
    # SFT reads no KL coefficient or DPO temperature: said, not matched to a close name
    with pytest.raises(ConfigError, match=r"beta is TRL's option, algo.beta in colo_rl, which the sft recipe does "
                                          r"not read \(DPO only\)"):
        check_override_keys(["beta=0.1"], "sft")
    # verl's SFT trainer: its data.train_batch_size counts examples (data.train_size, one edit away,
    # would cap the data instead)
    with pytest.raises(ConfigError, match=r"colo_rl's is trainer.batch_size .*: write trainer.batch_size=64"):
        check_override_keys(["data.train_batch_size=64"], "sft")
    with pytest.raises(ConfigError, match=r"colo_rl's is trainer.epochs: write trainer.epochs=3"):
        check_override_keys(["trainer.total_epochs=3"], "dpo")
    with pytest.raises(ConfigError, match=r"trainer.epochs in colo_rl, which the grpo recipe does not read "
                                          r"\(set trainer.total_steps\)"):
        check_override_keys(["trainer.total_epochs=3"], "grpo")
    # another recipe's peer name for an option this recipe reads too: said as such, never "does not read"
    with pytest.raises(ConfigError, match=r"optim.lr is verl's option; colo_rl's is trainer.lr: write trainer.lr=1e-6"):
        check_override_keys(["optim.lr=1e-6"], "grpo")


@pytest.mark.parametrize("arg,write", [
    ("report_to=wandb", "write logger=[jsonl,wandb]"),  # a list, jsonl kept
    ("report_to=none", "write logger=[jsonl]"),
    ("trainer.logger=[console,wandb]", "write logger=[jsonl,wandb]"),  # verl's list: the console is always on
    ("actor_rollout_ref.rollout.name=vllm", "set rollout.engine."),  # no vLLM: hf or sglang
    ("actor_rollout_ref.rollout.name=sglang", "write rollout.engine=sglang"),
    ("loss_type=dr_grpo", "write algo.loss_agg=seq-mean-token-sum-norm"),
    ("scale_rewards=group", "write algo.scale_by_std=true"),
    ("scale_rewards=batch", "set algo.scale_by_std."),  # no such choice: no ready value
    ("custom_reward_function.path=r.py", "write reward.functions=[r.py:compute_score]"),
    ("per_device_train_batch_size=4", "set trainer.micro_batch_tokens."),  # other units: never a 4-token budget
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "set trainer.mini_batches_per_step."),
])
def test_a_peers_value_is_written_as_colo_rls_or_not_at_all(arg, write):
    with pytest.raises(ConfigError) as e:
        check_override_keys([arg], "grpo")
    assert write in str(e.value)
    assert not [t for keys in RECIPE_PEER_KEYS.values() for _, t, _ in keys.values() if t not in OPTIONS]


@pytest.mark.parametrize("arg", [
    "model=tiny", "env=calculator", "trainer.lr=1e-5", "+trainer.lr=1e-5", "rollout.sglang_kwargs.mem_fraction_static=0.5",
    "hydra.run.dir=/tmp/x", "--multirun", "-cn", "sft", "debug=true",
    "--cfg", "job", "--config-name=sft", "-m", "--help", "hydra/job_logging=disabled",
    "+trainer.lrr=1",  # composed, then refused by validation.check_schema_keys (tests/test_validation.py)
])
def test_what_the_check_leaves_alone(arg):
    check_override_keys([arg])


@pytest.mark.parametrize("arg,write", [
    # OpenRLHF's rollout_batch_size is prompts per rollout (difflib said rollout.eval_batch_size)
    ("rollout_batch_size=8", "rollout_batch_size is OpenRLHF's option; colo_rl's is rollout.prompts_per_step "
                             "(prompts per step, all ranks): write rollout.prompts_per_step=8"),
    ("rollout-batch-size=8", "slime's option; colo_rl's is rollout.prompts_per_step"),
    ("rollout.batch_size=8", "OpenRLHF's option; colo_rl's is rollout.prompts_per_step"),  # its newer dotted flags
    ("n_samples_per_prompt=4", "write rollout.group_size=4"),
    ("n-samples-per-prompt=4", "slime's option; colo_rl's is rollout.group_size: write rollout.group_size=4"),
    ("actor_learning_rate=1e-6", "write trainer.lr=1e-6"),
    ("lr=1e-6", "lr is slime's option; colo_rl's is trainer.lr: write trainer.lr=1e-6"),
    ("micro_train_batch_size=2", "set trainer.micro_batch_tokens."),  # sequences, not tokens: no ready value
    ("train_batch_size=128", "set trainer.mini_batches_per_step."),
    ("global-batch-size=64", "set trainer.mini_batches_per_step."),
    ("max-tokens-per-gpu=4096", "write trainer.micro_batch_tokens=4096"),
    ("init_kl_coef=0.01", "write algo.kl_coef=0.01"),
    ("use_kl_loss=true", "write algo.kl_in_reward=false"),  # the opposite flag
    ("kl_estimator=k3", "write algo.kl_estimator=k3"),
    ("input_key=question", "write data.prompt_key=question"),
    ("label_key=answer", "write data.answer_key=answer"),
    ("label-key=answer", "slime's option; colo_rl's is data.answer_key"),
    ("prompt_max_len=512", "write data.max_prompt_tokens=512"),
    ("generate_max_len=1024", "write rollout.max_new_tokens=1024"),
    ("rollout-max-response-len=1024", "write rollout.max_new_tokens=1024"),
    ("max_epochs=2", "write trainer.ppo_epochs=2"),
    ("temperature=0.7", "temperature is TRL and OpenRLHF's option; colo_rl's is rollout.temperature"),
    ("rollout-temperature=0.7", "write rollout.temperature=0.7"),
    ("top_p=0.9", "write rollout.top_p=0.9"),
    ("eps_clip=0.2", "write algo.clip_low=0.2"),
    ("eps-clip-high=0.28", "write algo.clip_high=0.28"),
    ("advantage_estimator=group_norm", "write algo.adv_estimator=grpo"),
    ("advantage_estimator=reinforce_baseline", "write algo.adv_estimator=reinforce_pp_baseline"),
    ("advantage_estimator=gae", "set algo.adv_estimator."),  # no critic here
    ("advantage-estimator=reinforce_plus_plus", "write algo.adv_estimator=reinforce_pp"),
    ("save_path=/ckpt/run1", "write run_dir=/ckpt/run1"),
    ("ckpt_path=/ckpt/run1", "write run_dir=/ckpt/run1"),
    ("load_checkpoint=true", "write resume=auto"),
    ("num-rollout=100", "write trainer.total_steps=100"),
])
def test_openrlhf_and_slime_names_get_colo_rls(arg, write):
    with pytest.raises(ConfigError) as e:
        check_override_keys([arg], "grpo")
    assert write in str(e.value), str(e.value)
    assert "docs/data.md" in str(e.value)


@pytest.mark.parametrize("arg,instead", [
    ("num_episodes=1", "set trainer.total_steps"),
    ("num-epoch=1", "set trainer.total_steps"),
    ("actor_num_gpus_per_node=8", "--nproc_per_node=N"),
    ("trainer.nnodes=2", "--nnodes=N"),
    ("use-dynamic-batch-size=true", "always sized in tokens"),
])
def test_openrlhf_and_slime_names_with_no_equivalent_say_what_to_do(arg, instead):
    with pytest.raises(ConfigError, match=r"colo_rl has none like it: .*Drop it") as e:
        check_override_keys([arg], "grpo")
    assert instead in str(e.value)


def test_openrlhf_sft_names_mean_what_they_mean_there():
    with pytest.raises(ConfigError, match=r"colo_rl's is trainer.epochs: write trainer.epochs=3"):
        check_override_keys(["max_epochs=3"], "sft")
    with pytest.raises(ConfigError, match=r"colo_rl's is data.max_seq_len .*: write data.max_seq_len=512"):
        check_override_keys(["max_len=512"], "dpo")


@pytest.mark.parametrize("arg", ["foo_bar=1", "trainer.a_key_nothing_resembles=1", "~foo_bar"])
def test_an_unknown_key_gets_colo_rls_error_not_hydras(arg):
    # Hydra's own ("Could not override ... To append to your config use +foo_bar=1") recommends the
    # `+` form colo_rl refuses, and under the launcher ended as "rank 1 ... exited with code 1"
    with pytest.raises(ConfigError) as e:
        check_override_keys(["model=tiny", arg])
    key = arg.lstrip("~").split("=")[0]
    assert str(e.value) == f"{key}: colo_rl has no such option; the options are listed in docs/config.md"


@pytest.mark.parametrize("args,said", [
    (["--n_samples_per_prompt", "4"], "--n_samples_per_prompt 4: colo_rl takes key=value overrides (Hydra's), not "
                                      "--options; n_samples_per_prompt is OpenRLHF's option; colo_rl's is "
                                      "rollout.group_size: write rollout.group_size=4"),
    (["--micro_train_batch_size", "2"], "--micro_train_batch_size 2: colo_rl takes key=value overrides (Hydra's), "
                                        "not --options; micro_train_batch_size is OpenRLHF's option; colo_rl's is "
                                        "trainer.micro_batch_tokens"),
    (["--lr", "1e-6", "model=tiny"], "--lr 1e-6: colo_rl takes key=value overrides (Hydra's), not --options; lr is "
                                     "slime's option; colo_rl's is trainer.lr: write trainer.lr=1e-6"),
    (["--rollout-batch-size=16"], "--rollout-batch-size=16: colo_rl takes key=value overrides (Hydra's), not "
                                  "--options; rollout-batch-size is slime's option; colo_rl's is rollout.prompts_per_step (prompts per step, all ranks): write "
                                  "rollout.prompts_per_step=16"),
    (["--use_kl_loss", "model=tiny"], "--use_kl_loss: colo_rl takes key=value overrides (Hydra's), not --options; "
                                      "use_kl_loss is OpenRLHF's option; colo_rl's is algo.kl_in_reward"),
    (["--save_steps", "-1"], "--save_steps -1: colo_rl takes key=value overrides (Hydra's), not --options; "
                             "save_steps is TRL and OpenRLHF's option"),
    (["--trainer.lr", "1e-5"], "--trainer.lr 1e-5: colo_rl takes key=value overrides (Hydra's), not --options: "
                               "write trainer.lr=1e-5"),
    (["--foo_bar", "1"], "--foo_bar 1: colo_rl takes key=value overrides (Hydra's), not --options; foo_bar: colo_rl "
                         "has no such option; the options are listed in docs/config.md"),
])
def test_a_dashed_argument_gets_the_key_value_to_write(args, said):
    with pytest.raises(ConfigError) as e:
        check_override_keys(args, "grpo")
    assert str(e.value).startswith(said), str(e.value)


def test_hydras_own_flags_are_the_ones_hydra_parses():
    from hydra._internal.utils import get_args_parser

    assert HYDRA_FLAGS == {s for action in get_args_parser()._actions for s in action.option_strings}


def test_override_key():
    assert [override_key(a) for a in ("+x.y=1", "++x.y=1", "~x.y", "x@pkg=a", "--cfg", "hydra.job.name=a")] == \
        ["x.y", "x.y", "x.y", None, None, None]


def docs_table(section: str) -> dict[str, str]:
    """docs/data.md's table of peer names in `section` (its first table): each peer name (code or
    italics, outside parentheses) -> the colo_rl cell of its row."""
    text = (ROOT / "docs" / "data.md").read_text()
    table = next(p for p in text[text.index(section):].split("\n\n") if p.startswith("| "))
    in_docs = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        peers = re.sub(r"\([^)]*\)", "", " ".join(cells[:-1]))  # parenthesised: not a key
        for name in re.findall(r"[`*]([a-z_][a-z0-9_.-]*)[`*]", peers):
            if name not in OPTIONS:  # verl's data.prompt_key is colo_rl's too
                in_docs[name] = cells[-1]
    return in_docs


@pytest.mark.parametrize("section,whose", [("## Option names", ("verl", "TRL")),
                                           ("## From OpenRLHF / slime", ("OpenRLHF", "slime"))])
def test_every_peer_name_maps_to_an_option_and_the_docs_table_says_the_same(section, whose):
    assert not [target for _, target, _ in PEER_KEYS.values() if target not in OPTIONS]
    in_docs = docs_table(section)
    theirs = {k: v for k, v in PEER_KEYS.items() if any(w in v[0] for w in whose)}
    assert set(in_docs) == set(theirs), (set(in_docs) ^ set(theirs))
    wrong = {k: (target, in_docs[k]) for k, (_, target, _) in theirs.items() if f"`{target}" not in in_docs[k]}
    assert not wrong


def test_the_docs_name_each_no_equivalent_name():
    text = (ROOT / "docs" / "data.md").read_text()
    assert not [k for k in NO_EQUIVALENT if f"`{k}`" not in text and f"*{k}*" not in text]


def test_the_recipe_refuses_before_anything_starts(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), "learning_rate=1e-5",
                          f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: learning_rate is TRL's option; colo_rl's is trainer.lr: write trainer.lr=1e-5")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,said", [
    (["foo_bar=1"], "error: foo_bar: colo_rl has no such option; the options are listed in docs/config.md"),
    (["--n_samples_per_prompt", "4"], "error: --n_samples_per_prompt 4: colo_rl takes key=value overrides"),
])
def test_the_recipe_refuses_an_unknown_key_or_a_dashed_argument_itself(tmp_path, args, said):
    # before: Hydra's "Could not override 'foo_bar'" (exit 1), argparse's "unrecognized arguments"
    run = subprocess.run([sys.executable, str(ROOT / "recipes" / "grpo.py"), *args, f"run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip().splitlines()[-1]]  # one line, no usage block
    assert run.stderr.strip().startswith(said), run.stderr


def test_hydras_flags_keep_their_values_and_completion_and_sections_are_no_values():
    """A value-taking Hydra flag's value is not an override; `-sc install=bash` is Hydra's completion;
    a section that is no config group (`colocate=true`) or a key inside another option
    (`logger.wandb.project=p`) is refused here, not by Hydra after start-up."""
    check_override_keys(["-sc", "install=bash"])
    check_override_keys(["--shell-completion", "query=trainer.l"])
    check_override_keys(["-cn", "sft", "model=tiny", "colocate.memory_margin_gib=1", "rollout=sglang"])
    with pytest.raises(ConfigError, match="did you mean trainer.lr"):
        check_override_keys(["-cn", "sft", "trainer.lrr=1"])
    for arg in ("colocate=true", "--colocate"):
        with pytest.raises(ConfigError, match=r"colocate is slime's option; colo_rl has none like it"):
            check_override_keys([arg])
    with pytest.raises(ConfigError, match=r"logger.wandb.project is OpenRLHF's option.*WANDB_PROJECT"):
        check_override_keys(["logger.wandb.project=p"])
    with pytest.raises(ConfigError, match=r"reward.weights is one option \(a list: \[a,b\]\), with no keys inside"):
        check_override_keys(["reward.weights.math_verify=2"])


def test_a_secret_flag_value_is_never_echoed():
    with pytest.raises(ConfigError) as e:
        check_override_keys(["--use_wandb", "SECRETKEY123"])
    assert "SECRETKEY123" not in str(e.value) and "logger=[jsonl,wandb]" in str(e.value)
