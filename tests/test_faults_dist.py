"""Shutdown and dead ranks with the real GRPO recipe under torchrun (2 gloo ranks, tiny model).

- SIGINT to rank 0 alone: every rank stops after the same step, a checkpoint is written, all exit.
- SIGKILL to rank 1 (a dead rank): rank 0 and torchrun exit with an error within bounded time.
- SIGKILL to torchrun alone: the ranks (each in its own session) do not outlive it.
- SIGKILL to the generation rank of a split run (placement.mode=split): the trainer rank exits with
  one error line naming the dead rank and its pool, the launcher names the signal, nothing hangs.
- SIGINT to the trainer rank of a split run under staleness_policy=drop: every rank ends (the stop
  reaches a generator waiting on its full queue); SIGINT to its generation rank alone: the trainer
  learns of it with the next slot and stops the run the same way.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from colo_rl.checkpoint import newest_checkpoint
from conftest import ROOT, child_env, child_python_path

pytestmark = pytest.mark.slow

OVERRIDES = ["model=tiny", "trainer.total_steps=200", "rollout.prompts_per_step=4", "rollout.group_size=4",
             "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=4", "data.train_size=64", "data.eval_size=4",
             "data.max_prompt_tokens=56", "logger=[jsonl]", "plots=false"]


class Run:
    """recipes/grpo.py under torchrun in the background; its ranks found by their RANK variable."""

    def __init__(self, run_dir: Path, extra: tuple[str, ...] = (), launcher: str = "torch.distributed.run"):
        self.run_dir = run_dir
        self.log_path = run_dir.parent / f"{run_dir.name}.log"
        cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node=2",
               str(ROOT / "recipes" / "grpo.py"), *OVERRIDES, *extra, f"run_dir={run_dir}"]
        env = child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.launcher = psutil.Process(self.proc.pid)

    def wait_for_step(self, step: int, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        path = self.run_dir / "metrics.jsonl"
        while True:
            assert self.proc.poll() is None, self.output()[-4000:]
            if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()):
                return
            assert time.monotonic() < deadline, f"no step {step} in {timeout}s"
            time.sleep(0.1)

    def signal_rank(self, r: int, sig: signal.Signals, timeout: float) -> tuple[int, float, list]:
        """Send `sig` to rank `r` alone; the launcher's exit status, the seconds until it exited, and
        what of the run's processes is still alive 5 s after."""
        procs = self.everything()
        t0 = time.monotonic()
        self.rank(r).send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        seconds = time.monotonic() - t0
        _, alive = psutil.wait_procs(procs, timeout=5)
        return rc, seconds, alive

    def rank(self, r: int) -> psutil.Process:
        for child in self.launcher.children(recursive=True):
            try:
                if child.environ().get("RANK") == str(r):
                    return child
            except psutil.Error:
                continue
        raise AssertionError(f"rank {r} not found")

    def everything(self) -> list[psutil.Process]:
        return [self.launcher] + self.launcher.children(recursive=True)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        for p in self.everything() if self.launcher.is_running() else []:
            p.kill()
        self.proc.kill()
        self.log.close()


@pytest.fixture
def run(tmp_path):
    runs = []

    def start(name="run", **kwargs):
        runs.append(Run(tmp_path / name, **kwargs))
        return runs[-1]

    yield start
    for r in runs:
        try:
            r.close()
        except psutil.Error:
            pass


def test_sigint_to_rank0_stops_every_rank_after_the_step_with_a_checkpoint(run):
    r = run(extra=("plots=true",))
    r.wait_for_step(2)
    rc, seconds, alive = r.signal_rank(0, signal.SIGINT, timeout=60)
    out = r.output()
    print(f"SIGINT to rank 0: all ranks gone {seconds:.1f}s later, torchrun rc {rc}")
    assert alive == [], alive
    assert seconds < 30, seconds
    assert "rank 0 got SIGINT: stopping after the current step" in out
    rows = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]["step"]
    assert f"stopped by SIGINT after step {last}; continue with resume=auto run_dir={r.run_dir}" in out
    assert newest_checkpoint(r.run_dir / "checkpoints").name == f"step-{last:06d}"
    assert out.count("stopped by SIGINT") == 1  # every rank stopped; rank 0 says so
    assert (r.run_dir / "reward_curve.png").stat().st_size > 0  # the curves so far
    assert "Traceback" not in out.split("stopped by SIGINT")[0]  # the ranks stopped, nothing crashed
    # the over-length prompts the data policy dropped are reported in the metrics, not only logged
    assert rows[0]["data/overlong_dropped"] > 0 and rows[0]["data/overlong_truncated"] == 0
    assert f"({int(rows[0]['data/overlong_dropped'])} over-length dropped" in out


def test_a_dead_rank_makes_the_others_exit_with_an_error_not_hang(run):
    r = run()
    r.wait_for_step(2)
    rc, seconds, alive = r.signal_rank(1, signal.SIGKILL, timeout=90)
    print(f"rank 1 SIGKILLed: torchrun exited rc {rc} {seconds:.1f}s later")
    assert rc != 0 and alive == []
    assert seconds < 45, seconds  # torchrun's grace before SIGKILL is 30 s; gloo usually fails at once
    assert "exitcode  : -9" in r.output()  # torchrun names the rank that died


def test_a_killed_launcher_leaves_no_orphan_ranks(run):
    r = run()
    r.wait_for_step(2)
    ranks = [r.rank(0), r.rank(1)]
    t0 = time.monotonic()
    r.launcher.send_signal(signal.SIGKILL)  # the ranks live in their own sessions: nothing else reaches them
    r.proc.wait(timeout=10)
    _, alive = psutil.wait_procs(ranks, timeout=60)
    seconds = time.monotonic() - t0
    print(f"torchrun SIGKILLed: ranks gone {seconds:.1f}s later")
    assert alive == [], alive
    # parent-death signal -> SIGTERM -> the ranks stopped together after a step, with a checkpoint
    assert "got SIGTERM: stopping after the current step" in r.output()
    assert newest_checkpoint(r.run_dir / "checkpoints") is not None


def test_a_killed_generation_rank_ends_a_split_run_with_an_error_naming_it(run):
    """Split placement, rank 0 generates and rank 1 trains, one step off; the generation rank is
    killed mid-run. The trainer's next message to or from it fails on the closed connection: it
    says which rank of which pool stopped answering, in one line, and exits; colo_rl.launch names
    the rank that died and its signal. Within a bound, not torchrun's 30-second grace."""
    r = run(extra=("placement.mode=split", "rollout.max_staleness=1", "algo.rollout_correction=tis_token"),
            launcher="colo_rl.launch")
    r.wait_for_step(2)
    before = len(r.output())
    rc, seconds, alive = r.signal_rank(0, signal.SIGKILL, timeout=90)
    after = r.output()[before:]
    print(f"generation rank SIGKILLed: launcher exited rc {rc} {seconds:.1f}s later\n{after[-2000:]}")
    assert rc == 128 + signal.SIGKILL and alive == [], (rc, alive)
    assert seconds < 30, seconds
    assert ("error: placement.mode=split: generation rank 0 (the generation pool) stopped answering" in after
            or "error: placement.mode=split: a generation rank (ranks [0], the generation pool) stopped answering"
            in after), after[-3000:]
    assert "error: rank 0 (pid" in after and "was killed by SIGKILL" in after  # the launcher's line
    assert "Traceback" not in after  # one line per failure, no bare gloo trace


def sigint_split_run(run, rank: int, who: str, extra: tuple = ()) -> tuple[str, int]:
    """An on-policy split run given a SIGINT on `rank` after step 2: every rank is gone within 30 s
    and the launcher calls it a clean stop (rc 0, as after a Ctrl-C to it), the last logged step is
    checkpointed, no traceback. (output, the last step)."""
    r = run(extra=("placement.mode=split", "rollout.max_staleness=0", *extra), launcher="colo_rl.launch")
    r.wait_for_step(2)
    rc, seconds, alive = r.signal_rank(rank, signal.SIGINT, timeout=90)
    out = r.output()
    print(f"SIGINT to {who}: launcher rc {rc} {seconds:.1f}s later")
    assert alive == [] and rc == 0, (rc, alive, out[-3000:])
    assert seconds < 30, seconds
    last = [json.loads(line) for line in (r.run_dir / "metrics.jsonl").read_text().splitlines()][-1]["step"]
    assert newest_checkpoint(r.run_dir / "checkpoints").name == f"step-{last:06d}"
    assert "Traceback" not in out
    return out, last


def test_sigint_to_the_trainer_of_a_split_run_under_drop_ends_every_rank(run):
    """Split, staleness_policy=drop, on-policy (max_staleness=0): the generator outruns the update and
    waits on its full queue, taking no weights. A SIGINT to the trainer (rank 1) ends the run after
    the step with a checkpoint; its stop reaches the generator (the trainer reads the slot the
    generator waits on first: TrainerPool._unblock_generators) instead of waiting forever."""
    sigint_split_run(run, 1, "the trainer rank of a split run (drop)", ("rollout.staleness_policy=drop",))


def test_sigint_to_the_generation_rank_of_a_split_run_stops_the_run(run):
    """Split, on-policy: a SIGINT to the generation rank alone (rank 0) goes to the trainer with the
    next slot (RolloutPart.stop_signal), which stops after that step with a checkpoint and stops the
    generator; before, the generator logged the signal and the run went on to its last step."""
    out, last = sigint_split_run(run, 0, "the generation rank of a split run")
    assert "rank 0 got SIGINT: stopping after the current step" in out
    assert last < 20 and f"stopped by SIGINT after step {last}" in out, last
