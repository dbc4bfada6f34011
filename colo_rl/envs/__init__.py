"""Environments and tools for multi-turn rollouts (colo_rl/rollout/multiturn.py drives them)."""

from colo_rl.envs.calls import ParsedTurn, ToolCall, choose_format
from colo_rl.envs.environment import ENVIRONMENTS, Environment, Step, ToolEnvironment, build_environment
from colo_rl.envs.tools import TOOLS, Tool, ToolError, run_python, safe_arithmetic

__all__ = ["ENVIRONMENTS", "TOOLS", "Environment", "ParsedTurn", "Step", "Tool", "ToolCall", "ToolEnvironment",
           "ToolError", "build_environment", "choose_format", "run_python", "safe_arithmetic"]
