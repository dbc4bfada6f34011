"""Preference pairs for DPO: `prompt` / `chosen` / `rejected` records.

Each of the three may be a string or a message list:
    {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."}
    {"prompt": [{"role": "user", "content": ...}], "chosen": [{"role": "assistant", "content": ...}], ...}
The prompt is rendered with the chat template (generation prompt included) and shared by both
responses; the loss covers the responses' assistant tokens. `data.path=null` is the embedded
arithmetic task (right worked answer preferred over a wrong one, arithmetic_demos.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from colo_rl.data.arithmetic_demos import preference_records
from colo_rl.data.chat import ChatEncoder, Encoded, LengthStats, encode_splits
from colo_rl.data.files import Record


@dataclass
class PreferencePair:
    id: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    answer: Optional[str] = None
    origin: str = ""

    def __len__(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


def encode_preference_record(rec: Record, encoder: ChatEncoder) -> Encoded:
    prompt, chosen, rejected = rec.require("prompt", "chosen", "rejected")
    return encoder.encode_pair(prompt, [("chosen", chosen), ("rejected", rejected)], rec.origin)


def load_preference_data(tokenizer, data_cfg) -> tuple[list[PreferencePair], list[PreferencePair], LengthStats]:
    """Train and held-out pairs after the over-length policy, and what the policy did."""
    return encode_splits(tokenizer, data_cfg, preference_records, encode_preference_record,
                         lambda pair_id, enc, answer, origin: PreferencePair(
                             pair_id, enc.prompt_ids, *enc.responses[0], *enc.responses[1], answer, origin))
