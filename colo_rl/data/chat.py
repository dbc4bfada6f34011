"""Conversations to token ids with a loss mask, and the over-length policy (shared by SFT and DPO).

A conversation is rendered with the tokenizer's chat template and cut into segments at the
assistant turns that are trained on. Each segment is tokenised on its own, so every boundary is a
token boundary and the prompt segment is exactly what `PromptBuilder` gives the rollout engine
(the model trains on the tokens it is later prompted with). The loss covers each trained
assistant turn up to and including its end-of-turn token; whitespace after it does not count.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from colo_rl.data.files import DataError, Record, answer_text, blank_lines_skipped, read_records, wrong_type

log = logging.getLogger("colo_rl")

T = TypeVar("T")

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Encoded:
    """prompt_ids: everything before the first trained token; responses: (ids, mask) per response."""

    prompt_ids: list[int]
    responses: list[tuple[list[int], list[int]]]


@dataclass
class LengthStats:
    """What the over-length policy did, and the blank lines reading data.path skipped; reported by
    the recipes with the number of examples."""

    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    dropped_origins: list[str] = field(default_factory=list)
    blank_lines: int = 0  # of data.path, skipped by read_records

    def summary(self) -> str:
        text = f"{self.kept} kept, {self.truncated} truncated, {self.dropped} dropped as over-length"
        if self.dropped_origins:
            text += f" (first: {', '.join(self.dropped_origins[:3])})"
        return text + (f"; {blank_lines_skipped(self.blank_lines)} in data.path" if self.blank_lines else "")


def check_messages(messages: Any, origin: str, key: str) -> list[dict[str, Any]]:
    """A list of {role, content, ...} dicts with text content, or a DataError naming the record, key
    and message."""
    expected = "it must be a non-empty list of {role, content} messages" + ("" if key == "messages" else " or a string")
    if not isinstance(messages, list):
        raise wrong_type(origin, key, messages, expected)
    if not messages:
        raise DataError(f"{origin}: key {key!r} is an empty list; {expected}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{origin}: {key}[{i}] must be an object with 'role' and 'content'")
        for k in ("role", "content"):
            if m.get(k) is None and not (k == "content" and m.get("tool_calls")):  # a call alone has no content
                raise DataError(f"{origin}: {key}[{i}] is missing key {k!r}")
        if m["role"] not in ROLES:
            raise DataError(f"{origin}: {key}[{i}] has role {m['role']!r}; use one of {list(ROLES)}")
    # other keys (tool_calls, name, tool_call_id) reach the chat template as they are
    return [{**m, "content": None if m.get("content") is None else content_text(m["content"], origin, f"{key}[{i}]")}
            for i, m in enumerate(messages)]


def content_text(content: Any, origin: str, where: str) -> str:
    """A message's content as text: a string (or a number), or OpenAI-style text parts joined; any
    other part (an image) is refused, never trained on as its Python repr."""
    if isinstance(content, str):
        return content
    if isinstance(content, (int, float)) and not isinstance(content, bool):
        return str(content)
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise DataError(f"{origin}: {where}.content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                    f"parts, not {str(content)[:80]!r}; colo_rl trains on text only")


def require_chat_template(tokenizer, data_cfg) -> None:
    """data.use_chat_template=true needs a tokenizer that has one (GRPO prompts, SFT / DPO records)."""
    if data_cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the tokenizer at {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template, but "
            "data.use_chat_template=true: set data.use_chat_template=false (plain strings), or use a model "
            "directory whose tokenizer_config.json / chat_template.jinja defines one")


def user_turn(content: str, system_prompt: Optional[str]) -> list[dict[str, str]]:
    """A string prompt as messages: the user turn, after data.system_prompt when one is set."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": content}]


def leading_specials(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text of its own accord (Llama's and Gemma's
    BOS; none for GPT-2, Qwen or SmolLM2): what a plain-text prompt starts with, as the model was
    trained, and what cutting a prompt's start keeps. A chat template writes its own (`bos_token`)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return full[:k]
    return []


def keep_end(ids: list[int], limit: int, head: list[int]) -> list[int]:
    """The last `limit` tokens of an over-long prompt (its question and generation prompt), after
    `head` (`leading_specials`) when the prompt starts with it: a Llama prompt keeps its BOS."""
    if not head or ids[:len(head)] != head or limit <= len(head):
        return ids[-limit:]
    return head + ids[len(head) - limit:]


def render_chat(tokenizer, messages: list[dict[str, str]], generation_prompt: bool, origin: str,
                **template_kwargs: Any) -> str:
    """The chat template's text for `messages`; a template that refuses them (a role order it does
    not allow, a missing variable) is a DataError naming the record."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                             **template_kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors: say which record
        tools = ", the environment's tool definitions" if template_kwargs else ""
        raise DataError(f"{origin}: the chat template cannot render this conversation ({e}); check the record's "
                        f"messages (roles, order){tools}, or use another template") from None


class ChatEncoder:
    """Token ids + loss masks for prompt/response records, with or without a chat template."""

    def __init__(self, tokenizer, data_cfg):
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        require_chat_template(tokenizer, data_cfg)
        self.head = leading_specials(tokenizer)

    # ------------------------------------------------------------------ building conversations
    def prompt_messages(self, prompt: Any, origin: str, key: str = "prompt") -> list[dict[str, str]]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"{origin}: key {key!r} is empty")
            return user_turn(prompt, self.cfg.system_prompt)
        return check_messages(prompt, origin, key)

    @staticmethod
    def response_messages(response: Any, origin: str, key: str) -> list[dict[str, str]]:
        if isinstance(response, str):
            if not response.strip():
                raise DataError(f"{origin}: key {key!r} is empty")
            return [{"role": "assistant", "content": response}]
        msgs = check_messages(response, origin, key)
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{origin}: key {key!r} has no assistant message to train on")
        return msgs

    # ------------------------------------------------------------------ rendering
    def _template(self, messages: list[dict[str, str]], generation_prompt: bool, origin: str) -> str:
        return render_chat(self.tokenizer, messages, generation_prompt, origin)

    def segments(self, messages: list[dict[str, str]], train_from: int, origin: str) -> list[tuple[str, bool]]:
        """(text, trained) segments whose concatenation is the rendered conversation; assistant
        turns at index >= train_from are trained."""
        full = self._template(messages, False, origin)
        out: list[tuple[str, bool]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < train_from:
                continue
            start = self._template(messages[:i], True, origin) if i else ""
            end = self._template(messages[:i + 1], False, origin)
            if not (end.startswith(start) and full.startswith(end) and len(start) >= cursor):
                raise DataError(f"{origin}: the chat template does not render turn {i} as a prefix of the whole "
                                "conversation, so its tokens cannot be located; use single-turn records or "
                                "another template")
            body = end[len(start):].rstrip()
            out.append((full[cursor:len(start)], False))
            out.append((body, True))
            cursor = len(start) + len(body)
        if not any(trained for _, trained in out):
            raise DataError(f"{origin}: no assistant turn to train on")
        out.append((full[cursor:], False))
        return [(t, trained) for t, trained in out if t]

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_conversation(self, messages: list[dict[str, str]], origin: str) -> Encoded:
        """SFT `messages`: loss on every assistant turn; the prompt is what precedes the first."""
        if not self.cfg.use_chat_template:
            raise DataError(f"{origin}: 'messages' records need a chat template (data.use_chat_template=true)")
        if messages and messages[0]["role"] == "assistant":
            raise DataError(f"{origin}: the conversation opens with an assistant turn: nothing precedes its first "
                            f"token to predict it from. Start it with a system or user message")
        segs = self.segments(messages, 0, origin)
        first = next(i for i, (_, trained) in enumerate(segs) if trained)
        prompt = [t for text, _ in segs[:first] for t in self._ids(text)]
        ids, mask = self._tokens(segs[first:])
        return Encoded(prompt, [(ids, mask)])

    def encode_pair(self, prompt: Any, responses: list[tuple[str, Any]], origin: str) -> Encoded:
        """A prompt (string or messages) and one or more responses (string or messages), each
        `(key, value)`: SFT prompt/completion, DPO prompt/chosen/rejected. Every response shares
        the prompt's tokens."""
        if not self.cfg.use_chat_template:
            for key, value in [("prompt", prompt), *responses]:
                if isinstance(value, list):
                    raise DataError(f"{origin}: key {key!r} is a message list; message lists need a chat template: "
                                    f"set data.use_chat_template=true, or write it as a string")
                if not isinstance(value, str):  # a number's text would be trained on as the prompt or response
                    raise wrong_type(origin, key, value, "it must be a string (or, with data.use_chat_template=true, "
                                                         "a list of {role, content} messages)")
            if not prompt.strip():
                raise DataError(f"{origin}: the prompt is empty: nothing precedes the response's first token to "
                                f"predict it from; fill it in or remove the record")
            eos = self.tokenizer.eos_token or ""
            out = []
            for key, r in responses:
                if not r.strip():
                    raise DataError(f"{origin}: key {key!r} is empty")
                ids = self._ids(r + eos)
                out.append((ids, [1] * len(ids)))
            # as GRPO's and the evaluation's plain prompts (PromptBuilder.text): the model trains on the
            # text it is later prompted with, data.system_prompt included
            text = "\n".join(m["content"] for m in user_turn(prompt, self.cfg.system_prompt)) + "\n"
            return Encoded(self.head + self._ids(text), out)
        p_msgs = self.prompt_messages(prompt, origin)
        prompt_text = self._template(p_msgs, True, origin)
        prompt_ids = self._ids(prompt_text)
        out = []
        for key, r in responses:
            segs = self.segments(p_msgs + self.response_messages(r, origin, key), len(p_msgs), origin)
            if segs[0][0] != prompt_text:
                raise DataError(f"{origin}: the chat template renders the prompt differently once {key!r} is "
                                "appended; its tokens cannot be located")
            out.append(self._tokens(segs[1:]))
        return Encoded(prompt_ids, out)

    def _tokens(self, segs: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        for text, trained in segs:
            t = self._ids(text)
            ids += t
            mask += [int(trained)] * len(t)
        return ids, mask


def apply_length_policy(enc: Encoded, data_cfg, stats: LengthStats, origin: str,
                        head: Optional[list[int]] = None) -> Optional[Encoded]:
    """data.overlong_policy on prompt (> data.max_prompt_tokens: keep its end, after `head`, its
    leading specials) and prompt + response (> data.max_seq_len: cut the response's end). `drop`
    drops the example, `error` raises; an example left with no trained token is dropped. Updates
    `stats`."""
    max_prompt, max_seq = data_cfg.max_prompt_tokens, data_cfg.max_seq_len
    longest = max(len(ids) for ids, _ in enc.responses)
    too_long = len(enc.prompt_ids) > max_prompt or len(enc.prompt_ids) + longest > max_seq
    if not too_long:
        stats.kept += 1
        return enc
    if data_cfg.overlong_policy == "error":
        raise DataError(f"{origin}: {len(enc.prompt_ids)} prompt + {longest} response tokens exceed "
                        f"data.max_prompt_tokens={max_prompt} / data.max_seq_len={max_seq}; raise the limits "
                        "or set data.overlong_policy=drop|truncate")
    if data_cfg.overlong_policy == "drop":
        stats.dropped += 1
        stats.dropped_origins.append(origin)
        return None
    prompt = keep_end(enc.prompt_ids, max_prompt, head or []) if len(enc.prompt_ids) > max_prompt else enc.prompt_ids
    room = max_seq - len(prompt)
    responses = [(ids[:room], mask[:room]) for ids, mask in enc.responses]
    if room <= 0 or any(sum(mask) == 0 for _, mask in responses):
        stats.dropped += 1
        stats.dropped_origins.append(origin)
        return None
    stats.truncated += 1
    return Encoded(prompt, responses)


def split_records(records: list[Record], data_cfg) -> tuple[list[Record], list[Record]]:
    """Seeded held-out split of a user file (data.eval_size records); the rest is trained on, or
    data.train_size of it (the same records GRPO's `load_problems` picks), in the file's order."""
    if data_cfg.eval_size and len(records) <= data_cfg.eval_size:
        raise DataError(f"data.path={data_cfg.path!r} has {len(records)} records, not more than "
                        f"data.eval_size={data_cfg.eval_size}; lower data.eval_size (e.g. "
                        f"data.eval_size={max(1, len(records) // 5)}, a fifth held out), or data.eval_size=0 for no "
                        f"held-out evaluation")
    order = list(range(len(records)))
    random.Random(data_cfg.split_seed).shuffle(order)
    held = [records[i] for i in order[:data_cfg.eval_size]]
    rest = order[data_cfg.eval_size:]
    train = [records[i] for i in sorted(rest[: data_cfg.train_size or None])]
    if len(train) < len(rest):
        log.warning("data.path=%s: %d of %d records trained on (data.train_size=%d; data.train_size=null trains "
                    "on every record)", data_cfg.path, len(train), len(rest), data_cfg.train_size)
    return train, held


def encode_splits(tokenizer, data_cfg, embedded: Callable[[Any], tuple[list[Record], list[Record]]],
                  encode_record: Callable[[Record, "ChatEncoder"], Encoded],
                  make: Callable[[str, Encoded, Optional[str], str], T]) -> tuple[list[T], list[T], LengthStats]:
    """Train and held-out examples of data.path (split by `split_records`), or of the embedded
    task (`embedded(data_cfg)`) when data.path is null: each record encoded, put through the
    over-length policy and turned into an example by make(id, encoded, answer or None, origin).
    Also returns what the policy did."""
    stats = LengthStats()
    if data_cfg.path is None:
        train_recs, held_recs = embedded(data_cfg)
    else:
        records = read_records(data_cfg.path)
        stats.blank_lines = records.blank_lines
        train_recs, held_recs = split_records(records, data_cfg)
    encoder = ChatEncoder(tokenizer, data_cfg)

    def encode(recs: list[Record]) -> list[T]:
        out, unusable = [], []
        for i, rec in enumerate(recs):
            answer = rec.data.get("answer")
            try:
                answer = None if answer is None else answer_text(answer, rec.origin, "answer")
            except DataError:  # optional here (held-out accuracy only): a list or bool is no number to check
                unusable.append(rec.origin)
                answer = None
            enc = apply_length_policy(encode_record(rec, encoder), data_cfg, stats, rec.origin, encoder.head)
            if enc is not None:
                out.append(make(str(rec.data.get("id", i)), enc, answer, rec.origin))
        if unusable:
            log.warning("%d record(s) have an 'answer' that is not text or a number (first: %s): they count as "
                        "having no answer (the optional answer only serves the greedy held-out accuracy)",
                        len(unusable), unusable[0])
        return out

    return encode(train_recs), encode(held_recs), stats
