"""The command line's override keys, checked before Hydra composes them.

Hydra's own refusal of an unknown key names the key and the schema class only. A user coming from
verl or TRL types that framework's names (`actor_rollout_ref.actor.optim.lr=1e-6`, `beta=0.04`);
a typo is one edit from a real key. `check_override_keys` answers both with the key to write,
and leaves every other case (group choices, `hydra.*`, a key with no likely meaning) to Hydra.
"""

from __future__ import annotations

import difflib
from typing import Iterable

from colo_rl.config.validation import FREE_KEYS, OPTIONS
from colo_rl.errors import ConfigError
from colo_rl.rollout import ENGINES

# A peer's option -> (whose, colo_rl's option, what else to know). The table a user reads is
# docs/data.md's "Option names" (tests/test_command_line.py keeps the two in step).
PEER_KEYS: dict[str, tuple[str, str, str]] = {
    # verl (its Hydra keys)
    "actor_rollout_ref.model.path": ("verl", "model.path", ""),
    "actor_rollout_ref.rollout.n": ("verl", "rollout.group_size", ""),
    "data.train_files": ("verl", "data.path", ""),
    "data.val_files": ("verl", "data.eval_path", ""),
    "data.train_batch_size": ("verl", "rollout.prompts_per_step", "prompts per step, all ranks"),
    "data.max_response_length": ("verl", "rollout.max_new_tokens", ""),
    "data.max_prompt_length": ("verl", "data.max_prompt_tokens", ""),
    "actor_rollout_ref.actor.optim.lr": ("verl", "trainer.lr", ""),
    "actor_rollout_ref.actor.optim.weight_decay": ("verl", "trainer.weight_decay", ""),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": ("verl", "trainer.warmup_steps", ""),
    "actor_rollout_ref.actor.grad_clip": ("verl", "trainer.grad_clip", ""),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("verl", "model.gradient_checkpointing", ""),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        "verl", "trainer.mini_batches_per_step",
        "optimizer steps per rollout batch: verl's data.train_batch_size / ppo_mini_batch_size"),
    "actor_rollout_ref.actor.ppo_epochs": ("verl", "trainer.ppo_epochs", ""),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (
        "verl", "trainer.micro_batch_tokens", "whole groups up to a token budget; always on (use_dynamic_bsz)"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
        "verl", "trainer.micro_batch_tokens", "micro-batches are sized in tokens; trainer.micro_batch_size caps "
                                              "the sequences, in whole groups"),
    "actor_rollout_ref.actor.clip_ratio_low": ("verl", "algo.clip_low", ""),
    "actor_rollout_ref.actor.clip_ratio_high": ("verl", "algo.clip_high", ""),
    "actor_rollout_ref.actor.clip_ratio_c": ("verl", "algo.clip_ratio_c", ""),
    "actor_rollout_ref.actor.kl_loss_coef": ("verl", "algo.kl_coef", ""),
    "actor_rollout_ref.actor.kl_loss_type": ("verl", "algo.kl_estimator", ""),
    "actor_rollout_ref.actor.loss_agg_mode": ("verl", "algo.loss_agg", ""),
    "actor_rollout_ref.actor.entropy_coeff": ("verl", "algo.entropy_coef", ""),
    "algorithm.adv_estimator": ("verl", "algo.adv_estimator", ""),
    "algorithm.use_kl_in_reward": ("verl", "algo.kl_in_reward", "with algo.kl_coef > 0"),
    "trainer.rollout_data_dir": ("verl", "log_rollout_groups",
                                 "groups per step written to <run_dir>/rollouts.jsonl (rank 0's)"),
    "actor_rollout_ref.rollout.temperature": ("verl", "rollout.temperature", ""),
    "actor_rollout_ref.rollout.top_p": ("verl", "rollout.top_p", ""),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("verl", "rollout.tp_size", ""),
    "trainer.total_training_steps": ("verl", "trainer.total_steps", ""),
    "trainer.save_freq": ("verl", "trainer.save_every", ""),
    "trainer.test_freq": ("verl", "trainer.eval_every", ""),
    "trainer.logger": ("verl", "logger", ""),
    "trainer.experiment_name": ("verl", "run_name", ""),
    "rollout.n": ("verl", "rollout.group_size", "verl's actor_rollout_ref.rollout.n"),
    "actor_rollout_ref.rollout.name": ("verl", "rollout.engine", "hf or sglang"),
    "algorithm.kl_ctrl.kl_coef": ("verl", "algo.kl_coef", "the KL in the reward with algo.kl_in_reward=true"),
    "algorithm.kl_ctrl.target_kl": ("verl", "algo.kl_target", ""),
    "algorithm.kl_ctrl.horizon": ("verl", "algo.kl_horizon", ""),
    "custom_reward_function.path": ("verl", "reward.functions", "as reward.functions=[path.py:name]"),
    "custom_reward_function.name": ("verl", "reward.functions", "as reward.functions=[path.py:name]"),
    # TRL (GRPOConfig's fields)
    "num_generations": ("TRL", "rollout.group_size", ""),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "max_prompt_length": ("TRL", "data.max_prompt_tokens", ""),
    "eval_dataset": ("TRL", "data.eval_path", "a data file: JSONL or Parquet"),
    "learning_rate": ("TRL", "trainer.lr", ""),
    "weight_decay": ("TRL", "trainer.weight_decay", ""),
    "max_grad_norm": ("TRL", "trainer.grad_clip", ""),
    "warmup_steps": ("TRL", "trainer.warmup_steps", ""),
    "steps_per_generation": ("TRL", "trainer.mini_batches_per_step", "optimizer steps per rollout batch"),
    "num_iterations": ("TRL", "trainer.ppo_epochs", ""),
    "per_device_train_batch_size": (
        "TRL", "trainer.micro_batch_tokens", "micro-batches are sized in tokens; trainer.micro_batch_size caps "
                                             "the sequences, in whole groups"),
    "epsilon": ("TRL", "algo.clip_low", ""),
    "epsilon_high": ("TRL", "algo.clip_high", ""),
    "beta": ("TRL", "algo.kl_coef", ""),
    "loss_type": ("TRL", "algo.loss_agg", ""),
    "scale_rewards": ("TRL", "algo.scale_by_std", "false: Dr. GRPO"),
    "temperature": ("TRL", "rollout.temperature", ""),
    "top_p": ("TRL", "rollout.top_p", ""),
    "vllm_tensor_parallel_size": ("TRL", "rollout.tp_size", ""),
    "max_steps": ("TRL", "trainer.total_steps", ""),
    "save_steps": ("TRL", "trainer.save_every", ""),
    "eval_steps": ("TRL", "trainer.eval_every", ""),
    "gradient_checkpointing": ("TRL", "model.gradient_checkpointing", ""),
    "seed": ("TRL", "trainer.seed", ""),
    "report_to": ("TRL", "logger", ""),
    "reward_funcs": ("TRL", "reward.functions", ""),
    "log_completions": ("TRL", "log_rollout_groups", "groups per step written to <run_dir>/rollouts.jsonl"),
}

# TRL's SFTConfig / DPOConfig names where they differ from GRPOConfig's meaning (DPO's beta is its own).
OFFLINE_PEER_KEYS: dict[str, tuple[str, str, str]] = {
    "num_train_epochs": ("TRL", "trainer.epochs", ""),
    "max_steps": ("TRL", "trainer.max_steps", "0 = all epochs"),
    "max_length": ("TRL", "data.max_seq_len", "prompt + completion tokens"),
    "per_device_train_batch_size": (
        "TRL", "trainer.batch_size", "examples (DPO: pairs) per optimizer step over all ranks: TRL's "
                                     "per_device_train_batch_size x devices x gradient_accumulation_steps"),
    "gradient_accumulation_steps": (
        "TRL", "trainer.batch_size", "examples (DPO: pairs) per optimizer step over all ranks; micro-batches "
                                     "follow trainer.micro_batch_tokens"),
}
# verl's SFT trainer (fsdp_sft_trainer.yaml): its data.train_batch_size counts examples, not prompts.
VERL_SFT_KEYS: dict[str, tuple[str, str, str]] = {
    "data.train_batch_size": ("verl", "trainer.batch_size", "examples (DPO: pairs) per optimizer step, all ranks"),
    "data.micro_batch_size_per_gpu": ("verl", "trainer.micro_batch_tokens", "micro-batches are sized in tokens"),
    "data.max_length": ("verl", "data.max_seq_len", "prompt + completion tokens"),
    "trainer.total_epochs": ("verl", "trainer.epochs", ""),
    "trainer.total_training_steps": ("verl", "trainer.max_steps", "0 = all epochs"),
    "optim.lr": ("verl", "trainer.lr", ""),
    "model.partial_pretrain": ("verl", "model.path", ""),
}
RECIPE_PEER_KEYS: dict[str, dict[str, tuple[str, str, str]]] = {
    "sft": {**OFFLINE_PEER_KEYS, **VERL_SFT_KEYS},
    "dpo": {**OFFLINE_PEER_KEYS, **VERL_SFT_KEYS, "beta": ("TRL", "algo.beta", "DPO's inverse temperature")},
}


def _loggers(value: str) -> str | None:
    """TRL's report_to (one name, or none) or verl's trainer.logger list ([console,wandb]) as colo_rl's
    logger list, which always keeps jsonl (the console is always on)."""
    names = [v.strip(" '\"") for v in value.strip("[]").split(",") if v.strip(" '\"")]
    if not names or any(n not in ("none", "console", "jsonl", "tensorboard", "wandb", "mlflow") for n in names):
        return None
    return "[" + ",".join(["jsonl"] + [n for n in names if n in ("tensorboard", "wandb", "mlflow")]) + "]"


# How a peer's value reads as colo_rl's, where it does not carry over as it is; None: no ready value
# (other units, or another shape), the note says what to write.
_TRL_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                   "dr_grpo": "seq-mean-token-sum-norm"}
PEER_VALUES = {
    "report_to": _loggers,
    "trainer.logger": _loggers,
    "actor_rollout_ref.rollout.name": lambda v: v if v in ENGINES.names() else None,  # vllm: none here
    "loss_type": lambda v: _TRL_LOSS_TYPES.get(v.strip("'\"")),
    "scale_rewards": lambda v: {"group": "true", "true": "true", "none": "false", "false": "false"}.get(v.lower()),
    "custom_reward_function.path": lambda v: f"[{v}:compute_score]",  # verl's default function name
    **{key: lambda v: None for key in (
        "custom_reward_function.name", "reward_funcs", "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "data.micro_batch_size_per_gpu",
        "per_device_train_batch_size", "gradient_accumulation_steps")},
}
# verl's names for what colo_rl has no option for: what to do instead.
NO_EQUIVALENT: dict[str, tuple[str, str]] = {
    "trainer.n_gpus_per_node": ("verl", "the GPUs are torchrun's: --nproc_per_node=N"),
    "trainer.nnodes": ("verl", "colo_rl runs on one node"),
    "trainer.project_name": ("verl", "set WANDB_PROJECT (wandb) or MLFLOW_EXPERIMENT_NAME (mlflow) in the "
                                     "environment"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (
        "verl", "the engine's memory is planned for each phase (colocate.paging, colocate.memory_margin_gib: "
                "docs/paging.md)"),
}
# Every recipe's own peer names in one table (a name another recipe knows is never a typo here).
ANY_RECIPES_PEER_KEYS = {k: v for keys in RECIPE_PEER_KEYS.values() for k, v in keys.items()}


def peer_keys(recipe: str) -> dict[str, tuple[str, str, str]]:
    """The verl / TRL names a recipe's users type, and colo_rl's option for each: those whose option
    the recipe reads (SFT has no KL coefficient to point TRL's `beta` at)."""
    # another recipe's names too where this recipe reads their option (verl SFT's optim.lr is trainer.lr)
    keys = {**ANY_RECIPES_PEER_KEYS, **PEER_KEYS, **RECIPE_PEER_KEYS.get(recipe, {})}
    return {k: v for k, v in keys.items() if recipe in OPTIONS[v[1]].scope.reads}


def _known(key: str) -> bool:
    """An option, a group (`model=tiny` picks its YAML), or a key inside a free dict option."""
    if key in OPTIONS or any(k.startswith(f"{key}.") for k in OPTIONS):
        return True
    parts = key.split(".")
    return any(".".join(parts[:n]) in OPTIONS or ".".join(parts[:n]) in FREE_KEYS for n in range(1, len(parts)))


LIST_OPTIONS = ("reward.functions", "reward.weights", "logger", "eval.pass_k")  # a bare value is no list


def _check_list_value(arg: str, key: str) -> None:
    """`reward.functions=f.py:fn` (no brackets) failed in Hydra with "str is not a ListConfig", once per rank."""
    value = arg.split("=", 1)[1].strip() if "=" in arg else None
    if key in LIST_OPTIONS and value and not value.startswith("[") and value != "null":
        raise ConfigError(f"{key} takes a list: write {key}=[{value}] (quoted in the shell: '{key}=[{value}]')")


def override_key(arg: str) -> str | None:
    """The dotted key an override sets (`+x.y=1`, `~x.y`, `++x.y=1` -> `x.y`), or None for what is not
    a key override: Hydra's flags (`--multirun`, `-cn sft`), their values, `hydra.*`, `key@package`."""
    if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
        return None
    key = arg.lstrip("+~").split("=", 1)[0].strip()
    if not key or "@" in key or key == "hydra" or key.startswith("hydra."):
        return None
    return key


def check_override_keys(overrides: Iterable[str], recipe: str = "grpo") -> None:
    """Refuse an override whose key colo_rl lacks when we can say what to write instead: a verl / TRL
    option's colo_rl name (`peer_keys(recipe)`), else the closest option (difflib, cutoff 0.8; a `+key` typo is
    left to validation.check_schema_keys, whose message says what a `+` does)."""
    options, peers = list(OPTIONS), peer_keys(recipe)
    every_peer = {**PEER_KEYS, **ANY_RECIPES_PEER_KEYS}
    for arg in overrides:
        key = override_key(arg)
        if key is None:
            continue
        if _known(key):
            _check_list_value(arg, key)
            continue
        if key in NO_EQUIVALENT:
            whose, instead = NO_EQUIVALENT[key]
            raise ConfigError(f"{key} is {whose}'s option; colo_rl has none like it: {instead}. Drop it")
        value = arg.split("=", 1)[1] if "=" in arg else "..."
        if key in peers:
            whose, ours, note = peers[key]
            ours_value = PEER_VALUES.get(key, lambda v: v)(value) if "=" in arg else None
            write = f"write {ours}={ours_value}" if ours_value is not None else f"set {ours}"
            raise ConfigError(f"{key} is {whose}'s option; colo_rl's is {ours}" + (f" ({note})" if note else "") +
                              f": {write}. verl / TRL / colo_rl names side by side: docs/data.md "
                              f"(Option names); every option: docs/config.md")
        if key in every_peer:  # another recipe's: a close match here would mean something else
            whose, ours, _ = every_peer[key]
            instead = OPTIONS[ours].scope.instead.get(recipe)
            raise ConfigError(f"{key} is {whose}'s option, {ours} in colo_rl, which the {recipe} recipe does not read"
                              + (f" ({instead})" if instead else "") + "; every option: docs/config.md")
        if arg.startswith("+"):  # composed first, then validation.check_schema_keys says what a `+` does
            continue
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{key}: colo_rl has no such option; did you mean {close[0]}? ({close[0]}={value}; "
                              f"every option: docs/config.md)")
