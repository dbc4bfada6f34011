"""Environments: what the policy's turns are answered with.

An environment starts from a problem's first messages (adding what the policy must know, e.g. the
tools it may call) and takes each policy turn's text: it answers with an observation to append,
or says the episode is done. The final reward is the task's verifier on the policy's own text
(the recipe's RewardScorer), so a tool result is never credited as the policy's answer.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from colo_rl.envs.calls import ParsedTurn, choose_format, template_declares_tools
from colo_rl.envs.tools import TOOLS, Tool, ToolError, truncate
from colo_rl.registry import Registry

log = logging.getLogger("colo_rl")


@dataclass
class Step:
    """An environment's answer to one policy turn.

    observation: text to append (None: the episode is done). cut: where the turn's text ends
    (the character offset past a tool call; None: keep all of it). tool: the tool called, if any;
    error: why the call failed (a malformed call, a tool that raised or timed out)."""

    observation: Optional[str] = None
    cut: Optional[int] = None
    tool: Optional[str] = None
    error: Optional[str] = None

    @property
    def done(self) -> bool:
        return self.observation is None


class Environment(Protocol):
    def first_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]: ...

    def chat_template_kwargs(self) -> dict[str, Any]:
        """Extra apply_chat_template arguments (e.g. `tools=` where the template renders them)."""

    def parse(self, turn_text: str) -> ParsedTurn:
        """Cheap: does the turn call a tool (the driver cuts the turn there)? Runs nothing."""

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that close a call: an engine that can stops the turn there instead of sampling
        on to EOS (the driver cuts after the call either way)."""

    def step(self, turn_text: str, turn_closed: bool) -> Step:
        """Run what the turn asks for. `turn_closed`: the turn ended with EOS."""


class ToolEnvironment:
    """The policy may call `tools`; each call's result (or the error) is the observation. A call
    still running after `timeout_s` is answered with an error (its daemon thread is abandoned, so
    a hung tool can neither stall the step nor keep the process from exiting)."""

    def __init__(self, tools: list[Tool], fmt: str, chat_template: Optional[str], max_output_chars: int,
                 timeout_s: Optional[float] = None):
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.format = choose_format(fmt, chat_template, self.tools)
        self.template_renders_tools = self.format.name == "json" and template_declares_tools(chat_template)
        self.max_output_chars = max_output_chars

    def first_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if self.template_renders_tools:
            return messages
        out = [dict(m) for m in messages]
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        at = users[-1] if users else len(out) - 1
        out[at]["content"] = f"{out[at]['content']}\n{self.format.instructions()}"
        if self.format.name == "tags":  # after any system message, before the problem
            first = 1 if out and out[0]["role"] == "system" else 0
            out[first:first] = self.format.demonstration()
        return out

    def chat_template_kwargs(self) -> dict[str, Any]:
        return {"tools": [t.schema() for t in self.tools.values()]} if self.template_renders_tools else {}

    def parse(self, turn_text: str) -> ParsedTurn:
        return self.format.parse(turn_text)

    def stop_strings(self) -> tuple[str, ...]:
        return self.format.stop_strings()

    def step(self, turn_text: str, turn_closed: bool) -> Step:
        parsed = self.format.parse(turn_text)
        if not parsed.wants_tool:
            return Step()
        if parsed.error is not None:
            return self._answer(f"error: {parsed.error}", parsed, None, parsed.error, turn_closed)
        call = parsed.call
        result, error = self._run(self.tools[call.name], call.arguments)
        return self._answer(result if error is None else f"error: {error}", parsed, call.name, error, turn_closed)

    def _run(self, tool: Tool, arguments: dict[str, Any]) -> tuple[str, Optional[str]]:
        """(result, None) or (None, why it failed)."""
        box: list[tuple[Optional[str], Optional[str]]] = []

        def call() -> None:
            try:
                box.append((str(tool.run(arguments)), None))
            except ToolError as e:
                box.append((None, str(e)))
            except Exception as e:  # noqa: BLE001 - a faulty tool is an observation, never a crashed step
                box.append((None, f"the tool failed ({type(e).__name__}: {e})"))

        worker = threading.Thread(target=call, name=f"colo_rl-tool-{tool.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if not box:
            return None, f"timed out after {self.timeout_s:g} s"
        return box[0]

    def _answer(self, result: str, parsed: ParsedTurn, tool: Optional[str], error: Optional[str],
                turn_closed: bool) -> Step:
        closed = turn_closed and parsed.end is None  # a cut turn no longer ends with its EOS
        return Step(self.format.observation(truncate(result, self.max_output_chars), closed), parsed.end, tool, error)


ENVIRONMENTS: Registry[Callable[[Any, Optional[str]], Environment]] = Registry("env.name")


def _tool_env(*names: str) -> Callable[[Any, Optional[str]], ToolEnvironment]:
    def build(cfg, chat_template: Optional[str]) -> ToolEnvironment:
        # the python tool enforces cfg.tool_timeout_s itself (and kills its process); this is the backstop
        return ToolEnvironment([TOOLS.get(n)(cfg) for n in names], cfg.format, chat_template, cfg.max_output_chars,
                               timeout_s=cfg.tool_timeout_s + 2.0)

    return build


ENVIRONMENTS.register("calculator")(_tool_env("calculator"))
ENVIRONMENTS.register("python")(_tool_env("python"))
ENVIRONMENTS.register("calculator_python")(_tool_env("calculator", "python"))


def build_environment(cfg, chat_template: Optional[str]) -> Optional[Environment]:
    """The configured environment (`cfg` is the `env` config group), or None for env.name=none."""
    return None if cfg.name == "none" else ENVIRONMENTS.get(cfg.name)(cfg, chat_template)
