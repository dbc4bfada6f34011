"""The benchmark suite: every benchmark in its own process, one after the other, then the results
README. `make bench` runs the CPU preset (embedded SmolLM2-135M-Instruct), `make bench-gpu` the GPU
one (bigger handoff sizes, the 0.5B-class phase-switch model).

    python benchmarks/suite.py                     # CPU preset
    python benchmarks/suite.py --preset gpu
    python benchmarks/suite.py --only race_trl --dry-run

The CPU preset takes about twelve minutes on an idle 2-core machine (the race's 8 steps per side
dominate; the tool-turn comparison adds two) plus about 85 for the algorithm comparison (`--only` leaves it out); on a loaded machine it takes longer, and every result records the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from colo_rl.child_env import child_python_path  # noqa: E402

# The race's work (8 prompts x 8 completions, <= 64 new tokens) is also the step breakdown's.
RACE_WORK = ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=64",
             "rollout.eval_batch_size=64"]
# The race's colo_rl side runs under the step-breakdown harness, so the race also writes the step
# breakdown of the raced run (steps 3-8); `step_breakdown` alone runs only when the race does not.
PRESETS = {
    "cpu": {
        "race_trl": ["benchmarks/race_trl.py", "--steps", "8", "--skip", "2"],
        "step_breakdown": ["benchmarks/step_breakdown.py", "--skip", "2", "trainer.total_steps=8", *RACE_WORK],
        "handoff": ["benchmarks/handoff.py", "--sizes", "30m,135m,500m", "--repeats", "3"],
        "phase_switch": ["benchmarks/phase_switch.py", "--small", "--steps", "5"],
        "tool_turns": ["benchmarks/tool_turns.py"],  # ~2 min
        # the update's host overhead against the commit before issue 37, + the demo's update (~15 min)
        "update_overhead": ["benchmarks/update_overhead.py", "--base-commit", "c28839b", "--root", "new=.",
                            "--demo-steps", "3"],
        "packed_attention_memory": ["benchmarks/packed_attention_memory.py"],  # ~1 min
        # the host's cost per micro-batch with negligible arithmetic, by ZeRO-3 setting (~8 min)
        "host_overhead": ["benchmarks/host_overhead.py"],
        # the demo once per estimator / loss and grpo on 3 seeds: about 85 minutes of the suite's time
        "algorithms": ["benchmarks/algorithms.py"],
    },
    # Seconds-scale plumbing check (tiny random model, few tokens): not a measurement.
    "smoke": {
        "race_trl": ["benchmarks/race_trl.py", "--model", "tiny", "--steps", "3", "--skip", "1",
                     "--max-new-tokens", "8"],
        "step_breakdown": ["benchmarks/step_breakdown.py", "model=tiny", "trainer.total_steps=2",
                           "rollout.max_new_tokens=8"],
        "handoff": ["benchmarks/handoff.py", "--sizes", "30m", "--repeats", "1", "--memcpy-mb", "64"],
        "phase_switch": ["benchmarks/phase_switch.py", "--small", "--steps", "2", "--max-new-tokens", "4"],
        "tool_turns": ["benchmarks/tool_turns.py", "--override", "model=tiny", "--override", "rollout.max_new_tokens=8",
                       "--prompts", "2", "--repeats", "1"],
        "algorithms": ["benchmarks/algorithms.py", "--smoke", "--variants", "grpo,gspo", "--seeds", "7"],
        "update_overhead": ["benchmarks/update_overhead.py", "--layers", "2", "--steps", "2"],
        "host_overhead": ["benchmarks/host_overhead.py", "--rounds", "1", "--updates", "1", "--warmup", "1",
                          "--variants", "default"],
    },
    "gpu": {
        "race_trl": ["benchmarks/race_trl.py", "--steps", "8", "--skip", "2"],
        "step_breakdown": ["benchmarks/step_breakdown.py", "--skip", "2", "trainer.total_steps=8", *RACE_WORK],
        "handoff": ["benchmarks/handoff.py", "--sizes", "135m,500m,1.7b", "--repeats", "5", "--memcpy-mb", "2048"],
        "phase_switch": ["benchmarks/phase_switch.py", "--steps", "5"],
    },
}


def plan(preset: str, only: list[str] | None, out: Path = common.RESULTS) -> list[tuple[str, list[str]]]:
    steps = []
    names = list(PRESETS[preset])
    if "race_trl" in names and (not only or "race_trl" in only) and not (only and "step_breakdown" in only):
        names.remove("step_breakdown")  # the race writes it
    for name in names:
        argv = PRESETS[preset][name]
        if only and name not in only:
            continue
        argv = list(argv) + ["--out", str(out)]
        if name in ("step_breakdown", "handoff", "race_trl", "tool_turns", "update_overhead",
                    "packed_attention_memory", "host_overhead"):
            argv.append("--no-readme")  # the suite writes the README once at the end
        steps.append((name, argv))
    return steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="cpu")
    p.add_argument("--only", default="", help="comma-separated subset of " + ", ".join(PRESETS["cpu"]))
    p.add_argument("--out", type=Path, default=common.RESULTS, help="results folder (default benchmarks/results)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--keep-going", action="store_true", help="run the rest when one benchmark fails")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if importlib.util.find_spec("trl") is None and (not only or "race_trl" in only):
        print("suite: trl is not importable here, so the race against TRL is skipped and the step breakdown runs "
              "alone (`pip install -e '.[bench]'`; on the GPU machine carry trl's wheel in .whl/)")
        only = [n for n in (only or PRESETS[args.preset]) if n != "race_trl"]
        only = only + ["step_breakdown"] if "step_breakdown" not in only else only
    steps = plan(args.preset, only, args.out)
    env = {**os.environ, "PYTHONPATH": child_python_path(),
           "PYTHONUNBUFFERED": "1"}
    failed, ran = [], 0
    t_all = time.perf_counter()
    for name, cmd in steps:
        full = [sys.executable, *cmd]
        print(f"\n=== {name}: {common.command(full[1:])}  (load avg {os.getloadavg()[0]:.1f})", flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = subprocess.run(full, cwd=ROOT, env=env).returncode
        ran += 1
        print(f"=== {name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
            if not args.keep_going:
                break
    if not args.dry_run:
        readme = common.refresh_readme(args.out)
        print(f"\nsuite: {ran - len(failed)} of {len(steps)} benchmarks ran ok"
              f"{f', failed: {failed}' if failed else ''} in {time.perf_counter() - t_all:.0f} s; "
              f"results in {readme.parent}, summary in {readme}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
