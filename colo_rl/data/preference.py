"""Preference pairs for DPO: `prompt` / `chosen` / `rejected` records.

Each of the three may be a string or a message list:
    {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "5."}
    {"prompt": [{"role": "user", "content": ...}], "chosen": [{"role": "assistant", "content": ...}], ...}
The prompt is rendered with the chat template (generation prompt included) and shared by both
responses; the loss covers the responses' assistant tokens. `data.path=null` is the embedded
arithmetic task (right worked answer preferred over a wrong one, arithmetic_demos.py).

A pair whose chosen and rejected responses are the same tokens (the same text, or the same once cut
to data.max_seq_len) adds a constant to the loss and nothing to the gradient. TRL's DPOTrainer
trains on such pairs as they are, and so does colo_rl (the split and the step count stay TRL's),
but it counts them and warns with the count and the first one's file:line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from colo_rl.data.arithmetic_demos import preference_records
from colo_rl.data.chat import ChatEncoder, Encoded, LengthStats, encode_splits
from colo_rl.data.files import Record

log = logging.getLogger("colo_rl")


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
    """Train and held-out pairs after the over-length policy, and what the policy did; a warning
    counts the pairs whose chosen and rejected responses are the same tokens."""
    train, held, stats = encode_splits(tokenizer, data_cfg, preference_records, encode_preference_record,
                                       lambda pair_id, enc, answer, origin: PreferencePair(
                                           pair_id, enc.prompt_ids, *enc.responses[0], *enc.responses[1], answer,
                                           origin))
    warn_identical_pairs(train + held, data_cfg.path or "the embedded task")
    return train, held, stats


def identical_pairs(pairs: list[PreferencePair]) -> list[PreferencePair]:
    """The pairs whose chosen and rejected responses are the same tokens, with the same loss mask."""
    return [p for p in pairs if p.chosen_ids == p.rejected_ids and p.chosen_mask == p.rejected_mask]


def warn_identical_pairs(pairs: list[PreferencePair], source: str) -> int:
    """Warns with the number of pairs that cannot teach a preference and the first one's origin;
    returns the number."""
    same = identical_pairs(pairs)
    if same:
        log.warning("data.path=%s: %d of %d preference pairs have chosen identical to rejected once tokenised "
                    "(first: %s): each adds a constant to the loss, no gradient, and a miss to rewards/accuracy; "
                    "they are kept, as TRL keeps them: fix or remove them", source, len(same), len(pairs),
                    same[0].origin or same[0].id)
    return len(same)
