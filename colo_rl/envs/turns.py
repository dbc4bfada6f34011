"""How a chat template hands the conversation from the policy's turn to a user message and back:
the one place colo_rl writes chat markup into an episode (tool results, environment messages)."""

from __future__ import annotations

import logging
from typing import Optional

from colo_rl.errors import ConfigError

log = logging.getLogger("colo_rl")

# ChatML (SmolLM2, Qwen), for callers without a tokenizer.
CHATML_TURN = "<|im_end|>\n<|im_start|>{role}\n"
CHATML_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"

# Sentinels: no whitespace or markup, so templates that `|trim` messages (Llama 3, Gemma) keep them.
_ASSISTANT, _USER = "COLORLASSISTANTTURN7F3A", "COLORLUSERTURN7F3A"


class UserTurns:
    """The text that follows a policy turn to hand the conversation back with a new message (the
    user's, or a tool's with role="tool") and open the next assistant turn, as the chat template
    writes it: the template renders each message (ChatML, Llama 3, Gemma, Mistral, ...).
    `tokenizer=None`: ChatML."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        self.tokenizer = None
        if tokenizer is None:
            self.close_and_open, self.after = CHATML_TURN, CHATML_ASSISTANT
            return
        if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
            self.close_and_open, self.after = "\n", "\n"
            return
        self.tokenizer = tokenizer
        self.check_role("user")
        self._warn_if_earlier_turns_change(tokenizer)

    def check_role(self, role: str) -> None:
        """Refuse, naming the fix, a template that cannot write a `role` message after an assistant turn."""
        if self.tokenizer is None:
            return
        try:
            tail = self._tail(role, _USER)
        except Exception as e:  # noqa: BLE001 - a template that raises on the role (Gemma: user/assistant only)
            tail = f"{type(e).__name__}: {e}"
        if tail.count(_USER) != 1:
            fix = "set data.use_chat_template=false" if role == "user" else "set env.format=json or env.format=tags"
            raise ConfigError(f"the chat template of {getattr(self.tokenizer, 'name_or_path', '?')!r} does not write an "
                              f"assistant turn followed by a {role} turn as given, so "
                              f"{'environment messages' if role == 'user' else 'tool results'} cannot be written "
                              f"with it ({tail[:200]!r}); {fix}")

    def _tail(self, role: str, content: str) -> str:
        """What the template writes after an assistant turn's text: its close, the `role` message, and
        the next assistant header."""
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT},
                        {"role": role, "content": content}]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if text.count(_ASSISTANT) != 1:
            return text  # refused by check_role
        return text[text.index(_ASSISTANT) + len(_ASSISTANT):]

    def _warn_if_earlier_turns_change(self, tokenizer) -> None:
        """An episode keeps the tokens the policy saw; a template that writes earlier turns
        differently once the conversation goes on (Mistral v0.3 moves the system prompt into the
        last user turn) would render the same messages otherwise. Not wrong for training (the
        trainer scores what the engine saw), but worth knowing."""
        start = [{"role": "system", "content": "S"}, {"role": "user", "content": "?"}]
        try:
            prompt = tokenizer.apply_chat_template(start, tokenize=False, add_generation_prompt=True)
            full = tokenizer.apply_chat_template(start + [{"role": "assistant", "content": _ASSISTANT},
                                                          {"role": "user", "content": _USER}],
                                                 tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template without system messages (Gemma): nothing to compare
            return
        if not full.startswith(prompt):
            log.warning("the chat template of %r writes earlier turns differently once a conversation goes on (e.g. "
                        "it moves the system prompt): multi-turn episodes keep what the policy saw at each turn",
                        getattr(tokenizer, "name_or_path", "?"))

    def message(self, text: str, end_token: Optional[str], role: str = "user") -> str:
        """`end_token`: the text of the EOS token the policy's turn ended with (None: it did not). The
        template's own end of turn is left out when the turn already ends with it."""
        if self.tokenizer is not None:
            tail = self._tail(role, text)
        else:
            tail = self.close_and_open.format(role=role) + text + self.after
        if end_token and tail.startswith(end_token):
            tail = tail[len(end_token):]
        return tail
