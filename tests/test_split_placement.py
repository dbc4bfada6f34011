"""Split placement end to end (issue #35): recipes/grpo.py under torchrun with gloo, 1 generation
rank + 1 trainer rank, the tiny model, against a colocated run of the same work on one rank.

- k = 0 (synchronous split) trains on exactly what a one-rank colocated run trains on: the same
  engine seed and data shard (the generation pool's rank 0 of 1), the same starting weights (the
  trainer's version 0 is broadcast before the first rollout), one ZeRO-3 rank, so the same losses,
  gradient norms and rewards step by step.
- k = 1 (one-step-off): every sample is at most one version old, and the rollout of step t+1 is
  generated while step t trains (wall-clock overlap > 0); dynamic sampling fills on the generation rank.
- drop: with k = 0 and generators that never wait, stale rollouts are dropped and counted; every
  generated slot is either trained, dropped or left unused at the end.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import WORKERS, run_torchrun

# whole runs in split placement: in make test-e2e, not make test (CI runs both)
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 3
COMMON = ["model=tiny", f"trainer.total_steps={STEPS}", "data.eval_size=8", "rollout.prompts_per_step=4",
          "rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8",
          "trainer.micro_batch_size=8", "trainer.lr=1e-3", "reward.functions=[letter_share]",
          "reward.format_weight=0", "colocate.handoff_check_max_mean_abs=0.001", "plots=false",
          "logger=[jsonl]"]
SAME = ["train/loss", "train/grad_norm", "reward/mean", "response/len_mean", "throughput/train_tokens"]


def launch(tmp_path, name, extra, nproc=2):
    """Every metrics row of the run (step 0 included) and its console."""
    d = tmp_path / name
    proc = run_torchrun(WORKERS / "grpo_resume_worker.py", [*COMMON, *extra, f"run_dir={d}"], nproc=nproc,
                        timeout=600)
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()], proc.stdout + proc.stderr


def run(tmp_path, name, extra, nproc=2):
    """The run's rows after step 0 and its console."""
    rows, out = launch(tmp_path, name, extra, nproc)
    return [r for r in rows if r["step"] > 0], out


# k = 0 for 4 steps: compared with the colocated run, and the uninterrupted run of the resume test
SPLIT_K0 = ["placement.mode=split", "rollout.max_staleness=0", "trainer.total_steps=4"]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("colocated"), "run", ["trainer.total_steps=4"], nproc=1)[0]


@pytest.fixture(scope="module")
def split_k0(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("split_k0"), "run", SPLIT_K0)[0]


def test_k0_split_trains_what_the_colocated_run_trains(split_k0, colocated):
    (step0, *split), (colocated_step0, *colocated) = split_k0, colocated
    assert len(split) == len(colocated) == 4
    # held-out evaluation runs on the generation rank with the weights of step 0 and of the end, and
    # gives what the colocated run's evaluation gives
    for s, c in ((step0, colocated_step0), (split[-1], colocated[-1])):
        assert s["eval/count"] == c["eval/count"] == 8
        for key in ("eval/accuracy", "eval/response_len", "eval/format_rate"):
            assert s[key] == pytest.approx(c[key]), (s["step"], key)
    for s, c in zip(split, colocated):
        assert s["split/staleness_max"] == 0 and s["split/policy_version"] == s["step"] - 1
        assert s["split/overlap_seconds"] == 0  # synchronous: generation waits for the last update's weights
        # the engine-vs-trainer check holds on every step; its value differs from the colocated run's in the
        # 8th digit (a one-rank colocated engine reads DeepSpeed's flat buffer in place, the split one a copy)
        assert s["handoff/logprob_diff_mean"] < 1e-5
        for key in SAME:
            assert s[key] == pytest.approx(c[key], rel=1e-4, abs=1e-6), (s["step"], key, s[key], c[key])


def test_k1_overlaps_generation_with_the_update_and_stays_within_one_version(tmp_path):
    """k = 1 with DAPO's dynamic sampling on (one run for both): the generation rank samples its
    extra rounds and fills alone, the trainer reports them."""
    rows, _ = run(tmp_path, "k1", ["placement.mode=split", "rollout.max_staleness=1",
                                   "algo.rollout_correction=tis_token", "rollout.group_size=2",
                                   "reward.functions=[odd_length]", "algo.dynamic_sampling=true",
                                   "algo.max_sampling_rounds=2"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["split/staleness_max"] <= 1 for r in rows)
    assert all(r["split/dropped_groups"] == 0 for r in rows)  # wait policy: nothing wasted
    for row in rows:  # groups of 2 whose answers differ in parity: reward 0.5 when none had to be filled
        assert 1 <= row["sampling/rounds"] <= 3 and 0 <= row["sampling/filled_groups"] <= 4
        if row["sampling/filled_groups"] == 0:
            assert row["reward/mean"] == pytest.approx(0.5)
    assert max(row["sampling/rounds"] for row in rows) > 1  # extra rounds were sampled
    # step 2's rollout was generated while step 1 trained (the generator held version 0 then)
    assert rows[1]["split/policy_version"] == 0 and rows[1]["split/staleness_max"] == 1
    assert rows[1]["split/generation_start"] < rows[0]["split/update_end"]
    assert sum(r["split/overlap_seconds"] for r in rows) > 0
    # the engine-vs-trainer check ran on the fresh step (version 0 at step 1) and held
    assert rows[0]["handoff/logprob_diff_mean"] < 1e-3
    # each weight sync is in the ledger as a colocated handoff is: its step, bytes and seconds
    records = [json.loads(line) for line in (tmp_path / "k1" / "ledger.jsonl").read_text().splitlines()]
    syncs = {r["step"]: r["moves"][0] for r in records if r["transition"] == "weight sync"}
    # (the ledger names the loop's step index, as the colocated transitions' records do: row step - 1)
    synced = {r["step"] - 1: r for r in rows if "split/weight_sync_bytes" in r}
    assert syncs.keys() == synced.keys() and len(syncs) >= 1
    for step, move in syncs.items():
        assert move["what"] == "weights broadcast" and move["bytes"] == synced[step]["split/weight_sync_bytes"] > 0
        assert move["seconds"] == synced[step]["time/weight_sync"]


def test_drop_policy_counts_every_dropped_group(tmp_path):
    rows, out = run(tmp_path, "drop", ["placement.mode=split", "rollout.max_staleness=0",
                                       "rollout.staleness_policy=drop"])
    assert all(r["split/staleness_max"] == 0 for r in rows)  # what is trained is never stale
    generated = int(re.search(r"generation rank 0: (\d+) slot\(s\) generated", out).group(1))
    unused = int(re.search(r"(\d+) slot\(s\) generated past the end were not trained", out).group(1))
    dropped = rows[-1]["split/dropped_groups_total"]
    assert dropped == sum(r["split/dropped_groups"] for r in rows) > 0
    assert generated == STEPS + dropped / 4 + unused  # 4 groups per slot: trained, dropped or unused


def test_lora_and_a_reward_model_in_split_placement(tmp_path):
    """model.lora.rank > 0 and a reward model in split placement (one run for both):
    - the trainers gather whole merge units (base weight + both adapter matrices) and broadcast
      W + scaling B A under the HF names, so the generation rank's engine serves the adapted policy:
      its log-probs equal the trainer's while the policy moves away from the base (the KL to the
      base, what the adapters change, far above the gap);
    - the verifiers score where the episodes run, the reward model on the trainer rank before the
      advantages; the step's reward is their weighted sum, as in a colocated run."""
    from test_reward_model import make_tiny_reward_model

    rm = make_tiny_reward_model(tmp_path / "rm", seed=1)
    rows, _ = run(tmp_path, "lora", ["placement.mode=split", "rollout.max_staleness=0", "model.lora.rank=8",
                                     "algo.kl_coef=0.05", "reward.functions=[math_verify]", "reward.weights=[1.0,2.0]",
                                     f"reward.model.path={rm}"])
    assert [r["split/policy_version"] for r in rows] == list(range(STEPS))
    assert all(r["handoff/logprob_diff_max"] < 1e-4 for r in rows), [r["handoff/logprob_diff_max"] for r in rows]
    assert rows[-1]["train/kl"] > 1e-5 and rows[-1]["train/kl"] > 100 * rows[-1]["handoff/logprob_diff_mean"]
    # the merged model's bytes each sync (an adapter-only sync would be ~1/50 of it)
    assert all(r["split/weight_sync_bytes"] == rows[0]["split/weight_sync_bytes"] > 0 for r in rows)
    for row in rows:
        assert row["reward_source/model"] != 0 and row["time/reward_model"] > 0 and row["train/grad_norm"] > 0
        expected = 1.0 * row["reward_source/math_verify"] + 2.0 * row["reward_source/model"]
        assert row["reward/mean"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_killed_split_run_resumes_where_its_checkpoint_left_the_data(tmp_path, split_k0):
    """resume=auto in split placement (k = 0, the HF engine): run B checkpoints every step and is
    killed (SIGKILL, every process) once checkpoint 2 is complete; resumed, its steps 3 and 4 equal
    those of run A (`split_k0`), which ran 4 steps uninterrupted. The trainer restored DeepSpeed's state, each
    generator the data position and sampling RNG of the last slot the trainer used (what it had
    generated beyond is generated again): no prompt skipped or repeated."""
    import subprocess
    import time

    from test_checkpoint_resume import kill_all, torchrun_cmd

    from colo_rl.checkpoint import is_complete
    from conftest import ROOT, child_env, child_python_path

    split, a = SPLIT_K0, split_k0[1:]
    b = tmp_path / "b"
    with open(tmp_path / "killed.log", "w") as out:
        proc = subprocess.Popen(torchrun_cmd([*COMMON, *split, "trainer.save_every=1", f"run_dir={b}"]), cwd=ROOT,
                                env=child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1"), stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not is_complete(b / "checkpoints" / "step-000002"):
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "run B never wrote its checkpoint"
                time.sleep(0.05)
            kill_all(proc)
            proc.wait(timeout=30)
        finally:
            proc.kill()
    resumed, log = run(tmp_path, "b", [*split, "trainer.save_every=1", "resume=auto"])
    assert "resumed at data position" in log
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # the killed run's first two rows, then the resumed ones
    for ra, rb in zip(a[2:], resumed[2:]):
        for key in SAME + ["split/staleness_hist/0"] + ["eval/accuracy"] * (ra["step"] == 4):  # totals go on
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (ra["step"], key, ra[key], rb[key])


def check_wire(out):
    gen, trainer = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert trainer["buckets"] > 1  # 64-byte buckets: the weights travel in several
    assert gen["versions"] == [[0, False], [1, True]]
    assert len(gen["first"]) == 4 and all(gen["first"].values()) and all(gen["second"].values())
    assert gen["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert trainer["part"] == {"slot": 3, "version": 1, "groups": ["g0", "g1"]} and trainer["end"]
    # the next version's receive buffers replace the last one's: one copy of the weights at a time
    assert gen["receive_peak_bytes"] == gen["one_copy_bytes"]


def test_wire_carries_weights_and_rollouts_over_gloo(tmp_path):
    run_torchrun(WORKERS / "split_wire_worker.py", [str(tmp_path)], timeout=300)
    check_wire(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_wire_carries_weights_and_rollouts_over_nccl(tmp_path):
    """The same over NCCL (one GPU per rank): every buffer on the device (wire.wire_device)."""
    run_torchrun(WORKERS / "split_wire_worker.py", [str(tmp_path)], timeout=300)
    check_wire(tmp_path)


def test_an_nccl_wires_buffers_are_allocated_on_the_device_not_staged_on_the_host(monkeypatch):
    """Every bucket of every weight version was `torch.empty` on the host, then copied to the GPU:
    a model-sized pageable host buffer per version. On NCCL the buffer is now allocated on the
    device itself (here the meta device stands in: a 1 TiB host buffer could not exist)."""
    from colo_rl import dist
    from colo_rl.split import wire

    monkeypatch.setattr(wire.tdist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(dist, "device", lambda: torch.device("meta"))
    flat = wire.wire_empty(1 << 40, torch.uint8)
    assert flat.device.type == "meta" and flat.numel() == 1 << 40
    monkeypatch.setattr(wire.tdist, "get_backend", lambda *a, **k: "gloo")
    assert wire.wire_empty(4, torch.int64).device.type == "cpu"
