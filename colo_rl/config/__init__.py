"""Structured configs: every option has one home, a type and a default (`schema.py`), and one
validation pass for what types cannot express (`validation.py`)."""

from colo_rl.config.schema import (AlgoConfig, ColocateConfig, DataConfig, EnvConfig, EvalConfig, LoraConfig,
                                   ModelConfig, RewardConfig, RewardModelConfig, RolloutConfig, RunConfig,
                                   TrainerConfig, derive_seeds, register_configs)
from colo_rl.config.validation import (CHOICES, FREE_KEYS, NULLABLE, RANGES, RECIPES, check_grpo_rules,
                                       check_schema_keys, to_object, validate)
from colo_rl.errors import ConfigError

__all__ = ["AlgoConfig", "CHOICES", "ColocateConfig", "ConfigError", "DataConfig", "EnvConfig", "EvalConfig",
           "FREE_KEYS", "LoraConfig", "ModelConfig", "NULLABLE", "RANGES", "RECIPES", "RewardConfig",
           "RewardModelConfig", "RolloutConfig", "RunConfig", "TrainerConfig", "check_grpo_rules",
           "check_schema_keys", "derive_seeds", "register_configs", "to_object", "validate"]
