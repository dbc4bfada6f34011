"""Tool-call formats: how a policy writes a call and how the result comes back, parsed and
formatted in one place.

- `json`: the format chat templates with tools declare (Qwen / Hermes): the assistant writes
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, ends its message, and the result
  comes back as a user turn `<tool_response>...</tool_response>`, then a new assistant turn.
- `tags`: for templates without tools (SmolLM2): the call is inline, `<calculator>12*34</calculator>`,
  and the result follows inline, `<result>408</result>`, inside the same assistant message.

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
    `end`: the character offset just past the call's closing tag (None when no call was opened)."""

    call: Optional[ToolCall] = None
    error: Optional[str] = None
    end: Optional[int] = None

    @property
    def wants_tool(self) -> bool:
        return self.call is not None or self.error is not None


class JsonCallFormat:
    name = "json"
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
        except json.JSONDecodeError as e:
            return ParsedTurn(error=f"the call is not valid JSON ({e.msg})", end=end)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedTurn(error='the call must be a JSON object with a "name"', end=end)
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return ParsedTurn(error='"arguments" must be a JSON object', end=end)
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
    _OPEN = re.compile(r"<([A-Za-z_][\w-]*)>")

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
            if name == "result":
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


FORMATS = {"json": JsonCallFormat, "tags": TagCallFormat}


def template_declares_tools(chat_template: Optional[str]) -> bool:
    """Does the tokenizer's chat template render a `tools` list (Qwen, Hermes, Llama 3.1 ...)?"""
    return bool(chat_template) and "tools" in chat_template


def choose_format(name: str, chat_template: Optional[str], tools: dict[str, Tool],
                  turns: Optional[UserTurns] = None) -> JsonCallFormat:
    """env.format: auto = json where the template declares tools, tags otherwise."""
    if name == "auto":
        name = "json" if template_declares_tools(chat_template) else "tags"
    return FORMATS[name](tools, turns)
