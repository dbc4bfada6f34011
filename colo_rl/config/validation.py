"""The one validation pass: every check that types alone cannot express (choices from the
registries, value ranges, cross-key rules, keys a recipe does not read), run before anything heavy starts."""

from __future__ import annotations

import difflib
import math
from dataclasses import fields
from typing import Any, Callable, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from colo_rl.algos import ADV_ESTIMATORS, DPO_LOSSES, GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from colo_rl.envs import check_env_config
from colo_rl.errors import ConfigError
from colo_rl.loggers import LOGGERS, REQUIRED as REQUIRED_LOGGER, unavailable as logger_unavailable
from colo_rl.rewards import check_reward_config

from colo_rl.config.schema import AlgoConfig, EnvConfig, EvalConfig, RunConfig, TrainerConfig

CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("auto", "bf16", "fp32"),
    "model.lora.handoff": ("auto", "merged"),
    "data.overlong_policy": ("drop", "truncate", "error"),
    "rollout.engine": ("hf", "sglang"),
    "env.format": ("auto", "json", "tags", "llama"),
    # The algorithm choices are the registries' names: registering a function adds the choice.
    "algo.adv_estimator": tuple(ADV_ESTIMATORS.names()),
    "algo.policy_loss": tuple(POLICY_LOSSES.names()),
    "algo.kl_estimator": tuple(KL_ESTIMATORS.names()),
    "algo.loss_agg": tuple(LOSS_AGGREGATIONS.names()),
    "algo.dpo_loss": tuple(DPO_LOSSES.names()),
    "trainer.lr_schedule": ("constant", "cosine"),
    "trainer.zero_stage": (0, 1, 2, 3),
    "colocate.paging": ("auto", "on", "off"),
}



# ---------------------------------------------------------------------------------------------
# What each recipe reads, as data (one entry per recipe): the algo group it runs, whether its
# estimator is group-based, and the keys it does not read (with what to use instead). A key listed
# here and set on the command line is refused: it would be accepted and then silently ignored.
_GRPO_ONLY = {
    "trainer.total_steps": "set trainer.max_steps (a cap) or trainer.epochs",
    "trainer.mini_batches_per_step": "GRPO only",
    "rollout.prompts_per_step": "GRPO only", "rollout.group_size": "GRPO only",
    "rollout.max_new_tokens": "evaluation uses rollout.eval_max_new_tokens",
    "rollout.temperature": "evaluation decodes greedily", "rollout.top_p": "evaluation decodes greedily",
    "colocate.handoff_check_max_mean_abs": "GRPO only",
    "algo.scale_by_std": "GRPO only", "algo.clip_low": "GRPO only", "algo.clip_high": "GRPO only",
    "algo.kl_coef": "GRPO only", "algo.kl_estimator": "GRPO only", "algo.loss_agg": "GRPO only",
    "algo.tis_cap": "GRPO only", "algo.adv_estimator": "GRPO only", "algo.policy_loss": "GRPO only",
    "algo.clip_ratio_c": "GRPO only", "algo.entropy_coef": "GRPO only", "algo.kl_in_reward": "GRPO only",
    "algo.kl_target": "GRPO only", "algo.kl_horizon": "GRPO only", "algo.dynamic_sampling": "GRPO only",
    "algo.max_sampling_rounds": "GRPO only", "algo.overlong_buffer_len": "GRPO only",
    "algo.overlong_penalty": "GRPO only", "trainer.ppo_epochs": "GRPO only",
    "reward.model.path": "GRPO only", "reward.weights": "GRPO only (evaluation checks answers only)",
    "reward.workers": "GRPO only", "reward.timeout_s": "GRPO only",
    **{f"env.{f.name}": "multi-turn rollouts are for GRPO and recipes/eval.py" for f in fields(EnvConfig)},
}
# SFT and DPO train without a rollout engine, and evaluation without an optimizer: nothing is paged.
_NO_PAGING = {"colocate.paging": "only GRPO pages its trainer between phases",
              "colocate.device_memory_gib": "only GRPO plans its paging"}
_DPO_ONLY = {"algo.beta": "DPO only", "algo.dpo_loss": "DPO only", "algo.label_smoothing": "DPO only",
             "algo.precompute_ref_logprobs": "DPO only"}
_EVAL_ONLY = {f"eval.{f.name}": "recipes/eval.py only" for f in fields(EvalConfig)}
# recipes/eval.py trains nothing: its actor only holds the weights the engine gets through the handoff.
_EVAL_READS = ("trainer.seed", "trainer.zero_stage", "colocate.offload_pin_memory")
_NOT_EVAL = {**{f"algo.{f.name}": "recipes/eval.py trains nothing" for f in fields(AlgoConfig) if f.name != "name"},
             **{f"trainer.{f.name}": "recipes/eval.py trains nothing" for f in fields(TrainerConfig)
                if f"trainer.{f.name}" not in _EVAL_READS},
             "rollout.prompts_per_step": "set eval.samples", "rollout.group_size": "set eval.samples",
             "rollout.max_new_tokens": "set rollout.eval_max_new_tokens (greedy and sampled)",
             "colocate.handoff_check_max_mean_abs": "GRPO only", "resume": "an evaluation is not resumed",
             "data.train_size": "recipes/eval.py reads held-out problems only", "data.seed": "no training order",
             "data.shuffle": "no training order", "data.max_seq_len": "set data.max_prompt_tokens"}
RECIPES: dict[str, dict[str, Any]] = {
    "eval": {"algo": None, "group_based": False, "ignores": {**_NOT_EVAL, **_NO_PAGING}},
    "grpo": {"algo": "grpo", "group_based": True, "ignores": {
        **_DPO_ONLY, **_EVAL_ONLY,
        "trainer.max_steps": "set trainer.total_steps", "trainer.epochs": "set trainer.total_steps",
        "trainer.batch_size": "set rollout.prompts_per_step (x rollout.group_size completions)",
        "trainer.eval_generate": "GRPO always evaluates with generation (trainer.eval_every)",
        "data.max_seq_len": "set data.max_prompt_tokens and "
                                                                        "rollout.max_new_tokens"}},
    "sft": {"algo": "sft", "group_based": False, "ignores": {**_GRPO_ONLY, **_DPO_ONLY, **_EVAL_ONLY, **_NO_PAGING}},
    "dpo": {"algo": "dpo", "group_based": False, "ignores": {**_GRPO_ONLY, **_EVAL_ONLY, **_NO_PAGING}},
}

# Value ranges types cannot express: key -> (accepts the value, what it must be).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trainer.lr": (lambda v: v > 0, "must be > 0"),
    "model.lora.rank": (lambda v: v >= 0, "must be >= 0 (0 = full fine-tune, no adapters)"),
    "model.lora.alpha": (lambda v: v > 0, "must be > 0 (the adapter update is scaled by alpha / rank)"),
    "model.lora.dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "model.lora.target_modules": (lambda v: len(v) > 0, "must name at least one module (e.g. [q_proj,v_proj])"),
    "trainer.warmup_steps": (lambda v: v >= 0, "must be >= 0"),
    "trainer.min_lr_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.weight_decay": (lambda v: v >= 0, "must be >= 0"),
    "trainer.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "must be two values in [0, 1)"),
    "trainer.grad_clip": (lambda v: v >= 0, "must be >= 0 (0 = no clipping)"),
    "trainer.micro_batch_size": (lambda v: v > 0, "must be a positive integer"),
    "trainer.mini_batches_per_step": (lambda v: v > 0, "must be a positive integer"),
    "trainer.total_steps": (lambda v: v > 0, "must be a positive integer"),
    "trainer.epochs": (lambda v: v > 0, "must be a positive integer"),
    "trainer.batch_size": (lambda v: v > 0, "must be a positive integer"),
    "trainer.max_steps": (lambda v: v >= 0, "must be >= 0 (0 = all epochs)"),
    "trainer.eval_every": (lambda v: v >= 0, "must be >= 0 (0 = at the start and the end only)"),
    "trainer.save_every": (lambda v: v >= 0, "must be >= 0 (0 = only the final checkpoint)"),
    "trainer.max_nonfinite_steps": (lambda v: v > 0, "must be a positive integer"),
    "rollout.prompts_per_step": (lambda v: v > 0, "must be a positive integer"),
    "rollout.group_size": (lambda v: v > 0, "must be a positive integer"),
    "rollout.max_new_tokens": (lambda v: v > 0, "must be a positive integer"),
    "rollout.eval_max_new_tokens": (lambda v: v > 0, "must be a positive integer"),
    "rollout.eval_batch_size": (lambda v: v > 0, "must be a positive integer"),
    "rollout.temperature": (lambda v: v > 0, "must be > 0 (greedy decoding is used for evaluation only)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1 = no nucleus cut)"),
    "rollout.tp_size": (lambda v: v > 0, "must be a positive integer"),
    "algo.kl_coef": (lambda v: v >= 0, "must be >= 0 (0 = no KL penalty, no reference model)"),
    "algo.clip_low": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "algo.clip_high": (lambda v: v >= 0, "must be >= 0"),
    "algo.tis_cap": (lambda v: v is None or v > 0, "must be > 0, or null for no truncated importance sampling"),
    "algo.clip_ratio_c": (lambda v: v is None or v > 1, "must be > 1 (e.g. 3.0), or null for no dual-clip"),
    "algo.entropy_coef": (lambda v: v >= 0, "must be >= 0"),
    "algo.kl_target": (lambda v: v is None or v > 0, "must be > 0, or null for a fixed coefficient"),
    "algo.kl_horizon": (lambda v: v > 0, "must be a positive integer"),
    "algo.max_sampling_rounds": (lambda v: v >= 0, "must be >= 0"),
    "algo.overlong_buffer_len": (lambda v: v >= 0, "must be >= 0 (0 = no overlong shaping)"),
    "algo.overlong_penalty": (lambda v: v >= 0, "must be >= 0"),
    "trainer.ppo_epochs": (lambda v: v > 0, "must be a positive integer"),
    "algo.beta": (lambda v: v > 0, "must be > 0"),
    "algo.label_smoothing": (lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
    "reward.max_failure_rate": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "reward.workers": (lambda v: v >= 0, "must be >= 0 (0 = call the reward functions in the trainer's process)"),
    "reward.timeout_s": (lambda v: v > 0, "must be > 0 seconds"),
    "colocate.handoff_bucket_mb": (lambda v: v > 0, "must be a positive integer (MiB)"),
    "colocate.device_memory_gib": (lambda v: v is None or v > 0,
                                   "must be > 0 GiB, or null to measure the device at start"),
    "data.train_size": (lambda v: v >= 0, "must be >= 0 (0 = every record of data.path)"),
    "data.eval_size": (lambda v: v >= 0, "must be >= 0 (0 = no held-out evaluation)"),
    "data.max_prompt_tokens": (lambda v: v > 0, "must be a positive integer"),
    "data.max_seq_len": (lambda v: v > 0, "must be a positive integer"),
    "eval.samples": (lambda v: v >= 0, "must be >= 0 (0 = greedy accuracy only)"),
    "data.max_operations": (lambda v: v >= 2, "must be >= 2 (a multi-operand problem has at least 2 operations)"),
    "data.max_factor": (lambda v: v >= 2, "must be >= 2"),
    "env.max_turns": (lambda v: v > 0, "must be a positive integer"),
    "env.max_total_tokens": (lambda v: v > 0, "must be a positive integer"),
    "env.tool_timeout_s": (lambda v: v > 0, "must be > 0"),
    "env.tool_memory_mb": (lambda v: v >= 64, "must be >= 64 (a Python interpreter needs that much to start)"),
    "env.max_output_chars": (lambda v: v > 0, "must be a positive integer"),
    "env.reward_weight": (lambda v: math.isfinite(v), "must be a finite number"),
}

# Optional keys whose null is a setting (off), not a missing value.
NULLABLE = ("algo.tis_cap", "algo.clip_ratio_c", "algo.kl_target", "colocate.device_memory_gib")
# Keys whose children are not colo_rl's (checked elsewhere): not compared against the schema.
FREE_KEYS = ("rollout.sglang_kwargs",)


def validate(cfg: RunConfig | DictConfig, recipe: Optional[str] = None, overrides: Iterable[str] = ()) -> None:
    """Every check that types alone cannot express, in one pass before anything heavy starts.

    cfg: the composed config (a DictConfig: keys added with `+` are checked against the schema too)
    or a RunConfig. recipe: the recipe that will run (default: cfg.recipe). overrides: the command-line
    overrides (Hydra's task overrides): a key the recipe does not read is refused when set there.
    Raises ConfigError naming the key and what to do."""
    if isinstance(cfg, DictConfig):
        check_schema_keys(cfg)
        obj = OmegaConf.to_object(cfg)
    else:
        obj = cfg
    recipe = recipe or obj.recipe
    if recipe not in RECIPES:
        raise ConfigError(f"recipe={recipe!r} is not one of {list(RECIPES)}")
    spec = RECIPES[recipe]
    ignored = spec["ignores"]
    for ov in overrides:
        key = _override_key(ov)
        if key in ignored:
            raise ConfigError(f"{key} is not read by recipes/{recipe}.py ({ignored[key]}): remove it from the "
                              f"command line")
    if spec["algo"] is not None and obj.algo.name != spec["algo"]:
        raise ConfigError(f"algo={obj.algo.name} is not {recipe}'s algo group: recipes/{recipe}.py runs "
                          f"algo={spec['algo']}" + (f" (for {obj.algo.name.upper()} run recipes/{obj.algo.name}.py)"
                                                    if obj.algo.name in RECIPES else ""))
    for key, allowed in CHOICES.items():
        value = _get(obj, key)
        if key not in ignored and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    for key, (ok, what) in RANGES.items():
        value = _get(obj, key)
        if key not in ignored and (value is None and key not in NULLABLE or not ok(value)):
            raise ConfigError(f"{key}={value!r} {what}")
    if "rollout.tp_size" not in ignored and obj.rollout.tp_size > 1 and obj.rollout.engine != "sglang":
        raise ConfigError(f"rollout.tp_size={obj.rollout.tp_size} splits SGLang's engine over GPUs; "
                          f"rollout.engine={obj.rollout.engine} runs a whole model on every rank and would ignore it: "
                          f"use rollout=sglang (on GPUs) or leave rollout.tp_size=1")
    if spec["group_based"] and obj.algo.adv_estimator in GROUP_ESTIMATORS and obj.rollout.group_size < 2:
        raise ConfigError(f"rollout.group_size={obj.rollout.group_size}: algo.adv_estimator={obj.algo.adv_estimator}'s "
                          f"baseline is the other completions of the same prompt, so a group of one learns nothing; "
                          f"use rollout.group_size>=2 (or algo.adv_estimator=reinforce_pp, whose baseline is the batch)")
    if spec["group_based"]:
        check_grpo_rules(obj)
    check_loggers(obj.logger)
    if recipe == "eval":
        check_eval_rules(obj)
    check_reward_config(obj.reward)
    if "env.name" not in ignored:
        check_env_config(obj.env)


def check_context_length(cfg: RunConfig, context: int, source: str = "config.json") -> None:
    """The longest sequence the run makes fits the context length (model.path's config.json, or
    rollout.sglang_kwargs.context_length): SGLang refuses a longer request mid-run (input +
    max_new_tokens), and past it a model's positions are untrained. SFT / DPO: data.max_seq_len.
    GRPO / eval: the prompt + a turn's max_new_tokens; with an environment, a later turn's input
    holds the episode so far (up to env.max_total_tokens) and asks for up to a turn more."""
    if cfg.recipe in ("sft", "dpo"):
        budget = {"data.max_seq_len": cfg.data.max_seq_len}
    else:
        turn = {"rollout.max_new_tokens": cfg.rollout.max_new_tokens} if cfg.recipe != "eval" else {}
        turn["rollout.eval_max_new_tokens"] = cfg.rollout.eval_max_new_tokens
        name = max(turn, key=turn.get)
        budget = {"data.max_prompt_tokens": cfg.data.max_prompt_tokens, name: turn[name]}
        if cfg.env.name != "none":
            episode = {"data.max_prompt_tokens": cfg.data.max_prompt_tokens,
                       "env.max_total_tokens": cfg.env.max_total_tokens,
                       name: min(turn[name], cfg.env.max_total_tokens)}
            budget = max(budget, episode, key=lambda b: sum(b.values()))
    if sum(budget.values()) > context:
        spelled = " + ".join(f"{k}={v}" for k, v in budget.items())
        raise ConfigError(f"{spelled} = {sum(budget.values())} tokens is more than model.path={cfg.model.path!r} "
                          f"takes: its context length is {context} ({source}); lower {' or '.join(budget)} to fit")


def check_generation_fits(cfg: RunConfig, longest_prompt: int, context: int, source: str) -> None:
    """SFT / DPO's generation eval (trainer.eval_generate): the longest held-out prompt and
    rollout.eval_max_new_tokens fit the context."""
    need = longest_prompt + cfg.rollout.eval_max_new_tokens
    if need > context:
        raise ConfigError(f"trainer.eval_generate: the longest held-out prompt ({longest_prompt} tokens) + "
                          f"rollout.eval_max_new_tokens={cfg.rollout.eval_max_new_tokens} = {need} tokens is more "
                          f"than model.path={cfg.model.path!r} takes: its context length is {context} ({source}); "
                          f"lower rollout.eval_max_new_tokens or data.max_seq_len, or set trainer.eval_generate=false")


def check_loggers(names: list[str]) -> None:
    """logger=[...]: registered writers, metrics.jsonl among them, their packages installed."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"logger: {unknown[0]!r} is not one of {LOGGERS.names()}")
    if REQUIRED_LOGGER not in names:
        raise ConfigError(f"logger={list(names)} must include {REQUIRED_LOGGER} (metrics.jsonl: the run reads it back "
                          f"for its summary, plots and resume), e.g. logger=[{REQUIRED_LOGGER},{','.join(names)}]")
    missing = logger_unavailable(list(names))
    if missing:
        raise ConfigError(missing)


def check_eval_rules(cfg: "RunConfig") -> None:
    """pass@k needs k <= the samples drawn per problem."""
    if cfg.eval.samples and not all(0 < k <= cfg.eval.samples for k in cfg.eval.pass_k):
        raise ConfigError(f"eval.pass_k={list(cfg.eval.pass_k)}: every k must be in [1, eval.samples="
                          f"{cfg.eval.samples}] (pass@k is estimated from eval.samples completions per problem)")


def check_grpo_rules(cfg: "RunConfig") -> None:
    """Cross-key rules of the GRPO-family options."""
    algo = cfg.algo
    if algo.kl_in_reward and algo.kl_coef <= 0:
        raise ConfigError("algo.kl_in_reward=true needs algo.kl_coef > 0 (the KL's weight in the reward, and a "
                          "reference model to measure it against)")
    if algo.kl_target is not None and not algo.kl_in_reward:
        raise ConfigError("algo.kl_target adapts the KL-in-reward coefficient: set algo.kl_in_reward=true too")
    if algo.overlong_buffer_len >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer_len={algo.overlong_buffer_len} must be smaller than "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty ramps over the last "
                          f"overlong_buffer_len tokens)")
    if algo.policy_loss == "gspo" and algo.clip_high > 0.05:
        raise ConfigError(f"algo.policy_loss=gspo clips a sequence-level ratio: algo.clip_low/clip_high of the "
                          f"paper's order (3e-4 / 4e-4), not {algo.clip_low} / {algo.clip_high}")


def check_schema_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not have (`+trainer.lrr=1`: a `+` bypasses struct mode, and the
    value would then be ignored)."""
    schema = OmegaConf.structured(RunConfig)

    def walk(node: Any, ref: Any, prefix: str) -> None:
        for key in node.keys():
            path = f"{prefix}{key}"
            if path in FREE_KEYS:
                continue
            if key not in ref:
                known = [f"{prefix}{k}" for k in ref.keys()]
                close = difflib.get_close_matches(path, known, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                where = f"{prefix[:-1]} has" if prefix else "the config has"
                raise ConfigError(f"+{path}: {where} no key {key!r}; {hint}a `+` adds a key colo_rl does not "
                                  f"read, so it would be ignored. Remove it (the keys: colo_rl/config/schema.py).")
            child, ref_child = node._get_node(key), ref._get_node(key)
            if isinstance(child, DictConfig) and isinstance(ref_child, DictConfig):
                walk(child, ref_child, f"{path}.")

    walk(cfg, schema, "")


def _override_key(override: str) -> str:
    """`+trainer.lr=1`, `~x`, `trainer.lr=1` -> the dotted key."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj




def to_object(cfg: DictConfig, recipe: Optional[str] = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Typed config object from Hydra's DictConfig, validated (`validate`) for `recipe`."""
    validate(cfg, recipe, overrides)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, RunConfig), type(obj)
    return obj
