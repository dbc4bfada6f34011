"""What the python tool's sandbox costs per call (colo_rl/envs/sandbox.py, docs/sandbox.md).

The same calls, one after the other, through:
- `old`: run_python as it was before the sandbox (commit c28839b: `python -I -S` under rlimits,
  `unshare -rn` where it works), loaded from git (left out where git or the commit is missing);
- `none`: env.python_sandbox=none (the new launcher and output reader, no namespaces);
- `bwrap`: env.python_sandbox=bwrap (namespaces, per-call uid and, where possible, cgroup).

Calls: `print(1)`; a small computation (sum of squares to 10^5); a keep-state call replaying 4
earlier cells. Reported: median and 90th percentile ms per call over --calls calls (after 3 warm-up
calls), and the ratio to `old`. Results: results/python_tool-<device>-<date>.json / .md.

    python benchmarks/python_tool.py [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

OLD_COMMIT = "c28839b"
CALLS = {
    "print": ([], "print(1)"),
    "compute": ([], "print(sum(k * k for k in range(100000)))"),
    "keep_state_4": (["import math", "x = 6", "def f(k):\n    return k * x", "y = [f(k) for k in range(100)]"],
                     "print(math.fsum(y))"),
}


def old_run_python():
    """run_python from before the sandbox, or None where this is not a git checkout with that commit."""
    try:
        src = subprocess.run(["git", "show", f"{OLD_COMMIT}:colo_rl/envs/tools.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    module = types.ModuleType("colo_rl_old_tools")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src, f"{OLD_COMMIT}:colo_rl/envs/tools.py", "exec"), module.__dict__)
    return lambda code, earlier: module.run_python(code, 5.0, 512, 256, earlier=earlier)


def timed(call, n: int) -> list[float]:
    for _ in range(3):
        call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args()

    from colo_rl.envs.sandbox import get_sandbox
    from colo_rl.envs.tools import run_python

    runners = {}
    old = old_run_python()
    if old is not None:
        runners["old"] = old
    for kind in ("none", "bwrap"):
        runners[kind] = (lambda k: lambda code, earlier: run_python(code, 5.0, 512, 256, earlier=earlier, sandbox=k))(kind)
    sandbox = get_sandbox("bwrap").describe()

    rows = []
    for call, (earlier, code) in CALLS.items():
        expected = runners["none"](code, earlier)
        for name, run in runners.items():
            assert run(code, earlier) == expected, (name, call)
            ms = timed(lambda: run(code, earlier), args.calls)
            rows.append({"call": call, "runner": name, "median_ms": round(statistics.median(ms), 1),
                         "p90_ms": round(sorted(ms)[int(0.9 * (len(ms) - 1))], 1)})
    base = {r["call"]: r["median_ms"] for r in rows if r["runner"] == ("old" if old is not None else "none")}
    for r in rows:
        r["vs_old"] = round(r["median_ms"] / base[r["call"]], 2)

    lines = ["# python tool: cost per call, before and after the sandbox", "",
             f"bwrap here: {sandbox}. {args.calls} calls each (after 3 warm-up calls), one at a time; "
             f"`old` = run_python at {OLD_COMMIT}" + ("" if old is not None else " (not available: ratios are to `none`)"),
             "", "| call | runner | median ms | p90 ms | median / old |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['call']} | {r['runner']} | {r['median_ms']} | {r['p90_ms']} | {r['vs_old']} |" for r in rows]
    common.publish("python_tool", {"rows": rows, "sandbox": sandbox, "calls": args.calls}, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
