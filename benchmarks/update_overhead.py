"""Update overhead: the GRPO update's seconds per step and milliseconds per micro-batch, for several
code roots side by side in one run (issue 37: ZeRO-3 hooks per decoder layer, no device reads in the
micro-batch loop, entropy only where used or logged).

    python benchmarks/update_overhead.py --root base=/work/wt/base-c28839b --root new=.
    python benchmarks/update_overhead.py --root base=../base --root new=. --demo-steps 3
    python benchmarks/update_overhead.py --base-commit c28839b   # that commit of this repo vs this tree
    python benchmarks/update_overhead.py --dry-run              # print the runs, run nothing

Each run is the real recipe (recipes/grpo.py of that root, one rank, its own process with
PYTHONPATH=<root>, this interpreter) on the demo's work, 8 prompts x 8 completions, with
`model=tiny model.num_layers=30` by default (--layers): SmolLM2's depth at a negligible width, so the update's
time is the host's per-module and per-micro-batch overhead, not arithmetic. Times come from the
recipe's own metrics.jsonl (time/update: forward, backward and optimizer of the step; old /
reference log-probs are time/logprobs, not included); the first `--skip` steps are dropped.
"ms per micro-batch" is time/update divided by the step's micro-batches (train/micro_batches where
the root logs it, else the sequence-count rule of c28839b: ceil(groups / max(1, micro_batch_size //
group_size))); on a CPU all of it is host time.

Runs per root: its defaults; the same with trainer.micro_batch_size=64 (and, for roots with token
micro-batches, trainer.micro_batch_tokens=65536): the step as one micro-batch; for roots that know them, trainer.zero_leaf_modules=false
and algo.log_entropy=false (what each part saves), trainer.zero_memory_efficient_linear=on
(DeepSpeed's ZeRO-3 linear, the default before 2026-11-27); where the root has them, glibc's
default of returning freed host memory ($COLO_RL_KEEP_HOST_MEMORY=0) and DeepSpeed's gathers on
gloo's threads ($COLO_RL_LOCAL_GATHERS=0, colo_rl/solo_gathers.py); ZeRO-0 on the last root (no
partitioning hooks: the reference floor). `--demo-steps N` adds the demo itself (embedded
SmolLM2-135M, its defaults, and the two host settings off) per root. Ratios are within this run,
on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from colo_rl.host_malloc import KEEP_HOST_MEMORY_ENV  # noqa: E402
from colo_rl.solo_gathers import LOCAL_GATHERS_ENV  # noqa: E402

WORK = ["rollout.prompts_per_step=8", "rollout.group_size=8", "data.train_size=256", "data.eval_size=8",
        "rollout.eval_max_new_tokens=8", "plots=false", "logger=[jsonl]"]
# Options only roots with this changes know (an older root would refuse them).
NEW_ONLY = ("trainer.zero_leaf_modules", "algo.log_entropy")
# CPU host settings (since 2026-11-27), each turned off by its variable where the root's module has it:
# (module, variant name, environment)
HOST_SETTINGS_OFF = [("host_malloc", "freed host memory returned", {KEEP_HOST_MEMORY_ENV: "0"}),
                     ("solo_gathers", "gloo's gathers", {LOCAL_GATHERS_ENV: "0"})]


def host_settings_off(root: Path) -> list[tuple[str, dict]]:
    """(variant, environment) of each host setting `root` has (an older root predates them)."""
    return [(variant, env) for module, variant, env in HOST_SETTINGS_OFF
            if (root / "colo_rl" / f"{module}.py").exists()]


def variants(roots: list[tuple[str, Path]], knows_new: dict[str, bool], demo_steps: int) -> list[dict]:
    """The runs, in order: per root its defaults, one micro-batch, and (where known) each part off;
    ZeRO-0 on the last root; the demo per root when asked."""
    runs = []
    for label, root in roots:
        runs.append({"root": label, "work": "deep_narrow", "variant": "default", "overrides": []})
        one = ["trainer.micro_batch_size=64"] + (["trainer.micro_batch_tokens=65536"] if knows_new[label] else [])
        runs.append({"root": label, "work": "deep_narrow", "variant": "one micro-batch", "overrides": one})
        if knows_new[label]:
            runs.append({"root": label, "work": "deep_narrow", "variant": "leaf modules off",
                         "overrides": ["trainer.zero_leaf_modules=false"]})
            runs.append({"root": label, "work": "deep_narrow", "variant": "entropy not logged",
                         "overrides": ["algo.log_entropy=false"]})
        if knows_option(root, "zero_memory_efficient_linear"):  # off by default since 2026-11-27
            runs.append({"root": label, "work": "deep_narrow", "variant": "DeepSpeed's linear",
                         "overrides": ["trainer.zero_memory_efficient_linear=on"]})
        for variant, env in host_settings_off(root):
            runs.append({"root": label, "work": "deep_narrow", "variant": variant, "overrides": [], "env": env})
        if knows_option(root, "compile: bool"):  # model.compile, off by default (2026-11-27)
            runs.append({"root": label, "work": "deep_narrow", "variant": "decoder layers compiled",
                         "overrides": ["model.compile=true"]})
    last = roots[-1][0]
    runs.append({"root": last, "work": "deep_narrow", "variant": "ZeRO-0 (reference)",
                 "overrides": ["trainer.zero_stage=0"]})
    if demo_steps:
        for label, root in roots:
            runs.append({"root": label, "work": "demo", "variant": "default", "overrides": [], "steps": demo_steps})
            for variant, env in host_settings_off(root):
                runs.append({"root": label, "work": "demo", "variant": variant, "overrides": [], "steps": demo_steps,
                             "env": env})
    return runs


def micro_batches(row: dict, overrides: list[str]) -> float:
    """The step's micro-batches: logged, or c28839b's sequence-count rule for packed groups."""
    if "train/micro_batches" in row:
        return float(row["train/micro_batches"])
    mbs = next((int(o.split("=")[1]) for o in reversed(overrides) if o.startswith("trainer.micro_batch_size=")), 8)
    groups, G = 8, 8
    return float(math.ceil(groups / max(1, mbs // G)))


def summarise(rows: list[dict], skip: int, overrides: list[str]) -> dict:
    kept = [r for r in rows if "time/update" in r][skip:]
    if not kept:
        raise RuntimeError("no step rows with time/update in metrics.jsonl")
    upd = [r["time/update"] for r in kept]
    n_mb = micro_batches(kept[-1], overrides)
    return {"steps": len(kept), "update_s_mean": statistics.fmean(upd), "update_s_median": statistics.median(upd),
            "micro_batches": n_mb, "ms_per_micro_batch": 1000 * statistics.median(upd) / n_mb,
            "step_s_median": statistics.median(r.get("time/step", float("nan")) for r in kept),
            "generation_s_median": statistics.median(r.get("time/generation", float("nan")) for r in kept),
            "train_loss_last": kept[-1].get("train/loss")}


def run_one(run: dict, root: Path, steps: int, skip: int, tmp: Path, timeout: int, layers: int) -> dict:
    run_dir = tmp / re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{run['root']}-{run['work']}-{run['variant']}")  # Hydra-safe
    work = WORK + (["model=tiny", f"model.num_layers={layers}"] if run["work"] == "deep_narrow" else [])
    n = run.get("steps", steps)
    argv = [sys.executable, "recipes/grpo.py", *work, f"trainer.total_steps={n}", *run["overrides"],
            f"run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", **run.get("env", {})}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        returncode, max_rss_kib = wait_with_rusage(proc, timeout)
        out.seek(0)
        log_tail = out.read()[-6000:]
    max_rss_gib = max_rss_kib / 2**20
    if returncode != 0:
        raise RuntimeError(f"{run} failed ({returncode}):\n{log_tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = summarise(rows, min(skip, n - 1), run["overrides"])
    return {**run, **out, "wall_s": time.perf_counter() - t0, "max_rss_gib": max_rss_gib,
            "command": "".join(f"{k}={v} " for k, v in run.get("env", {}).items()) + common.command(argv[1:])}


def wait_with_rusage(proc: subprocess.Popen, timeout: float) -> tuple[int, int]:
    """(exit status, peak resident KiB) of `proc`: its own rusage from wait4 (the largest of it and
    its waited-for children, e.g. SGLang's scheduler), not this process's. Killed past `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
            return proc.returncode, usage.ru_maxrss
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.2)


def checkout(rev: str, into: Path) -> Path:
    """This repository's tree at `rev`, extracted into `into` (no worktree metadata left behind)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, timeout=120)
    if archive.returncode != 0:
        raise SystemExit(f"--base-commit {rev}: git archive failed: {archive.stderr.decode()[-500:]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=120)
    (into / ".git-commit").write_text(rev + "\n")
    return into


def root_commit(root: Path) -> str:
    if (root / ".git-commit").exists():
        return (root / ".git-commit").read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def knows_option(root: Path, name: str) -> bool:
    schema = root / "colo_rl" / "config" / "schema.py"
    return schema.exists() and name in schema.read_text()


def knows_options(root: Path) -> bool:
    return all(knows_option(root, o.split(".")[1]) for o in NEW_ONLY)


def markdown(result: dict) -> str:
    roots = result["roots"]
    lines = [f"Deep narrow model (`model=tiny model.num_layers=30`) and the demo's work: 8 prompts x 8 completions, "
             f"1 rank; median of steps {result['skip'] + 1}-{result['steps']} (time/update: forward, backward, "
             "optimizer). Roots: " + ", ".join(f"`{k}` = {v['path']} ({v['commit']})" for k, v in roots.items()) + ".",
             "", "| work | root | variant | micro-batches | update s/step | ms per micro-batch "
                 "| vs first root, same variant | generation s/step | peak RSS GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    first = next(iter(roots))
    base = {(r["work"], r["variant"]): r["update_s_median"] for r in result["runs"] if r["root"] == first}
    for r in result["runs"]:
        ref = base.get((r["work"], r["variant"]))
        ratio = f"{r['update_s_median'] / ref:.2f}x" if ref and r["root"] != first else ""
        lines.append(f"| {r['work']} | {r['root']} | {r['variant']} | {r['micro_batches']:.0f} | "
                     f"{r['update_s_median']:.3f} | {r['ms_per_micro_batch']:.0f} | {ratio} | "
                     f"{r.get('generation_s_median', float('nan')):.2f} | {r.get('max_rss_gib', float('nan')):.2f} |")
    if "target" in result:
        t = result["target"]
        lines += ["", f"- deep narrow model, default settings: {t['ratio']:.2f}x the first root's update seconds per "
                      f"step (target <= 0.4x with token micro-batches as well); "
                      f"with one micro-batch on both: {t['ratio_one_micro_batch']:.2f}x of the first root's default"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", action="append", default=[], metavar="LABEL=PATH",
                   help="a code root (a colo_rl checkout); repeat; the first is the baseline (default: new=this repo)")
    p.add_argument("--base-commit", default="", metavar="REV",
                   help="add this commit of this repository as the first root (`git archive` into a temporary folder)")
    p.add_argument("--layers", type=int, default=30, help="model.num_layers of the deep narrow model (SmolLM2's: 30)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--skip", type=int, default=1, help="first steps dropped (warm-up)")
    p.add_argument("--demo-steps", type=int, default=0,
                   help="also run the demo (embedded model) this many steps per root")
    p.add_argument("--works", type=lambda v: v.split(","), default=[],
                   help="only these works (deep_narrow, demo); default: both (demo only with --demo-steps)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--name", default="update_overhead",
                   help="results file name (update_overhead_demo for a demo-only run)")
    p.add_argument("--no-readme", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    roots = [(s.split("=", 1)[0], Path(s.split("=", 1)[1]).resolve()) for s in (args.root or [f"new={ROOT}"])]
    keep = tempfile.TemporaryDirectory(prefix="update_overhead-base-")
    if args.base_commit:
        roots.insert(0, (args.base_commit, checkout(args.base_commit, Path(keep.name))))
    for label, path in roots:
        if not (path / "recipes" / "grpo.py").exists():
            p.error(f"--root {label}={path}: no recipes/grpo.py there (a colo_rl checkout is needed)")
    knows = {label: knows_options(path) for label, path in roots}
    runs = [r for r in variants(roots, knows, args.demo_steps) if not args.works or r["work"] in args.works]
    if args.dry_run:
        for r in runs:
            print(r)
        return 0
    paths = dict(roots)
    done = []
    with tempfile.TemporaryDirectory(prefix="update_overhead-") as tmp:
        for r in runs:
            print(f"update_overhead: {r['root']} / {r['work']} / {r['variant']} ...", flush=True)
            res = run_one(r, paths[r["root"]], args.steps, args.skip, Path(tmp), args.timeout, args.layers)
            print(f"  update {res['update_s_median']:.3f} s/step, {res['micro_batches']:.0f} micro-batches, "
                  f"{res['ms_per_micro_batch']:.0f} ms each", flush=True)
            done.append(res)
    result = {"roots": {k: {"path": str(v), "commit": root_commit(v)} for k, v in roots},
              "steps": args.steps, "skip": args.skip, "runs": done}
    by = {(r["root"], r["work"], r["variant"]): r["update_s_median"] for r in done}
    first, last = roots[0][0], roots[-1][0]
    if first != last and (first, "deep_narrow", "default") in by:
        before = by[(first, "deep_narrow", "default")]
        result["target"] = {"ratio": by[(last, "deep_narrow", "default")] / before,
                            "ratio_one_micro_batch": by[(last, "deep_narrow", "one micro-batch")] / before}
    common.publish(args.name, result, markdown(result), args.out, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
