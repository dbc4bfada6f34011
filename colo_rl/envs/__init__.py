"""Environments and tools for multi-turn rollouts (colo_rl/rollout/multiturn.py drives them)."""

from colo_rl.envs.calls import ParsedTurn, ToolCall, choose_format
from colo_rl.envs.environment import (ENVIRONMENTS, Environment, Session, Step, ToolEnvironment, ToolSession,
                                      turns_end_at_strings)
from colo_rl.envs.conversation import ConversationEnvironment, Retry, build_environment, check_env_config
from colo_rl.envs.turns import UserTurns
from colo_rl.envs.tools import TOOLS, Tool, ToolError, run_python, safe_arithmetic

__all__ = ["ENVIRONMENTS", "TOOLS", "ConversationEnvironment", "Environment", "ParsedTurn", "Retry", "Session", "Step",
           "Tool", "ToolCall", "ToolEnvironment", "ToolError", "ToolSession", "UserTurns", "build_environment",
           "check_env_config", "choose_format", "run_python", "safe_arithmetic", "turns_end_at_strings"]
