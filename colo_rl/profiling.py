"""Where a step's time goes: `trainer.profile_steps` profiles the steps it names (metrics rows, from 1).

Each profiled step runs under torch.profiler (CPU operators, and CUDA kernels on a GPU) and cProfile
at once, and writes to <run_dir>/profile/:

- `step<N>-rank<R>.trace.json.gz` (every rank): the chrome trace; open it in https://ui.perfetto.dev
  or chrome://tracing. The recipe's timed sections (generation, reward, logprobs, update, ...) and the
  phase switches are ranges named `colo_rl/<section>`.
- `step<N>.json` / `step<N>.md` (rank 0): per section its wall seconds and the device's busy seconds
  inside it (the union of kernel intervals: the trainer's process only; SGLang's kernels run in the
  engine's process), the host's seconds by Python package (cProfile's self time; a C built-in such as
  autograd's `run_backward` or a stream's `synchronize` counted to its caller's package), and the
  functions, operators and kernels that cost the most.

Both profilers slow the host, so a host-bound profiled step runs slower than its neighbours (compare
its metrics row with theirs): read the shares, not the seconds. A profiler that cannot start, or a
profile that cannot be written, is a warning: the step and the run go on. The same host attribution
serves `benchmarks/gpu/update_mfu.py`.
"""

from __future__ import annotations

import cProfile
import gzip
import json
import logging
import pstats
import shutil
import time
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Callable, Iterable, Iterator

import torch

from colo_rl import dist

log = logging.getLogger("colo_rl")

RANGE_PREFIX = "colo_rl/"  # metrics.Timer's sections and the phase switches, as record_function ranges
PACKAGES = ("deepspeed", "transformers", "sglang", "torch", "colo_rl", "benchmarks", "recipes")
BUILTIN = "~"  # cProfile's file name for C functions
WRITE_SECTION = "profile_write"  # the Timer section a profiled step's writing is timed as (time/profile_write)


def is_profiled(row: dict) -> bool:
    """Is this metrics row a profiled step's? Its time/profile_write says so: both profilers slowed it."""
    return f"time/{WRITE_SECTION}" in row


# ----------------------------------------------------------------------------- trace arithmetic
def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def busy_within(events: list[dict], t0: float, t1: float, category: str) -> tuple[float, int]:
    """The union of `category` events ("kernel") clipped to [t0, t1) (trace microseconds), and how
    many of them overlap it."""
    inside = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in events
              if e.get("cat") == category and e.get("ph") == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    return union_seconds(inside), len(inside)


def section_figures(trace: dict, category: str | None = "kernel") -> dict[str, dict]:
    """Per `colo_rl/<section>` range of a chrome trace: its count, wall seconds and the seconds of
    `category` events inside it (summed over its instances; None: not counted, busy_s None)."""
    events = trace.get("traceEvents", [])
    out: dict[str, dict] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or e.get("cat") != "user_annotation" or not name.startswith(RANGE_PREFIX):
            continue
        row = out.setdefault(name[len(RANGE_PREFIX):], {"count": 0, "wall_s": 0.0, "busy_s": 0.0 if category else None})
        row["count"] += 1
        row["wall_s"] += e["dur"] / 1e6
        if category:
            row["busy_s"] += busy_within(events, e["ts"], e["ts"] + e["dur"], category)[0] / 1e6
    return out


# a chrome trace's event categories: the host's (nesting per thread) and the device's
HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_ops(events: list[dict], categories: Iterable[str], n: int = 12) -> list[dict]:
    """The `n` names of a chrome trace's `categories` events with the most self time, as {name,
    calls, self_ms}: an event's duration less its direct children's on the same thread (kernels do
    not nest: their self time is their duration). These are `key_averages()`'s self times, read from
    the exported trace: `key_averages()` rebuilds every event in Python, ~80 s for the ~800k
    operators of a CPU step at SmolLM2's depth. An operator that calls itself (aten::sum) counts
    each entry, where `key_averages()` counts the outer one."""
    wanted = set(categories)
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in wanted and "dur" in e:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    calls: dict[str, int] = {}
    self_us: dict[str, float] = {}
    for thread in threads.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, children's microseconds]
        for e in thread:
            calls[e["name"]] = calls.get(e["name"], 0) + 1
            self_us[e["name"]] = self_us.get(e["name"], 0.0) + e["dur"]
            if e["cat"] in DEVICE_CATEGORIES:  # a stream's kernels follow one another
                continue
            while stack and stack[-1][0] <= e["ts"]:
                _, name, children = stack.pop()
                self_us[name] -= children
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0])
        for _, name, children in stack:
            self_us[name] -= children
    top = sorted(self_us, key=self_us.get, reverse=True)[:n]
    return [{"name": k, "calls": calls[k], "self_ms": self_us[k] / 1e3} for k in top if self_us[k] > 0]


# ----------------------------------------------------------------------------- host time by package
def _package_index(parts: tuple) -> int | None:
    """Where a file's package starts in its path: the part after site-packages (an installed
    package), else the innermost known package folder (this checkout, whatever its folder's name)."""
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = len(parts) - parts[::-1].index(marker)
            return i if i < len(parts) else None
    return next((i for i in range(len(parts) - 1, -1, -1) if parts[i] in PACKAGES), None)


def package_of(filename: str) -> str:
    """The package a function's file belongs to, by its path: one of PACKAGES, else `other` (the
    standard library, other packages)."""
    parts = PurePath(filename).parts
    i = _package_index(parts)
    return parts[i] if i is not None and parts[i] in PACKAGES else "other"


def short_name(func: tuple) -> str:
    """`deepspeed/runtime/zero/stage3.py:1619(__add_grad_to_ipg_bucket)` from cProfile's (file,
    line, name): the path from the package on; a built-in by its name alone."""
    filename, line, name = func
    if filename == BUILTIN:
        return name
    parts = PurePath(filename).parts
    start = _package_index(parts)
    return f"{'/'.join(parts[len(parts) - 1 if start is None else start:])}:{line}({name})"


def summarise(stats: dict, wall_s: float, n: int = 15) -> dict:
    """cProfile's raw stats ({func: (primitive calls, calls, self s, cumulative s, callers)}) as:
    seconds by package (a built-in's self time split over its callers' packages, by what each
    caller's calls cost), the `n` functions with the most self time, and the profiled wall time."""
    by_package: dict[str, float] = {}

    def add(pkg: str, seconds: float) -> None:
        by_package[pkg] = by_package.get(pkg, 0.0) + seconds

    for func, (_, _, self_s, _, callers) in stats.items():
        if func[0] != BUILTIN:
            add(package_of(func[0]), self_s)
        elif not callers:  # called from outside any profiled frame
            add("other", self_s)
        else:
            for caller, caller_stats in callers.items():  # (primitive calls, calls, self s, cumulative s)
                add("other" if caller[0] == BUILTIN else package_of(caller[0]), caller_stats[2])
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return {"wall_s": wall_s, "profiled_s": sum(v[2] for v in stats.values()),
            "by_package": dict(sorted(by_package.items(), key=lambda kv: -kv[1])),
            "top_self": [{"name": short_name(f), "calls": v[1], "self_ms": 1e3 * v[2], "cumulative_ms": 1e3 * v[3]}
                         for f, v in top]}


def profile_call(fn: Callable[[], object]) -> dict:
    """Run `fn` once under cProfile and `summarise` it."""
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    return summarise(pstats.Stats(profiler).stats, time.perf_counter() - t0)


def host_text(host: dict | None) -> str:
    """The Markdown of `summarise`'s result ("" without one)."""
    if not host:
        return ""
    if "error" in host:
        return f"Under cProfile: not measured ({host['error']})."
    packages = ", ".join(f"{k} {v:.2f}" for k, v in host["by_package"].items() if v >= 0.005)
    compiled = host.get("compilations")
    return "\n".join([
        f"Under cProfile ({host['wall_s']:.2f} s, the profiler's own cost included): seconds by "
        f"package (a C built-in counted to its caller's): {packages}."
        + (f" torch.compile compiled {compiled} frame(s) during it: those seconds include compilation." if compiled
           else ""), "",
        "| function (cProfile) | calls | self ms | cumulative ms |", "|---|---|---|---|",
        *[f"| `{o['name'][:90]}` | {o['calls']} | {o['self_ms']:.1f} | {o['cumulative_ms']:.1f} |"
          for o in host["top_self"]]])


# ----------------------------------------------------------------------------- trainer.profile_steps
def step_markdown(row: int, s: dict) -> str:
    """The Markdown of one profiled step's summary (`StepProfiler.write`): shares are of the step's
    own time (the loop's `step` section), not of the profilers' start and stop around it."""
    device = s["device_category"] == "kernel"
    step = max(s["step_s"], 1e-9)
    lines = [f"# Step {row}, profiled (rank 0 of {s['world_size']})", "",
             f"The step took {s['step_s']:.2f} s ({s['wall_s']:.2f} s with the profilers' start and stop) under "
             f"torch.profiler and cProfile, which both slow the host: compare shares, and this step's metrics row "
             f"with its neighbours'. Trace: `{s['trace']}` (https://ui.perfetto.dev).", "",
             "| section | count | wall s | share of the step |" + (" device busy s | busy share |" if device else ""),
             "|---|---|---|---|" + ("---|---|" if device else "")]
    for name, r in sorted(s["sections"].items(), key=lambda kv: -kv[1]["wall_s"]):
        busy = f" {r['busy_s']:.3f} | {100 * r['busy_s'] / max(r['wall_s'], 1e-9):.1f} % |" if device else ""
        lines.append(f"| {name} | {r['count']} | {r['wall_s']:.3f} | {100 * r['wall_s'] / step:.1f} % |" + busy)
    if device:
        lines += ["", f"Device busy from the step's first event to its last: {s['busy_s']:.3f} s. Generation on "
                  "SGLang runs its kernels in the engine's process: not in this trace."]
    lines += ["", host_text(s["host"]), "", "Operators by self CPU time:", "", "| operator | calls | self ms |",
              "|---|---|---|", *[f"| `{o['name'][:80]}` | {o['calls']} | {o['self_ms']:.1f} |" for o in s["host_ops"]]]
    if s["device_ops"]:
        lines += ["", "Kernels by device time:", "", "| kernel | calls | ms |", "|---|---|---|",
                  *[f"| `{o['name'][:80]}` | {o['calls']} | {o['self_ms']:.1f} |" for o in s["device_ops"]]]
    return "\n".join(lines) + "\n"


class StepProfiler:
    """`with profiler(row):` around a training step profiles it when `row` is one of `steps`; the
    writing is timed as `timer`'s WRITE_SECTION, which marks the row (`is_profiled`)."""

    def __init__(self, steps: Iterable[int], run_dir: Path, timer):
        self.steps = set(steps)
        self.dir = Path(run_dir) / "profile"
        self.timer = timer

    def check_reach(self, start: int, total: int) -> None:
        """Say (rank 0) which named steps this run will not reach: rows start+1 .. total run."""
        missed = sorted(s for s in self.steps if not start < s <= total)
        if missed and dist.is_rank0():
            log.warning("trainer.profile_steps: step(s) %s are outside this run's steps %d-%d: not profiled",
                        missed, start + 1, total)

    @contextmanager
    def __call__(self, row: int) -> Iterator[None]:
        started = self._start(row) if row in self.steps else None
        if started is None:
            yield
            return
        prof, host, on_gpu, t0 = started
        try:
            yield
        except BaseException:  # the step failed: stop both, write nothing, let the error through
            host.disable()
            prof.__exit__(None, None, None)
            raise
        host.disable()
        if on_gpu:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        wall = time.perf_counter() - t0
        with self.timer(WRITE_SECTION):
            try:
                self.write(row, prof, summarise(pstats.Stats(host).stats, wall), "kernel" if on_gpu else "cpu_op")
            except Exception as exc:  # a profile that cannot be written must not end the run
                log.warning("trainer.profile_steps: step %d's profile was not written to %s: %s: %s", row, self.dir,
                            type(exc).__name__, exc)

    def _start(self, row: int):
        """Both profilers started, or None (and a warning) where one cannot start: the step then runs
        unprofiled rather than not at all (e.g. Python 3.12's cProfile refuses while another tool holds
        sys.monitoring's profiler slot)."""
        on_gpu = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
        prof, host = torch.profiler.profile(activities=activities), cProfile.Profile()
        try:
            prof.__enter__()
        except Exception as exc:
            log.warning("trainer.profile_steps: step %d not profiled: torch.profiler did not start (%s: %s)", row,
                        type(exc).__name__, exc)
            return None
        try:
            host.enable()
        except Exception as exc:
            prof.__exit__(None, None, None)
            log.warning("trainer.profile_steps: step %d not profiled: cProfile did not start (%s: %s)", row,
                        type(exc).__name__, exc)
            return None
        return prof, host, on_gpu, time.perf_counter()

    def write(self, row: int, prof, host: dict, category: str) -> None:
        """Every rank its trace (gzipped); rank 0 the summary of its own (JSON + Markdown)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"step{row}-rank{dist.rank()}"
        plain = self.dir / f"{stem}.trace.json"
        prof.export_chrome_trace(str(plain))
        # level 1: a CPU step's ~200 MB trace in ~1 s, not level 9's ~8 s, for a file ~25 % larger
        with open(plain, "rb") as fin, gzip.open(self.dir / f"{stem}.trace.json.gz", "wb", compresslevel=1) as out:
            shutil.copyfileobj(fin, out)
        trace = json.loads(plain.read_text()) if dist.is_rank0() else {}
        plain.unlink()
        if not dist.is_rank0():
            return
        events = trace.get("traceEvents", [])
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and "dur" in e]
        t0, t1 = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else (0.0, 0.0)
        sections = section_figures(trace, category if category == "kernel" else None)  # a CPU has no device
        summary = {"step": row, "world_size": dist.world_size(), "wall_s": host["wall_s"],
                   "step_s": sections.get("step", {}).get("wall_s", host["wall_s"]),
                   "trace": f"profile/{stem}.trace.json.gz", "device_category": category,
                   "busy_s": busy_within(events, t0, t1, category)[0] / 1e6 if category == "kernel" else None,
                   "sections": sections, "host": host,
                   "host_ops": trace_ops(events, HOST_CATEGORIES),
                   "device_ops": trace_ops(events, DEVICE_CATEGORIES) if category == "kernel" else []}
        (self.dir / f"step{row}.json").write_text(json.dumps(summary, indent=1) + "\n")
        (self.dir / f"step{row}.md").write_text(step_markdown(row, summary))
        log.info("profile of step %d: %s (trace: %s)", row, self.dir / f"step{row}.md", summary["trace"])
