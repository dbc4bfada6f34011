"""The split pools' protocol in one process: GenerationPool and TrainerPool in two threads, the wire
replaced by in-memory queues (the real wire under torchrun: tests/test_split_placement.py). Checks
the schedule itself, fast: the bound holds, wait never drops, drop counts every dropped slot, the
stop ends both sides, whatever the relative speeds."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest

from colo_rl import loop
from colo_rl.samples import Group, Rollout
from colo_rl.split import pools, roles
from colo_rl.split.placement import split_layout


class Sent:
    """A message in flight: done once the receiver took it (the bounded queue waits on that)."""

    def __init__(self):
        self.taken = threading.Event()

    def done(self):
        return self.taken.is_set()

    def wait(self):
        assert self.taken.wait(30), "a send was never received"


class Wire:
    def __init__(self):
        self.to_trainer: queue.Queue = queue.Queue()
        self.weights: queue.Queue = queue.Queue()

    def send_object(self, obj, dst, group):
        sent = Sent()
        self.to_trainer.put((obj, sent))
        return sent

    def recv_object(self, src, group):
        obj, sent = self.to_trainer.get(timeout=30)
        sent.taken.set()
        return obj


def run_pools(monkeypatch, k, policy, steps=6, gen_s=0.01, update_s=0.03, sync_every=1, eval_every=0):
    """The trainer's loop over both pools; with `eval_every`, the held-out evaluations as the loop
    asks for them (version 0, every eval_every, the last), each generator's share a fake [n, correct]."""
    wire = Wire()
    monkeypatch.setattr(pools, "send_object", wire.send_object)
    monkeypatch.setattr(pools, "recv_object", wire.recv_object)

    class Receiver:
        def __init__(self, group, leader):
            self.evaluate = False
            self.load_seconds = 0.0

        def ready(self):
            return not wire.weights.empty()

        def take(self, engine):
            version, stop, self.evaluate = wire.weights.get(timeout=30)
            engine.version = version
            return version, stop

    class Sender:
        def __init__(self, weights, group, leader, max_bucket_bytes):
            pass

        def send(self, version, stop, evaluate=False):
            wire.weights.put((version, stop, evaluate))
            return {"time/weight_sync": 0.0, "split/weight_sync_bytes": 0.0}

    monkeypatch.setattr(pools, "WeightReceiver", Receiver)
    monkeypatch.setattr(pools, "WeightSender", Sender)
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=k, staleness_policy=policy),
                          placement=SimpleNamespace(sync_every=sync_every), colocate=SimpleNamespace(handoff_bucket_mb=1))
    role = roles.SplitRole(split_layout(2, 1, 1, 2), generates=True, weight_group=None)
    engine = SimpleNamespace(version=-1)
    made = []

    def make_rollout(version):
        assert engine.version == version  # the rollout is tagged with the weights that generated it
        time.sleep(gen_s)
        made.append(version)
        groups = [Group(f"p{len(made)}.{j}", [], []) for j in range(2)]
        return Rollout(groups=groups, policy_version=version), {"time/generation": gen_s}

    def evaluate_shard(version):
        assert engine.version == version  # evaluated with the weights it names
        time.sleep(gen_s)
        return {"eval/": ({"count": 10.0, "correct": float(version)}, [{"completion": f"v{version}", "answer": "1"}]),
                "eval_no_tools/": ({"count": 4.0, "correct": 2.0 * version}, [])}

    def evaluates(version):
        return bool(eval_every) and (version == 0 or loop.eval_due(version, steps, eval_every))

    monkeypatch.setattr(pools.dist, "job_rank", lambda: 0)
    gen = pools.GenerationPool(role, cfg, engine, make_rollout, steps, evaluate_shard)
    monkeypatch.setattr(pools.dist, "job_rank", lambda: 1)
    trainer = pools.TrainerPool(role, cfg, weights=None, total_steps=steps, evaluates=evaluates)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("slots", gen.serve()))
    thread.start()
    trainer.start()
    rows = []
    evals = {0: trainer.evaluation(0)} if eval_every else {}
    for step in range(steps):
        rollout, flow = trainer.receive(step)
        start = time.time()
        time.sleep(update_s)
        rows.append({**flow, **trainer.after_update(step, (start, time.time()))})
        if evaluates(step + 1):
            evals[step + 1] = trainer.evaluation(step + 1)
    run_pools.evals = evals
    unused = trainer.close()
    thread.join(30)
    assert not thread.is_alive()
    return rows, out["slots"], unused, made


@pytest.mark.parametrize("k", [0, 1, 2])
def test_wait_trains_every_slot_within_the_bound(monkeypatch, k):
    # updates of 0.1 s: room for the generator thread to run during one even on a loaded machine
    # (with 0.03 s a CI run under load once saw no overlap in all 6 steps at k = 2)
    rows, slots, unused, made = run_pools(monkeypatch, k, "wait", update_s=0.1)
    assert slots == 6 and unused == 0 and len(made) == 6
    assert all(r["split/staleness_max"] <= k and r["split/dropped_groups"] == 0 for r in rows)
    if k == 0:  # synchronous: step t trains version t, and nothing overlaps
        assert [r["split/policy_version"] for r in rows] == list(range(6))
        assert all(r["split/overlap_seconds"] == 0 for r in rows)
    else:  # generation runs ahead: stale samples, overlapping the update
        assert max(r["split/staleness_max"] for r in rows) >= 1
        assert sum(r["split/overlap_seconds"] for r in rows) > 0


def test_drop_counts_every_slot_it_drops(monkeypatch):
    rows, slots, unused, made = run_pools(monkeypatch, 0, "drop", update_s=0.05)
    dropped = rows[-1]["split/dropped_groups_total"]
    assert all(r["split/staleness_max"] == 0 for r in rows)
    assert dropped == sum(r["split/dropped_groups"] for r in rows) > 0
    assert slots == 6 + dropped / 2 + unused  # 2 groups per slot: each trained, dropped, or unused


def test_sync_every_two_with_k1_never_needs_a_version_not_sent(monkeypatch):
    rows, slots, unused, _ = run_pools(monkeypatch, 1, "wait", sync_every=2)
    assert slots == 6 and all(r["split/staleness_max"] <= 1 for r in rows)
    assert sum("time/weight_sync" in r for r in rows) == 3  # after steps 2, 4, 6


@pytest.mark.parametrize("k", [0, 1])
def test_generators_evaluate_exactly_the_versions_the_loop_asks_for(monkeypatch, k):
    """Held-out evaluation in split placement: the generation rank evaluates the weights of the
    step-0 and every eval step's version between rollouts; the trainer gets each in order while the
    rollouts that arrived before it still reach their steps (none lost, none trained twice)."""
    rows, slots, unused, made = run_pools(monkeypatch, k, "wait", eval_every=2)
    evals = run_pools.evals
    assert sorted(evals) == [0, 2, 4, 6]
    for version, shares in evals.items():
        (sums, samples), (no_tools, _) = shares["eval/"], shares["eval_no_tools/"]
        assert sums == {"count": 10.0, "correct": float(version)} and samples[0]["completion"] == f"v{version}"
        assert no_tools == {"count": 4.0, "correct": 2.0 * version}  # each prefix summed on its own
    assert slots == 6 and unused == 0 and len(made) == 6
    assert [r["split/policy_version"] <= i for i, r in enumerate(rows)] == [True] * 6
    assert all(r["split/staleness_max"] <= k for r in rows)
