"""Learning per step against TRL: benchmarks/race_trl.py's two sides (same model, the same prompts at
each step, same reward, lr 1e-5, one optimizer step per batch of 8 prompts x 8 completions) on
several seeds and precisions; per step each side's reward and accuracy, mean and spread over seeds.

    python benchmarks/race_learning.py --seeds 1,2,3 --dtypes fp32,bf16 --steps 20
    python benchmarks/race_learning.py --seeds 1 --dtypes fp32 --sides trl --no-publish   # one side of one run

One side of one (dtype, seed) per process is how a shared machine queues them (`flock
/tmp/colo_heavy.lock ...`); a finished side (its JSON in --work) is reused unless --fresh, so a last
call without --no-publish only collects. colo_rl runs plain recipes/grpo.py (race_trl's
--colo-runner recipe), so no step breakdown is written.

Accuracy: the share of each step's 64 sampled completions (temperature 1) that the verifier marks
correct; every step draws problems neither side has trained on, so it is a held-out measure taken
on the policy of that step. Verdict per dtype: the seeds are paired (a seed fixes the initial
model and the prompts of both sides), so the gap is the mean over seeds of colo_rl - TRL in the
reward averaged over all steps, set against twice the larger of the two sides' std over seeds.
Results: results/race_learning-<device>-<date>.json / .md / .png.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks import race_trl  # noqa: E402

SIDES = ("colo_rl", "trl")
DTYPES = ("fp32", "bf16")


def side_args(args, seed: int, dtype: str) -> SimpleNamespace:
    """The namespace race_trl.run_colo / run_trl read: its defaults, this seed and dtype."""
    ns = race_trl.parse_args(["--seed", str(seed), "--dtype", dtype, "--steps", str(args.steps),
                              "--model", args.model, "--colo-runner", "recipe", "--no-readme"])
    return SimpleNamespace(**vars(ns))


def run_side(args, side: str, seed: int, dtype: str, log) -> dict:
    """One side of one (dtype, seed), or its saved JSON when it already ran."""
    work = args.work / f"{dtype}-seed{seed}"
    saved = work / f"{side}-result.json"  # not trl.json: the TRL worker's own output
    if saved.exists() and not args.fresh:
        result = json.loads(saved.read_text())
        if len(result["reward"]) >= args.steps:
            log(f"{side} {dtype} seed {seed}: reusing {saved}")
            return result
    work.mkdir(parents=True, exist_ok=True)
    log(f"{side} {dtype} seed {seed}: {args.steps} steps ...")
    ns = side_args(args, seed, dtype)
    result = race_trl.run_colo(ns, work) if side == "colo_rl" else race_trl.run_trl(ns, work)
    saved.write_text(json.dumps(result, indent=1) + "\n")
    log(f"{side} {dtype} seed {seed}: done in {result['wall_seconds'] / 60:.1f} min")
    return result


def trl_from_log(log: Path) -> dict:
    """A TRL side stopped before its end (a time limit): the steps it logged, read from its log
    (Trainer's per-step dicts: `reward`, `completions/mean_length`, `step_time`). The accuracy is
    not logged by TRL, so it is missing here."""
    rows = [ast.literal_eval(line[line.index("{"):]) for line in log.read_text().splitlines()
            if line.lstrip().startswith("{") and "'reward':" in line]
    return {"reward": [float(r["reward"]) for r in rows], "accuracy": [],
            "completion_len": [float(r["completions/mean_length"]) for r in rows],
            "step_seconds": [float(r["step_time"]) for r in rows], "wall_seconds": None, "from_log": str(log)}


def spread(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "n": len(values)}


def compare(runs: dict, steps: int) -> dict:
    """Per dtype and side: per-step mean / std over seeds of reward and accuracy, each seed's mean
    reward over all steps, and the verdict (paired gap against the seed spread). A side that
    logged fewer steps (trl_from_log) shortens the comparison to the steps every run has."""
    steps = min([steps] + [len(side["reward"]) for pair in runs.values() for side in pair.values()])
    out = {}
    for dtype in DTYPES:
        seeds = sorted({s for (d, s) in runs if d == dtype and all(side in runs[(d, s)] for side in SIDES)})
        if not seeds:
            continue
        block = {"seeds": seeds}
        for side in SIDES:
            per_seed = [runs[(dtype, s)][side] for s in seeds]
            block[side] = {
                "reward_per_step": [spread([r["reward"][i] for r in per_seed]) for i in range(steps)],
                "accuracy_per_step": [spread([r["accuracy"][i] for r in per_seed if len(r["accuracy"]) > i])
                                      for i in range(steps)],
                "reward_mean_per_seed": [statistics.fmean(r["reward"][:steps]) for r in per_seed],
                "accuracy_mean_per_seed": [statistics.fmean(r["accuracy"][:steps]) for r in per_seed
                                           if len(r["accuracy"]) >= steps],
                "reward_last5_per_seed": [statistics.fmean(r["reward"][max(0, steps - 5):steps]) for r in per_seed],
                "median_step_seconds": [race_trl.median_step(r["step_seconds"][:steps], 2) for r in per_seed],
                "wall_seconds": [r["wall_seconds"] for r in per_seed],
                "completion_len_mean": statistics.fmean(
                    x for r in per_seed for x in r["completion_len"][:steps] if x is not None)}
            block[side]["reward_mean"] = spread(block[side]["reward_mean_per_seed"])
            block[side]["accuracy_mean"] = spread(block[side]["accuracy_mean_per_seed"])
            block[side]["reward_last5"] = spread(block[side]["reward_last5_per_seed"])
        gaps = [c - t for c, t in zip(block["colo_rl"]["reward_mean_per_seed"], block["trl"]["reward_mean_per_seed"])]
        block["gap_per_seed"] = gaps
        gap = statistics.fmean(gaps)
        stds = [block[s]["reward_mean"]["std"] for s in SIDES if block[s]["reward_mean"]["std"] is not None]
        if not stds:
            verdict = (f"colo_rl - TRL = {gap:+.3f} in mean reward over {steps} steps with one seed: no seed spread "
                       f"to judge it against.")
        else:
            noise = 2 * max(stds)
            verdict = (f"colo_rl - TRL = {gap:+.3f} in mean reward over {steps} steps (per seed "
                       f"{', '.join(f'{g:+.3f}' for g in gaps)}); twice the larger seed std is {noise:.3f}: "
                       + ("beyond the seed spread." if abs(gap) > noise else "within the seed spread (no difference "
                                                                             "shown)."))
        block["gap"], block["verdict"], block["steps"] = gap, verdict, steps
        out[dtype] = block
    return out


def table(result: dict) -> str:
    def ms(s, d=3):
        if s["mean"] is None:
            return "n/a"
        return f"{s['mean']:.{d}f}" + (f" ({s['std']:.{d}f})" if s["std"] is not None else "")

    def per_seed(xs, d=0):
        return ", ".join("n/a" if x is None else f"{x:.{d}f}" for x in xs)

    lines = [f"# {common.TITLES['race_learning']}", "",
             "benchmarks/race_trl.py's work on both sides (SmolLM2-135M-Instruct, 8 prompts x 8 completions, <= 64 "
             "new tokens, temperature 1, lr 1e-5, one optimizer step per batch, no reference model, the same prompts "
             "at each step), per precision and seed. Figures are mean (std) over seeds. "
             "Accuracy: the share of the step's 64 sampled completions that are correct, on problems not trained "
             "on before."]
    for dtype, b in result["comparison"].items():
        c, t = b["colo_rl"], b["trl"]
        lines += ["", f"### {dtype}, seeds {b['seeds']}, {b['steps']} steps", "",
                  "| | colo_rl | TRL GRPOTrainer |", "|---|---|---|",
                  f"| reward, mean over all steps | {ms(c['reward_mean'])} | {ms(t['reward_mean'])} |",
                  f"| reward, last 5 steps | {ms(c['reward_last5'])} | {ms(t['reward_last5'])} |",
                  f"| accuracy, mean over all steps | {ms(c['accuracy_mean'])} | {ms(t['accuracy_mean'])} |",
                  f"| mean completion tokens | {c['completion_len_mean']:.1f} | {t['completion_len_mean']:.1f} |",
                  f"| median s / step (per seed) | {per_seed(c['median_step_seconds'], 1)} | "
                  f"{per_seed(t['median_step_seconds'], 1)} |",
                  f"| wall clock per run incl. start-up (s) | {per_seed(c['wall_seconds'])} | "
                  f"{per_seed(t['wall_seconds'])} |",
                  "", b["verdict"], "",
                  "| step | colo_rl reward | TRL reward | colo_rl accuracy | TRL accuracy |", "|---|---|---|---|---|"]
        for i in range(b["steps"]):
            lines.append(f"| {i + 1} | {ms(c['reward_per_step'][i])} | {ms(t['reward_per_step'][i])} | "
                         f"{ms(c['accuracy_per_step'][i])} | {ms(t['accuracy_per_step'][i])} |")
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def chart(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = result["comparison"]
    fig, axes = plt.subplots(len(blocks), 2, figsize=(11, 3.8 * len(blocks)), squeeze=False)
    for row, (dtype, b) in zip(axes, blocks.items()):
        for ax, key, title in ((row[0], "reward_per_step", "reward"), (row[1], "accuracy_per_step", "accuracy")):
            for side, label in (("colo_rl", "colo_rl"), ("trl", "TRL")):
                kept = [(i + 1, s) for i, s in enumerate(b[side][key]) if s["mean"] is not None]
                if not kept:  # a side whose log has no accuracy (trl_from_log)
                    continue
                x = [i for i, _ in kept]
                mean = [s["mean"] for _, s in kept]
                std = [s["std"] or 0.0 for _, s in kept]
                ax.plot(x, mean, marker="o", label=label)
                ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
            ax.set_title(f"{dtype}: {title} per step, mean +- std over seeds {b['seeds']}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--model", choices=["embedded", "tiny"], default="embedded", help="tiny: a plumbing check")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench" / "race_learning")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--fresh", action="store_true", help="rerun finished sides too")
    p.add_argument("--no-publish", action="store_true", help="run, write nothing to --out")
    p.add_argument("--note", default="", help="a sentence added under the tables (e.g. what did not run)")
    p.add_argument("--trl-from-log", action="store_true",
                   help="where a TRL side has no result (stopped by a time limit), take the steps its log holds")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    sides = [s for s in args.sides.split(",") if s]
    for name, got, allowed in (("dtype", dtypes, DTYPES), ("side", sides, SIDES)):
        bad = [g for g in got if g not in allowed]
        if bad:
            p.error(f"unknown {name} {bad[0]!r}; choose from {list(allowed)}")

    def log(msg: str) -> None:
        print(f"[race_learning] {msg}", flush=True)

    runs: dict = {}
    for dtype in dtypes:  # dtype-major, then seed: an interrupted queue still has whole seeds of fp32
        for seed in seeds:
            for side in sides:
                partial = args.work / f"{dtype}-seed{seed}" / "trl.log"
                if (side == "trl" and args.trl_from_log and partial.exists()
                        and not (args.work / f"{dtype}-seed{seed}" / "trl-result.json").exists()):
                    runs.setdefault((dtype, seed), {})[side] = trl_from_log(partial)
                    log(f"trl {dtype} seed {seed}: {len(runs[(dtype, seed)][side]['reward'])} steps from {partial}")
                    continue
                runs.setdefault((dtype, seed), {})[side] = run_side(args, side, seed, dtype, log)
    if args.no_publish:
        return 0
    comparison = compare(runs, args.steps)
    if not comparison:
        p.error("no (dtype, seed) has both sides: run both, or collect with --sides colo_rl,trl")
    result = {"steps": args.steps, "seeds": seeds, "dtypes": dtypes, "note": args.note, "comparison": comparison,
              "runs": {f"{d}-seed{s}": v for (d, s), v in runs.items()}}
    common.publish("race_learning", result, table(result), args.out, chart=chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
