"""Tool-call formats: how a policy writes a call and how the result comes back, parsed and
formatted in one place.

- `json`: the format chat templates with tools declare (Qwen / Hermes): the assistant writes
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, ends its message, and the result
  comes back as a user turn `<tool_response>...</tool_response>`, then a new assistant turn.
- `tags`: for templates without tools (SmolLM2): the call is inline, `<calculator>12*34</calculator>`,
  and the result follows inline, `<result>408</result>`, inside the same assistant message.
- `llama`: Llama 3.1 / 3.2 / 3.3's own JSON calls: the assistant's message is the call alone,
  `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` at times), ended by EOS, and the result
  comes back as the template's tool message (an `ipython` turn). `<|python_tag|>` followed by code
  (Llama's code interpreter, which its template announces as "Environment: ipython") is a call of
  the `python` tool.

A policy turn ends at its first complete call (the driver cuts what was sampled after it, so the
policy never writes its own "result") or at EOS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from colo_rl.envs.tools import Tool
from colo_rl.envs.turns import UserTurns


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """What a policy turn asked for: a call, a malformed call (`error` says why), or nothing.
    `end`: the character offset just past the call's closing tag, where the driver cuts the turn
    (None when no call was opened, or when a call fills the turn: it is kept whole, its EOS too)."""

    call: Optional[ToolCall] = None
    error: Optional[str] = None
    end: Optional[int] = None

    @property
    def wants_tool(self) -> bool:
        return self.call is not None or self.error is not None


def _why(error: Exception) -> str:
    return error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply"


class JsonCallFormat:
    name = "json"
    template_writes_tools = True  # the chat template may declare the tools itself (its `tools` argument)
    reads_special: tuple[str, ...] = ()  # special tokens a call is told by (kept in the turn text parse reads)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: dict[str, Tool], turns: Optional[UserTurns] = None):
        self.tools = tools
        self.turns = turns or UserTurns(None)  # how the chat template writes a user turn (default ChatML)

    def instructions(self) -> str:
        """Used only when the chat template cannot render tools itself."""
        specs = "\n".join(json.dumps(t.schema()["function"]) for t in self.tools.values())
        return (f"You can call these tools:\n{specs}\nTo call one, write {self.OPEN}{{\"name\": NAME, \"arguments\": "
                f"{{...}}}}{self.CLOSE}; its result comes back in <tool_response></tool_response>.")

    def stop_strings(self) -> tuple[str, ...]:
        return (self.CLOSE,)

    def parse(self, text: str) -> ParsedTurn:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedTurn()
        stop = text.find(self.CLOSE, start)
        if stop < 0:
            return ParsedTurn(error=f"unterminated {self.OPEN}: close the call with {self.CLOSE}")
        end = stop + len(self.CLOSE)
        body = text[start + len(self.OPEN):stop].strip()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as e:
            return ParsedTurn(error=f"the call is not valid JSON ({_why(e)})", end=end)
        return self._call(obj, "arguments", end)

    def _call(self, obj: Any, args_key: str, end: Optional[int]) -> ParsedTurn:
        """A decoded call object: {"name": ..., args_key: {...}} naming a known tool."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedTurn(error='the call must be a JSON object with a "name"', end=end)
        args = obj.get(args_key, {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                pass
        if not isinstance(args, dict):
            return ParsedTurn(error=f'"{args_key}" must be a JSON object', end=end)
        return self._known(ToolCall(obj["name"], args), end)

    def _known(self, call: ToolCall, end: int) -> ParsedTurn:
        if call.name not in self.tools:
            return ParsedTurn(error=f"unknown tool {call.name!r}; available: {sorted(self.tools)}", end=end)
        return ParsedTurn(call=call, end=end)

    def observation(self, result: str, end_token: Optional[str]) -> str:
        """Text appended after the policy's turn: close its message (unless it ended with EOS: its
        text is `end_token`), the result as a user message, and the next assistant header, as the
        chat template writes them."""
        return self.turns.message(f"<tool_response>\n{result}\n</tool_response>", end_token)


class TagCallFormat(JsonCallFormat):
    name = "tags"
    template_writes_tools = False
    _OPEN = re.compile(r"<([A-Za-z_][\w-]*)>")
    # Tags a policy writes in prose, never a call: reasoning blocks (<think>), HTML emphasis. Any other
    # unknown tag is a call of a tool that does not exist, and the policy is told so.
    PROSE_TAGS = frozenset({"result", "think", "thinking", "reasoning", "answer", "b", "i", "u", "s", "em", "strong",
                            "code", "pre", "br", "p", "sub", "sup", "li", "ul", "ol"})

    def instructions(self) -> str:
        uses = " or ".join(f"<{t.name}>{t.main_arg.upper()}</{t.name}>" for t in self.tools.values())
        examples = " ".join(f"<{t.name}>{t.example[0]}</{t.name}><result>{t.example[1]}</result>"
                            for t in self.tools.values())
        return f"To use a tool, write {uses}; its result follows in <result></result>. Example: {examples}"

    def stop_strings(self) -> tuple[str, ...]:
        """The known tools' closing tags (a call of an unknown tool runs on to EOS; it is cut all the same)."""
        return tuple(f"</{name}>" for name in self.tools)

    def parse(self, text: str) -> ParsedTurn:
        for m in self._OPEN.finditer(text):
            name = m.group(1)
            if name.lower() in self.PROSE_TAGS and name not in self.tools:  # HTML's case: <B>, <Think>
                continue
            close = f"</{name}>"
            stop = text.find(close, m.end())
            if name not in self.tools:
                end = stop + len(close) if stop >= 0 else None
                return ParsedTurn(error=f"unknown tool <{name}>; available: {sorted(self.tools)}", end=end)
            if stop < 0:
                return ParsedTurn(error=f"unterminated <{name}>: close the call with {close}")
            arg = text[m.end():stop]
            return self._known(ToolCall(name, {self.tools[name].main_arg: arg}), stop + len(close))
        return ParsedTurn()

    def demonstration(self) -> list[dict[str, str]]:
        """One worked exchange that uses the first tool, put before the problem: a small model
        without tool training copies a shown answer far more often than it follows a description."""
        t = next(iter(self.tools.values()))
        question = "What is 12 * 34?" if t.name == "calculator" else f"Use the {t.name} tool: what is 12 * 34?"
        return [{"role": "user", "content": f"{question}\n{self.instructions()}"},
                {"role": "assistant", "content": f"<{t.name}>{t.example[0]}</{t.name}><result>{t.example[1]}</result> "
                                                 f"The answer is {t.example[1]}."}]

    def observation(self, result: str, end_token: Optional[str]) -> str:
        if end_token is not None:  # the message ended with EOS after the call: the result opens a new exchange
            return self.turns.message(f"<result>{result}</result>", end_token)
        return f"<result>{result}</result>"


class LlamaCallFormat(JsonCallFormat):
    """Llama 3.1+'s custom tools: the call is the whole message, so nothing marks where it closes
    (no stop string); the turn ends at EOS, which stays the policy's own token."""

    name = "llama"
    PYTHON_TAG = "<|python_tag|>"
    reads_special = (PYTHON_TAG,)
    _BEFORE_CALL = re.compile(r"\s*(?:<\|python_tag\|>\s*)?")  # whitespace, then Llama's code-call tag at times
    _AFTER_CALL = re.compile(r"(?:\s|<\|[\w.-]+\|>)*")  # whitespace and special tokens (EOS) only
    _LAST_SPECIAL = re.compile(r"<\|[\w.-]+\|>\Z")
    _BUILT_IN = re.compile(r"\s*(brave_search|wolfram_alpha|photogen)\.call\(")  # Llama's other built-ins

    def __init__(self, tools: dict[str, Tool], turns: Optional[UserTurns] = None):
        super().__init__(tools, turns)
        self.turns.check_role("tool")

    def instructions(self) -> str:
        specs = "\n".join(json.dumps(t.schema()["function"]) for t in self.tools.values())
        return (f"You can call these functions:\n{specs}\nTo call one, respond with only the JSON "
                f'{{"name": function name, "parameters": {{argument name: value}}}}; its result comes back '
                f"in the next message.")

    def stop_strings(self) -> tuple[str, ...]:
        return ()

    def parse(self, text: str) -> ParsedTurn:
        start = self._BEFORE_CALL.match(text).end()
        if not text.startswith("{", start):
            if self.PYTHON_TAG in text[:start]:  # the code interpreter: the code itself, up to EOS
                return self._code_call(self._without_trailer(text[start:]))
            return ParsedTurn()  # an answer, not a call
        try:
            obj, end = json.JSONDecoder().raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError) as e:  # cut short, or not JSON after all: the turn runs to its end
            return ParsedTurn(error=f"the call is not valid JSON ({_why(e)})")
        keep_whole = self._AFTER_CALL.fullmatch(text, end) is not None  # the call fills the turn, EOS included
        args_key = "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters"
        return self._call(obj, args_key, None if keep_whole else end)

    @classmethod
    def _without_trailer(cls, text: str) -> str:
        r"""`text` without the whitespace and special tokens (EOS) ending it. Peeled from the end: a
        pattern anchored at the end (`(\s|<|..|>)*\Z`) retried at every position of a long run of
        spaces, quadratic in its length, on the rollout's thread."""
        while True:
            text = text.rstrip()
            m = cls._LAST_SPECIAL.search(text, max(0, text.rfind("<|")))
            if m is None:
                return text
            text = text[:m.start()]

    def _code_call(self, code: str) -> ParsedTurn:
        python = self.tools.get("python")
        built_in = self._BUILT_IN.match(code)
        if built_in:
            return ParsedTurn(error=f"the built-in tool {built_in.group(1)} is not offered here; call one of "
                                    f'{sorted(self.tools)} with {{"name": ..., "parameters": {{...}}}}')
        if python is None:
            return ParsedTurn(error=f"{self.PYTHON_TAG} starts code for a Python interpreter, which is not "
                                    f'offered here; call a tool with {{"name": ..., "parameters": {{...}}}}: '
                                    f"{sorted(self.tools)}")
        if not code.strip():
            return ParsedTurn(error=f"no code after {self.PYTHON_TAG}")
        return ParsedTurn(call=ToolCall("python", {python.main_arg: code}))  # the turn is kept whole, EOS too

    def observation(self, result: str, end_token: Optional[str]) -> str:
        if end_token == "<|eom_id|>":  # Llama's "end of message, a tool answers next" closes it as <|eot_id|> does
            end_token = "<|eot_id|>"
        return self.turns.message(result, end_token, role="tool")


FORMATS = {"json": JsonCallFormat, "tags": TagCallFormat, "llama": LlamaCallFormat}


def template_declares_tools(chat_template: Optional[str]) -> bool:
    """Does the tokenizer's chat template render a `tools` list (Qwen, Hermes, Llama 3.1 ...)?"""
    return bool(chat_template) and "tools" in chat_template


def choose_format(name: str, chat_template: Optional[str], tools: dict[str, Tool],
                  turns: Optional[UserTurns] = None) -> JsonCallFormat:
    """env.format: auto = llama where the template declares tools and an `ipython` role (Llama 3.1+),
    json where it declares tools otherwise (Qwen, Hermes), tags where it declares none."""
    if name == "auto":
        if not template_declares_tools(chat_template):
            name = "tags"
        else:
            name = "llama" if "ipython" in chat_template else "json"
    return FORMATS[name](tools, turns)
