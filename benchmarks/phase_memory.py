"""Peak memory per phase of a recipe's steps (benchmarks/step_breakdown.py): a sampler thread every 10 ms
(CPU: this process's RSS via psutil; GPU: device-wide used memory via cudaMemGetInfo, which also sees an
SGLang engine's processes) plus one synchronous sample at every phase boundary. Phases are marked by
wrapping, at run time, the recipe's Timer sections and the memory manager's transitions (`instrumented`:
no library code is changed). A sample counts for every phase open at that moment."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from typing import Optional

from benchmarks import common


class PhaseMemory:
    """Peak memory per (step, phase): a sampler thread plus a sample at every phase boundary."""

    def __init__(self, interval: float = 0.01):
        import torch

        self.interval = interval
        self.cuda = torch.cuda.is_available()
        self.kind = "device_used" if self.cuda else "rss"
        if self.cuda:
            from colo_rl import dist

            # The sampler thread's current device would be GPU 0 on every rank: name this rank's.
            gpu = dist.device()
            self._probe = lambda: (lambda f, t: t - f)(*torch.cuda.mem_get_info(gpu))
        else:
            import psutil

            proc = psutil.Process()
            self._probe = lambda: proc.memory_info().rss
        self.lock = threading.Lock()
        self.stack: list[str] = []
        self.step = -1  # -1: before the first step (the step-0 evaluation)
        self.peak: dict[tuple[int, str], int] = {}
        self.entry: dict[tuple[int, str], int] = {}
        # seconds the phase-boundary samples took in the recipe's thread, per step: the harness's own
        # cost inside the step it measures (its thread's samples run beside the step instead)
        self.boundary_seconds: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phase-memory", daemon=True)

    def start(self) -> "PhaseMemory":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _record(self, value: int) -> None:
        for label in self.stack:
            k = (self.step, label)
            if value > self.peak.get(k, -1):
                self.peak[k] = value

    def sample(self) -> int:
        value = int(self._probe())
        with self.lock:
            self._record(value)
        return value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed probe loses one sample, never the run
                pass

    @contextlib.contextmanager
    def phase(self, label: str):
        with self.lock:
            if label == "step":
                self.step += 1
            t0 = time.perf_counter()
            value = int(self._probe())
            self._count_boundary(time.perf_counter() - t0)
            self.entry.setdefault((self.step, label), value)
            self.stack.append(label)
            self._record(value)
        try:
            yield
        finally:
            t0 = time.perf_counter()
            self.sample()
            with self.lock:
                self._count_boundary(time.perf_counter() - t0)
                self.stack.remove(label)

    def _count_boundary(self, seconds: float) -> None:
        self.boundary_seconds[self.step] = self.boundary_seconds.get(self.step, 0.0) + seconds

    def boundary_seconds_per_step(self, steps: list[int]) -> Optional[float]:
        """Mean seconds per step the boundary samples took in the recipe's thread (the given loop steps)."""
        vals = [self.boundary_seconds.get(s, 0.0) for s in steps]
        return statistics.fmean(vals) if vals else None

    def summary(self, steps: list[int]) -> dict[str, dict]:
        """Per phase: peak over the given loop steps (0-based) and the value at its first entry."""
        out: dict[str, dict] = {}
        for (step, label), value in self.peak.items():
            if step not in steps:
                continue
            o = out.setdefault(label, {"peak_gib": 0.0, "entry_gib": None})
            o["peak_gib"] = max(o["peak_gib"], value / common.GIB)
            entry = self.entry.get((step, label))
            if o["entry_gib"] is None and entry is not None:
                o["entry_gib"] = entry / common.GIB
        return out


@contextlib.contextmanager
def instrumented(mem: PhaseMemory):
    """Mark phases for `mem` by wrapping the recipe's Timer sections and the memory manager's
    transitions (handoff inside); everything is restored on exit."""
    from colo_rl.colocate import handoff, memory
    from colo_rl import metrics

    saved = []

    def wrap(owner, attr, label_of):
        original = getattr(owner, attr)
        saved.append((owner, attr, original))

        if attr == "__call__":  # Timer.__call__ is itself a context manager factory
            @contextlib.contextmanager
            def timer_call(self, name):
                with mem.phase(label_of(name)), original(self, name):
                    yield
            setattr(owner, attr, timer_call)
        else:
            def method(self, *a, **kw):
                with mem.phase(label_of(None)):
                    return original(self, *a, **kw)
            setattr(owner, attr, method)

    wrap(metrics.Timer, "__call__", lambda name: name)
    wrap(memory.MemoryManager, "to_generation", lambda _: "phase_switch")
    wrap(memory.MemoryManager, "to_train", lambda _: "phase_switch")
    wrap(handoff.WeightHandoff, "push", lambda _: "handoff")
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)
