"""Split placement's pure parts: the layout and its refusals, the staleness bound and its counts,
the weight buckets' layout, and the config rules a split run is checked against at start-up."""

from __future__ import annotations

import pytest
import torch

from colo_rl.config import RunConfig
from colo_rl.config.validation import check_grpo_rules
from colo_rl.errors import ConfigError
from colo_rl.split import staleness as st
from colo_rl.split.placement import split_layout
from colo_rl.split.wire import bucket_bytes, bucket_layout, pack, unpack


def test_layout_puts_generation_first_and_the_leader_after():
    lay = split_layout(world=5, generation_ranks=2, tp_size=1, prompts_per_step=6)
    assert lay.generation == (0, 1) and lay.trainers == (2, 3, 4) and lay.leader == 2
    assert lay.weight_ranks == (2, 0, 1)


def test_tp_groups_in_the_generation_pool_have_one_generator_each():
    """rollout.tp_size=2, 4 generation ranks: ranks 0 and 2 drive an engine each (the flow's
    generators, in the weight group), ranks 1 and 3 hold their GPU for those engines."""
    lay = split_layout(world=6, generation_ranks=4, tp_size=2, prompts_per_step=4)
    assert lay.generation == (0, 2) and lay.trainers == (4, 5) and lay.weight_ranks == (4, 0, 2)
    assert lay.engine_helpers == (1, 3) and list(lay.helpers_of(2)) == [3]
    assert [lay.owner_of(r) for r in lay.engine_helpers] == [0, 2]
    assert lay.generates(2) and not lay.generates(3) and not lay.generates(4)
    assert split_layout(world=3, generation_ranks=1, tp_size=1, prompts_per_step=2).engine_helpers == ()
    # the trainers' mini-batch rule, not the generators': 2 generators of 1 prompt, 1 trainer of 2 groups
    assert split_layout(world=3, generation_ranks=2, tp_size=1, prompts_per_step=2, mini_batches_per_step=2).trainers == (2,)
    # 2 generation ranks in TP + 1 trainer on one node of 3: no rank count divisible by 2 is needed
    assert split_layout(world=3, generation_ranks=2, tp_size=2, prompts_per_step=2).generation == (0,)


def test_a_resume_keeps_each_generators_position_or_is_refused():
    from colo_rl.errors import CheckpointError
    from colo_rl.split.pools import saved_positions

    assert saved_positions(None, (0, 2)) == {}  # a fresh run
    assert saved_positions({"0": "a", "2": "b"}, (0, 2)) == {0: "a", 2: "b"}  # JSON keys are strings
    with pytest.raises(CheckpointError, match=r"generators \[0, 1\], this run's generators are ranks \[0\]"):
        saved_positions({"0": "a", "1": "b"}, (0,))  # 2 generators then, 1 TP engine of 2 ranks now


@pytest.mark.parametrize("world,g,tp,prompts,keys", [
    (8, 6, 2, 4, ["rollout.prompts_per_step=4", "3 generators", "6 / 2"]),  # 3 engines on 6 ranks
    (6, 4, 2, 2, ["rollout.tp_size=2", "3 ranks per node", "generation rank 2", "span two nodes"]),
    (2, 2, 1, 4, ["placement.generation_ranks", "no rank left to train"]),
    (4, 3, 2, 6, ["rollout.tp_size=2", "placement.generation_ranks=3", "cross the boundary"]),
    (3, 1, 1, 3, ["rollout.prompts_per_step=3", "2 trainer ranks"]),
    (3, 2, 1, 5, ["rollout.prompts_per_step=5", "2 generation ranks"]),
    (3, 2, 1, 4, ["trainer.mini_batches_per_step=3", "4 prompt groups each of the 1 trainer ranks"]),
])
def test_a_split_that_cannot_work_is_refused_naming_the_keys(world, g, tp, prompts, keys):
    with pytest.raises(ConfigError) as e:
        split_layout(world=world, generation_ranks=g, tp_size=tp, prompts_per_step=prompts,
                     local_world=3 if world == 6 else None, mini_batches_per_step=3 if prompts == 4 else 1)
    for key in keys:
        assert key in str(e.value)


@pytest.mark.parametrize("g,n,per_gen", [(1, 1, 4), (1, 2, 4), (2, 1, 2), (2, 3, 3), (3, 2, 2)])
def test_every_group_of_a_slot_reaches_exactly_one_trainer(g, n, per_gen):
    lay = split_layout(world=g + n, generation_ranks=g, tp_size=1, prompts_per_step=g * per_gen)
    seen = []
    for i in range(n):
        mine = [gen * per_gen + j for gen in range(g) for j in lay.groups_for(gen, i, per_gen)]
        assert len(mine) == g * per_gen // n  # an even share per trainer
        seen += mine
    assert sorted(seen) == list(range(g * per_gen))


def test_staleness_bound_and_wait_rule():
    assert st.staleness(5, 3) == 2
    assert st.admitted(5, 4, 1) and not st.admitted(5, 3, 1) and st.admitted(5, 5, 0)
    with pytest.raises(ValueError, match="ahead of the trainer"):
        st.staleness(2, 3)
    # wait policy, k = 1: the rollout for step s needs weights of version >= s - 1
    assert st.may_generate(0, 0, 1) and st.may_generate(1, 0, 1) and not st.may_generate(2, 0, 1)
    assert not st.may_generate(1, 0, 0)  # k = 0: synchronous


def test_staleness_stats_count_per_step_and_in_total():
    s = st.StalenessStats()
    s.record_trained(0, 4)
    first = s.pop()
    assert first["split/staleness_mean"] == 0 and first["split/dropped_groups"] == 0
    s.record_dropped(4)
    s.record_trained(1, 4)
    second = s.pop()
    assert second["split/staleness_max"] == 1 and second["split/staleness_mean"] == 1
    assert second["split/dropped_groups"] == 4 and second["split/dropped_groups_total"] == 4
    assert second["split/staleness_hist/0"] == 4 and second["split/staleness_hist/1"] == 4
    assert s.pop()["split/dropped_groups"] == 0
    # a resumed run's totals go on from its checkpoint's (state.json: JSON)
    import json

    resumed = st.StalenessStats()
    resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))
    resumed.record_trained(1, 2)
    third = resumed.pop()
    assert third["split/staleness_hist/0"] == 4 and third["split/staleness_hist/1"] == 6
    assert third["split/dropped_groups_total"] == 4 and third["split/dropped_groups"] == 0


def test_overlap_of_two_intervals():
    assert st.overlap_seconds((0, 2), (1, 5)) == 1
    assert st.overlap_seconds((0, 1), (1, 5)) == 0 and st.overlap_seconds((3, 4), (0, 1)) == 0


def test_weight_buckets_round_trip_mixed_dtypes_aligned():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.randn(2, 2)),
               ("big", torch.randn(40))]
    buckets = bucket_layout([(n, tuple(t.shape), t.dtype) for n, t in tensors], bucket_bytes=100)
    # a: 60 B (next at 64); b: 14 B at 64 (next at 80); c: 16 B at 80 -> 96 <= 100; big: 160 B alone
    assert [[(s.name, s.offset) for s in b] for b in buckets] == [[("a", 0), ("b", 64), ("c", 80)], [("big", 0)]]
    by_name = dict(tensors)
    for b in buckets:
        flat = torch.zeros(bucket_bytes(b), dtype=torch.uint8)
        pack(b, [(s.name, by_name[s.name]) for s in b], flat)
        for name, view in unpack(b, flat):
            assert view.dtype == by_name[name].dtype and torch.equal(view, by_name[name])


def split_cfg(**changes) -> RunConfig:
    cfg = RunConfig()
    cfg.placement.mode = "split"
    cfg.algo.rollout_correction = "tis_token"
    for key, value in changes.items():
        *path, last = key.split("__")
        target = cfg
        for p in path:
            target = getattr(target, p)
        setattr(target, last, value)
    return cfg


def test_split_config_accepted_as_documented():
    check_grpo_rules(split_cfg())
    check_grpo_rules(split_cfg(rollout__max_staleness=0, algo__rollout_correction=None))
    check_grpo_rules(split_cfg(rollout__tp_size=2))  # TP engines in the generation pool (split_layout checks the ranks)


@pytest.mark.parametrize("changes,words", [
    ({"placement__sync_every": 3, "rollout__max_staleness": 1}, "placement.sync_every <= rollout.max_staleness + 1"),
    ({"algo__rollout_correction": None}, "algo.rollout_correction"),
])
def test_split_config_refusals_name_the_keys(changes, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("+", r"\+")):
        check_grpo_rules(split_cfg(**changes))


def test_a_dead_peer_becomes_one_error_naming_the_rank_and_the_pool():
    from colo_rl.errors import PoolError
    from colo_rl.runtime import CLEAN_ERRORS
    from colo_rl.split.roles import peer

    with pytest.raises(PoolError, match=r"generation rank 0 \(the generation pool\) stopped answering "
                                        r"\(\[pair.cc:598\] Connection closed by peer\)"):
        with peer("generation rank 0 (the generation pool)"):
            raise RuntimeError("[pair.cc:598] Connection closed by peer\n  a long gloo trace")
    assert PoolError in CLEAN_ERRORS  # printed as one `error:` line, no traceback
    with pytest.raises(KeyError):  # not a wire error: passes unchanged
        with peer("x"):
            raise KeyError("y")


def test_a_wait_on_the_other_pool_ends_when_a_peer_on_this_node_is_gone(monkeypatch):
    """gloo left a leader's bucket broadcast to a SIGKILLed generation rank waiting for the process
    group's timeout (30 min); wire.wait polls and looks at the peers' processes. The transfer that
    never completes stands in for that gloo state (the run under torchrun: test_faults_dist)."""
    import subprocess
    import sys
    import time

    from colo_rl.split import wire

    class NeverDone:
        def is_completed(self):
            return False

        def wait(self):
            raise AssertionError("a blocking wait: the dead peer would hold it for the group's timeout")

    class Failed:  # a transfer the backend failed: its own error comes out
        def is_completed(self):
            return True

        def wait(self):
            raise RuntimeError("Connection closed by peer")

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = wire.PeerWatch({3: child.pid})
    monkeypatch.setattr(wire, "_WATCH", watch)
    assert watch.gone() is None
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wire.wait([Failed()])
    child.kill()  # not reaped yet: a zombie, as a rank is until its launcher polls it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^rank 3 \(pid {child.pid}\) exited$"):
        wire.wait([NeverDone()])
    assert time.monotonic() - t0 < 1.0
    child.wait()  # reaped: no such process
    assert watch.gone() == f"rank 3 (pid {child.pid}) exited"


def test_auto_split_is_the_fastest_allowed_balance_of_the_measured_phases():
    from colo_rl.bottleneck import balanced_generation_ranks

    # 2 ranks measured 6 s generating and 2 s training per step: 12 and 4 rank-seconds of work.
    # On 4 ranks: g=1 takes max(12/1, 4/3) = 12 s, g=2 max(6, 4/2) = 6 s, g=3 max(4, 4) = 4 s
    seconds = {"generation": 6.0, "train": 2.0, "other": 0.5}
    best = balanced_generation_ranks(seconds, measured_ranks=2, world=4)
    assert best["generation_gpus"] == 3 and best["step_seconds"] == pytest.approx(4.5)
    assert best["balanced_generation_ranks"] == pytest.approx(3.0)
    assert best["generation_idle_share"] == pytest.approx(0) and best["training_idle_share"] == pytest.approx(0)
    # a split the layout refuses (e.g. 3 does not divide the prompts) is never chosen
    assert balanced_generation_ranks(seconds, 2, 4, allowed=lambda g: g != 3)["generation_gpus"] == 2
    # train-bound: the fewest generation ranks
    assert balanced_generation_ranks({"generation": 1.0, "train": 5.0, "other": 0.0}, 2, 4)["generation_gpus"] == 1
    with pytest.raises(ValueError, match="no split of 4 ranks is allowed"):
        balanced_generation_ranks(seconds, 2, 4, allowed=lambda g: False)


def test_auto_split_reads_a_colocated_runs_report_and_refuses_when_it_cannot_know(tmp_path):
    import json
    from types import SimpleNamespace

    from colo_rl.bottleneck import bottleneck_report, resolve_generation_ranks
    from colo_rl.errors import ConfigError

    def placement(g="auto", source=None):
        return SimpleNamespace(generation_ranks=g, balance_from=source)

    assert resolve_generation_ranks(placement("2"), world=4, tp_size=1, prompts_per_step=8) == 2
    with pytest.raises(ConfigError, match="placement.balance_from=<its run directory>"):
        resolve_generation_ranks(placement(), 4, 1, 8)
    with pytest.raises(ConfigError, match="neither summary.json nor metrics.jsonl"):
        resolve_generation_ranks(placement(source=str(tmp_path)), 4, 1, 8)
    rows = [{"step": s, "time/step": 8.5, "time/generation": 6.0, "time/logprobs": 0.5, "time/update": 1.5,
             "time/reward": 0.5} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match="no bottleneck report"):  # the run has not finished
        resolve_generation_ranks(placement(source=str(tmp_path)), 4, 1, 8)
    (tmp_path / "summary.json").write_text(json.dumps({"bottleneck": bottleneck_report(rows, 2)}))
    assert resolve_generation_ranks(placement(source=str(tmp_path / "summary.json")), 4, 1, 8) == 2  # 3 cannot split 8 prompts
    assert resolve_generation_ranks(placement(source=str(tmp_path)), 4, 1, 12) == 3
    split = tmp_path / "split"
    split.mkdir()
    (split / "metrics.jsonl").write_text(json.dumps({**rows[0], "split/policy_version": 0}) + "\n")
    with pytest.raises(ConfigError, match="is a split run"):
        resolve_generation_ranks(placement(source=str(split)), 4, 1, 8)


def test_a_generators_position_round_trips_through_json():
    """What a checkpoint's state.json keeps of a generation rank: the data position and the
    engine's sampling RNG, so the draws after a restore are the draws after the save."""
    import json

    from colo_rl.data.sampler import EpochSampler
    from colo_rl.split.position import generator_position, restore_generator_position

    class Engine:  # the HF engine's RNG methods
        def __init__(self):
            self.generator = torch.Generator().manual_seed(3)

        def rng_state(self):
            return self.generator.get_state()

        def set_rng_state(self, state):
            self.generator.set_state(state)

    sampler, engine = EpochSampler(10, seed=7), Engine()
    sampler.next_global(4)
    torch.rand(5, generator=engine.generator)
    saved = json.loads(json.dumps(generator_position(sampler, engine)))
    after = sampler.next_global(4), torch.rand(3, generator=engine.generator)
    other_sampler, other_engine = EpochSampler(10, seed=7), Engine()
    restore_generator_position(saved, other_sampler, other_engine)
    assert other_sampler.next_global(4) == after[0]
    assert torch.equal(torch.rand(3, generator=other_engine.generator), after[1])
