"""How a chat template hands the conversation from the policy's turn to a user message and back:
the one place colo_rl writes chat markup into an episode (tool results, environment messages)."""

from __future__ import annotations

import logging
from typing import Optional

from colo_rl.errors import ConfigError

log = logging.getLogger("colo_rl")

# ChatML (SmolLM2, Qwen), for callers without a tokenizer.
CHATML_USER = "<|im_end|>\n<|im_start|>user\n"
CHATML_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"

# Sentinels: no whitespace or markup, so templates that `|trim` messages (Llama 3, Gemma) keep them.
_ASSISTANT, _USER = "COLORLASSISTANTTURN7F3A", "COLORLUSERTURN7F3A"


class UserTurns:
    """The text that follows a policy turn to hand the conversation back to the user with a new
    message and open the next assistant turn, as the chat template writes it: read off one
    rendered conversation (ChatML, Llama 3, Gemma, Mistral, ...). `tokenizer=None`: ChatML."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        if tokenizer is None:
            self.close_and_open, self.after = CHATML_USER, CHATML_ASSISTANT
            return
        if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
            self.close_and_open, self.after = "\n", "\n"
            return
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT},
                        {"role": "user", "content": _USER}]
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if text.count(_ASSISTANT) != 1 or text.count(_USER) != 1:
            raise ConfigError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} does not write an "
                              f"assistant turn followed by a user turn as given, so tool results and environment "
                              f"messages cannot be written with it; set data.use_chat_template=false")
        tail = text[text.index(_ASSISTANT) + len(_ASSISTANT):]
        self.close_and_open, self.after = tail.split(_USER)
        self._warn_if_earlier_turns_change(tokenizer)

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

    def message(self, text: str, end_token: Optional[str]) -> str:
        """`end_token`: the text of the EOS token the policy's turn ended with (None: it did not). The
        template's own end of turn is left out when the turn already ends with it."""
        head = self.close_and_open
        if end_token and head.startswith(end_token):
            head = head[len(end_token):]
        return head + text + self.after
