"""Tools a policy can call: a registry of factories, each building a Tool from the env config.

A tool takes the call's arguments (a dict) and returns the text the policy reads. It raises
ToolError for a bad call (the environment turns it into an observation saying so); any other
exception is caught there too, so a faulty tool never stops the step. A tool that keeps state
within an episode (python with env.python_keep_state) gives each episode its own runner.
"""

from __future__ import annotations

import ast
import operator
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

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


def truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"...[truncated {len(text) - limit} chars]"


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
def _unshare_works() -> bool:
    """Can this machine run a command in a fresh network namespace without root (user namespaces)?"""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_NO_NETWORK: list[bool] = []  # probed once per process


def network_isolated() -> bool:
    if not _NO_NETWORK:
        _NO_NETWORK.append(_unshare_works())
    return _NO_NETWORK[0]


# Set in the child interpreter before the tool's code runs (not in a preexec_fn: that is unsafe in a
# process with threads, and the rollout runs tools from a thread pool next to torch's threads).
# Earlier cells (env.python_keep_state) run first in the same namespace, their output discarded.
_PRELUDE = """import resource, sys
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
import contextlib, io, json
cells = json.loads(sys.argv[3])
del sys.argv[1:], mem, cpu, resource
scope = {"__name__": "__main__"}
for k, cell in enumerate(cells[:-1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(cell, f"<earlier call {k + 1}>", "exec"), scope)
        except SystemExit:  # it ended its own call early; the calls after it still run
            pass
exec(compile(cells[-1], "<tool>", "exec"), scope)
"""


def run_python(code: str, timeout_s: float, memory_mb: int, max_output_chars: int,
               earlier: Sequence[str] = ()) -> str:
    """Run `code` in a fresh, isolated interpreter (`python -I -S`, empty environment, its own
    temporary working directory and session) under address-space, CPU-time and file-size limits and
    a wall-clock timeout; no network where user namespaces allow (`unshare -rn`; otherwise sockets
    still work: a documented limitation). `earlier` cells run first in the same namespace, their
    output discarded (within the same limits). Returns stdout (+ stderr), cut to `max_output_chars`."""
    import json
    import tempfile

    cells = json.dumps([*earlier, code])
    cmd = [sys.executable, "-I", "-S", "-c", _PRELUDE, str(memory_mb << 20), str(max(1, int(timeout_s + 1))), cells]
    if network_isolated():
        cmd = ["unshare", "-rn", *cmd]
    with tempfile.TemporaryDirectory(prefix="colo_rl_py_") as cwd:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=cwd, env={"PATH": "/usr/bin:/bin", "HOME": cwd}, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: whatever it spawned goes too
            proc.communicate()
            raise ToolError(f"timed out after {timeout_s:g} s") from None
    text = out.decode("utf-8", errors="replace").strip()
    if proc.returncode != 0:
        tail = text.splitlines()[-1] if text else f"exit status {proc.returncode}"
        if proc.returncode < 0:
            tail = f"killed by signal {-proc.returncode} (time or memory limit)"
        raise ToolError(truncate(tail, max_output_chars))
    return truncate(text, max_output_chars)


def _code(args: dict[str, Any]) -> str:
    code = args.get("code")
    if not isinstance(code, str):
        raise ToolError("python needs a string argument 'code'")
    return code


@TOOLS.register("python")
def python(cfg) -> Tool:
    def run(args: dict[str, Any]) -> str:
        return run_python(_code(args), cfg.tool_timeout_s, cfg.tool_memory_mb, cfg.max_output_chars)

    def episode_runner() -> Callable[[dict[str, Any]], str]:
        """env.python_keep_state: each call re-runs the episode's earlier successful calls first (a
        fresh process every time, so nothing else leaks between calls or episodes)."""
        cells: list[str] = []

        def run_in_episode(args: dict[str, Any]) -> str:
            code = _code(args)
            out = run_python(code, cfg.tool_timeout_s, cfg.tool_memory_mb, cfg.max_output_chars, earlier=cells)
            cells.append(code)  # only a call that succeeded: a failing one raised ToolError above
            return out

        return run_in_episode

    return Tool("python", "Runs a short Python program and returns what it prints.",
                {"type": "object", "properties": {"code": {"type": "string",
                                                           "description": "e.g. print(123 * 456)"}},
                 "required": ["code"]}, "code", run, example=("print(12 * 34)", "408"),
                episode_runner=episode_runner if cfg.python_keep_state else None)
