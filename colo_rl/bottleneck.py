"""Is a GRPO run rollout-bound or train-bound, and what would a split of the node's GPUs give?

From the measured per-step phase times (metrics.jsonl: time/generation, time/pack, time/logprobs,
time/update, time/handoff, time/phase_switch, time/reward), on N GPUs that every phase uses in turn:

    generation work   W_g = t_gen * N            GPU-seconds per step
    training work     W_t = (t_pack + t_logprobs + t_update) * N
    colocated step    T_c = t_gen + t_train + t_switch + t_other      (t_switch = handoff + phase switch;
                      t_other = the rest of time/step: the verifiers' time/reward and the untimed host
                      work between phases, so the shares sum to 1)

A disaggregated layout gives g GPUs to generation and N - g to training, pipelined one step off
policy (as slime / verl's async mode do): its step takes max(W_g / g, W_t / (N - g)) + t_other,
and the faster pool idles for the rest. The balance rule (rollout throughput = training
consumption) puts g* = N * W_g / (W_g + W_t); the report evaluates the integer splits around it
and the idle share each pool keeps, against what colocation pays: t_switch per step, no idle
pool. Weight transfer between pools is not modelled (it is at least the colocated handoff).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
import logging
from typing import Callable, Iterable, Optional

from colo_rl.errors import ConfigError
from colo_rl.loggers import read_jsonl
from colo_rl.metrics import EVAL_SWITCH_KEYS, SAVE_SWITCH_KEYS
from colo_rl.profiling import is_profiled
from colo_rl.split.placement import split_layout as layout_of

log = logging.getLogger("colo_rl")

# The timed phases; "other" is the rest of time/step (time/reward and untimed host work).
# time/reward_model: the reward model scores on the training GPUs, in the update phase.
PHASES = {"generation": ["time/generation"],
          "train": ["time/pack", "time/logprobs", "time/update", "time/reward_model"],
          "switch": ["time/handoff", "time/phase_switch"]}
SHARES = (*PHASES, "other")


EVAL_SWITCH = {paid: key for key, paid in EVAL_SWITCH_KEYS.items()}  # time/eval_handoff -> time/handoff, ...
SAVE_SWITCH = SAVE_SWITCH_KEYS["time/phase_switch"]


def _is_step(row: dict) -> bool:
    return row.get("time/step") is not None and row.get("step", 1) > 0


def charged_rows(rows: Iterable[dict]) -> list[dict]:
    """The rows, each step row (step > 0, with time/step) charged the switch into the generation
    phase that the evaluation logged before it paid in its stead (colo_rl/evaluation.py
    `switch_seconds_paid`): its time/handoff, time/phase_switch and time/step grow by it, as in a
    run without that evaluation. Not when a save after the evaluation switched back to the update
    phase (time/save_phase_switch in the evaluation's row): the next step then paid its own, and
    the evaluation's switch was the evaluation's cost. The last evaluation's switch has no step
    after it and is left out. The rows given are not changed."""
    out, carried = [], {}
    for r in rows:
        if _is_step(r) and carried:
            r = dict(r)
            for key, seconds in carried.items():
                r[key] = float(r.get(key) or 0.0) + seconds
                r["time/step"] = float(r["time/step"]) + seconds
            carried = {}
        out.append(r)
        paid = {step_key: float(r[key]) for key, step_key in EVAL_SWITCH.items() if r.get(key)}
        if paid and not r.get(SAVE_SWITCH):
            carried = paid
    return out


def charged_steps(rows: Iterable[dict]) -> list[dict]:
    """The step rows of `charged_rows`, less the profiled ones (`profiling.is_profiled`: both
    profilers slow the host) while any other remains."""
    steps = [r for r in charged_rows(rows) if _is_step(r)]
    unprofiled = [r for r in steps if not is_profiled(r)]
    return unprofiled or steps


def phase_means(rows: Iterable[dict], skip: int = 1) -> dict[str, float]:
    """Mean seconds per step of each phase over the step rows (the first `skip` dropped as warm-up),
    an evaluation's switch charged to the step after it (`charged_steps`)."""
    steps = charged_steps(rows)
    kept = steps[min(skip, max(0, len(steps) - 1)):]
    if not kept:
        raise ValueError("no step rows with time/step: nothing to report")
    out = {name: statistics.fmean(sum(float(r.get(k) or 0.0) for k in keys) for r in kept)
           for name, keys in PHASES.items()}
    out["step"] = statistics.fmean(float(r["time/step"]) for r in kept)
    # the rest of the step, not just time/reward: on a GPU the untimed host work between phases was
    # 16 % of a 0.5B step (2026-11-27), and a report that left it out summed to 83 %
    out["other"] = max(0.0, out["step"] - sum(out[name] for name in PHASES))
    out["steps"] = float(len(kept))
    return out


def split_layout(t_gen: float, t_train: float, t_other: float, n_gpus: int, g: int) -> dict:
    """Step time and idle shares with g generation GPUs and n_gpus - g training GPUs (pipelined)."""
    gen_time = t_gen * n_gpus / g
    train_time = t_train * n_gpus / (n_gpus - g)
    busy = max(gen_time, train_time)
    return {"generation_gpus": g, "training_gpus": n_gpus - g, "step_seconds": busy + t_other,
            "generation_idle_share": 1 - gen_time / busy if busy > 0 else 0.0,
            "training_idle_share": 1 - train_time / busy if busy > 0 else 0.0}


def bottleneck_report(rows: Iterable[dict], n_gpus: int, skip: int = 1) -> dict:
    t = phase_means(rows, skip)
    busy = t["generation"] + t["train"]
    report = {
        "gpus": n_gpus, "steps_measured": int(t["steps"]), "seconds_per_step": t,
        "shares": {k: (t[k] / t["step"] if t["step"] > 0 else 0.0) for k in SHARES},
        "bound": "rollout" if t["generation"] >= t["train"] else "train",
        "colocated": {"step_seconds": t["step"], "switch_share": t["switch"] / t["step"] if t["step"] > 0 else 0.0},
        "splits": [],
    }
    if n_gpus >= 2 and busy > 0:
        g_star = n_gpus * t["generation"] / busy
        report["balanced_generation_gpus"] = g_star
        candidates = sorted({min(n_gpus - 1, max(1, math.floor(g_star))), min(n_gpus - 1, max(1, math.ceil(g_star)))})
        report["splits"] = [split_layout(t["generation"], t["train"], t["other"], n_gpus, g) for g in candidates]
        best = min(report["splits"], key=lambda s: s["step_seconds"])
        report["best_split"] = best
        report["split_vs_colocated"] = best["step_seconds"] / t["step"] if t["step"] > 0 else float("nan")
    return report


def balanced_generation_ranks(seconds: dict, measured_ranks: int, world: int,
                              allowed: Callable[[int], bool] = lambda g: True) -> dict:
    """placement.generation_ranks=auto: the split of `world` ranks a measured colocated run's phases
    balance best. `seconds`: phase_means of a colocated run on `measured_ranks` ranks. Its work per
    step is W_g = t_gen * N_measured and W_t = t_train * N_measured rank-seconds; on `world` ranks
    each phase of the colocated step would take W / world, and a split with g generation ranks
    takes max(W_g / g, W_t / (world - g)) + t_other (split_layout). Among the g in [1, world) that
    `allowed` accepts (the layout's rules: TP groups, whole prompt groups per rank), the fastest;
    on a tie the one nearest the balance point g* = world * W_g / (W_g + W_t). Returns
    split_layout's dict for it with "balanced_generation_ranks" (g*)."""
    scale = measured_ranks / world
    t_gen, t_train, t_other = seconds["generation"] * scale, seconds["train"] * scale, seconds["other"]
    if t_gen + t_train <= 0:
        raise ValueError("the measured steps spent no time generating or training: nothing to balance")
    g_star = world * t_gen / (t_gen + t_train)
    candidates = [split_layout(t_gen, t_train, t_other, world, g) for g in range(1, world) if allowed(g)]
    if not candidates:
        raise ValueError(f"no split of {world} ranks is allowed (each pool needs a rank, whole TP groups and "
                         f"whole prompt groups)")
    best = min(candidates, key=lambda s: (round(s["step_seconds"], 9), abs(s["generation_gpus"] - g_star)))
    return {**best, "balanced_generation_ranks": g_star}


def measured_phases(source: Path) -> tuple[dict, int]:
    """A previous colocated GRPO run's phase seconds per step and its rank count, from the bottleneck
    report in its run directory's summary.json (`source`: the directory or the file); ValueError
    saying what is missing."""
    run_dir = source.parent if source.name == "summary.json" else source
    summary, metrics = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not metrics.is_file() and not summary.is_file():
        raise ValueError(f"{run_dir} holds neither summary.json nor metrics.jsonl: not a GRPO run directory")
    rows = read_jsonl(metrics) if metrics.is_file() else []
    if any("split/policy_version" in r for r in rows):
        raise ValueError(f"{run_dir} is a split run: its steps measure the pipeline, not each phase; give a "
                         f"colocated run of the same work")
    report = json.loads(summary.read_text()).get("bottleneck") if summary.is_file() else None
    if report:
        return report["seconds_per_step"], int(report["gpus"])
    raise ValueError(f"{run_dir} has no bottleneck report (summary.json is written at the end of a colocated GRPO "
                     f"run with at least one step); let a colocated run of the same work finish first")


def resolve_generation_ranks(placement, world: int, tp_size: int, prompts_per_step: int,
                             local_world: Optional[int] = None, mini_batches_per_step: int = 1) -> int:
    """placement.generation_ranks as a number of ranks: the number given, or with `auto` the split
    balanced_generation_ranks finds for the colocated run named by placement.balance_from (every
    rank reads the same file, so every rank gets the same answer). ConfigError when it cannot be known."""
    if str(placement.generation_ranks) != "auto":
        return int(placement.generation_ranks)
    source = placement.balance_from
    if not source:
        raise ConfigError("placement.generation_ranks=auto takes the split from a measured colocated run of the "
                          "same work: set placement.balance_from=<its run directory> (a colocated GRPO run writes its "
                          "bottleneck report into summary.json at the end), or set placement.generation_ranks to a "
                          "number of ranks")

    def allowed(g: int) -> bool:
        try:
            layout_of(world, g, tp_size, prompts_per_step, local_world, mini_batches_per_step)
        except ConfigError:
            return False
        return True

    try:
        seconds, measured = measured_phases(Path(source))
        best = balanced_generation_ranks(seconds, measured, world, allowed)
    except ValueError as e:
        raise ConfigError(f"placement.generation_ranks=auto with placement.balance_from={source}: {e}") from e
    log.info("placement.generation_ranks=auto: %d of %d ranks generate (balance point %.2f, from %s measured on %d "
             "rank(s)); predicted %.2f s/step, idle: generation pool %.0f %%, trainer pool %.0f %%",
             best["generation_gpus"], world, best["balanced_generation_ranks"], source, measured,
             best["step_seconds"], 100 * best["generation_idle_share"], 100 * best["training_idle_share"])
    return best["generation_gpus"]


def format_report(report: dict) -> str:
    """The report in words; with "measured_ranks" set and unlike "gpus" (a projection), what it assumes."""
    t, s = report["seconds_per_step"], report["shares"]
    lines = [f"bottleneck ({report['steps_measured']} steps, {report['gpus']} ranks): "
             f"{report['bound']}-bound; per step {t['step']:.2f} s = generation {100 * s['generation']:.0f} % + "
             f"training {100 * s['train']:.0f} % + switching {100 * s['switch']:.1f} % + other {100 * s['other']:.0f} %"]
    measured = report.get("measured_ranks", report["gpus"])
    if measured != report["gpus"]:  # --gpus N: the same seconds, relabelled
        lines[0] = lines[0].replace(f"{report['gpus']} ranks)", f"projected to {report['gpus']} devices from a run "
                                    f"of {measured or 'an unknown number of'} rank(s))")
        lines.append(f"  the projection assumes each phase takes the measured seconds per step on {report['gpus']} "
                     f"devices (each one as fast as a measured rank, the step's work spread as it was: a CPU run's "
                     f"seconds are not a GPU's); only the split of the devices between generation and training is "
                     f"modelled. Measure on the node itself for figures.")
    best = report.get("best_split")
    if best:
        lines.append(
            f"  balance rule: {report['balanced_generation_gpus']:.1f} of {report['gpus']} devices for generation; "
            f"best split {best['generation_gpus']} gen / {best['training_gpus']} train would take "
            f"{best['step_seconds']:.2f} s/step ({report['split_vs_colocated']:.2f}x colocated), idle: generation "
            f"pool {100 * best['generation_idle_share']:.0f} %, training pool {100 * best['training_idle_share']:.0f} %; "
            f"colocation pays {100 * report['colocated']['switch_share']:.1f} % switching and no idle pool")
    return "\n".join(lines)


def main(argv=None) -> int:
    """`python -m colo_rl.bottleneck RUN_DIR [--gpus N]`: the report of a run directory's metrics.jsonl,
    e.g. for a run stopped before its end, or to ask what another GPU count would change."""
    p = argparse.ArgumentParser(prog="python -m colo_rl.bottleneck", description=main.__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--gpus", type=int, default=None, help="devices of the node (default: the run's world size)")
    p.add_argument("--skip", type=int, default=1, help="first steps dropped as warm-up")
    args = p.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    if not metrics.is_file():
        p.error(f"{metrics}: no such file (a GRPO run directory holds metrics.jsonl)")
    rows = read_jsonl(metrics)
    if any("split/policy_version" in r for r in rows):
        p.error(f"{args.run_dir} is a split run: its pools run at once, so the phases' shares of a step mean "
                f"nothing; its split/* and time/generation_idle metrics say where each pool waits")
    summary = args.run_dir / "summary.json"
    measured = json.loads(summary.read_text()).get("bottleneck", {}).get("gpus") if summary.is_file() else None
    gpus = args.gpus or measured
    if not gpus:
        p.error("the run's world size is not in summary.json: give --gpus N")
    try:
        report = bottleneck_report(rows, gpus, args.skip)
        report["measured_ranks"] = measured
        print(format_report(report))
    except ValueError as e:
        p.error(f"{metrics}: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
