"""Every engine the colocated loop can be given answers the RolloutEngine protocol: each required
method, with the protocol's parameters (names, order, defaults), so the memory manager, the handoff
and the recipes can call any of them alike."""

from __future__ import annotations

import inspect

import pytest

from colo_rl.rollout.base import RolloutEngine
from colo_rl.rollout.hf import HFEngine
from colo_rl.rollout.sglang import SGLangEngine
from colo_rl.rollout.tp_group import TPGroupEngine

REQUIRED = [name for name, member in vars(RolloutEngine).items()
            if callable(member) and not name.startswith("_")]


def parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_lists_the_calls_the_loop_makes():
    assert sorted(REQUIRED) == ["finish_weight_update", "generate", "load_weights", "shutdown", "sleep", "wake"]


@pytest.mark.parametrize("engine", [HFEngine, SGLangEngine, TPGroupEngine], ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", REQUIRED)
def test_engine_implements_the_protocol(engine, method):
    assert callable(getattr(engine, method, None)), f"{engine.__name__} has no {method}()"
    assert parameters(getattr(engine, method)) == parameters(getattr(RolloutEngine, method))
