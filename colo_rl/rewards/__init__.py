"""Rewards: the built-in verifiers (verifiers.py), the user's reward functions (sources.py), the
worker pool that calls them with a timeout (pool.py) and the batch scorer (scorer.py)."""

from colo_rl.errors import RewardError
from colo_rl.rewards.scorer import RewardResult, RewardScorer, add_source, model_weight
from colo_rl.rewards.sources import RewardSource, check_reward_config, load_source, resolve_sources, source_metric
from colo_rl.rewards.verifiers import (REWARD_FUNCTIONS, RewardFn, answers_match, extract_final_answer,
                                       extract_last_number, format_reward, last_number_reward, math_verify_reward,
                                       register_reward)

__all__ = ["REWARD_FUNCTIONS", "RewardError", "RewardFn", "RewardResult", "RewardScorer", "RewardSource",
           "answers_match", "check_reward_config", "extract_final_answer", "extract_last_number", "format_reward",
           "add_source", "last_number_reward", "load_source", "math_verify_reward", "model_weight", "register_reward",
           "resolve_sources", "source_metric"]
