"""Structured configs: every option has one home, a type, a default and its rules (`schema.py`, with
`options.py`'s `opt`), and one validation pass for what types cannot express (`validation.py`)."""

from colo_rl.config.options import Check, Resume, Rules, Scope, opt, reads, refuse
from colo_rl.config.schema import (AlgoConfig, ColocateConfig, DataConfig, EnvConfig, EvalConfig, LoraConfig,
                                   ModelConfig, RewardConfig, RewardModelConfig, RolloutConfig, RunConfig,
                                   TrainerConfig, derive_seeds, register_configs)
from colo_rl.config.validation import (FREE_KEYS, OPTIONS, RECIPES, check_grpo_rules, check_schema_keys,
                                       resume_rule, to_object, validate)
from colo_rl.errors import ConfigError

__all__ = ["AlgoConfig", "Check", "ColocateConfig", "ConfigError", "DataConfig", "EnvConfig", "EvalConfig",
           "FREE_KEYS", "LoraConfig", "ModelConfig", "OPTIONS", "RECIPES", "Resume", "RewardConfig",
           "RewardModelConfig", "RolloutConfig", "Rules", "RunConfig", "Scope", "TrainerConfig", "check_grpo_rules",
           "check_schema_keys", "derive_seeds", "opt", "reads", "refuse", "register_configs", "resume_rule",
           "to_object", "validate"]
