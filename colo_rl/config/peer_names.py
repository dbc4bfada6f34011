"""Peer frameworks' option names (verl, TRL, OpenRLHF, slime) and colo_rl's for each: the tables
config/command_line.py checks an override against before Hydra sees it, and what to do where
colo_rl has no such option. The table a user reads is docs/data.md (tests keep the two in step)."""

from __future__ import annotations

from colo_rl.config.validation import OPTIONS
from colo_rl.rollout import ENGINES

# Notes that several peers' names share.
_PROMPTS_PER_STEP = "prompts per step, all ranks"
_SEQUENCES_CAPPED = "micro-batches are sized in tokens; trainer.micro_batch_size caps the sequences, in whole groups"
_KL_IN_REWARD = "the KL in the reward with algo.kl_in_reward=true"
_KL_LOSS_INVERTED = "inverted: the KL loss term is colo_rl's default with algo.kl_coef > 0"
_OPENRLHF_ESTIMATOR = "group_norm: grpo; dr_grpo: grpo with algo.scale_by_std=false; no gae (no critic)"
_DYNAMIC_SAMPLING = "groups whose rewards are all equal are dropped and more prompts sampled"
_REWARD_FUNCTION = "a function score(completions, truths, **fields): docs/data.md (From OpenRLHF / slime)"
_EXAMPLES_PER_STEP = "examples (DPO: pairs) per optimizer step, all ranks"
_SEQUENCE_TOKENS = "prompt + completion tokens"
_ENGINE_MEMORY = ("the engine's memory is planned for each phase (colocate.paging, colocate.memory_margin_gib: "
                  "docs/paging.md)")

# A peer's option -> (whose, colo_rl's option, what else to know). The table a user reads is
# docs/data.md's "Option names" (tests/test_command_line.py keeps the two in step).
PEER_KEYS: dict[str, tuple[str, str, str]] = {
    # verl (its Hydra keys)
    "actor_rollout_ref.model.path": ("verl", "model.path", ""),
    "actor_rollout_ref.rollout.n": ("verl", "rollout.group_size", ""),
    "data.train_files": ("verl", "data.path", ""),
    "data.val_files": ("verl", "data.eval_path", ""),
    "data.train_batch_size": ("verl", "rollout.prompts_per_step", _PROMPTS_PER_STEP),
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
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("verl", "trainer.micro_batch_tokens", _SEQUENCES_CAPPED),
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
    "algorithm.kl_ctrl.kl_coef": ("verl", "algo.kl_coef", _KL_IN_REWARD),
    "algorithm.kl_ctrl.target_kl": ("verl", "algo.kl_target", ""),
    "algorithm.kl_ctrl.horizon": ("verl", "algo.kl_horizon", ""),
    "custom_reward_function.path": ("verl", "reward.functions", "as reward.functions=[path.py:name]"),
    "custom_reward_function.name": ("verl", "reward.functions", "as reward.functions=[path.py:name]"),
    # TRL (GRPOConfig's fields; OpenRLHF and slime share some, named beside TRL)
    "num_generations": ("TRL", "rollout.group_size", ""),
    "max_completion_length": ("TRL", "rollout.max_new_tokens", ""),
    "max_prompt_length": ("TRL", "data.max_prompt_tokens", ""),
    "eval_dataset": ("TRL and OpenRLHF", "data.eval_path", "a data file: JSONL or Parquet"),
    "learning_rate": ("TRL", "trainer.lr", ""),
    "weight_decay": ("TRL", "trainer.weight_decay", ""),
    "max_grad_norm": ("TRL", "trainer.grad_clip", ""),
    "warmup_steps": ("TRL", "trainer.warmup_steps", ""),
    "steps_per_generation": ("TRL", "trainer.mini_batches_per_step", "optimizer steps per rollout batch"),
    "num_iterations": ("TRL", "trainer.ppo_epochs", ""),
    "per_device_train_batch_size": ("TRL", "trainer.micro_batch_tokens", _SEQUENCES_CAPPED),
    "epsilon": ("TRL", "algo.clip_low", ""),
    "epsilon_high": ("TRL", "algo.clip_high", ""),
    "beta": ("TRL", "algo.kl_coef", ""),
    "loss_type": ("TRL", "algo.loss_agg", ""),
    "scale_rewards": ("TRL", "algo.scale_by_std", "false: Dr. GRPO"),
    "temperature": ("TRL and OpenRLHF", "rollout.temperature", ""),
    "top_p": ("TRL and OpenRLHF", "rollout.top_p", ""),
    "vllm_tensor_parallel_size": ("TRL and OpenRLHF", "rollout.tp_size", ""),
    "max_steps": ("TRL", "trainer.total_steps", ""),
    "save_steps": ("TRL and OpenRLHF", "trainer.save_every", ""),
    "eval_steps": ("TRL and OpenRLHF", "trainer.eval_every", ""),
    "gradient_checkpointing": ("TRL and OpenRLHF", "model.gradient_checkpointing", ""),
    "seed": ("TRL, OpenRLHF and slime", "trainer.seed", ""),
    "report_to": ("TRL", "logger", ""),
    "reward_funcs": ("TRL", "reward.functions", ""),
    "log_completions": ("TRL", "log_rollout_groups", "groups per step written to <run_dir>/rollouts.jsonl"),
    # OpenRLHF (openrlhf/cli/train_ppo_ray.py's flags); TRL's names it shares are TRL's rows above
    "pretrain": ("OpenRLHF", "model.path", ""),
    "prompt_data": ("OpenRLHF", "data.path", ""),
    "input_key": ("OpenRLHF", "data.prompt_key", ""),
    "label_key": ("OpenRLHF", "data.answer_key", ""),
    "max_samples": ("OpenRLHF", "data.train_size", ""),
    "apply_chat_template": ("OpenRLHF", "data.use_chat_template", "colo_rl's default: true"),
    "rollout_batch_size": ("OpenRLHF", "rollout.prompts_per_step", _PROMPTS_PER_STEP),
    "n_samples_per_prompt": ("OpenRLHF", "rollout.group_size", ""),
    "prompt_max_len": ("OpenRLHF", "data.max_prompt_tokens", ""),
    "generate_max_len": ("OpenRLHF", "rollout.max_new_tokens", ""),
    "actor_learning_rate": ("OpenRLHF", "trainer.lr", ""),
    "l2": ("OpenRLHF", "trainer.weight_decay", ""),
    "max_norm": ("OpenRLHF", "trainer.grad_clip", ""),
    "train_batch_size": (
        "OpenRLHF", "trainer.mini_batches_per_step",
        "optimizer steps per rollout batch: OpenRLHF's rollout_batch_size x n_samples_per_prompt / train_batch_size"),
    "max_epochs": ("OpenRLHF", "trainer.ppo_epochs", "passes over each rollout batch"),
    "micro_train_batch_size": ("OpenRLHF", "trainer.micro_batch_tokens", _SEQUENCES_CAPPED),
    "train_max_tokens_per_gpu": (
        "OpenRLHF", "trainer.micro_batch_tokens", "whole groups up to a token budget; always on (use_dynamic_batch)"),
    "packing_samples": ("OpenRLHF", "trainer.packing", "colo_rl's default: true"),
    "zero_stage": ("OpenRLHF", "trainer.zero_stage", ""),
    "bf16": ("OpenRLHF", "model.dtype", "auto, bf16 or fp32"),
    "eps_clip": ("OpenRLHF", "algo.clip_low", "one side: set algo.clip_high to it too"),
    "eps_clip_low_high": ("OpenRLHF", "algo.clip_low", "and algo.clip_high, its two values"),
    "dual_clip": ("OpenRLHF", "algo.clip_ratio_c", ""),
    "init_kl_coef": ("OpenRLHF", "algo.kl_coef", "a KL loss term; OpenRLHF without use_kl_loss puts the KL in the "
                                                 "reward: algo.kl_in_reward=true"),
    "use_kl_loss": ("OpenRLHF", "algo.kl_in_reward", _KL_LOSS_INVERTED),
    "kl_estimator": ("OpenRLHF", "algo.kl_estimator", ""),
    "kl_target": ("OpenRLHF", "algo.kl_target", _KL_IN_REWARD),
    "kl_horizon": ("OpenRLHF", "algo.kl_horizon", ""),
    "entropy_loss_coef": ("OpenRLHF", "algo.entropy_coef", ""),
    "advantage_estimator": ("OpenRLHF", "algo.adv_estimator", _OPENRLHF_ESTIMATOR),
    "no_advantage_std_norm": ("OpenRLHF", "algo.scale_by_std", "inverted: false is Dr. GRPO"),
    "policy_loss_type": ("OpenRLHF", "algo.policy_loss", "ppo: ppo_clip"),
    "overlong_penalty_factor": ("OpenRLHF", "algo.overlong_penalty", ""),
    "dynamic_filtering": ("OpenRLHF", "algo.dynamic_sampling",
                          _DYNAMIC_SAMPLING),
    "remote_rm_url": ("OpenRLHF", "reward.functions",
                      _REWARD_FUNCTION),
    "save_path": ("OpenRLHF", "run_dir", "the final model: <run_dir>/checkpoint-final"),
    "ckpt_path": ("OpenRLHF", "run_dir", "checkpoints: <run_dir>/checkpoints"),
    "load_checkpoint": ("OpenRLHF", "resume", "auto: the run directory's latest checkpoint"),
    "use_wandb": ("OpenRLHF", "logger", ""),
    "use_tensorboard": ("OpenRLHF", "logger", "written to <run_dir>/tensorboard"),
    "wandb_run_name": ("OpenRLHF", "run_name", ""),
    "lora_rank": ("OpenRLHF", "model.lora.rank", ""),
    "lora_alpha": ("OpenRLHF", "model.lora.alpha", ""),
    "lora_dropout": ("OpenRLHF", "model.lora.dropout", ""),
    # OpenRLHF's newer dotted flags (its train_ppo_ray.py since the flags were grouped)
    "actor.model_name_or_path": ("OpenRLHF", "model.path", ""),
    "data.prompt_dataset": ("OpenRLHF", "data.path", ""),
    "eval.dataset": ("OpenRLHF", "data.eval_path", ""),
    "data.input_key": ("OpenRLHF", "data.prompt_key", ""),
    "data.label_key": ("OpenRLHF", "data.answer_key", ""),
    "data.max_samples": ("OpenRLHF", "data.train_size", ""),
    "rollout.batch_size": ("OpenRLHF", "rollout.prompts_per_step", _PROMPTS_PER_STEP),
    "rollout.n_samples_per_prompt": ("OpenRLHF", "rollout.group_size", ""),
    "actor.adam.lr": ("OpenRLHF", "trainer.lr", ""),
    "actor.adam.weight_decay": ("OpenRLHF", "trainer.weight_decay", ""),
    "actor.max_norm": ("OpenRLHF", "trainer.grad_clip", ""),
    "actor.gradient_checkpointing_enable": ("OpenRLHF", "model.gradient_checkpointing", ""),
    "train.batch_size": (
        "OpenRLHF", "trainer.mini_batches_per_step",
        "optimizer steps per rollout batch: OpenRLHF's rollout.batch_size x rollout.n_samples_per_prompt / "
        "train.batch_size"),
    "train.max_epochs": ("OpenRLHF", "trainer.ppo_epochs", "passes over each rollout batch"),
    "train.micro_batch_size": ("OpenRLHF", "trainer.micro_batch_tokens", _SEQUENCES_CAPPED),
    "train.max_tokens_per_gpu": (
        "OpenRLHF", "trainer.micro_batch_tokens", "whole groups up to a token budget; always on "
                                                  "(train.dynamic_batch_enable)"),
    "train.seed": ("OpenRLHF", "trainer.seed", ""),
    "ds.zero_stage": ("OpenRLHF", "trainer.zero_stage", ""),
    "actor.eps_clip": ("OpenRLHF", "algo.clip_low", "one side: set algo.clip_high to it too"),
    "actor.dual_clip": ("OpenRLHF", "algo.clip_ratio_c", ""),
    "actor.entropy_coef": ("OpenRLHF", "algo.entropy_coef", ""),
    "actor.policy_loss_type": ("OpenRLHF", "algo.policy_loss", "ppo: ppo_clip"),
    "algo.kl.init_coef": ("OpenRLHF", "algo.kl_coef", "a KL loss term; OpenRLHF without algo.kl.use_loss puts the "
                                                      "KL in the reward: algo.kl_in_reward=true"),
    "algo.kl.use_loss": ("OpenRLHF", "algo.kl_in_reward", _KL_LOSS_INVERTED),
    "algo.kl.estimator": ("OpenRLHF", "algo.kl_estimator", ""),
    "algo.kl.target": ("OpenRLHF", "algo.kl_target", _KL_IN_REWARD),
    "algo.kl.horizon": ("OpenRLHF", "algo.kl_horizon", ""),
    "algo.advantage.estimator": ("OpenRLHF", "algo.adv_estimator", _OPENRLHF_ESTIMATOR),
    "algo.advantage.no_std_norm": ("OpenRLHF", "algo.scale_by_std", "inverted: false is Dr. GRPO"),
    "algo.dynamic_filtering_enable": ("OpenRLHF", "algo.dynamic_sampling",
                                      _DYNAMIC_SAMPLING),
    "reward.overlong_penalty_factor": ("OpenRLHF", "algo.overlong_penalty", ""),
    "reward.remote_url": ("OpenRLHF", "reward.functions",
                          _REWARD_FUNCTION),
    "ckpt.path": ("OpenRLHF", "run_dir", "checkpoints: <run_dir>/checkpoints"),
    "ckpt.output_dir": ("OpenRLHF", "run_dir", "the final model: <run_dir>/checkpoint-final"),
    "ckpt.load_enable": ("OpenRLHF", "resume", "auto: the run directory's latest checkpoint"),
    "ckpt.save_steps": ("OpenRLHF", "trainer.save_every", ""),
    "eval.steps": ("OpenRLHF", "trainer.eval_every", ""),
    # slime (its --dashed flags, Megatron's among them)
    "hf-checkpoint": ("slime", "model.path", ""),
    "prompt-data": ("slime", "data.path", ""),
    "eval-prompt-data": ("slime", "data.eval_path", "one file, no name before it"),
    "input-key": ("slime", "data.prompt_key", ""),
    "label-key": ("slime", "data.answer_key", ""),
    "apply-chat-template": ("slime", "data.use_chat_template", "colo_rl's default: true"),
    "rollout-shuffle": ("slime", "data.shuffle", "colo_rl's default: true"),
    "rollout-batch-size": ("slime", "rollout.prompts_per_step", _PROMPTS_PER_STEP),
    "n-samples-per-prompt": ("slime", "rollout.group_size", ""),
    "rollout-max-prompt-len": ("slime", "data.max_prompt_tokens", "longer prompts: data.overlong_policy"),
    "rollout-max-response-len": ("slime", "rollout.max_new_tokens", ""),
    "rollout-temperature": ("slime", "rollout.temperature", ""),
    "rollout-top-p": ("slime", "rollout.top_p", ""),
    "rollout-num-gpus-per-engine": ("slime", "rollout.tp_size", ""),
    "num-rollout": ("slime", "trainer.total_steps", "rollout batches"),
    "lr": ("slime", "trainer.lr", ""),
    "lr-warmup-iters": ("slime", "trainer.warmup_steps", ""),
    "weight-decay": ("slime", "trainer.weight_decay", ""),
    "clip-grad": ("slime", "trainer.grad_clip", ""),
    "global-batch-size": (
        "slime", "trainer.mini_batches_per_step",
        "optimizer steps per rollout batch: slime's rollout-batch-size x n-samples-per-prompt / global-batch-size"),
    "num-steps-per-rollout": ("slime", "trainer.mini_batches_per_step", "optimizer steps per rollout batch"),
    "micro-batch-size": ("slime", "trainer.micro_batch_tokens", _SEQUENCES_CAPPED),
    "max-tokens-per-gpu": (
        "slime", "trainer.micro_batch_tokens", "whole groups up to a token budget; always on (use-dynamic-batch-size)"),
    "eps-clip": ("slime", "algo.clip_low", ""),
    "eps-clip-high": ("slime", "algo.clip_high", ""),
    "eps-clip-c": ("slime", "algo.clip_ratio_c", ""),
    "kl-loss-coef": ("slime", "algo.kl_coef", ""),
    "kl-coef": ("slime", "algo.kl_coef", _KL_IN_REWARD),
    "use-kl-loss": ("slime", "algo.kl_in_reward", _KL_LOSS_INVERTED),
    "kl-loss-type": ("slime", "algo.kl_estimator", ""),
    "entropy-coef": ("slime", "algo.entropy_coef", ""),
    "advantage-estimator": ("slime", "algo.adv_estimator", "gspo and cispo are algo.policy_loss's; no ppo (no critic)"),
    "disable-grpo-std-normalization": ("slime", "algo.scale_by_std", "false: Dr. GRPO"),
    "custom-rm-path": ("slime", "reward.functions",
                       _REWARD_FUNCTION),
    "save": ("slime", "run_dir", "checkpoints: <run_dir>/checkpoints"),
    "save-interval": ("slime", "trainer.save_every", ""),
    "eval-interval": ("slime", "trainer.eval_every", ""),
    "load": ("slime", "resume", "auto, or a colo_rl checkpoint directory; the starting weights are model.path"),
    "use-wandb": ("slime", "logger", ""),
    "use-tensorboard": ("slime", "logger", "written to <run_dir>/tensorboard"),
}
# TRL's SFTConfig / DPOConfig (and OpenRLHF's SFT / DPO) names where they differ from the GRPO
# meaning (DPO's beta is its own).
OFFLINE_PEER_KEYS: dict[str, tuple[str, str, str]] = {
    "num_train_epochs": ("TRL", "trainer.epochs", ""),
    "max_steps": ("TRL", "trainer.max_steps", "0 = all epochs"),
    "max_length": ("TRL", "data.max_seq_len", _SEQUENCE_TOKENS),
    "per_device_train_batch_size": (
        "TRL", "trainer.batch_size", "examples (DPO: pairs) per optimizer step over all ranks: TRL's "
                                     "per_device_train_batch_size x devices x gradient_accumulation_steps"),
    "gradient_accumulation_steps": (
        "TRL", "trainer.batch_size", "examples (DPO: pairs) per optimizer step over all ranks; micro-batches "
                                     "follow trainer.micro_batch_tokens"),
    # OpenRLHF's train_sft.py / train_dpo.py (flat names, then the newer dotted ones)
    "max_epochs": ("OpenRLHF", "trainer.epochs", ""),
    "train.max_epochs": ("OpenRLHF", "trainer.epochs", ""),
    "train_batch_size": ("OpenRLHF", "trainer.batch_size", _EXAMPLES_PER_STEP),
    "train.batch_size": ("OpenRLHF", "trainer.batch_size", _EXAMPLES_PER_STEP),
    "max_len": ("OpenRLHF", "data.max_seq_len", _SEQUENCE_TOKENS),
    "data.max_len": ("OpenRLHF", "data.max_seq_len", _SEQUENCE_TOKENS),
}
# verl's SFT trainer (fsdp_sft_trainer.yaml): its data.train_batch_size counts examples, not prompts.
VERL_SFT_KEYS: dict[str, tuple[str, str, str]] = {
    "data.train_batch_size": ("verl", "trainer.batch_size", _EXAMPLES_PER_STEP),
    "data.micro_batch_size_per_gpu": ("verl", "trainer.micro_batch_tokens", "micro-batches are sized in tokens"),
    "data.max_length": ("verl", "data.max_seq_len", _SEQUENCE_TOKENS),
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
def _flag(value: str) -> bool:
    return value.strip("'\"").lower() in ("true", "1", "yes")


def _inverted(value: str) -> str | None:
    """A peer's flag whose colo_rl option says the opposite (use_kl_loss: algo.kl_in_reward)."""
    flag = value.strip("'\"").lower()
    return {"true": "false", "1": "false", "false": "true", "0": "true"}.get(flag)


_OPENRLHF_ESTIMATORS = {"group_norm": "grpo", "rloo": "rloo", "reinforce": "reinforce_pp",
                        "reinforce_baseline": "reinforce_pp_baseline"}  # dr_grpo: grpo + algo.scale_by_std=false
_SLIME_ESTIMATORS = {"grpo": "grpo", "reinforce_plus_plus": "reinforce_pp",
                     "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
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
        "per_device_train_batch_size", "gradient_accumulation_steps",
        # OpenRLHF / slime: other units (sequences, samples), another shape (a pair, a named list), a URL
        "train_batch_size", "train.batch_size", "global-batch-size", "micro_train_batch_size",
        "train.micro_batch_size", "micro-batch-size", "eps_clip_low_high", "eval-prompt-data", "remote_rm_url",
        "reward.remote_url", "custom-rm-path")},
    # OpenRLHF / slime: a flag (true when given bare), or their own choice names
    **{key: _inverted for key in ("use_kl_loss", "algo.kl.use_loss", "use-kl-loss", "no_advantage_std_norm",
                                  "algo.advantage.no_std_norm", "disable-grpo-std-normalization")},
    **{key: lambda v: "auto" if _flag(v) else "null" for key in ("load_checkpoint", "ckpt.load_enable")},
    **{key: lambda v: "[jsonl,wandb]" for key in ("use_wandb", "use-wandb")},
    **{key: lambda v: "[jsonl,tensorboard]" for key in ("use_tensorboard", "use-tensorboard")},
    "bf16": lambda v: "bf16" if _flag(v) else None,
    **{key: lambda v: _OPENRLHF_ESTIMATORS.get(v.strip("'\"")) for key in ("advantage_estimator",
                                                                        "algo.advantage.estimator")},
    "advantage-estimator": lambda v: _SLIME_ESTIMATORS.get(v.strip("'\"")),
    **{key: lambda v: {"ppo": "ppo_clip", "gspo": "gspo"}.get(v.strip("'\"")) for key in ("policy_loss_type",
                                                                                       "actor.policy_loss_type")},
}
# verl's, OpenRLHF's and slime's names for what colo_rl has no option for: what to do instead.
_GPUS = "the GPUs are torchrun's: --nproc_per_node=N"
_NODES = "the nodes are torchrun's: --nnodes=N (docs/running.md, Two nodes)"
_EPOCHS = "GRPO counts rollout batches: set trainer.total_steps (passes x records / rollout.prompts_per_step)"
_COLOCATED = ("the engine and the trainer share each GPU (colocated) by default; other layouts: placement.* "
              "(docs/placement.md)")
_TOKEN_BUDGET = "micro-batches are always sized in tokens (trainer.micro_batch_tokens)"
NO_EQUIVALENT: dict[str, tuple[str, str]] = {
    "trainer.n_gpus_per_node": ("verl", _GPUS),
    "trainer.nnodes": ("verl", _NODES),
    "trainer.project_name": ("verl", "set WANDB_PROJECT (wandb) or MLFLOW_EXPERIMENT_NAME (mlflow) in the "
                                     "environment"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("verl", _ENGINE_MEMORY),
    "actor_num_gpus_per_node": ("OpenRLHF", _GPUS),
    "actor.num_gpus_per_node": ("OpenRLHF", _GPUS),
    "actor-num-gpus-per-node": ("slime", _GPUS),
    "num-gpus-per-node": ("slime", _GPUS),
    "actor_num_nodes": ("OpenRLHF", _NODES),
    "actor.num_nodes": ("OpenRLHF", _NODES),
    "actor-num-nodes": ("slime", _NODES),
    "num_episodes": ("OpenRLHF", _EPOCHS),
    "train.num_episodes": ("OpenRLHF", _EPOCHS),
    "num-epoch": ("slime", _EPOCHS),
    "colocate_all_models": ("OpenRLHF", _COLOCATED),
    "colocate": ("slime", _COLOCATED),
    "vllm_num_engines": ("OpenRLHF", "one engine per rollout.tp_size ranks"),
    "vllm_gpu_memory_utilization": ("OpenRLHF", _ENGINE_MEMORY),
    "use_dynamic_batch": ("OpenRLHF", _TOKEN_BUDGET),
    "train.dynamic_batch_enable": ("OpenRLHF", _TOKEN_BUDGET),
    "use-dynamic-batch-size": ("slime", _TOKEN_BUDGET),
    "lr_warmup_ratio": ("OpenRLHF", "set trainer.warmup_steps, a step count (the ratio x trainer.total_steps)"),
    "wandb_project": ("OpenRLHF", "set WANDB_PROJECT in the environment"),
    "logger.wandb.project": ("OpenRLHF", "set WANDB_PROJECT in the environment"),
    "wandb-project": ("slime", "set WANDB_PROJECT in the environment"),
}
# Every recipe's own peer names in one table (a name another recipe knows is never a typo here).
ANY_RECIPES_PEER_KEYS = {k: v for keys in RECIPE_PEER_KEYS.values() for k, v in keys.items()}


def peer_keys(recipe: str) -> dict[str, tuple[str, str, str]]:
    """The verl / TRL names a recipe's users type, and colo_rl's option for each: those whose option
    the recipe reads (SFT has no KL coefficient to point TRL's `beta` at)."""
    # another recipe's names too where this recipe reads their option (verl SFT's optim.lr is trainer.lr)
    keys = {**ANY_RECIPES_PEER_KEYS, **PEER_KEYS, **RECIPE_PEER_KEYS.get(recipe, {})}
    return {k: v for k, v in keys.items() if recipe in OPTIONS[v[1]].scope.reads}
