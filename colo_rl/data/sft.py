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
from dataclasses import dataclass
from typing import Optional

from colo_rl.data.arithmetic_demos import sft_records
from colo_rl.data.chat import ChatEncoder, Encoded, LengthStats, check_messages, encode_splits
from colo_rl.data.files import DataError, Record

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


def encode_sft_record(rec: Record, encoder: ChatEncoder) -> Encoded:
    d = rec.data
    if d.get("messages") is not None:
        return encoder.encode_conversation(check_messages(d["messages"], rec.origin, "messages"), rec.origin)
    if d.get("prompt") is not None:
        prompt, completion = rec.require("prompt", "completion")
        return encoder.encode_pair(prompt, [("completion", completion)], rec.origin)
    raise DataError(f"{rec.origin}: missing key 'messages' (or 'prompt' and 'completion'); record has {sorted(d)}")


def load_sft_data(tokenizer, data_cfg) -> tuple[list[SFTExample], list[SFTExample], LengthStats]:
    """Train and held-out examples after the over-length policy, and what the policy did."""
    return encode_splits(tokenizer, data_cfg, sft_records, encode_sft_record,
                         lambda ex_id, enc, answer, origin: SFTExample(ex_id, enc.prompt_ids, *enc.responses[0],
                                                                       answer, origin))
