"""EngineMemoryState: which of SGLang's memory tags are released and whether the engine's weights
are valid, as a pure state machine (no SGLang import), so every transition is tested on CPU."""

from __future__ import annotations

from typing import Iterable

from colo_rl.errors import EngineStateError
from colo_rl.rollout.base import ALL_TAGS, KV_CACHE, WEIGHTS


class EngineMemoryState:
    """Which SGLang memory tags are released, whether the weights are valid, whether a cache flush
    or a weight-update session is pending.

    SGLang raises when resuming a tag that is not released and must not release a tag twice
    (torch_memory_saver aborts the process on a double pause); resumed weights are garbage
    until a weight update finishes. `sleep`/`wake` are idempotent over this bookkeeping.
    """

    def __init__(self, supported: Iterable[str] = ALL_TAGS):
        self.supported = tuple(supported)
        self.released: set[str] = set()
        self.weights_valid = False  # dummy weights at start: only the handoff makes them real
        self.flush_pending = False
        self.session_open = False

    def _validate(self, tags: Iterable[str], verb: str) -> list[str]:
        tags = list(tags)
        unknown = [t for t in tags if t not in ALL_TAGS]
        if unknown:
            raise ValueError(f"cannot {verb} unknown memory tags {unknown}; known: {list(ALL_TAGS)}")
        return [t for t in ALL_TAGS if t in tags and t in self.supported]  # canonical order

    def plan_release(self, tags: Iterable[str]) -> list[str]:
        if self.session_open:
            raise EngineStateError("release requested during a weight update: call finish_weight_update() first")
        return [t for t in self._validate(tags, "release") if t not in self.released]

    def mark_released(self, tags: Iterable[str]) -> None:
        tags = list(tags)
        double = [t for t in tags if t in self.released]
        if double:
            raise EngineStateError(f"tags {double} are already released; releasing twice kills the engine")
        self.released.update(tags)

    def plan_resume(self, tags: Iterable[str]) -> list[str]:
        return [t for t in self._validate(tags, "resume") if t in self.released]

    def mark_resumed(self, tags: Iterable[str]) -> None:
        tags = list(tags)
        held = [t for t in tags if t not in self.released]
        if held:
            raise EngineStateError(f"tags {held} are not released; SGLang raises when resuming them")
        self.released.difference_update(tags)
        if WEIGHTS in tags:
            self.weights_valid = False

    def require_weights_resident(self, what: str) -> None:
        if WEIGHTS in self.released:
            raise EngineStateError(f"{what} while the engine's weights are released: wake(['weights']) first")

    def finish_update(self) -> bool:
        """A weight update finished: weights valid, cache to flush. Returns whether to flush now
        (the KV cache is resident); otherwise the flush waits for the KV cache to be resumed."""
        self.weights_valid = True
        self.flush_pending = True
        return KV_CACHE not in self.released

    def require_generate(self) -> None:
        released = [t for t in ALL_TAGS if t in self.released]
        if released:
            raise EngineStateError(f"generate while {released} are released: wake the engine first")
        if self.session_open:
            raise EngineStateError("generate during a weight update: call finish_weight_update() first")
        if not self.weights_valid:
            raise EngineStateError("generate on weights that no finished weight update has written (dummy or "
                                   "just-resumed memory): run the handoff before generating")
