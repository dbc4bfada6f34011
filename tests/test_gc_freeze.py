"""The collector freeze (colocate.memory.freeze_collector): page-outs stop scanning set-up's objects,
and nothing the trainer or the engine frees later is kept alive by it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from colo_rl.colocate.memory import freeze_collector
from colo_rl.colocate.switch import PhaseSwitcher
from colo_rl.phase import PhaseGuard


class Holder:
    def __init__(self):
        self.tensor = torch.ones(1024)
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the pytest process keeps an ordinary collector


def test_garbage_existing_at_the_freeze_is_collected_not_frozen():
    cycle = Holder()
    ref = weakref.ref(cycle)
    del cycle
    out = freeze_collector()
    assert ref() is None  # collected before freezing: a frozen cycle would never be freed
    # a frozen object can still be freed by reference counting (another thread of the pytest
    # process may drop one right after the freeze), so the count can only have shrunk a little
    assert 0 < gc.get_freeze_count() <= out["frozen_objects"]
    assert gc.get_freeze_count() > 0.99 * out["frozen_objects"]


def test_a_tensor_holding_cycle_created_after_the_freeze_is_collected():
    freeze_collector()
    cycle = Holder()
    ref, tensor_ref = weakref.ref(cycle), weakref.ref(cycle.tensor)
    del cycle
    assert ref() is not None  # a cycle: reference counting alone does not free it
    gc.collect()  # what DeepSpeed's offload_states runs
    assert ref() is None and tensor_ref() is None


def test_objects_alive_at_the_freeze_and_dropped_later_are_freed():
    kept = Holder()
    plain = torch.zeros(8)
    plain_ref = weakref.ref(plain)
    kept_ref = weakref.ref(kept)
    kept.me = None  # no cycle any more: reference counting frees it the moment it is dropped
    freeze_collector()
    del plain, kept
    assert plain_ref() is None and kept_ref() is None


def test_a_later_collection_skips_the_frozen_objects():
    junk = [[i] for i in range(200_000)]  # set-up's long-lived objects
    freeze_collector()
    assert gc.get_freeze_count() >= len(junk)
    # a full collection now only sees what was created since: the frozen objects are out of its generations
    assert len(gc.get_objects()) < len(junk) // 2
    del junk


def test_the_switcher_freezes_again_after_the_first_step(monkeypatch):
    calls = []
    monkeypatch.setattr("colo_rl.colocate.switch.freeze_collector", lambda: calls.append(1) or
                        {"frozen_objects": 1, "seconds": 0.0})
    switch = PhaseSwitcher(manager=None, guard=PhaseGuard())
    switch.begin_step(0)
    assert calls == []
    switch.begin_step(1)  # the first step's warm-up is done
    switch.begin_step(2)
    assert calls == [1]
