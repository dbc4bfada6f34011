"""Where the host's time of one update goes, by Python function (cProfile). The torch.profiler
trace names aten operators and kernels; on an H100 most of the 0.5B update's host time was the
"update" range's own self time (2.5-2.7 s of 3.4 s, 2026-11-27): Python between operators, which the
trace does not attribute. cProfile does: every function's own time, and built-ins (C methods such
as autograd's `run_backward` or a stream's `synchronize`) counted to the package of the Python
function that called them, so a host waiting on the device shows up as the wait's caller.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import PurePath
from typing import Callable

PACKAGES = ("deepspeed", "transformers", "torch", "colo_rl", "benchmarks")
BUILTIN = "~"  # cProfile's file name for C functions


def _package_index(parts: tuple) -> int | None:
    """Where a file's package starts in its path: the part after site-packages (an installed
    package), else the innermost `colo_rl` / `benchmarks` (this checkout, whatever its folder's name)."""
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            i = len(parts) - 1 - parts[::-1].index(marker) + 1
            return i if i < len(parts) else None
    return next((i for i in range(len(parts) - 1, -1, -1) if parts[i] in PACKAGES), None)


def package_of(filename: str) -> str:
    """The package a function's file belongs to, by its path: `deepspeed`, `transformers`,
    `colo_rl`, `benchmarks`, `torch`, else `other` (the standard library, other packages)."""
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
    for func, (_, _, self_s, _, callers) in stats.items():
        if func[0] != BUILTIN:
            by_package[package_of(func[0])] = by_package.get(package_of(func[0]), 0.0) + self_s
            continue
        if not callers:  # called from outside any profiled frame
            by_package["other"] = by_package.get("other", 0.0) + self_s
            continue
        for caller, caller_stats in callers.items():  # (primitive calls, calls, self s, cumulative s)
            pkg = "other" if caller[0] == BUILTIN else package_of(caller[0])
            by_package[pkg] = by_package.get(pkg, 0.0) + caller_stats[2]
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return {"wall_s": wall_s, "profiled_s": sum(v[2] for v in stats.values()),
            "by_package": dict(sorted(by_package.items(), key=lambda kv: -kv[1])),
            "top_self": [{"name": short_name(f), "calls": v[1], "self_ms": 1e3 * v[2], "cumulative_ms": 1e3 * v[3]}
                         for f, v in top]}


def profile_call(fn: Callable[[], object], clock: Callable[[], float]) -> dict:
    """Run `fn` once under cProfile and `summarise` it (`clock`: the wall clock, e.g. time.perf_counter)."""
    profiler = cProfile.Profile()
    t0 = clock()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    wall = clock() - t0
    return summarise(pstats.Stats(profiler).stats, wall)


def host_text(host: dict | None) -> str:
    """The Markdown of `summarise`'s result ("" without one)."""
    if not host:
        return ""
    packages = ", ".join(f"{k} {v:.2f}" for k, v in host["by_package"].items() if v >= 0.005)
    compiled = host.get("compilations")
    return "\n".join([
        f"One more update under cProfile ({host['wall_s']:.2f} s, the profiler's own cost included): seconds by "
        f"package (a C built-in counted to its caller's): {packages}."
        + (f" torch.compile compiled {compiled} frame(s) during it: those seconds include compilation." if compiled
           else ""), "",
        "| function (cProfile) | calls | self ms | cumulative ms |", "|---|---|---|---|",
        *[f"| `{o['name'][:90]}` | {o['calls']} | {o['self_ms']:.1f} | {o['cumulative_ms']:.1f} |"
          for o in host["top_self"]]])
