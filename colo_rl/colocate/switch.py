"""Phase switching: `with switch.generation(): ...` / `with switch.update(): ...`.

The switcher owns the phase state machine; the engine and the trainer check the shared guard, so
generating while the trainer holds its states (or training while the engine holds the GPU) fails
with an error that says which context to use.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch

from colo_rl.colocate.memory import MemoryManager, freeze_collector
from colo_rl.phase import Phase, PhaseError, PhaseGuard
from colo_rl.profiling import RANGE_PREFIX

log = logging.getLogger("colo_rl")


class PhaseSwitcher:
    def __init__(self, manager: MemoryManager, guard: PhaseGuard):
        self.manager = manager
        self.guard = guard
        self.step = 0  # the ledger's records name the step they belong to
        self.switch_seconds = 0.0  # phase-switch time (excluding the handoff) since begin_step
        self.handoff_seconds = 0.0
        self._inside = False
        self._steps_begun = 0

    def begin_step(self, step: int) -> None:
        """A new training step: the transitions that follow are recorded under `step`, and
        `timed_phase_seconds` counts from zero."""
        self._steps_begun += 1
        if self._steps_begun == 2:
            # The first step's warm-up (kernels, autograd, the engine's first requests) left objects
            # that live for the run: freeze them too, so the page-outs' collections skip them.
            log.info("collector frozen after the first step: %(frozen_objects)d objects, %(seconds).2fs",
                     freeze_collector())
        self.step = step
        self.switch_seconds = 0.0
        self.handoff_seconds = 0.0

    def _account(self, transition) -> None:
        """Run the manager's transition; the step pays its wall time, the ledger's own work (memory
        snapshots, the record's write) included, which the record's "seconds" (its moves) leave out."""
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"{RANGE_PREFIX}phase switch {transition.__name__}"):
            record = transition(self.step)
        # a record's moves lie inside its wall time; max() keeps a manager that only reports them consistent
        wall = max(record["seconds"], time.perf_counter() - t0)
        handoff = sum(m["seconds"] for m in record["moves"] if m["what"] == "weights handoff")
        self.handoff_seconds += handoff
        self.switch_seconds += wall - handoff

    def _switch(self, transition, to: Phase) -> None:
        """A transition into `to`; one that raises leaves the phase BROKEN (states half paged, an engine
        half woken), so that nothing runs on that memory and a later switch refuses rather than
        trusting the phase it would otherwise read."""
        if self.guard.phase is Phase.BROKEN:
            raise PhaseError(f"cannot switch to the {to.value} phase: an earlier phase switch failed midway (its error "
                             f"came first), so the trainer's and the engine's memory are in neither phase's layout; "
                             f"restart from the last checkpoint (resume=auto)")
        try:
            self._account(transition)
        except BaseException:
            self.guard.phase = Phase.BROKEN
            raise
        self.guard.phase = to

    @contextmanager
    def generation(self):
        if self._inside:
            raise PhaseError(f"switch.generation() entered inside the {self.guard.phase.value} phase; "
                             "phases do not nest")
        if self.guard.phase is not Phase.GENERATION:
            self._switch(self.manager.to_generation, Phase.GENERATION)
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    @contextmanager
    def update(self):
        if self._inside:
            raise PhaseError(f"switch.update() entered inside the {self.guard.phase.value} phase; "
                             "phases do not nest")
        if self.guard.phase is not Phase.UPDATE:
            if self.guard.phase is Phase.IDLE:  # nothing handed off yet: the trainer already holds its states
                self.guard.phase = Phase.UPDATE
            else:
                self._switch(self.manager.to_train, Phase.UPDATE)
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def timed_phase_seconds(self) -> dict[str, float]:
        return {"time/handoff": self.handoff_seconds, "time/phase_switch": self.switch_seconds}
