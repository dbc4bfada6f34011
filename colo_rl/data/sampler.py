"""Seeded, resumable order over a dataset: every rank computes the same global order and takes
its own share of each global batch."""

from __future__ import annotations

import random

from colo_rl import dist
from colo_rl.errors import CheckpointError


class EpochSampler:
    def __init__(self, num_items: int, seed: int, shuffle: bool = True):
        if num_items <= 0:
            raise ValueError("the training set is empty (after dropping over-length prompts)")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_global(self, batch_size: int, short_last: bool = False) -> list[int]:
        """The next `batch_size` indices, wrapping into a new, reshuffled epoch; with `short_last` an
        epoch's last batch is what is left of it (SFT / DPO: an epoch sees each item once)."""
        if short_last:
            if self.position >= self.num_items:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            out = self._order[self.position:self.position + batch_size]
            self.position += len(out)
            return out
        out: list[int] = []
        while len(out) < batch_size:
            if self.position >= self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._make_order()
            take = min(batch_size - len(out), self.num_items - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def planned(self, batch_size: int, steps: int, short_last: bool = False) -> list[int]:
        """The distinct indices the next `steps` global batches draw, sorted (this sampler is not moved)."""
        replay = EpochSampler(self.num_items, self.seed, self.shuffle)
        replay.load_state_dict(self.state_dict())
        used: set[int] = set()
        for _ in range(steps):
            used.update(replay.next_global(batch_size, short_last))
            if len(used) == self.num_items:
                break
        return sorted(used)

    def next_local(self, global_batch_size: int, short_last: bool = False) -> list[int]:
        return dist.shard(self.next_global(global_batch_size, short_last))

    def epochs_done(self) -> float:
        """Epochs drawn so far, as a fraction (train/epoch)."""
        return self.epoch + self.position / self.num_items

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": self.num_items}

    def load_state_dict(self, state: dict, checkpoint: str = "<checkpoint>") -> None:
        """A saved position; CheckpointError, naming `checkpoint` and what to do, for another data order."""
        if state["num_items"] != self.num_items or state["seed"] != self.seed:
            raise CheckpointError(
                f"cannot resume from {checkpoint}: its data order ({state['num_items']} records, seed "
                f"{state['seed']}) is not this run's ({self.num_items} records, seed {self.seed}): the data file(s) "
                f"or how many are dropped as over-length changed since. Restore the data the run started with, or "
                f"start a new run from its weights (python -m colo_rl.checkpoint {checkpoint} <out_dir>, then "
                f"model.path=<out_dir>)")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()
