"""TP groups on one node: real torchrun ranks (gloo, CPU), a fake engine only on each group owner.

The fake stands for SGLang alone (it cannot run here); the routing, the process groups and the
collectives are the real ones. Run as a script by torchrun, this file is the worker; each rank
writes what it saw to <out>/rank<r>.json and the test checks those records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORLD = 4
N = 3  # completions per prompt
COUNTS = [2, 0, 3, 1]  # prompts per rank (rank 1 has none: it must still get its empty share)


def prompts_for(rank: int) -> list[list[int]]:
    return [[1000 * rank + 10 * i, 7, i] for i in range(COUNTS[rank])]


# ------------------------------------------------------------------------- worker (under torchrun)
class FakeEngine:
    """Stands in for SGLang on a group owner: token ids say which prompt, sample and engine."""

    def __init__(self, rank: int):
        self.rank = rank
        self.calls: list[tuple] = []
        self.fail_next: str | None = None

    def generate(self, prompts, params):
        from colo_rl.rollout.base import Completion

        self.calls.append(("generate", len(prompts)))
        if self.fail_next:
            message, self.fail_next = self.fail_next, None
            raise RuntimeError(message)
        return [Completion(list(p), [p[0], k, self.rank], [-0.5] * 3, "stop") for p in prompts for k in range(params.n)]

    def sleep(self, tags):
        self.calls.append(("sleep", list(tags)))
        return 100 + self.rank

    def wake(self, tags):
        self.calls.append(("wake", list(tags)))
        return 200 + self.rank

    def load_rank_payloads(self, payloads):
        self.calls.append(("load", payloads))
        if self.fail_next:
            message, self.fail_next = self.fail_next, None
            raise RuntimeError(message)

    def finish_weight_update(self):
        self.calls.append(("finish",))


def fake_prepare(named_tensors):
    from colo_rl import dist

    payload = {"rank": dist.rank(), "names": [n for n, _ in named_tensors],
               "sum": float(sum(t.sum() for _, t in named_tensors))}
    return payload, [t for _, t in named_tensors]


def completions_record(completions) -> list:
    return [[c.prompt_ids, c.token_ids, c.finish_reason] for c in completions]


def outcome(fn):
    try:
        return {"ok": fn()}
    except Exception as e:  # noqa: BLE001 - recorded for the test to check
        return {"error": type(e).__name__, "message": str(e)}


def worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as tdist

    from colo_rl.rollout.base import SamplingParams
    from colo_rl.rollout.tp_group import TPGroupEngine

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    assert tdist.get_world_size() == WORLD
    params = SamplingParams(max_new_tokens=4, temperature=0.7, n=N)
    rec: dict = {"rank": rank}

    import hashlib
    import multiprocessing

    def authkey() -> str:
        return hashlib.sha256(bytes(multiprocessing.current_process().authkey)).hexdigest()

    rec["authkey_own"] = authkey()
    fake2 = FakeEngine(rank) if rank % 2 == 0 else None
    tp2 = TPGroupEngine.build(fake2, 2, prepare_payload=fake_prepare)
    rec["authkey_tp2"] = authkey()
    fake4 = FakeEngine(rank) if rank == 0 else None
    tp4 = TPGroupEngine.build(fake4, 4, prepare_payload=fake_prepare)
    rec["authkey_tp4"] = authkey()

    rec["tp2"] = outcome(lambda: completions_record(tp2.generate(prompts_for(rank), params)))
    rec["tp4"] = outcome(lambda: completions_record(tp4.generate(prompts_for(rank), params)))

    # The owner of group 1 fails: its group raises, group 0 is untouched.
    if rank == 2:
        fake2.fail_next = "CUDA out of memory (fake)"
    rec["tp2_engine_error"] = outcome(lambda: completions_record(tp2.generate(prompts_for(rank), params)))

    # Rank 1 asks for other params than its owner: its group refuses, group 1 is untouched.
    mine = SamplingParams(max_new_tokens=4, temperature=0.9 if rank == 1 else 0.7, n=N)
    rec["tp2_param_mismatch"] = outcome(lambda: completions_record(tp2.generate(prompts_for(rank), mine)))

    # Memory: the owner acts, everyone gets the owner's byte count.
    rec["sleep"] = outcome(lambda: tp2.sleep(["kv_cache", "weights"]))
    rec["wake"] = outcome(lambda: tp2.wake(["weights"]))

    # Weights: every rank's payload reaches the owner, in group order.
    bucket = [("w.a", torch.full((2, 2), float(rank))), ("w.b", torch.ones(3))]
    rec["load"] = outcome(lambda: tp2.load_weights(bucket))
    if rank == 0:
        fake2.fail_next = "update_weights_from_tensor failed: (False, 'not in a session')"
    rec["load_error"] = outcome(lambda: tp2.load_weights(bucket))
    rec["finish"] = outcome(lambda: tp2.finish_weight_update())

    rec["calls2"] = fake2.calls if fake2 else None
    rec["calls4"] = fake4.calls if fake4 else None
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rec))
    tdist.barrier()
    tdist.destroy_process_group()


# ------------------------------------------------------------------------- the test
def expected(rank: int, owner: int) -> list:
    return [[p, [p[0], k, owner], "stop"] for p in prompts_for(rank) for k in range(N)]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_group")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_every_rank_gets_exactly_its_own_completions_in_order(records):
    for r, rec in enumerate(records):
        assert rec["tp2"] == {"ok": expected(r, owner=r - r % 2)}, f"rank {r}, tp=2"
        assert rec["tp4"] == {"ok": expected(r, owner=0)}, f"rank {r}, tp=4"


@pytest.mark.slow
def test_owner_generates_once_for_the_whole_group(records):
    calls2 = {r: records[r]["calls2"] for r in (0, 2)}
    assert [c for c in calls2[0] if c[0] == "generate"][0] == ["generate", COUNTS[0] + COUNTS[1]]
    assert [c for c in calls2[2] if c[0] == "generate"][0] == ["generate", COUNTS[2] + COUNTS[3]]
    assert [c for c in records[0]["calls4"] if c[0] == "generate"] == [["generate", sum(COUNTS)]]
    assert records[1]["calls2"] is None and records[3]["calls4"] is None  # non-owners hold no engine


@pytest.mark.slow
def test_owner_failure_reaches_every_rank_of_its_group_only(records):
    for r in (2, 3):
        err = records[r]["tp2_engine_error"]
        assert err["error"] == "TPGroupError" and "CUDA out of memory (fake)" in err["message"], (r, err)
    for r in (0, 1):
        assert records[r]["tp2_engine_error"] == {"ok": expected(r, owner=0)}


@pytest.mark.slow
def test_params_must_agree_within_a_group(records):
    for r in (0, 1):
        err = records[r]["tp2_param_mismatch"]
        assert err["error"] == "TPGroupError" and "ranks [1]" in err["message"], (r, err)
    for r in (2, 3):
        assert records[r]["tp2_param_mismatch"] == {"ok": expected(r, owner=2)}


@pytest.mark.slow
def test_sleep_and_wake_run_on_the_owner_and_report_its_bytes(records):
    # Without CUDA a rank cannot measure its GPU: the owner reports its engine's bytes, others 0.
    for r, rec in enumerate(records):
        owner = r % 2 == 0
        assert rec["sleep"] == {"ok": 100 + r if owner else 0}, r
        assert rec["wake"] == {"ok": 200 + r if owner else 0}, r
    for owner in (0, 2):
        calls = [c for c in records[owner]["calls2"] if c[0] in ("sleep", "wake")]
        assert calls == [["sleep", ["kv_cache", "weights"]], ["wake", ["weights"]]]


@pytest.mark.slow
def test_weight_payloads_reach_the_owner_in_group_order_and_failures_raise_everywhere(records):
    for owner in (0, 2):
        loads = [c for c in records[owner]["calls2"] if c[0] == "load"]
        assert len(loads) == 2
        payloads = loads[0][1]
        assert [p["rank"] for p in payloads] == [owner, owner + 1]
        assert [p["sum"] for p in payloads] == [4.0 * owner + 3, 4.0 * (owner + 1) + 3]
        assert all(p["names"] == ["w.a", "w.b"] for p in payloads)
        assert ["finish"] in records[owner]["calls2"]
    for r, rec in enumerate(records):
        assert rec["load"] == {"ok": None} and rec["finish"] == {"ok": None}
        if r in (0, 1):
            assert rec["load_error"]["error"] == "HandoffError" and "not in a session" in rec["load_error"]["message"]
        else:
            assert rec["load_error"] == {"ok": None}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from colo_rl import process_exit

    process_exit.run_and_exit(lambda: worker(Path(sys.argv[1])))


def test_every_rank_of_a_group_takes_its_owners_authkey(records):
    """A CPU payload (a file descriptor through torch's ForkingPickler) is fetched over a connection
    authenticated with its producer's authkey, and the engine's processes hold the owner's."""
    own = [r["authkey_own"] for r in records]
    assert len(set(own)) == WORLD  # torchrun's ranks start with keys of their own
    assert [r["authkey_tp2"] for r in records] == [own[0], own[0], own[2], own[2]]
    assert [r["authkey_tp4"] for r in records] == [own[0]] * WORLD
