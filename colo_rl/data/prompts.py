"""Problems with verifiable answers and the prompts built from them."""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from colo_rl.data.arithmetic import ArithmeticTask, make_arithmetic_splits
from colo_rl.data.chat import (check_messages, keep_end, leading_specials, render_chat, require_chat_template,
                               user_turn)
from colo_rl.data.files import DataError, Record, answer_text, read_records, wrong_type

log = logging.getLogger("colo_rl")


@dataclass
class Problem:
    id: str
    question: str  # user text, or "" when `messages` is given
    answer: str  # ground truth for the verifier
    messages: Optional[list[dict[str, str]]] = None
    origin: str = ""
    # The record's keys as read (the embedded task: question / answer): the `**fields` of a user's
    # reward function.
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptStats:
    kept: int = 0
    truncated: int = 0
    dropped: int = 0


class PromptBuilder:
    """Tokenised prompts with the configured over-length policy; counts what it drops or cuts.
    With an environment (colo_rl/envs) its first messages are used: e.g. the tools it offers."""

    def __init__(self, tokenizer, data_cfg, env=None):
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        self.env = env
        self.stats = PromptStats()
        require_chat_template(tokenizer, data_cfg)
        self.head = leading_specials(tokenizer)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        if problem.messages is not None:
            return problem.messages if self.env is None else self.env.first_messages(problem.messages)
        content = problem.question
        if self.cfg.instruction:
            content = f"{content}\n{self.cfg.instruction}"
        msgs = user_turn(content, self.cfg.system_prompt)
        return msgs if self.env is None else self.env.first_messages(msgs)

    def text(self, problem: Problem) -> str:
        if self.cfg.use_chat_template:
            extra = self.env.chat_template_kwargs() if self.env is not None else {}
            return render_chat(self.tokenizer, self.messages(problem), True, problem.origin or problem.id, **extra)
        msgs = self.messages(problem)
        return "\n".join(m["content"] for m in msgs) + "\n"

    def encode(self, problem: Problem) -> Optional[list[int]]:
        """Token ids, or None when the prompt is over-length and the policy drops it."""
        return self._within_limit(problem, self._ids([self._checked_text(problem)])[0])

    def encode_all(self, problems: list[Problem], chunk: int = 1024) -> list[tuple[Problem, list[int]]]:
        """(problem, token ids) for each problem the over-length policy keeps, in order. The tokenizer
        takes the texts a chunk at a time: one call per prompt cost ~2 s at start-up for 20k prompts."""
        kept = []
        for start in range(0, len(problems), chunk):
            part = problems[start:start + chunk]
            texts = [self._checked_text(p) for p in part]
            for problem, ids in zip(part, self._ids(texts)):
                if (ids := self._within_limit(problem, ids)) is not None:
                    kept.append((problem, ids))
        return kept

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """A chat template writes its own BOS; plain text gets the one the tokenizer adds (Llama's)."""
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return ids if self.cfg.use_chat_template else [self.head + i for i in ids]

    def _checked_text(self, problem: Problem) -> str:
        if not (problem.question or problem.messages):
            raise DataError(f"{problem.origin or problem.id}: empty prompt; remove the record or fill it in")
        return self.text(problem)

    def _within_limit(self, problem: Problem, ids: list[int]) -> Optional[list[int]]:
        limit = self.cfg.max_prompt_tokens
        if len(ids) > limit:
            if self.cfg.overlong_policy == "error":
                raise DataError(
                    f"{problem.origin or problem.id}: prompt has {len(ids)} tokens > data.max_prompt_tokens={limit}; "
                    "raise the limit or set data.overlong_policy=drop|truncate"
                )
            if self.cfg.overlong_policy == "drop":
                self.stats.dropped += 1
                return None
            ids = keep_end(ids, limit, self.head)
            self.stats.truncated += 1
        self.stats.kept += 1
        return ids


_GSM8K_ANSWER = re.compile(r".*####\s*(.+?)\s*$", re.S)  # after the last '####'


def gsm8k_final_answer(text: str, origin: str) -> str:
    """The number after a GSM8K solution's last '####' (commas removed), or DataError."""
    m = _GSM8K_ANSWER.match(text)
    answer = m.group(1).replace(",", "").strip() if m else ""
    if not answer:
        raise DataError(f"{origin}: its answer has no final answer after '####'")
    return answer


# OpenRLHF's and slime's default keys last (input / label): their prompt files read as they are
PROMPT_KEYS = ("prompt", "question", "messages", "input")
# verl's layout keeps the truth under reward_model (its data_source / extra_info reach reward functions as fields)
ANSWER_KEYS = ("answer", "ground_truth", "solution", "reward_model.ground_truth", "label")
PROMPT_IS = "a prompt is a string or a list of {role, content} messages"


def _problem_from_record(rec: Record, index: int, prompt_key: Optional[str] = None,
                         answer_key: Optional[str] = None) -> Problem:
    """GSM8K (`question` + `answer` with '#### n'), or a prompt (text or message list) and an answer
    under PROMPT_KEYS / ANSWER_KEYS, or under data.prompt_key / data.answer_key (dotted: nested)."""
    d = rec.data
    if not (prompt_key or answer_key) and "question" in d and isinstance(d.get("answer"), str) \
            and "####" in d["answer"]:
        (question,) = rec.require("question")
        if not isinstance(question, str):  # its repr would be the prompt
            raise wrong_type(rec.origin, "question", question, PROMPT_IS)
        return Problem(id=str(d.get("id", index)), question=question,
                       answer=gsm8k_final_answer(d["answer"], rec.origin), origin=rec.origin, fields=dict(d))
    prompt_at, prompt = rec.first_of(*([prompt_key] if prompt_key else PROMPT_KEYS), option="data.prompt_key")
    if prompt_at == "input" and not prompt_key and "instruction" in d:  # Alpaca's: the task is in `instruction`
        raise DataError(f"{rec.origin}: holds 'instruction' and 'input' (Alpaca's layout), and colo_rl reads one "
                        f"key as the prompt: set data.prompt_key=instruction, or join the two into a 'prompt' key")
    answer_at, answer = rec.first_of(*([answer_key] if answer_key else ANSWER_KEYS), option="data.answer_key")
    # a number is its text; a list, object or bool is refused: its repr would be the truth
    answer = answer_text(answer, rec.origin, answer_at, " (data.answer_key names a nested one: a.b)")
    # a GSM8K-style solution under any key: its final number is the truth (reward functions see it too)
    answer = gsm8k_final_answer(answer, rec.origin) if "####" in answer else answer
    if not answer.strip():
        raise DataError(f"{rec.origin}: key {answer_at!r} is empty: the verifier has no truth to check against; "
                        f"fill it in or remove the record")
    if isinstance(prompt, list):
        return Problem(id=str(d.get("id", index)), question="", answer=answer,
                       messages=check_messages(prompt, rec.origin, prompt_at), origin=rec.origin, fields=dict(d))
    if not isinstance(prompt, str):  # its repr would be the prompt
        raise wrong_type(rec.origin, prompt_at, prompt, f"{PROMPT_IS} (data.prompt_key names a nested one: a.b)")
    if not prompt.strip():
        raise DataError(f"{rec.origin}: empty prompt; remove the record or fill it in")
    return Problem(id=str(d.get("id", index)), question=str(prompt), answer=answer, origin=rec.origin,
                   fields=dict(d))


def file_problems(path, prompt_key: Optional[str] = None, answer_key: Optional[str] = None) -> list[Problem]:
    """Every record of a user file as a problem (file:line errors for a bad record); blank lines
    skipped are logged with the count of records."""
    problems, skipped = _file_problems(path, prompt_key, answer_key)
    if skipped:
        log.info("data.path=%s: %d records%s", path, len(problems), skipped)
    return problems


def _file_problems(path, prompt_key: Optional[str], answer_key: Optional[str]) -> tuple[list[Problem], str]:
    """The problems, and what reading skipped (`Records.skipped`, for the loader's records line)."""
    records = read_records(path)
    return [_problem_from_record(r, i, prompt_key, answer_key) for i, r in enumerate(records)], records.skipped()


def load_problems(data_cfg) -> tuple[list[Problem], list[Problem]]:
    """Train and held-out problems: the arithmetic task, or a user file split by seed."""
    if data_cfg.path is None:
        task = ArithmeticTask(data_cfg.min_operand, data_cfg.max_operand, data_cfg.three_operand_fraction,
                              data_cfg.max_operations, data_cfg.max_factor)
        train, held = make_arithmetic_splits(task, data_cfg.train_size, data_cfg.eval_size, data_cfg.split_seed)
        as_problem = lambda i, e, v, s: Problem(id=f"{s}-{i}", question=f"What is {e}?", answer=str(v),  # noqa: E731
                                                origin=f"arithmetic:{s}[{i}]",
                                                fields={"question": f"What is {e}?", "answer": str(v)})
        return ([as_problem(i, e, v, "train") for i, (e, v) in enumerate(train)],
                [as_problem(i, e, v, "eval") for i, (e, v) in enumerate(held)])
    problems, skipped = _file_problems(data_cfg.path, data_cfg.prompt_key, data_cfg.answer_key)
    if data_cfg.eval_path is not None:  # a validation file of its own: every record of data.path is trained on
        held, held_skipped = _file_problems(data_cfg.eval_path, data_cfg.prompt_key, data_cfg.answer_key)
        held = held[: data_cfg.eval_size or None]
        train = problems[: data_cfg.train_size or None]
        log.info("data.path=%s: %d records%s, %d trained on (%s); data.eval_path=%s: %d held out%s", data_cfg.path,
                 len(problems), skipped, len(train), "every record" if len(train) == len(problems) else
                 f"data.train_size={data_cfg.train_size}", data_cfg.eval_path, len(held), held_skipped)
        return train, held
    if len(problems) <= data_cfg.eval_size:
        raise DataError(f"data.path={data_cfg.path!r} has {len(problems)} records, not more than "
                        f"data.eval_size={data_cfg.eval_size}; lower data.eval_size (e.g. "
                        f"data.eval_size={max(1, len(problems) // 5)}, a fifth held out), or data.eval_size=0 for no "
                        f"held-out evaluation")
    order = list(range(len(problems)))
    random.Random(data_cfg.split_seed).shuffle(order)
    held = [problems[i] for i in order[:data_cfg.eval_size]]
    rest = [problems[i] for i in order[data_cfg.eval_size:]]
    train = rest[: data_cfg.train_size or None]
    why = "every other record" if len(train) == len(rest) else f"data.train_size={data_cfg.train_size} of {len(rest)}"
    log.info("data.path=%s: %d records%s: %d held out (data.eval_size), %d trained on (%s)", data_cfg.path,
             len(problems), skipped, len(held), len(train), why)
    return train, held

