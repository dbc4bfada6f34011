"""Tools a policy can call: a registry of factories, each building a Tool from the env config.

A tool takes the call's arguments (a dict) and returns the text the policy reads. It raises
ToolError for a bad call (the environment turns it into an observation saying so); any other
exception is caught there too, so a faulty tool never stops the step. A tool that keeps state
within an episode (python with env.python_keep_state) gives each episode its own runner.
"""

from __future__ import annotations

import ast
import operator
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from colo_rl.envs.sandbox import CallResult, Limits, get_sandbox
from colo_rl.registry import Registry


class ToolError(Exception):
    """A call the tool refuses or cannot complete (bad arguments, time limit); its text is the observation."""


@dataclass
class Tool:
    name: str
    description: str
    # JSON schema of the arguments (what a chat template with tools renders); `main_arg` is the one
    # argument a plain-tag call `<name>TEXT</name>` fills.
    parameters: dict[str, Any]
    main_arg: str
    run: Callable[[dict[str, Any]], str] = field(repr=False)
    # A worked use, (argument, result), shown in the prompt's instructions: small models copy it.
    example: tuple[str, str] = ("", "")
    # A fresh runner per episode, for a tool that keeps state between an episode's calls; None: `run`.
    episode_runner: Optional[Callable[[], Callable[[dict[str, Any]], str]]] = field(default=None, repr=False)

    def start_episode(self) -> Callable[[dict[str, Any]], str]:
        return self.episode_runner() if self.episode_runner is not None else self.run

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


TOOLS: Registry[Callable[[Any], Tool]] = Registry("env tool")


ERROR_PREFIX = "error: "  # how the environment shows a failed call to the policy


def truncate(text: str, limit: int) -> str:
    """`text` in at most `limit` characters (the cut's marker included, so a cut text is not cut again
    by a later limit), or the marker alone where `limit` cannot hold it."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(f"...[truncated {len(text)} chars]"))
    return text[:keep] + f"...[truncated {len(text) - keep} chars]"


# ------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 10**64 is plenty; 9**9**9 would take the process down
MAX_MAGNITUDE = 10 ** 100
MAX_EXPRESSION_CHARS = 200


def safe_arithmetic(expression: str) -> int | float:
    """Value of an arithmetic expression over number literals with + - * / // % ** and parentheses,
    walking its syntax tree (never `eval`): names, calls, attributes and everything else are refused."""
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
                raise ToolError("result out of range")
            return out
        raise ToolError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")

    return value(tree.body)


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(round(x, 10)) if isinstance(x, float) else str(x)


@TOOLS.register("calculator")
def calculator(cfg) -> Tool:
    def run(args: dict[str, Any]) -> str:
        expr = args.get("expression")
        if not isinstance(expr, str):
            raise ToolError("calculator needs a string argument 'expression'")
        return format_number(safe_arithmetic(expr))

    return Tool("calculator", "Evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses).",
                {"type": "object", "properties": {"expression": {"type": "string",
                                                                 "description": "e.g. 123 * (45 + 6)"}},
                 "required": ["expression"]}, "expression", run, example=("12 * 34", "408"))


# ------------------------------------------------------------------------- python
def python_limits(cfg) -> Limits:
    return Limits(timeout_s=cfg.tool_timeout_s, memory_mb=cfg.tool_memory_mb, processes=cfg.python_max_processes,
                  output_bytes=cfg.python_output_bytes)


_KILLED_BY = {signal.SIGKILL: "memory, time or process limit", signal.SIGXCPU: "CPU-time limit",
              signal.SIGXFSZ: "file-size limit", signal.SIGSEGV: "crashed, often the memory limit"}


def observation(result: CallResult, limits: Limits, max_output_chars: int) -> str:
    """What the policy reads for a finished call: its output, or a ToolError naming why it failed
    (the exception it raised, after what it printed; the limit it hit)."""
    text = result.output.decode("utf-8", errors="replace").strip()
    error_chars = max_output_chars - len(ERROR_PREFIX)  # a ToolError is shown after the prefix
    if result.stopped == "timeout":
        raise ToolError(f"timed out after {limits.timeout_s:g} s")
    if result.stopped == "output":
        stopped = f"\nstopped: printed more than {limits.output_bytes} bytes"
        raise ToolError(truncate(text, max(0, error_chars - len(stopped))) + stopped)
    if result.stopped == "status":
        raise ToolError("stopped: wrote more than 1 MiB to a file descriptor that is not its output")
    if result.returncode == 0:
        return truncate(text, max_output_chars)
    if result.error is not None:  # keep the exception whole: cut what was printed before it
        printed = truncate(text, max(0, error_chars - len(result.error) - 1)) if text else ""
        raise ToolError(f"{printed}\n{result.error}" if printed else result.error)
    rc = result.returncode
    signum = -rc if rc is not None and rc < 0 else rc - 128 if rc is not None and rc > 128 else None  # bwrap: 128 + n
    if result.oom:
        raise ToolError(f"killed: the call went over its memory limit ({limits.memory_mb} MB)")
    if signum in _KILLED_BY:
        raise ToolError(f"killed by signal {signum} ({_KILLED_BY[signum]})")
    tail = text.splitlines()[-1] if text else ""
    raise ToolError(truncate(tail or f"exit status {result.returncode}", error_chars))


def run_python(code: str, timeout_s: float, memory_mb: int, max_output_chars: int, earlier: Sequence[str] = (),
               sandbox: str = "bwrap", **limits: int) -> str:
    """Run `code` in the python tool's sandbox (colo_rl/envs/sandbox.py: bubblewrap, or none) under a
    wall-clock timeout, memory, process, CPU-time and output limits. `earlier` cells run first in the
    same namespace, their output discarded. Returns its output, cut to `max_output_chars`; raises
    ToolError with the exception (or the limit hit) when it fails."""
    bounds = Limits(timeout_s=timeout_s, memory_mb=memory_mb, **limits)
    return observation(get_sandbox(sandbox).run([*earlier, code], bounds), bounds, max_output_chars)


def _code(args: dict[str, Any]) -> str:
    code = args.get("code")
    if not isinstance(code, str):
        raise ToolError("python needs a string argument 'code'")
    return code


@TOOLS.register("python")
def python(cfg) -> Tool:
    box = get_sandbox(cfg.python_sandbox)  # fails closed at start-up where the sandbox cannot be made
    limits = python_limits(cfg)

    def run(args: dict[str, Any]) -> str:
        return observation(box.run([_code(args)], limits), limits, cfg.max_output_chars)

    def episode_runner() -> Callable[[dict[str, Any]], str]:
        """env.python_keep_state: each call re-runs the episode's earlier successful calls first (a
        fresh sandbox every time, so nothing else leaks between calls or episodes). An earlier call
        that fails when re-run (it read a file it wrote, timing, randomness) is dropped from the
        episode and the observation starts with a note naming it and its error."""
        cells: list[str] = []
        numbers: list[int] = []  # each cell's call number in the episode (failed calls are not cells)
        calls = 0

        def run_in_episode(args: dict[str, Any]) -> str:
            nonlocal calls
            code = _code(args)
            calls += 1
            result = box.run([*cells, code], limits)
            notes = [f"note: earlier call {numbers[k]} failed when re-run ({error}); its state is gone"
                     for k, error in result.replay_failed]
            for k, _ in reversed(result.replay_failed):
                del cells[k], numbers[k]
            try:
                out = observation(result, limits, cfg.max_output_chars)
            except ToolError as e:
                raise ToolError("\n".join([*notes, str(e)])) from None
            cells.append(code)  # only a call that succeeded: a failing one would fail every later one
            numbers.append(calls)
            return "\n".join([*notes, out]) if notes else out

        return run_in_episode

    return Tool("python", "Runs a short Python program and returns what it prints.",
                {"type": "object", "properties": {"code": {"type": "string",
                                                           "description": "e.g. print(123 * 456)"}},
                 "required": ["code"]}, "code", run, example=("print(12 * 34)", "408"),
                episode_runner=episode_runner if cfg.python_keep_state else None)
