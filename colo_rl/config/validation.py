"""The one validation pass: every check that types alone cannot express (choices from the
registries, value ranges, cross-key rules, keys a recipe does not read), run before anything heavy starts."""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from colo_rl.algos import (GROUP_ESTIMATORS, ROLLOUT_CORRECTIONS, TOKEN_LEVEL_ESTIMATORS, TWO_SIDED_CORRECTIONS,
                           kl_goes_in_reward)
from colo_rl.envs import check_env_config
from colo_rl.errors import ConfigError
from colo_rl.loggers import LOGGERS, REQUIRED as REQUIRED_LOGGER, unavailable as logger_unavailable
from colo_rl.rewards import check_reward_config
from colo_rl.rollout import ENGINES
from colo_rl.train.compiled_layers import check_compile

from colo_rl.config.options import RECIPE_NAMES, WARN, Resume, Rules, option_rules
from colo_rl.config.schema import AlgoConfig, RunConfig

# Each option's rules (range, choices, which recipes read it, the resume rule) sit beside its field in
# schema.py (`opt(...)`, config/options.py); this is them by dotted key, applied by `validate`.
OPTIONS: dict[str, Rules] = option_rules(RunConfig)

# What each recipe runs: its algo group, and whether its advantage estimator sees prompt groups.
RECIPES: dict[str, dict[str, Any]] = {
    "grpo": {"algo": "grpo", "group_based": True},
    "sft": {"algo": "sft", "group_based": False},
    "dpo": {"algo": "dpo", "group_based": False},
    "eval": {"algo": None, "group_based": False},
}
assert tuple(RECIPES) == RECIPE_NAMES, "config/options.py RECIPE_NAMES names the recipes RECIPES describes"

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
    for ov in overrides:
        key = _override_key(ov)
        rules = OPTIONS.get(key)
        if rules is not None and recipe not in rules.scope.reads:
            raise ConfigError(f"{key} is not read by recipes/{recipe}.py ({rules.scope.instead[recipe]}): remove it "
                              f"from the command line")
    if spec["algo"] is not None and obj.algo.name != spec["algo"]:
        raise ConfigError(f"algo={obj.algo.name} is not {recipe}'s algo group: recipes/{recipe}.py runs "
                          f"algo={spec['algo']}" + (f" (for {obj.algo.name.upper()} run recipes/{obj.algo.name}.py)"
                                                    if obj.algo.name in RECIPES else ""))
    for key, rules in OPTIONS.items():  # the rules beside each field, for the options this recipe reads
        if recipe not in rules.scope.reads:
            continue
        value = _get(obj, key)
        allowed = rules.allowed()
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {allowed}")
        if rules.check is not None and not rules.check.accepts(value):
            raise ConfigError(f"{key}={value!r} {rules.check.what}")
    if obj.data.min_operand > obj.data.max_operand:
        raise ConfigError(f"data.min_operand={obj.data.min_operand} > data.max_operand={obj.data.max_operand}: the "
                          f"arithmetic task draws operands from [min_operand, max_operand]; raise data.max_operand")
    ENGINES.get(obj.rollout.engine).check_config(obj)
    if spec["group_based"] and obj.algo.adv_estimator in GROUP_ESTIMATORS and obj.rollout.group_size < 2:
        raise ConfigError(f"rollout.group_size={obj.rollout.group_size}: algo.adv_estimator={obj.algo.adv_estimator}'s "
                          f"baseline is the other completions of the same prompt, so a group of one learns nothing; "
                          f"use rollout.group_size>=2 (or algo.adv_estimator=reinforce_pp, whose baseline is the batch)")
    if spec["group_based"]:
        check_grpo_rules(obj)
    check_packing_attention(obj, recipe)
    check_compile(obj.model, obj.trainer)
    check_loggers(obj.logger)
    if recipe == "eval":
        check_eval_rules(obj)
    check_reward_config(obj.reward)
    if recipe in OPTIONS["env.name"].scope.reads:
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


# The attention implementations that take packed rows' masks: a 4-D additive mask (every recipe), or
# FlexAttention's block mask (GRPO's group rows: train/packing.py group_attention).
PACKED_ATTENTION = {"grpo": ("sdpa", "eager", "flex_attention"), "sft": ("sdpa", "eager"), "dpo": ("sdpa", "eager")}


def check_packing_attention(cfg: "RunConfig", recipe: str) -> None:
    """trainer.packing keeps a row's sequences apart with a mask the attention must take."""
    allowed = PACKED_ATTENTION.get(recipe)
    if allowed and cfg.trainer.packing and cfg.model.attn_implementation not in allowed:
        raise ConfigError(f"trainer.packing=true puts several sequences in one row and keeps them apart with an "
                          f"attention mask that model.attn_implementation={cfg.model.attn_implementation} does not "
                          f"take: use one of {list(allowed)}, or trainer.packing=false (padded rows)")


def check_grpo_rules(cfg: "RunConfig") -> None:
    """Cross-key rules of the GRPO-family options."""
    algo = cfg.algo
    if algo.kl_in_reward and algo.kl_coef <= 0:
        raise ConfigError("algo.kl_in_reward=true needs algo.kl_coef > 0 (the KL's weight in the reward, and a "
                          "reference model to measure it against)")
    if algo.kl_target is not None and not kl_goes_in_reward(algo):  # REINFORCE++ puts it there by definition
        raise ConfigError("algo.kl_target adapts the KL-in-reward coefficient: set algo.kl_in_reward=true too")
    if algo.kl_target is not None and algo.kl_coef <= 0:  # and 0 would stay 0 under a multiplicative update
        raise ConfigError(f"algo.kl_target={algo.kl_target} adapts algo.kl_coef, which is 0: no reference model is "
                          f"loaded and nothing adapts. Set algo.kl_coef > 0 (the starting coefficient, e.g. 0.05)")
    # the penalty's length limit: an episode's response tokens with an environment, else one completion's
    limit_key = "env.max_total_tokens" if cfg.env.name != "none" else "rollout.max_new_tokens"
    limit = cfg.env.max_total_tokens if cfg.env.name != "none" else cfg.rollout.max_new_tokens
    if algo.overlong_buffer_len >= limit:
        raise ConfigError(f"algo.overlong_buffer_len={algo.overlong_buffer_len} must be smaller than "
                          f"{limit_key}={limit} (the penalty ramps over the last overlong_buffer_len tokens "
                          f"before it)")
    if algo.dynamic_sampling and cfg.rollout.group_size < 2:
        raise ConfigError(f"algo.dynamic_sampling=true keeps groups whose rewards differ; with rollout.group_size="
                          f"{cfg.rollout.group_size} no group can, so every round would be set aside. Use "
                          f"rollout.group_size >= 2 or algo.dynamic_sampling=false")
    if algo.dynamic_sampling and algo.adv_estimator not in GROUP_ESTIMATORS:
        raise ConfigError(f"algo.dynamic_sampling=true drops groups whose rewards are all equal, which a group "
                          f"baseline gives zero advantage; algo.adv_estimator={algo.adv_estimator}'s baseline is the "
                          f"whole batch, so those groups carry a signal the filter would throw away. Use "
                          f"algo.adv_estimator=one of {list(GROUP_ESTIMATORS)} or algo.dynamic_sampling=false")
    if algo.clip_ratio_c is not None and algo.policy_loss != "ppo_clip":
        raise ConfigError(f"algo.clip_ratio_c={algo.clip_ratio_c} (dual-clip) bounds ppo_clip's token loss; "
                          f"algo.policy_loss={algo.policy_loss} has no such term and would ignore it: remove "
                          f"algo.clip_ratio_c or use algo.policy_loss=ppo_clip")
    if (algo.loss_agg == "seq-mean-token-sum-norm") != (algo.loss_scale_factor is not None):
        raise ConfigError(f"algo.loss_agg={algo.loss_agg} with algo.loss_scale_factor={algo.loss_scale_factor}: "
                          f"seq-mean-token-sum-norm divides by a constant length and needs it (e.g. "
                          f"algo.loss_scale_factor={cfg.rollout.max_new_tokens}, rollout.max_new_tokens); no other "
                          f"aggregation reads algo.loss_scale_factor")
    check_rollout_correction(algo)
    if cfg.placement.mode == "split":
        check_split_rules(cfg)
    if algo.policy_loss == "gspo":
        check_gspo(algo)


def check_gspo(algo: "AlgoConfig") -> None:
    """GSPO's objective: a mean over sequences of a clipped sequence-level ratio (the paper's clip
    range is ~1e3 times PPO's)."""
    if max(algo.clip_low, algo.clip_high) > 0.05:
        raise ConfigError(f"algo.policy_loss=gspo clips a sequence-level ratio: algo.clip_low/clip_high of the "
                          f"paper's order (3e-4 / 4e-4), not {algo.clip_low} / {algo.clip_high}. Set "
                          f"algo.clip_low=3e-4 algo.clip_high=4e-4 algo.loss_agg=seq-mean-token-mean")
    if algo.loss_agg != "seq-mean-token-mean":
        raise ConfigError(f"algo.policy_loss=gspo averages over sequences (each sequence's token mean, then the "
                          f"mean over sequences); algo.loss_agg={algo.loss_agg} would weigh sequences differently. "
                          f"Set algo.loss_agg=seq-mean-token-mean")
    if algo.adv_estimator in TOKEN_LEVEL_ESTIMATORS and algo.kl_coef > 0:
        raise ConfigError(f"algo.policy_loss=gspo weighs every token of a sequence by one advantage (the paper's "
                          f"objective); algo.adv_estimator={algo.adv_estimator} with algo.kl_coef={algo.kl_coef} gives "
                          f"each token its own (the returns-to-go of a per-token KL penalty). Use "
                          f"algo.adv_estimator=reinforce_pp_baseline (or grpo, rloo), or algo.kl_coef=0")


def check_split_rules(cfg: "RunConfig") -> None:
    """placement.mode=split: the options it reads, and a weight sync often enough for the bound (the
    ranks' layout, TP groups included, is checked by colo_rl/split/placement.py)."""
    if cfg.placement.balance_from is not None and str(cfg.placement.generation_ranks) != "auto":
        raise ConfigError(f"placement.balance_from={cfg.placement.balance_from} is read only with "
                          f"placement.generation_ranks=auto (not {cfg.placement.generation_ranks})")
    k, every = cfg.rollout.max_staleness, cfg.placement.sync_every
    if every > k + 1:
        raise ConfigError(f"placement.sync_every={every} with rollout.max_staleness={k}: between two weight syncs "
                          f"the trainer gets {every - 1} steps ahead of the generators' weights; set "
                          f"placement.sync_every <= rollout.max_staleness + 1")
    if k > 0 and cfg.algo.rollout_correction is None and cfg.algo.tis_cap is None:
        raise ConfigError(f"rollout.max_staleness={k}: samples up to {k} step(s) old are trained on, and the loss "
                          f"needs the generating policy's log-probs as its behaviour policy (decoupled PPO: the "
                          f"importance weight pi_old / pi_rollout). Set algo.rollout_correction (e.g. tis_token) "
                          f"or rollout.max_staleness=0")


def check_rollout_correction(algo: "AlgoConfig") -> None:
    """algo.tis_cap is the token-level TIS of algo.rollout_correction: one of the two; the band's keys
    only with a correction that reads them."""
    if algo.tis_cap is not None and algo.rollout_correction is not None:
        raise ConfigError(f"algo.tis_cap={algo.tis_cap} and algo.rollout_correction={algo.rollout_correction}: two "
                          f"rollout corrections; tis_cap is rollout_correction=tis_token with "
                          f"rollout_is_threshold=tis_cap: keep one")
    default = AlgoConfig.rollout_is_threshold
    if algo.rollout_correction is None and algo.rollout_is_threshold != default:
        raise ConfigError(f"algo.rollout_is_threshold={algo.rollout_is_threshold} is read only with "
                          f"algo.rollout_correction set (one of {ROLLOUT_CORRECTIONS.names()})")
    if algo.rollout_is_threshold_lower is not None and algo.rollout_correction not in TWO_SIDED_CORRECTIONS:
        raise ConfigError(f"algo.rollout_is_threshold_lower={algo.rollout_is_threshold_lower} is the lower edge of "
                          f"a two-sided band ({list(TWO_SIDED_CORRECTIONS)}); algo.rollout_correction="
                          f"{algo.rollout_correction} does not read it: remove it")


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


def resume_rule(key: str) -> Resume:
    """May a resumed run change this flattened config key? Its option's rule; a key inside a free dict
    (rollout.sglang_kwargs.x) takes that option's; a key the schema no longer has takes its group's
    rule when every option of the group shares one (data.*: refused, colocate.*: silent); else WARN."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in OPTIONS:
            return OPTIONS[".".join(parts[:n])].resume
    group = {r.resume for k, r in OPTIONS.items() if k.startswith(f"{parts[0]}.")}
    return group.pop() if len(group) == 1 else WARN


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
