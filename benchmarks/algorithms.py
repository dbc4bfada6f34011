"""Algorithm comparison: the embedded demo's task and budget, once per advantage estimator / policy
loss, same seed; then the default (grpo) again with other seeds for the spread a seed alone causes.

    python benchmarks/algorithms.py                      # 7 variants + 2 extra seeds of grpo (~85 min, 2 idle cores: ~9.5 min a run)
    python benchmarks/algorithms.py --variants grpo,rloo --seeds 7
    python benchmarks/algorithms.py --smoke              # tiny random model, 2 steps: plumbing only

Each run is `make demo` (recipes/grpo.py on SmolLM2-135M-Instruct, arithmetic, 14 steps of 8 prompts x 8
completions, 2 ranks, in fp32) with one change shared by every variant:
  * trainer.mini_batches_per_step=2: two optimizer steps per rollout batch. With one (the demo's
    setting) the only pass is on-policy, every importance ratio is exactly 1, and PPO-clip, dual-clip
    and CISPO give the same gradient: the comparison would only compare estimators. Two
    mini-batches let the ratios leave 1 so the losses' clipping differs, at the same sampling cost.
Held-out accuracy (greedy, 200 problems) at the start and the end, as in the demo.
A run's directory holds its metrics.jsonl; a finished run (summary.json present) is reused unless
--fresh, so an interrupted benchmark picks up where it stopped. Results: results/algorithms-<device>-<date>
.json / .md / .png (held-out accuracy and reward vs step, one line per variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

# name -> (overrides on top of the demo, what it is). drgrpo: Dr. GRPO drops the std scaling; its other
# change (no per-response length normalisation) is already colo_rl's default token-mean aggregation.
VARIANTS: dict[str, tuple[list[str], str]] = {
    "grpo": ([], "GRPO: group-normalised advantages, PPO-clip (the demo's default)"),
    "drgrpo": (["algo.scale_by_std=false"], "Dr. GRPO: group mean subtracted, no std scaling"),
    "rloo": (["algo.adv_estimator=rloo"], "RLOO: leave-one-out group baseline"),
    "reinforce_pp_baseline": (["algo.adv_estimator=reinforce_pp_baseline"],
                              "REINFORCE++ with group baseline, whitened over the global batch"),
    "gspo": (["algo.policy_loss=gspo", "algo.clip_low=3e-4", "algo.clip_high=4e-4", "algo.loss_agg=seq-mean-token-mean"],
             "GSPO: sequence-level length-normalised ratio, clip 3e-4 / 4e-4, mean over sequences (the paper's)"),
    "cispo": (["algo.policy_loss=cispo"],
              "CISPO: stop-gradient IS weight, clipped to PPO's band [0.8, 1.2], times the log-prob: "
              "clipped tokens keep their gradient"),
    "grpo_dual_clip": (["algo.clip_ratio_c=3.0"], "GRPO + dual-clip (c = 3) on negative advantages"),
    "grpo_dynamic_sampling": (["algo.dynamic_sampling=true"],
                              "GRPO + DAPO dynamic sampling (all-equal groups dropped, refilled)"),
}
# What the suite runs (each ~8 min on an idle 2-core machine): grpo_dual_clip on request only.
DEFAULT_VARIANTS = [n for n in VARIANTS if n != "grpo_dual_clip"]
DEFAULT_SEED = 7  # conf/trainer/grpo_cpu.yaml
# fp32 pinned: model.dtype=auto picks bf16 on CPUs with native bf16 (AVX-512 BF16 / AMX), so the
# table would otherwise depend on which machine ran it.
SHARED = ["trainer.mini_batches_per_step=2", "model.dtype=fp32", "logger=[jsonl]", "plots=false"]
SMOKE = ["model=tiny", "trainer.total_steps=2", "trainer.eval_every=1", "rollout.max_new_tokens=8",
         "rollout.eval_max_new_tokens=8", "data.eval_size=8"]


def add_sweep_arguments(p: argparse.ArgumentParser, name: str, smoke: str, seeds_help: Optional[str] = None) -> None:
    """The options every seed-sweep benchmark takes (this one, engine_compare.py, split_pools.py)."""
    p.add_argument("--seeds", default="7,8,9", help=seeds_help)
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench" / name)
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--fresh", action="store_true", help="rerun finished runs too")
    p.add_argument("--smoke", action="store_true", help=f"tiny random model, {smoke} (plumbing check, not a result)")


def chosen(p: argparse.ArgumentParser, value: str, known, kind: str) -> list[str]:
    """A comma-separated subset of `known`; an unknown name is a usage error naming the choices."""
    names = [n for n in value.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad:
        p.error(f"unknown {kind} {bad[0]!r}; choose from {list(known)}")
    return names


def seed_list(value: str) -> list[int]:
    return [int(s) for s in value.split(",") if s]


def sweep_log(name: str):
    """A benchmark's progress line: `[name HH:MM:SS] message`."""
    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    return log


def run_one(name: str, seed: int, overrides: list[str], work: Path, nproc: int, fresh: bool, log) -> Path:
    run_dir = work / f"{name}-seed{seed}"
    if (run_dir / "summary.json").exists() and not fresh:
        log(f"{name} seed {seed}: reusing {run_dir}")
        return run_dir
    cmd = [sys.executable, "-m", "colo_rl.launch", "--standalone", f"--nproc_per_node={nproc}", "recipes/grpo.py",
           *overrides, f"trainer.seed={seed}", f"run_dir={run_dir}"]
    log(f"{name} seed {seed}: {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stdout.log", "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {rc}); see {run_dir / 'stdout.log'}")
    wall = time.perf_counter() - t0
    (run_dir / "wall_seconds").write_text(f"{wall:.1f}\n")  # launch to exit, start-up and evaluations included
    log(f"{name} seed {seed}: done in {wall / 60:.1f} min")
    return run_dir


def summarise(run_dir: Path, wall_s: float | None = None) -> dict:
    """Curves and end figures of one run from its metrics.jsonl; its wall seconds (`wall_s`, else
    the `wall_seconds` file run_one writes, else None)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r.get("reward/mean") is not None]
    last = steps[-5:]
    out = {
        "eval_steps": [s for s, _ in evals], "eval_accuracy": [a for _, a in evals],
        "reward_steps": [r["step"] for r in steps], "reward_mean": [r["reward/mean"] for r in steps],
        "heldout_start": evals[0][1], "heldout_end": evals[-1][1],
        "heldout_delta": evals[-1][1] - evals[0][1],
        "reward_last5": statistics.fmean(r["reward/mean"] for r in last),
        "train_accuracy_last5": statistics.fmean(r["reward/accuracy"] for r in last),
        "s_per_step": statistics.median(r["time/step"] for r in steps),
        "clip_frac_mean": statistics.fmean(r.get("train/clip_frac", 0.0) for r in steps),
        "wall_s": wall_s if wall_s is not None else (float((run_dir / "wall_seconds").read_text())
                                                     if (run_dir / "wall_seconds").exists() else None),
    }
    if any("sampling/rounds" in r for r in steps):
        out["sampling_rounds_mean"] = statistics.fmean(r.get("sampling/rounds", 0.0) for r in steps)
    return out


def table(result: dict) -> str:
    runs = result["runs"]
    lines = [f"# {common.TITLES['algorithms']}", "",
             f"The embedded demo (SmolLM2-135M-Instruct, arithmetic, {result['steps']} steps of 8 prompts x 8 "
             f"completions, 2 ranks) per variant, seed {DEFAULT_SEED}; shared overrides: "
             f"`{' '.join(result['shared'])}`. Held-out: greedy accuracy on the 200 held-out problems.", "",
             "| variant | held-out start | held-out end | change (points) | reward, last 5 steps | "
             "train accuracy, last 5 | clip fraction | s / step |",
             "|---|---|---|---|---|---|---|---|"]
    for key, r in runs.items():
        if not key.endswith(f"seed{DEFAULT_SEED}"):
            continue
        extra = f" ({r['sampling_rounds_mean']:.1f} sampling rounds)" if "sampling_rounds_mean" in r else ""
        lines.append(f"| {r['variant']}{extra} | {r['heldout_start']:.3f} | {r['heldout_end']:.3f} | "
                     f"{100 * r['heldout_delta']:+.1f} | {r['reward_last5']:.3f} | {r['train_accuracy_last5']:.3f} | "
                     f"{r['clip_frac_mean']:.4f} | {r['s_per_step']:.1f} |")
    lines += ["", "Variants:", ""] + [f"- `{n}`: {VARIANTS[n][1]} (`{' '.join(VARIANTS[n][0]) or 'defaults'}`)"
                                     for n in result["variants"]]
    spread = result.get("seed_spread")
    if spread:
        lines += ["", f"Seed spread of grpo (seeds {spread['seeds']}): held-out end {spread['mean']:.3f} "
                      f"(std {spread['std']:.3f}, range {spread['min']:.3f} - {spread['max']:.3f}); change "
                      f"{100 * spread['delta_mean']:+.1f} points on average."]
    if result.get("winner"):
        w = result["winner"]
        lines += ["", f"Highest held-out accuracy at the end: **{w['variant']}** ({w['heldout_end']:.3f}). "
                      + w["verdict"]]
    return "\n".join(lines)


def chart(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_reward) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, r in result["runs"].items():
        seeded = not key.endswith(f"seed{DEFAULT_SEED}")
        style = {"linestyle": ":", "alpha": 0.6} if seeded else {}
        label = key if seeded else r["variant"]
        ax_eval.plot(r["eval_steps"], r["eval_accuracy"], marker="o", label=label, **style)
        ax_reward.plot(r["reward_steps"], r["reward_mean"], label=label, **style)
    ax_eval.set_title("held-out accuracy (greedy)")
    ax_reward.set_title("reward / mean (training samples)")
    for ax in (ax_eval, ax_reward):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=7)
    fig.suptitle("colo_rl estimators and losses on the embedded demo")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def verdict(runs: dict, spread: dict | None) -> tuple[dict, str]:
    main = {k: r for k, r in runs.items() if k.endswith(f"seed{DEFAULT_SEED}")}
    best = max(main.values(), key=lambda r: (r["heldout_end"], r["reward_last5"]))
    if not spread:
        return best, "No seed spread measured: differences cannot be told from seed noise."
    grpo = main.get(f"grpo-seed{DEFAULT_SEED}")
    margin = best["heldout_end"] - (grpo["heldout_end"] if grpo else 0.0)
    if best["variant"] == "grpo":
        return best, f"The default wins; the seed spread of grpo is {spread['std']:.3f} (std)."
    beyond = margin > 2 * spread["std"]
    return best, (f"It beats grpo by {100 * margin:.1f} points, "
                  + ("more than twice grpo's seed std" if beyond else f"within twice grpo's seed std "
                     f"({2 * spread['std']:.3f}): not a difference one run per variant can establish") + ".")


def collect(variants: list[str], seeds: list[int], work: Path, steps: int) -> dict:
    runs = {}
    for name in variants:
        if (work / f"{name}-seed{DEFAULT_SEED}" / "summary.json").exists():
            runs[f"{name}-seed{DEFAULT_SEED}"] = {"variant": name, **summarise(work / f"{name}-seed{DEFAULT_SEED}")}
    for seed in seeds:
        if seed != DEFAULT_SEED and (work / f"grpo-seed{seed}" / "summary.json").exists():
            runs[f"grpo-seed{seed}"] = {"variant": "grpo", **summarise(work / f"grpo-seed{seed}")}
    result = {"variants": variants, "steps": steps, "shared": SHARED, "runs": runs}
    grpo = {int(k.rsplit("seed", 1)[1]): r for k, r in runs.items() if r["variant"] == "grpo"}
    ends = [r["heldout_end"] for r in grpo.values()]
    deltas = [r["heldout_delta"] for r in grpo.values()]
    if len(ends) >= 2:  # the seeds that finished, not the ones asked for
        result["seed_spread"] = {"seeds": sorted(grpo), "mean": statistics.fmean(ends),
                                 "std": statistics.stdev(ends), "min": min(ends), "max": max(ends),
                                 "delta_mean": statistics.fmean(deltas)}
    if runs:
        best, why = verdict(runs, result.get("seed_spread"))
        result["winner"] = {"variant": best["variant"], "heldout_end": best["heldout_end"], "verdict": why}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--nproc", type=int, default=2)
    add_sweep_arguments(p, "algorithms", "2 steps", seeds_help="seeds for grpo (the others run seed 7 only)")
    args = p.parse_args(argv)
    variants = chosen(p, args.variants, VARIANTS, "variant")
    seeds = seed_list(args.seeds)
    shared = SHARED + (SMOKE if args.smoke else [])
    steps = 2 if args.smoke else 14
    log = sweep_log("algorithms")

    plan = [(n, DEFAULT_SEED) for n in variants] + [("grpo", s) for s in seeds if s != DEFAULT_SEED]
    failed = []
    for i, (name, seed) in enumerate(plan, 1):
        log(f"run {i}/{len(plan)}")
        for attempt in (1, 2):  # a rank killed from outside (the OOM killer on a shared machine) gets one retry
            try:
                run_one(name, seed, shared + VARIANTS[name][0], args.work, args.nproc, args.fresh or attempt > 1, log)
                break
            except RuntimeError as e:
                log(f"{e}" + ("; retrying once" if attempt == 1 else "; going on without it"))
        else:
            failed.append(f"{name}-seed{seed}")
            continue
        if not args.smoke:  # results after every run: an interrupted benchmark still leaves its table
            result = collect(variants, seeds, args.work, steps)
            result["shared"] = shared
            for r in result["runs"].values():
                r.pop("run_dir", None)
            # a subset is a rerun beside the full comparison, never its replacement in results/README.md
            name = "algorithms" if set(variants) >= set(DEFAULT_VARIANTS) else "algorithms_subset"
            common.publish(name, result, table(result), args.out, chart=chart)
    if failed:
        log(f"failed twice, left out of the table: {failed}")
    if args.smoke:
        result = collect(variants, seeds, args.work, steps)
        print(table({**result, "shared": shared}))
        assert len(result["runs"]) == len(plan), sorted(result["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
