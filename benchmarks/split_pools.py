"""Split pools vs colocated on the demo's work: 2 ranks that both generate and train in turn
(placement.mode=colocated, the default) against 1 generation rank + 1 trainer rank running at the
same time, one step off policy (placement.mode=split, rollout.max_staleness=1) and synchronous
(rollout.max_staleness=0, the correctness baseline: no overlap), seeds 7, 8, 9.

    python benchmarks/split_pools.py                           # colocated, split_k1, split_k0 on seeds 7, 8, 9 (9 runs)
    python benchmarks/split_pools.py --layouts colocated,split_k1 --seeds 7
    python benchmarks/split_pools.py --smoke                   # tiny random model, 2 steps: plumbing only

Each run is `make demo` (recipes/grpo.py, the embedded model and task, 14 steps, the demo's
defaults) plus algo.rollout_correction=tis_token on both layouts: a split run with k >= 1 needs the
behaviour policy's weights (decoupled PPO), and on a colocated run's on-policy samples the weights
are 1 up to rounding, so the two layouts train with the same loss. The runs are interleaved
(colocated s7, split s7, colocated s8, ...) so the machine's load falls on both alike. Held-out
accuracy is the loop's own evaluation at step 0 and after the last step, the same procedure on both:
a colocated run evaluates on its 2 ranks, a split run on its generation rank with the trainer's
weights of that step (colo_rl/split/pools.py).

Per run: seconds per step (median), each pool's idle share (split: time/trainer_wait and
time/generation_idle over time/step; colocated: no pool idles, it pays the phase switch), the
staleness trained on (mean, max), groups dropped, held-out accuracy, wall time; and the colocated
run's bottleneck report (summary.json "bottleneck" -> "splits") predicting the 1 + 1 split's step,
side by side with the split runs' measured step. A finished run (summary.json present) is reused
unless --fresh. Results: results/split_pools-<device>-<date>.json / .md / .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.algorithms import (add_sweep_arguments, chosen, run_one, seed_list, summarise,  # noqa: E402
                                   sweep_log)
from benchmarks.engine_compare import spread  # noqa: E402

SPLIT = ["placement.mode=split", "placement.generation_ranks=1"]
LAYOUTS: dict[str, tuple[list[str], str]] = {
    "colocated": ([], "2 ranks, each generates then trains (the default)"),
    "split_k1": ([*SPLIT, "rollout.max_staleness=1"], "1 generation + 1 trainer rank, one step off (k = 1)"),
    "split_k0": ([*SPLIT, "rollout.max_staleness=0"], "1 generation + 1 trainer rank, synchronous (k = 0)"),
}
DEFAULT_LAYOUTS = ["colocated", "split_k1", "split_k0"]
SHARED = ["algo.rollout_correction=tis_token", "logger=[jsonl]", "plots=false"]
SMOKE = ["model=tiny", "trainer.total_steps=2", "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8",
         "data.eval_size=8"]


def idle_shares(rows: list[dict], skip: int = 1) -> dict[str, float]:
    """Each pool's idle share of the step time over the step rows (the first `skip` dropped: the
    pipeline fills on a split run's first step): sum(idle seconds) / sum(time/step). A split run's
    trainer idles in time/trainer_wait, its generation rank in time/generation_idle; a colocated
    run has neither (0) and pays time/handoff + time/phase_switch instead (switch)."""
    steps = [r for r in rows if r.get("time/step") is not None and r.get("step", 1) > 0]
    kept = steps[common.kept_steps(len(steps), skip):]
    total = sum(r["time/step"] for r in kept) or float("nan")

    def share(*keys: str) -> float:
        return sum(float(r.get(k) or 0.0) for r in kept for k in keys) / total

    return {"trainer_idle_share": share("time/trainer_wait"), "generation_idle_share": share("time/generation_idle"),
            "switch_share": share("time/handoff", "time/phase_switch")}


def run_summary(run_dir: Path) -> dict:
    """algorithms.summarise, the pools' idle shares, the staleness trained on and the drops, the
    weight sync's seconds, and (colocated) the bottleneck report's 1 + 1 split."""
    from colo_rl.loggers import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r.get("reward/mean") is not None]
    out = {**summarise(run_dir), **idle_shares(rows)}
    if any("split/staleness_max" in r for r in steps):
        out.update({"staleness_mean": statistics.fmean(r["split/staleness_mean"] for r in steps),
                    "staleness_max": max(r["split/staleness_max"] for r in steps),
                    "dropped_groups": steps[-1]["split/dropped_groups_total"],
                    "weight_sync_s": statistics.fmean(r.get("time/weight_sync", 0.0) for r in steps)})
    report = json.loads((run_dir / "summary.json").read_text()).get("bottleneck") or {}
    one_one = [s for s in report.get("splits", []) if s["generation_gpus"] == 1 and s["training_gpus"] == 1]
    if one_one:
        out["predicted_split"] = one_one[0]
        out["bound"] = report["bound"]
    return out


def compare(runs: dict[str, dict], layouts: list[str]) -> dict:
    """Per layout, over seeds: seconds per step, idle shares, held-out accuracy; the bottleneck
    report's prediction of the 1 + 1 split against the measured split runs."""
    out: dict = {"layouts": {}}
    for name in layouts:
        rs = [r for r in runs.values() if r["layout"] == name]
        if not rs:
            continue
        keys = ["s_per_step", "heldout_start", "heldout_end", "heldout_delta", "trainer_idle_share",
                "generation_idle_share", "switch_share", "wall_s"]
        out["layouts"][name] = {k: spread([r[k] for r in rs]) for k in keys if all(r.get(k) is not None for r in rs)}
    predicted = [r["predicted_split"] for r in runs.values() if r["layout"] == "colocated" and "predicted_split" in r]
    if predicted:
        out["predicted_split"] = {k: spread([p[k] for p in predicted]) for k in
                                  ("step_seconds", "generation_idle_share", "training_idle_share")}
    colo, k1, k0 = (out["layouts"].get(n) for n in ("colocated", "split_k1", "split_k0"))
    if colo and k0:
        out["split_k0_vs_colocated"] = k0["s_per_step"]["mean"] / colo["s_per_step"]["mean"]
    if k1 and k0:  # what the one-step-off overlap buys over the synchronous split
        out["split_k1_vs_split_k0"] = k1["s_per_step"]["mean"] / k0["s_per_step"]["mean"]
    if colo and k1:
        out["split_k1_vs_colocated"] = k1["s_per_step"]["mean"] / colo["s_per_step"]["mean"]
        if predicted:
            out["measured_vs_predicted"] = k1["s_per_step"]["mean"] / out["predicted_split"]["step_seconds"]["mean"]
    return out


def table(result: dict) -> str:
    def f(x, d=2):
        return "" if x is None else f"{x:.{d}f}"

    def pct(x):
        return "" if x is None else f"{100 * x:.0f} %"

    def ms(s, key, scale=1.0, d=2):  # "mean (std)" over seeds
        v = s.get(key)
        if v is None:
            return ""
        std = "-" if v["std"] is None else f"{scale * v['std']:.{d}f}"
        return f"{scale * v['mean']:.{d}f} ({std})"

    lines = [f"# {common.TITLES['split_pools']}", "",
             f"`make demo`'s work per layout and seed (seeds {result['seeds']}, interleaved), shared overrides "
             f"`{' '.join(result['shared'])}`; layouts: " +
             "; ".join(f"`{n}`: {LAYOUTS[n][1]} (`{' '.join(LAYOUTS[n][0]) or 'defaults'}`)" for n in result["layouts"])
             + ". Idle: the share of the step a pool waited (split: the trainer for a rollout, the generation "
               "rank for weights or queue space); a colocated run idles no pool and pays the phase switch "
               "instead. Held-out: greedy accuracy on the held-out problems at step 0 and after the last step.", "",
             "| layout | seed | s / step (median) | trainer idle | generation idle | switch | staleness mean / max | "
             "dropped groups | weight sync (s) | held-out start | held-out end | wall (min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"].values():
        stale = f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}" if "staleness_mean" in r else ""
        lines.append(f"| {r['layout']} | {r['seed']} | {r['s_per_step']:.1f} | {pct(r['trainer_idle_share'])} | "
                     f"{pct(r['generation_idle_share'])} | {pct(r['switch_share'])} | {stale} | "
                     f"{f(r.get('dropped_groups'), 0)} | {f(r.get('weight_sync_s'))} | {r['heldout_start']:.3f} | "
                     f"{r['heldout_end']:.3f} | {f(r['wall_s'] and r['wall_s'] / 60, 1)} |")
    cmp = result["comparison"]
    lines += ["", "Mean (std) over seeds:", "",
              "| layout | s / step | trainer idle (%) | generation idle (%) | switch (%) | held-out start | "
              "held-out end | change (points) | wall (min) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in cmp["layouts"].items():
        lines.append(f"| {name} | {ms(s, 's_per_step', d=1)} | {ms(s, 'trainer_idle_share', 100, 0)} | "
                     f"{ms(s, 'generation_idle_share', 100, 0)} | {ms(s, 'switch_share', 100, 1)} | "
                     f"{ms(s, 'heldout_start', d=3)} | {ms(s, 'heldout_end', d=3)} | "
                     f"{ms(s, 'heldout_delta', 100, 1)} | {ms(s, 'wall_s', 1 / 60, 1)} |")
    p = cmp.get("predicted_split")
    k1 = cmp["layouts"].get("split_k1")
    if p and k1:
        lines += ["", "The colocated runs' bottleneck report (summary.json `bottleneck`) predicts the 1 + 1 split; "
                      "the split_k1 runs measure it:", "",
                  "| | s / step | generation pool idle (%) | trainer pool idle (%) |", "|---|---|---|---|",
                  f"| predicted (colocated runs' report) | {ms(p, 'step_seconds', d=1)} | "
                  f"{ms(p, 'generation_idle_share', 100, 0)} | {ms(p, 'training_idle_share', 100, 0)} |",
                  f"| measured (split_k1) | {ms(k1, 's_per_step', d=1)} | {ms(k1, 'generation_idle_share', 100, 0)} | "
                  f"{ms(k1, 'trainer_idle_share', 100, 0)} |", "",
                  f"split_k1 / colocated seconds per step: {cmp['split_k1_vs_colocated']:.2f}; measured / predicted: "
                  f"{cmp['measured_vs_predicted']:.2f}."]
    ratios = [f"{a} / {b} seconds per step: {cmp[f'{a}_vs_{b}']:.2f}" for a, b in
              (("split_k0", "colocated"), ("split_k1", "split_k0")) if f"{a}_vs_{b}" in cmp]
    lines += (["", "; ".join(ratios) + "."] if ratios else [])
    lines += (["", result["note"]] if result.get("note") else [])
    return "\n".join(lines) + "\n"


def chart(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_step, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(result["comparison"]["layouts"])
    colours = dict(zip(LAYOUTS, ("tab:blue", "tab:orange", "tab:green")))
    for i, name in enumerate(names):
        rs = [r for r in result["runs"].values() if r["layout"] == name]
        ax_step.scatter([i] * len(rs), [r["s_per_step"] for r in rs], color=colours[name], label=name)
        for r in rs:
            ax_eval.plot(r["eval_steps"], r["eval_accuracy"], marker="o", color=colours[name], alpha=0.7,
                         label=f"{name} s{r['seed']}")
    p = result["comparison"].get("predicted_split")
    if p:
        ax_step.axhline(p["step_seconds"]["mean"], color="grey", linestyle=":", label="predicted 1 + 1 split")
    ax_step.set_xticks(range(len(names)), names)
    ax_step.set_ylabel("seconds per step (median)")
    ax_step.set_title("step time")
    ax_eval.set_title("held-out accuracy (greedy)")
    ax_eval.set_xlabel("step")
    for ax in (ax_step, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="comma-separated subset of " + ", ".join(LAYOUTS))
    add_sweep_arguments(p, "split_pools", "2 steps")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override for every run")
    p.add_argument("--note", default="", help="a paragraph added under the tables (e.g. the conclusion)")
    args = p.parse_args(argv)
    layouts = chosen(p, args.layouts, LAYOUTS, "layout")
    seeds = seed_list(args.seeds)
    shared = SHARED + (SMOKE if args.smoke else []) + args.override
    log = sweep_log("split_pools")

    runs, failed = {}, []
    for seed in seeds:  # interleaved: the machine's load falls on every layout alike
        for name in layouts:
            try:
                run_dir = run_one(name, seed, shared + LAYOUTS[name][0], args.work, 2, args.fresh, log)
            except RuntimeError as e:
                log(f"{e}; going on without it")
                failed.append(f"{name}-seed{seed}")
                continue
            runs[f"{name}-seed{seed}"] = {"layout": name, "seed": seed, **run_summary(run_dir)}
        result = {"layouts": layouts, "seeds": seeds, "shared": shared, "runs": runs,
                  "comparison": compare(runs, layouts), "failed": failed, "note": args.note}
        if args.smoke:
            print(table(result))
        elif runs:  # after every seed: an interrupted benchmark still leaves its table
            common.publish("split_pools", result, table(result), args.out, chart=chart)
    if failed:
        log(f"failed, left out of the table: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
