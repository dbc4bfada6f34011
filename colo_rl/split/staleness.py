"""The staleness bound of the split placement, as pure functions (AReaL / SkyRL `max_staleness`,
NeMo-RL `max_trajectory_age_steps`, verl's one-step-off at k=1).

Versions count optimizer steps: the trainer training step t holds weights of version t (t steps
done); a sample generated with weights of version v, trained at step t, has

    staleness = t - v        and is trained only if staleness <= k   (k = rollout.max_staleness)

wait: a generator makes the rollout of slot s (the step that will train on it) only once its
weights are at least version s - k, so every rollout is admitted and none is wasted; k = 0 is the
synchronous split (no overlap), k = 1 generates step t+1 while step t trains.
drop: generators never wait; the trainer drops rollouts older than k (counted) and takes the next.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

POLICIES = ("wait", "drop")


def staleness(trainer_version: int, rollout_version: int) -> int:
    """How many optimizer steps behind the trainer the generating weights are (>= 0)."""
    if rollout_version > trainer_version:
        raise ValueError(f"a rollout of version {rollout_version} reached a trainer at version {trainer_version}: "
                         "the generators cannot be ahead of the trainer")
    return trainer_version - rollout_version


def admitted(trainer_version: int, rollout_version: int, max_staleness: int) -> bool:
    """Train on it: staleness <= k."""
    return staleness(trainer_version, rollout_version) <= max_staleness


def may_generate(slot: int, weights_version: int, max_staleness: int) -> bool:
    """wait policy: may a generator holding `weights_version` make the rollout for step `slot`?"""
    return weights_version >= slot - max_staleness


class StalenessStats:
    """What the bound did, per step and in total: the staleness of what was trained (histogram,
    mean, max), the rollouts and groups dropped, the generators' waits for new weights."""

    def __init__(self) -> None:
        self.trained: Counter[int] = Counter()  # staleness -> groups trained, whole run
        self.dropped_groups_total = 0
        self._step: Counter[int] = Counter()
        self._dropped = 0

    def record_trained(self, value: int, groups: int) -> None:
        self.trained[value] += groups
        self._step[value] += groups

    def record_dropped(self, groups: int) -> None:
        self._dropped += groups
        self.dropped_groups_total += groups

    def state_dict(self) -> dict:
        """The run's totals, for a checkpoint (JSON: staleness keys as strings)."""
        return {"trained": {str(k): v for k, v in sorted(self.trained.items())},
                "dropped_groups_total": self.dropped_groups_total}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """A resumed run's totals go on from the checkpoint's (None: one saved without them, from zero)."""
        if state is not None:
            self.trained = Counter({int(k): int(v) for k, v in state["trained"].items()})
            self.dropped_groups_total = int(state["dropped_groups_total"])

    def pop(self) -> dict[str, float]:
        """This step's metrics (and the run's totals); the step's counts start again from zero."""
        n = sum(self._step.values())
        out = {"split/staleness_mean": sum(s * c for s, c in self._step.items()) / max(n, 1),
               "split/staleness_max": float(max(self._step, default=0)),
               "split/dropped_groups": float(self._dropped),
               "split/dropped_groups_total": float(self.dropped_groups_total),
               **{f"split/staleness_hist/{s}": float(c) for s, c in sorted(self.trained.items())}}
        self._step, self._dropped = Counter(), 0
        return out


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two wall-clock intervals (start, end) share: a generation and an update running together."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
