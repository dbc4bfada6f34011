"""The phase switcher's state machine: which transitions it asks the memory manager for, under which
step, and how it splits their time into handoff and phase switch. The manager here only records the
calls; the real one (paging, handoff, ledger) runs under torchrun in test_colocated_dist.py."""

from __future__ import annotations

import time

import pytest

from colo_rl.colocate.switch import PhaseSwitcher
from colo_rl.errors import HandoffError
from colo_rl.phase import Phase, PhaseError, PhaseGuard


class RecordingManager:
    """Answers each transition with a ledger-shaped record: 1.0 s in all, 0.25 s of it the handoff."""

    def __init__(self):
        self.calls = []

    def _record(self, name: str, step: int, moves: list[dict]) -> dict:
        self.calls.append((name, step))
        return {"step": step, "transition": name, "seconds": 1.0, "moves": moves}

    def to_generation(self, step: int) -> dict:
        return self._record("update->generation", step, [{"what": "weights handoff", "seconds": 0.25},
                                                         {"what": "trainer states", "seconds": 0.5}])

    def to_train(self, step: int) -> dict:
        return self._record("generation->update", step, [{"what": "trainer states", "seconds": 0.75}])


@pytest.fixture
def switch():
    return PhaseSwitcher(RecordingManager(), PhaseGuard())


def test_transitions_are_recorded_under_the_step_begun(switch):
    switch.begin_step(7)
    with switch.generation():
        assert switch.guard.phase is Phase.GENERATION
    with switch.update():
        assert switch.guard.phase is Phase.UPDATE
    switch.begin_step(8)
    with switch.generation():
        pass
    assert switch.manager.calls == [("update->generation", 7), ("generation->update", 7), ("update->generation", 8)]


def test_handoff_time_is_split_from_switch_time_and_begin_step_restarts_both(switch):
    switch.begin_step(0)
    with switch.generation():
        pass
    with switch.update():
        pass
    assert switch.timed_phase_seconds() == {"time/handoff": 0.25, "time/phase_switch": 1.75}
    switch.begin_step(1)
    assert switch.timed_phase_seconds() == {"time/handoff": 0.0, "time/phase_switch": 0.0}


def test_the_step_pays_the_transitions_wall_time_bookkeeping_included():
    """The ledger's record counts its moves; the snapshots and the record's write around them are the
    step's cost too (on a GPU they were outside every timer)."""
    class SlowLedger(RecordingManager):
        def to_train(self, step: int) -> dict:
            time.sleep(0.2)  # the memory snapshots and the fsync'd ledger write
            return {**super().to_train(step), "seconds": 0.05}

    switch = PhaseSwitcher(SlowLedger(), PhaseGuard())
    switch.begin_step(0)
    with switch.generation():
        pass
    with switch.update():
        pass
    seconds = switch.timed_phase_seconds()
    assert seconds["time/handoff"] == 0.25
    assert seconds["time/phase_switch"] >= 0.75 + 0.2  # 1.0 - 0.25 handoff, then the slow transition's wall


def test_no_transition_when_already_in_the_phase(switch):
    with switch.update():  # start-up (idle) -> update: the trainer already holds its states
        pass
    with switch.update():
        pass
    assert switch.manager.calls == []
    with switch.generation():
        pass
    with switch.generation():
        pass
    assert [name for name, _ in switch.manager.calls] == ["update->generation"]


def test_phases_do_not_nest(switch):
    with switch.generation():
        with pytest.raises(PhaseError, match="switch.update.. entered inside the generation phase"):
            with switch.update():
                pass
    with switch.update():  # the refused entry left the switcher usable
        pass
    assert switch.guard.phase is Phase.UPDATE


class FailingHandoffManager:
    """Pages the trainer out, then fails the handoff (a bucket the engine refused)."""

    def __init__(self):
        self.paged_out = self.reloads = 0

    def to_generation(self, step):
        self.paged_out += 1
        raise HandoffError("bucket 3: the engine refused the weights")

    def to_train(self, step):
        self.reloads += 1
        return {"seconds": 0.0, "moves": []}


def test_a_failed_switch_leaves_no_phase_to_trust():
    """The guard said UPDATE after a page-out whose handoff failed: a later update() reloaded nothing
    and the trainer would have run on states that were on the host."""
    manager, guard = FailingHandoffManager(), PhaseGuard()
    switch = PhaseSwitcher(manager, guard)
    with switch.update():  # start-up: the trainer holds its states, nothing to switch
        pass
    with pytest.raises(HandoffError):
        with switch.generation():
            pass
    assert guard.phase is Phase.BROKEN
    with pytest.raises(PhaseError, match="trainer forward needs the update phase but the current phase is broken"):
        guard.require(Phase.UPDATE, "trainer forward")
    for enter in (switch.update, switch.generation):
        with pytest.raises(PhaseError, match="an earlier phase switch failed midway.*resume=auto"):
            with enter():
                pass
    assert manager.reloads == 0 and manager.paged_out == 1
