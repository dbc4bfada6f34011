"""Environments: what the policy's turns are answered with.

An environment (one per run) sets up the prompt (adding what the policy must know, e.g. the tools
it may call) and starts one session per episode (`start(problem)`): the session takes each policy
turn's text and answers with an observation to append, or says the episode is done. A session
keeps whatever the episode needs between turns (a notebook-like python tool's earlier cells, a
user environment's own state) and is closed when the episode ends. The final reward is the task's
verifier on the policy's own text (the recipe's RewardScorer), so a tool result is never credited
as the policy's answer.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol

from colo_rl.envs.calls import ParsedTurn, choose_format, template_declares_tools
from colo_rl.envs.tools import ERROR_PREFIX, TOOLS, Tool, ToolError, truncate
from colo_rl.envs.turns import UserTurns
from colo_rl.errors import USER_CODE_FAILURES, EnvError, failure_text
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


class Session(Protocol):
    """One episode's side of the environment."""

    def step(self, turn_text: str, end_token: Optional[str]) -> Step:
        """Answer the policy's turn. `end_token`: the text of the EOS token it ended with (None: no EOS)."""

    def reward(self) -> tuple[Optional[float], Optional[str]]:
        """The environment's own score of the finished episode (None: it gives none), or why it failed."""

    def close(self) -> None:
        """The episode is over (called once, whatever ended it)."""


class Environment(Protocol):
    # True: every policy turn goes to the session (it decides when the episode ends); False: only
    # turns that call a tool (a turn without a call ends the episode).
    answers_every_turn: bool
    # True: a session's reward() may score the episode (a reward source "env", weighted by
    # env.reward_weight); False: the environment never scores (tools: the reward functions do).
    scores_episodes: bool

    def first_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]: ...

    def chat_template_kwargs(self) -> dict[str, Any]:
        """Extra apply_chat_template arguments (e.g. `tools=` where the template renders them)."""

    def parse(self, turn_text: str) -> ParsedTurn:
        """Cheap: does the turn call a tool (the driver cuts the turn there)? Runs nothing."""

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that close a call: an engine that can stops the turn there instead of sampling
        on to EOS (the driver cuts after the call either way)."""

    def start(self, problem: Any) -> Session:
        """A session for one episode of `problem` (colo_rl.data.Problem; None where unknown)."""


# Calls abandoned at their timeout that are still running: threads cannot be stopped, so each one
# keeps its share of the interpreter (a spinning `step` slowed the trainer's own loop 4x after 8
# episodes). Past this many at once the run stops, naming the caller.
MAX_HUNG_CALLS = 8
_hung: list[tuple[threading.Thread, str]] = []


def call_with_timeout(fn: Callable[[], Any], timeout_s: Optional[float], what: str,
                      may_stop: bool = True) -> tuple[Any, Optional[str]]:
    """(fn's result, None) or (None, why it failed): its exception (sys.exit too), or a timeout. `fn`
    runs in a daemon thread that a timeout abandons, so a hung call can neither stall the step nor
    keep the process from exiting; MAX_HUNG_CALLS of them still running stop the run (EnvError),
    from the next call that hangs with `may_stop` (a `close` counts, but never raises: it runs where
    the other sessions still wait to be closed). ToolError's text is the reason as is; `what` names
    the caller in others."""
    box: list[tuple[Any, Optional[str]]] = []

    def call() -> None:
        try:
            box.append((fn(), None))
        except ToolError as e:
            box.append((None, str(e)))
        except USER_CODE_FAILURES as e:  # a faulty tool is an observation, never a crashed step
            box.append((None, f"{what} failed ({failure_text(e)})"))

    worker = threading.Thread(target=call, name="colo_rl-env-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not worker.is_alive() and not box:  # it ended without an answer: not a timeout
        return None, f"{what} failed (its thread ended without returning)"
    if not box:
        note_hung(worker, what, may_stop)
        return None, f"timed out after {timeout_s:g} s"
    return box[0]


def note_hung(worker: threading.Thread, what: str, may_stop: bool = True) -> None:
    """Keep `worker` (abandoned, still running) on the hung list; EnvError when MAX_HUNG_CALLS on it
    still run and `may_stop`."""
    _hung[:] = [(t, w) for t, w in _hung if t.is_alive()] + [(worker, what)]
    if may_stop and len(_hung) >= MAX_HUNG_CALLS:
        names = sorted({w for _, w in _hung})
        raise EnvError(f"{len(_hung)} calls into {', '.join(names)} are still running after their timeout "
                       f"(env.tool_timeout_s): they cannot be stopped and slow the whole run down, so it stops here. "
                       f"Fix the code that hangs (an endless loop, a wait that is never answered), or give "
                       f"the work its own process with a limit of its own")


def special_token_strings(tokenizer) -> list[str]:
    """The texts the tokenizer reads as its special tokens (EOS, <|im_start|>, Llama's reserved ones)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in decoder.values() if getattr(t, "special", False)}
                  | set(getattr(tokenizer, "all_special_tokens", ())))


def special_token_defuser(specials: Iterable[str]) -> Callable[[str], str]:
    """A tool's output (what the policy's code printed) with each special token's text broken by a
    zero-width space: encoded, it would be that token, and a printed "<|im_end|><|im_start|>user"
    would forge the conversation's turns in the policy's own context."""
    specials = sorted((s for s in specials if len(s) > 1), key=len, reverse=True)
    if not specials:
        return lambda text: text
    pattern = re.compile("|".join(map(re.escape, specials)))
    return lambda text: pattern.sub(lambda m: m.group(0)[0] + "\u200b" + m.group(0)[1:], text)


class ToolEnvironment:
    """The policy may call `tools`; each call's result (or the error) is the observation. A call
    still running after `timeout_s` is answered with an error (`call_with_timeout`)."""

    answers_every_turn = False
    scores_episodes = False

    def __init__(self, tools: list[Tool], fmt: str, chat_template: Optional[str], max_output_chars: int,
                 timeout_s: Optional[float] = None, turns: Optional[UserTurns] = None,
                 special_tokens: Iterable[str] = ()):
        self.tools = {t.name: t for t in tools}
        self.defuse = special_token_defuser(special_tokens)
        self.timeout_s = timeout_s
        self.format = choose_format(fmt, chat_template, self.tools, turns)
        self.template_renders_tools = self.format.template_writes_tools and template_declares_tools(chat_template)
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

    def special_tokens_read(self) -> tuple[str, ...]:
        """Special tokens that stay in the turn text `step` gets (the rest are dropped, EOS included)."""
        return self.format.reads_special

    def start(self, problem: Any = None) -> "ToolSession":
        return ToolSession(self)


class ToolSession:
    """One episode's tools: each tool's runner for this episode (a stateful tool keeps its state there)."""

    def __init__(self, env: ToolEnvironment):
        self.env = env
        self.runners = {name: tool.start_episode() for name, tool in env.tools.items()}

    def step(self, turn_text: str, end_token: Optional[str]) -> Step:
        env = self.env
        parsed = env.format.parse(turn_text)
        if not parsed.wants_tool:
            return Step()
        if parsed.error is not None:
            return self._answer(f"{ERROR_PREFIX}{parsed.error}", parsed, None, parsed.error, end_token)
        call = parsed.call
        run = self.runners[call.name]
        result, error = call_with_timeout(lambda: str(run(call.arguments)), env.timeout_s, "the tool")
        return self._answer(result if error is None else f"{ERROR_PREFIX}{error}", parsed, call.name, error, end_token)

    def reward(self) -> tuple[Optional[float], Optional[str]]:
        return None, None  # tools score nothing: the verifiers do

    def close(self) -> None:
        self.runners = {}

    def _answer(self, result: str, parsed: ParsedTurn, tool: Optional[str], error: Optional[str],
                end_token: Optional[str]) -> Step:
        end = end_token if parsed.end is None else None  # a cut turn no longer ends with its EOS
        env = self.env
        shown = env.defuse(truncate(result, env.max_output_chars))
        return Step(env.format.observation(shown, end), parsed.end, tool, error)


# A factory per name: (the env config group, the policy's tokenizer, data.use_chat_template) -> Environment.
ENVIRONMENTS: Registry[Callable[[Any, Any, bool], Environment]] = Registry("env.name")


def _tool_env(*names: str) -> Callable[[Any, Any, bool], ToolEnvironment]:
    def build(cfg, tokenizer, use_chat_template: bool = True) -> ToolEnvironment:
        # the python tool enforces cfg.tool_timeout_s itself (and kills its process); this is the backstop
        template = getattr(tokenizer, "chat_template", None)
        turns = UserTurns(tokenizer, use_chat_template) if tokenizer is not None else None
        return ToolEnvironment([TOOLS.get(n)(cfg) for n in names], cfg.format, template, cfg.max_output_chars,
                               timeout_s=cfg.tool_timeout_s + 2.0, turns=turns,
                               special_tokens=special_token_strings(tokenizer) if tokenizer is not None else ())

    return build


# The tool environments, whose turns may end at a call's closing tag (a conversation's end at EOS).
TOOL_ENVIRONMENTS = {"calculator": ("calculator",), "python": ("python",), "calculator_python": ("calculator", "python")}
for _name, _tools in TOOL_ENVIRONMENTS.items():
    ENVIRONMENTS.register(_name)(_tool_env(*_tools))


def turns_end_at_strings(env_cfg) -> bool:
    """Whether the configured environment's turns may end at a string (a tool call's closing tag):
    then the engine needs its tokenizer to match it (SGLang matches stop strings on decoded text).
    env.format=auto may still pick `llama`, whose calls end at EOS: the tokenizer is then unused."""
    return env_cfg.name in TOOL_ENVIRONMENTS and env_cfg.format != "llama"
