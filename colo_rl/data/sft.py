"""SFT data: chat `messages` or `prompt` / `completion` records, tokenised with a completion mask.

Formats (JSONL, JSON, Parquet or a local HF `datasets` directory; see files.py):
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
        rendered with the tokenizer's chat template; loss on every assistant turn.
    {"prompt": "...", "completion": "..."}   (either may also be a message list)
        the prompt as a user turn (chat template) and the completion as the assistant's reply;
        loss on the completion only.
An optional `answer` (ground truth for the verifier) enables the greedy held-out accuracy.
`data.path=null` is the embedded arithmetic task (arithmetic_demos.py).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Optional

from colo_rl.data.arithmetic_demos import sft_records
from colo_rl.data.chat import ChatEncoder, Encoded, LengthStats, apply_length_policy, check_messages
from colo_rl.data.files import DataError, Record, read_records

log = logging.getLogger("colo_rl")


@dataclass
class SFTExample:
    id: str
    prompt_ids: list[int]  # everything before the first trained token
    completion_ids: list[int]  # the rest of the sequence
    completion_mask: list[int]  # 1 where the loss counts (assistant tokens)
    answer: Optional[str] = None
    origin: str = ""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def encode_sft_record(rec: Record, encoder: ChatEncoder, index: int) -> tuple[str, Encoded]:
    d = rec.data
    if d.get("messages") is not None:
        enc = encoder.encode_conversation(check_messages(d["messages"], rec.origin, "messages"), rec.origin)
    elif d.get("prompt") is not None:
        prompt, completion = rec.require("prompt", "completion")
        enc = encoder.encode_pair(prompt, [("completion", completion)], rec.origin)
    else:
        raise DataError(f"{rec.origin}: missing key 'messages' (or 'prompt' and 'completion'); "
                        f"record has {sorted(d)}")
    return str(d.get("id", index)), enc


def split_records(records: list[Record], data_cfg) -> tuple[list[Record], list[Record]]:
    """Seeded held-out split of a user file (data.eval_size records); the rest is trained on."""
    if data_cfg.eval_size and len(records) <= data_cfg.eval_size:
        raise DataError(f"data.path={data_cfg.path!r} has {len(records)} records, not more than "
                        f"data.eval_size={data_cfg.eval_size}; lower data.eval_size")
    order = list(range(len(records)))
    random.Random(data_cfg.seed).shuffle(order)
    held = [records[i] for i in order[:data_cfg.eval_size]]
    train = [records[i] for i in sorted(order[data_cfg.eval_size:])]
    return train, held


def load_sft_data(tokenizer, data_cfg) -> tuple[list[SFTExample], list[SFTExample], LengthStats]:
    """Train and held-out examples after the over-length policy, and what the policy did."""
    if data_cfg.path is None:
        train_recs, held_recs = sft_records(data_cfg)
    else:
        train_recs, held_recs = split_records(read_records(data_cfg.path), data_cfg)
    encoder = ChatEncoder(tokenizer, data_cfg)
    stats = LengthStats()

    def encode(recs: list[Record]) -> list[SFTExample]:
        out = []
        for i, rec in enumerate(recs):
            ex_id, enc = encode_sft_record(rec, encoder, i)
            enc = apply_length_policy(enc, data_cfg, stats, rec.origin)
            if enc is None:
                continue
            ids, mask = enc.responses[0]
            answer = rec.data.get("answer")
            out.append(SFTExample(ex_id, enc.prompt_ids, ids, mask, None if answer is None else str(answer),
                                  rec.origin))
        return out

    return encode(train_recs), encode(held_recs), stats
