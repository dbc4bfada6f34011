"""How a chat template hands the conversation from the policy's turn to a user message and back:
the one place colo_rl writes chat markup into an episode (tool results, environment messages)."""

from __future__ import annotations

from colo_rl.errors import ConfigError

# ChatML (SmolLM2, Qwen), for callers without a tokenizer.
CHATML_END = "<|im_end|>"
CHATML_USER = "<|im_end|>\n<|im_start|>user\n"
CHATML_ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"

_ASSISTANT, _USER = "\x1fCOLO_RL_ASSISTANT\x1f", "\x1fCOLO_RL_USER\x1f"  # sentinels, never in real text


class UserTurns:
    """The text that follows a policy turn to hand the conversation back to the user with a new
    message and open the next assistant turn, as the chat template writes it (read off one
    rendered conversation, so any template works: ChatML, Llama 3, ...). `tokenizer=None`: ChatML."""

    def __init__(self, tokenizer, use_chat_template: bool = True):
        if tokenizer is None:
            self.eos, self.close_and_open, self.after = CHATML_END, CHATML_USER, CHATML_ASSISTANT
            return
        template = getattr(tokenizer, "chat_template", None)
        self.eos = getattr(tokenizer, "eos_token", None)
        if not (use_chat_template and template):
            self.close_and_open, self.after = "\n", "\n"
            return
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ASSISTANT},
             {"role": "user", "content": _USER}], tokenize=False, add_generation_prompt=True)
        if text.count(_ASSISTANT) != 1 or text.count(_USER) != 1:
            raise ConfigError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} does not write an "
                              f"assistant turn followed by a user turn as given, so tool results and environment "
                              f"messages cannot be written with it; set data.use_chat_template=false")
        tail = text[text.index(_ASSISTANT) + len(_ASSISTANT):]
        self.close_and_open, self.after = tail.split(_USER)

    def message(self, text: str, turn_closed: bool) -> str:
        """`turn_closed`: the policy's turn already ends with its EOS (the template's end of turn)."""
        head = self.close_and_open
        if turn_closed and self.eos and head.startswith(self.eos):
            head = head[len(self.eos):]
        return head + text + self.after
