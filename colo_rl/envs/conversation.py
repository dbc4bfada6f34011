"""Environments that answer the policy with a user message: your own class from a file
(`env.name=path/to/file.py:Name`) and the built-in `retry`.

One object per episode, made from the problem and kept for the whole episode (its state is the
episode's):

    class Name:
        def __init__(self, problem): ...            # problem.answer, .question, .fields (the record)
        def step(self, turn: str) -> str | None: ... # the policy's turn -> the next user message; None ends
        def reward(self) -> float: ...               # optional: its own score of the finished episode
        def close(self): ...                         # optional: the episode is over

Every policy turn goes to `step`; its message is appended as a user turn written by the policy
model's own chat template (data.use_chat_template=false: on its own lines), then the policy answers
again, up to env.max_turns turns and env.max_total_tokens tokens. The reward is the configured
verifiers' on the policy's turns (`retry`'s: the last stated answer), plus env.reward_weight x
`reward()` where the object has one. A `step` or constructor that
raises, times out (env.tool_timeout_s) or returns something other than str / None ends that
episode; it is counted in env/tool_errors and the first such error is logged with its cause.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import threading
from typing import Any, Callable, Optional

from colo_rl.envs.calls import ParsedTurn
from colo_rl.envs.environment import ENVIRONMENTS, TOOL_ENVIRONMENTS, Environment, Step, call_with_timeout
from colo_rl.envs.sandbox import get_sandbox
from colo_rl.envs.tools import truncate
from colo_rl.envs.turns import UserTurns
from colo_rl.errors import ConfigError
from colo_rl.rewards.verifiers import answers_match, extract_final_answer
from colo_rl.user_files import load_object, split_spec

log = logging.getLogger("colo_rl")

class ConversationEnvironment:
    answers_every_turn = True
    scores_episodes = True  # your class's reward(), where it has one

    def __init__(self, factory: Callable[[Any], Any], label: str, turns: UserTurns, max_output_chars: int,
                 timeout_s: float):
        self.factory, self.label, self.turns = factory, label, turns
        self.max_output_chars, self.timeout_s = max_output_chars, timeout_s
        self.logged_error = self.logged_close_error = False
        self.last_error: Optional[str] = None  # the latest failure (the driver quotes it if a whole batch fails)

    def first_messages(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return messages

    def chat_template_kwargs(self) -> dict[str, Any]:
        return {}

    def parse(self, turn_text: str) -> ParsedTurn:
        return ParsedTurn()  # no tool calls: the whole turn is the policy's message

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    def start(self, problem: Any) -> "ConversationSession":
        return ConversationSession(self, problem)

    def failed(self, error: str) -> Step:
        self.last_error = error
        if not self.logged_error:
            self.logged_error = True
            log.warning("env.name=%s: %s; that episode ends here (counted in env/tool_errors; only the first such "
                        "error is logged)", self.label, error)
        return Step(error=error)


class ConversationSession:
    """One episode's object. Its constructor, `step` and `close` run under env.tool_timeout_s; an
    object whose constructor outlives the limit is closed as soon as it arrives."""

    def __init__(self, env: ConversationEnvironment, problem: Any):
        self.env = env
        self._lock = threading.Lock()
        self._gave_up, self._made = False, None

        def make():
            episode = env.factory(problem)
            with self._lock:
                late = self._gave_up
                if not late:
                    self._made = episode
            if late:  # nobody will use it: let it go as an episode's end would
                _close_quietly(env, episode)
            return episode

        _, self.error = call_with_timeout(make, env.timeout_s, env.label)
        with self._lock:
            self._gave_up = True
            self.episode = self._made  # it may have arrived just after the limit: then it is used

    def step(self, turn_text: str, end_token: Optional[str]) -> Step:
        env = self.env
        if self.episode is None:  # its constructor failed
            return env.failed(self.error or f"{env.label}(problem) returned None")
        reply, error = call_with_timeout(lambda: self.episode.step(turn_text), env.timeout_s, f"{env.label}.step")
        if error is not None:
            return env.failed(error)
        if reply is None:
            return Step()
        if not isinstance(reply, str):
            return env.failed(f"{env.label}.step returned {type(reply).__name__}; return the next user message (a "
                              f"str) or None to end the episode")
        return Step(observation=env.turns.message(truncate(reply, env.max_output_chars), end_token))

    def reward(self) -> tuple[Optional[float], Optional[str]]:
        """The object's `reward()` if it has one (after its last turn): (value, None), (None, None)
        without one, or (0.0, why) when it fails or is not a finite number (counted, logged once)."""
        env = self.env
        score = getattr(self.episode, "reward", None)
        if score is None:
            return None, None
        value, error = call_with_timeout(score, env.timeout_s, f"{env.label}.reward")
        if error is None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not math.isfinite(value)):
            error = f"{env.label}.reward returned {value!r}; return a finite float"
        if error is not None:
            env.failed(error)
            return 0.0, error
        return float(value), None

    def close(self) -> None:
        _close_quietly(self.env, self.episode)


def _close_quietly(env: ConversationEnvironment, episode: Any) -> None:
    """`episode.close()` if it has one; a failure or a hang is logged (once), never raised: the
    episode's data is complete by then."""
    close = getattr(episode, "close", None)
    if close is None:
        return
    _, error = call_with_timeout(close, env.timeout_s, f"{env.label}.close", may_stop=False)
    if error is not None and not env.logged_close_error:
        env.logged_close_error = True
        log.warning("env.name=%s: %s (only the first such error is logged)", env.label, error)


class Retry:
    """env.name=retry: a wrong (or missing) stated answer is told so and the policy tries again;
    the episode ends at a right answer (as verl's GSM8K interaction). The verifier reads the last
    stated answer, so a run learns to get there in fewer turns only if its reward says so."""

    def __init__(self, problem):
        if problem is None or not getattr(problem, "answer", None):
            raise ValueError("env.name=retry needs each problem's answer")
        self.truth = problem.answer

    def step(self, turn: str) -> Optional[str]:
        stated = extract_final_answer(turn)
        if stated is None:
            return "You did not state a final answer. End with: The answer is <number>."
        if answers_match(stated, self.truth):
            return None
        return f"{stated} is not right. Check your work, then state the final answer again."


def conversation(factory: Callable[[Any], Any], label: str, cfg, tokenizer,
                 use_chat_template: bool) -> ConversationEnvironment:
    """A ConversationEnvironment of `factory` with the env config's limits (`cfg`: the env group)."""
    return ConversationEnvironment(factory, label, UserTurns(tokenizer, use_chat_template), cfg.max_output_chars,
                                   cfg.tool_timeout_s)


@ENVIRONMENTS.register("retry")
def retry(cfg, tokenizer, use_chat_template: bool = True) -> ConversationEnvironment:
    return conversation(Retry, "retry", cfg, tokenizer, use_chat_template)


def load_user_environment(spec: str) -> Callable[[Any], Any]:
    """The class (or function) `env.name=path/to/file.py:Name` names; ConfigError when it is missing
    or a class without a `step` method."""
    factory, path = load_object(spec, "env.name")
    name = getattr(factory, "__name__", spec)
    if not _takes(factory, None):
        raise ConfigError(f"env.name={spec!r}: {name}{_signature(factory)} in {path} must take one argument, the "
                          f"episode's problem: {name}(problem)")
    if inspect.isclass(factory):
        step = getattr(factory, "step", None)
        if not callable(step):
            raise ConfigError(f"env.name={spec!r}: class {name} in {path} has no step(self, turn) method; it must "
                              f"return the next user message (str) or None to end the episode")
        if not _takes(step, None, ""):  # unbound: self, turn
            raise ConfigError(f"env.name={spec!r}: {name}.step{_signature(step)} in {path} must take the policy's "
                              f"turn: step(self, turn)")
        reward = getattr(factory, "reward", None)
        if reward is not None and not (callable(reward) and _takes(reward, None)):
            raise ConfigError(f"env.name={spec!r}: {name}.reward{_signature(reward)} in {path} must take no argument "
                              f"but self and return the episode's score: reward(self) -> float")
    return factory


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _takes(fn, *args) -> bool:
    """Can `fn` be called with these positional arguments? (True where its signature cannot be read.)"""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def check_env_config(cfg) -> None:
    """env.name at start-up: none, a registered environment, or a file's class; an environment with
    the python tool also needs its sandbox (env.python_sandbox), made here once: fail closed."""
    if "python" in TOOL_ENVIRONMENTS.get(cfg.name, ()):
        get_sandbox(cfg.python_sandbox)
    if cfg.name == "none" or cfg.name in ENVIRONMENTS:
        return
    if split_spec(cfg.name) is None:
        raise ConfigError(f"env.name={cfg.name!r} is not one of {['none', *ENVIRONMENTS.names()]} or a file's class "
                          f"as path/to/file.py:Name")
    load_user_environment(cfg.name)


def build_environment(cfg, tokenizer, use_chat_template: bool = True) -> Optional[Environment]:
    """The configured environment (`cfg` is the `env` config group), or None for env.name=none."""
    if cfg.name == "none":
        return None
    spec = split_spec(cfg.name)
    if spec is not None:  # the user's class: its name labels its errors
        return conversation(load_user_environment(cfg.name), spec[1], cfg, tokenizer, use_chat_template)
    return ENVIRONMENTS.get(cfg.name)(cfg, tokenizer, use_chat_template)
