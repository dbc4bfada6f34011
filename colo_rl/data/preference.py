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
from colo_rl.data.chat import ChatEncoder, LengthStats, apply_length_policy
from colo_rl.data.files import Record, read_records
from colo_rl.data.sft import split_records


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


def load_preference_data(tokenizer, data_cfg) -> tuple[list[PreferencePair], list[PreferencePair], LengthStats]:
    """Train and held-out pairs after the over-length policy, and what the policy did."""
    if data_cfg.path is None:
        train_recs, held_recs = preference_records(data_cfg)
    else:
        train_recs, held_recs = split_records(read_records(data_cfg.path), data_cfg)
    encoder = ChatEncoder(tokenizer, data_cfg)
    stats = LengthStats()

    def encode(recs: list[Record]) -> list[PreferencePair]:
        out = []
        for i, rec in enumerate(recs):
            prompt, chosen, rejected = rec.require("prompt", "chosen", "rejected")
            enc = encoder.encode_pair(prompt, [("chosen", chosen), ("rejected", rejected)], rec.origin)
            enc = apply_length_policy(enc, data_cfg, stats, rec.origin)
            if enc is None:
                continue
            (c_ids, c_mask), (r_ids, r_mask) = enc.responses
            answer = rec.data.get("answer")
            out.append(PreferencePair(str(rec.data.get("id", i)), enc.prompt_ids, c_ids, c_mask, r_ids, r_mask,
                                      None if answer is None else str(answer), rec.origin))
        return out

    return encode(train_recs), encode(held_recs), stats
