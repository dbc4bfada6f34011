"""Per-step metrics (to the writers of colo_rl/loggers.py), timers, the rank-0 progress bar and run plots."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

import torch

from colo_rl import dist
from colo_rl.loggers import LOGGERS
from colo_rl.profiling import RANGE_PREFIX

log = logging.getLogger("colo_rl")


class Timer:
    """Accumulates wall-clock seconds per named section: `with timer("generation"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(RANGE_PREFIX + name):  # a profiled step's sections (profiling.py)
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        self.seconds = {}
        return out


class StepSums:
    """A step's statistics added up over its micro-batches where they are computed, read once.

    `add` takes 0-d device tensors or floats and keeps tensors on their device (float64, detached):
    nothing inside the micro-batch loop waits for the device. `totals` then reads every tensor to
    the host in one transfer and reduces over ranks: keys named in `maxima` take the largest value
    (statistics >= 0), the others are summed. Every rank calls `totals` with the same keys
    (collectives): `keys` and `maxima` start at 0, so a rank whose micro-batches add nothing to
    them still has them.
    """

    def __init__(self, keys: Iterable[str] = (), maxima: Iterable[str] = ()) -> None:
        self.maxima = frozenset(maxima)
        self.values: dict[str, object] = dict.fromkeys([*keys, *maxima], 0.0)

    def add(self, values: Optional[dict] = None, prefix: str = "", **named) -> None:
        """Add `values` (and `named`) under `prefix` + their key."""
        for key, value in {**(values or {}), **named}.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().to(torch.float64)
            key = prefix + key
            old = self.values.get(key)
            if old is None:
                self.values[key] = value
            elif key in self.maxima:
                self.values[key] = _maximum(old, value)
            else:
                self.values[key] = old + value

    def totals(self) -> dict[str, float]:
        """Every key's sum (or maximum) over micro-batches and ranks, as floats."""
        local = dist.host_floats(self.values)  # one device-to-host transfer
        maxima = sorted(k for k in local if k in self.maxima)
        sums = {k: v for k, v in local.items() if k not in self.maxima}
        out = dist.all_reduce_sum(sums) if sums else {}
        if maxima:
            out.update(zip(maxima, dist.all_reduce_max([local[k] for k in maxima])))
        return out


def _maximum(a, b):
    """The larger of two floats or device tensors, NaN if either is (no host tensor joins a device one)."""
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b)
    if isinstance(b, torch.Tensor):
        return b.clamp(min=a)
    return a if (a != a or a >= b) else b


# The phase switch that work outside a step paid, under its own keys: an evaluation's switch into
# the generation phase (part of time/eval), a save's switch back to the update phase (part of
# time/save; it hands nothing off). colo_rl/bottleneck.py charges them.
EVAL_SWITCH_KEYS = {"time/handoff": "time/eval_handoff", "time/phase_switch": "time/eval_phase_switch"}
SAVE_SWITCH_KEYS = {"time/phase_switch": "time/save_phase_switch"}


class MetricsLogger:
    """Rank 0 writes each step's row to every writer `loggers` names (colo_rl/loggers.py: metrics.jsonl,
    TensorBoard, wandb), each given the resolved `config` once; every rank may call `log` (no-op elsewhere)."""

    def __init__(self, run_dir: Path, loggers: Iterable[str] = ("jsonl", "tensorboard"),
                 console_keys: Iterable[str] = (), config: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.enabled = dist.is_rank0()
        self.console_keys = list(console_keys)
        self.path = self.run_dir / "metrics.jsonl"
        # metrics.jsonl first: the run reads it back (summary, plots, resume), whatever the others do
        names = sorted(loggers, key=lambda name: name != "jsonl")
        self.writers = [(name, LOGGERS.get(name)(self.run_dir, config or {})) for name in names] if self.enabled else []

    def log(self, step: int, metrics: dict[str, float], console: bool = True, progress: str = "") -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: clean_value(v) for k, v in metrics.items()}}
        for name, writer in list(self.writers):
            self._guarded(name, writer, lambda: writer.write(step, row), f"step {step}")
        if console:
            shown = [k for k in self.console_keys if k in row]
            keys = shown or [k for k in row if k != "step"][:8]
            # named against every console key, not this row's: a metric keeps one name on every line
            names = console_names(self.console_keys if shown else keys)
            # the value as measured (nan, inf) where the row holds null for it
            log.info("step %d | %s%s", step, "  ".join(f"{names[k]}={_fmt(_measured(metrics.get(k, row[k])))}"
                                                        for k in keys),
                     f" | {progress}" if progress else "")

    def close(self) -> None:
        for name, writer in list(self.writers):
            self._guarded(name, writer, writer.close, "closing")
        self.writers = []

    def _guarded(self, name: str, writer, call, what: str) -> None:
        """A monitoring service that fails mid-run (wandb's process gone, an MLflow server down) is
        dropped with a warning, not the training run; metrics.jsonl's own failure (a full disk) stops it."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any writer's failure
            if name == "jsonl":
                raise
            log.warning("logger %s failed (%s: %s) at %s: it writes nothing more this run; metrics.jsonl and the "
                        "other loggers go on", name, type(e).__name__, e, what)
            self.writers = [(n, w) for n, w in self.writers if w is not writer]


# Last parts that say nothing alone: reward/mean stays reward/mean, time/step is not a step number.
VAGUE_ALONE = {"step", "total", "mean", "std", "min", "max"}


def console_names(keys: list[str]) -> dict[str, str]:
    """Short console names (the last part of the key), unique among `keys`. The full key stays for a
    held-out score (eval/..., never mistaken for a training one), a last part two keys share
    (rewards/margins, eval/rewards/margins) and one vague alone (VAGUE_ALONE)."""
    last = [k.split("/")[-1] for k in keys]
    return {k: k if (k.startswith("eval/") or n in VAGUE_ALONE or last.count(n) > 1) else n
            for k, n in zip(keys, last)}


def clean_value(v):
    """A metric as JSON writes it: a number as a float, a non-finite one as None; text as it is."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return v
    return v if math.isfinite(v) else None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _measured(v):
    """A metric as a float where it is a number (nan and inf kept), else as it is (None, text)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def json_text(obj, indent: Optional[int] = 2) -> str:
    """`obj` as JSON (indented; one line with `indent=None`), a non-finite number as null, as
    metrics.jsonl writes it: Python's NaN / Infinity are no JSON, and other readers (jq, JavaScript)
    refuse the file."""
    def finite(o):
        if isinstance(o, dict):
            return {k: finite(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        if o is None or isinstance(o, (str, bool, int)):
            return o
        return clean_value(o)

    return json.dumps(finite(obj), indent=indent, allow_nan=False, default=float)


class RolloutLog:
    """<run_dir>/rollouts.jsonl (GRPO, `log_rollout_groups`): the first groups of rank 0's training
    batch every step, one line per completion: what the policy wrote and what it was paid. Read it,
    or `jq 'select(.step == 5) | .completion' rollouts.jsonl`; a resume cuts it back to its checkpoint
    as it does metrics.jsonl. `step` is the metrics.jsonl row of the step that trained on it."""

    def __init__(self, run_dir: Path, groups: int, prompt_text, decode):
        self.path, self.groups = Path(run_dir) / "rollouts.jsonl", groups
        self.prompt_text, self.decode = prompt_text, decode  # problem -> its prompt; token ids -> text

    def write(self, step: int, rollout) -> None:
        if not self.groups or not dist.is_rank0():
            return
        lines = []
        shaping = {name: values.tolist() for name, values in rollout.shaping.items()}
        for g, group in enumerate(rollout.groups[:self.groups]):
            prompt, row0 = self.prompt_text(group.problem), g * rollout.group_size
            for i, c in enumerate(group.completions):
                row = {"step": step, "group": g, "sample": i, "policy_version": rollout.policy_version,
                       "prompt": prompt, "completion": group.texts[i] if group.texts else self.decode(c.token_ids),
                       "answer": getattr(group.problem, "answer", None), "reward": group.rewards[i],
                       "sources": {name: values[i] for name, values in group.sources.items()},
                       "shaping": {name: values[row0 + i] for name, values in shaping.items()},
                       "correct": group.correct[i] if group.correct else None,
                       "tokens": len(c.token_ids), "finish_reason": c.finish_reason}
                if c.policy_mask is not None:  # an episode: the whole transcript, tool results included
                    row["transcript"] = self.decode(c.token_ids)
                lines.append(json_text(row, indent=None) + "\n")
        with open(self.path, "a") as fh:
            fh.write("".join(lines))


class Progress:
    """A rich progress bar with ETA on rank 0; when output is not a terminal (nohup, SLURM, a pipe),
    where rich would draw only the finished bar, `status()` is the step line's ending: `3/14, ETA 3m40s`."""

    def __init__(self, total: int, description: str, start: int = 0, terminal: Optional[bool] = None):
        self.bar = None
        self.task = None
        self.lines = False
        if not dist.is_rank0():
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        if not (Console().is_terminal if terminal is None else terminal):
            self.lines, self.total, self.description = True, total, description
            self.start, self.done, self.t0 = start, start, time.monotonic()
            return

        # speed over the whole run: rich's default 30-s window holds no sample when a step takes longer
        # (a GRPO step takes minutes), and the ETA stayed -:--:--
        self.bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), transient=False,
                                speed_estimate_period=7 * 24 * 3600.0)
        self.bar.start()
        self.task = self.bar.add_task(description, total=total, completed=start)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)
        if self.lines:
            self.done += n

    def status(self) -> str:
        """`i/N, elapsed ..., ETA ...` without a terminal (at this run's own pace); "" with the bar."""
        if not self.lines or self.done == self.start:
            return ""
        elapsed = time.monotonic() - self.t0
        eta = elapsed / (self.done - self.start) * (self.total - self.done)
        return f"{self.done}/{self.total}, elapsed {_duration(elapsed)}, ETA {_duration(eta)}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _duration(seconds: float) -> str:
    """1h02m, 3m40s, 12s."""
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def plot_curves(rows: list[dict], out_path: Path, panels: list[tuple[str, list[str]]], title: str) -> Optional[Path]:
    """One PNG with a panel per (title, metric keys) against step; missing keys are left out."""
    if not dist.is_rank0() or not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [(t, [k for k in keys if any(r.get(k) is not None for r in rows)]) for t, keys in panels]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (panel_title, keys) in zip(axes[0], panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=k)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a short run's axis read 1.25, 1.5, ...
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, out_path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, write as PNG and close (matplotlib keeps open figures alive)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
