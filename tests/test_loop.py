"""The one training loop (colo_rl/loop.py) with a scripted recipe: order of calls, evaluation and
checkpoint cadence, resume, and a stop signal. No model: the loop's own logic."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from colo_rl import loop
from colo_rl.loggers import read_jsonl
from colo_rl.metrics import MetricsLogger


class Script:
    """A recipe that records what the loop asks of it."""

    name = "TEST"

    def __init__(self, total_steps: int, resume_at: int = 0, signal_at: int | None = None):
        self.total_steps = total_steps
        self.resume_at = resume_at
        self.signal_at = signal_at
        self.calls: list[tuple] = []

    def resume(self, ckpt):
        self.calls.append(("resume",))
        return self.resume_at

    def evaluate(self, step):
        self.calls.append(("evaluate", step))
        return {"eval/score": float(step)}

    def train_step(self, step):
        self.calls.append(("train_step", step))
        if self.signal_at == step:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C would, mid-step
        return {"train/loss": 1.0 / (step + 1)}

    def save(self, ckpt, step):
        self.calls.append(("save", step))

    def plot(self):
        self.calls.append(("plot",))

    def finish(self, result):
        self.calls.append(("finish", result.last_eval["eval/score"]))


class Ckpt:
    def __init__(self, run_dir: Path, save_every: int):
        self.run_dir, self.save_every = run_dir, save_every

    def due(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0


def cfg(eval_every: int, profile_steps: tuple = ()):
    return SimpleNamespace(trainer=SimpleNamespace(eval_every=eval_every, profile_steps=list(profile_steps)))


def test_fresh_run_evaluates_first_then_steps_with_cadences(tmp_path):
    recipe = Script(total_steps=5)
    metrics = MetricsLogger(tmp_path, loggers=["jsonl"])
    result = loop.run(recipe, cfg(eval_every=2), Ckpt(tmp_path, save_every=3), metrics, {"time/setup": 1.5})
    assert recipe.calls == [("resume",), ("evaluate", 0), ("train_step", 0), ("train_step", 1), ("evaluate", 2),
                            ("train_step", 2), ("save", 3), ("train_step", 3), ("evaluate", 4), ("train_step", 4),
                            ("evaluate", 5), ("save", 5), ("finish", 5.0)]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[0]["time/setup"] == 1.5 and "train/loss" not in rows[0]
    assert [r.get("eval/score") for r in rows] == [0.0, None, 2.0, None, 4.0, 5.0]
    assert all(r["time/step"] >= 0 for r in rows[1:])
    assert (result.first_eval, result.last_eval, result.stopped_by, result.exit_code) == \
        ({"eval/score": 0.0}, {"eval/score": 5.0}, None, 0)


def test_the_profiled_step_is_the_metrics_row_named(tmp_path, monkeypatch):
    """trainer.profile_steps=[2]: the loop's second step (train_step(1), metrics row 2) runs under the
    profiler, and only it."""
    from colo_rl.profiling import StepProfiler

    written = []
    monkeypatch.setattr(StepProfiler, "write", lambda self, row, prof, host, category: written.append(row))
    metrics = MetricsLogger(tmp_path, loggers=["jsonl"])
    loop.run(Script(total_steps=3), cfg(eval_every=0, profile_steps=[2]), Ckpt(tmp_path, save_every=0), metrics)
    assert written == [2]
    # its row says so (the bottleneck report leaves it out), and the writing is not in its time/step
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert ["time/profile_write" in r for r in rows] == [False, False, True, False]


def test_resumed_run_skips_step_zero_and_reads_its_evaluations_back(tmp_path):
    metrics = MetricsLogger(tmp_path, loggers=["jsonl"])
    metrics.log(0, {"eval/score": 0.0}, console=False)  # what the interrupted run had logged
    metrics.log(2, {"train/loss": 0.3, "eval/score": 2.0}, console=False)
    recipe = Script(total_steps=4, resume_at=2)
    result = loop.run(recipe, cfg(eval_every=0), Ckpt(tmp_path, save_every=0), metrics)
    assert recipe.calls == [("resume",), ("train_step", 2), ("train_step", 3), ("evaluate", 4), ("save", 4),
                            ("finish", 4.0)]
    assert result.first_eval == {"eval/score": 0.0} and result.start_step == 2


def test_a_stop_signal_saves_after_the_step_draws_the_curves_so_far_and_skips_finish(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    recipe = Script(total_steps=6, signal_at=1)
    result = loop.run(recipe, cfg(eval_every=0), Ckpt(tmp_path, save_every=0), MetricsLogger(tmp_path, ["jsonl"]))
    assert recipe.calls[-3:] == [("train_step", 1), ("save", 2), ("plot",)]
    assert result.stopped_by == "SIGINT" and result.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_an_error_in_a_step_restores_the_signal_handlers(tmp_path):
    before = signal.getsignal(signal.SIGTERM)

    class Broken(Script):
        def train_step(self, step):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        loop.run(Broken(3), cfg(0), Ckpt(tmp_path, 0), MetricsLogger(tmp_path, ["jsonl"]))
    assert signal.getsignal(signal.SIGTERM) is before


def test_redirected_output_shows_each_steps_i_of_n_and_eta_on_its_line(tmp_path, caplog):
    """Under nohup / SLURM (no terminal) rich drew only the finished bar, at the end."""
    recipe = Script(total_steps=3, resume_at=1)
    metrics = MetricsLogger(tmp_path, loggers=["jsonl"])
    with caplog.at_level("INFO", logger="colo_rl"):
        loop.run(recipe, cfg(eval_every=0), Ckpt(tmp_path, save_every=0), metrics)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 2 | ") and " | 2/3, elapsed 0s, ETA 0s" in lines[0], lines
    assert lines[1].startswith("step 3 | ") and lines[1].endswith(" | 3/3, elapsed 0s, ETA 0s"), lines
