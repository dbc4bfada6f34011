"""Step breakdown: where one colocated GRPO step's seconds and memory go.

Runs the real recipe (recipes/grpo.py, in this process, world size 1) with any Hydra overrides
and reports, per step phase, seconds (mean, median, share of the step), peak memory, generation and
training tokens/s, and the share of the step that colocation costs (weight handoff + phase
switch; the target is under 5 %). The ledger's transitions are summarised too.

    python benchmarks/step_breakdown.py                                  # embedded default, 4 steps
    python benchmarks/step_breakdown.py model=tiny trainer.total_steps=2 # any Hydra override
    python benchmarks/step_breakdown.py --skip 2 rollout.max_new_tokens=64 trainer.total_steps=8

Times come from the recipe's own per-step metrics (time/generation, time/reward, time/logprobs,
time/update, time/handoff, time/phase_switch, time/step); "other" is the rest of the step
(collation, advantages, metric reductions), so the shares sum to 1. The first `--skip` steps are
dropped: step 1 carries the warm-up. The switch into generation that an evaluation paid (the
step after it found the engine generating) is charged to that step (colo_rl/bottleneck.py).

Peak memory per phase (benchmarks/phase_memory.py): a sampler thread and a sample at every phase
boundary; a sample counts for every phase open at that moment, so "phase switch" includes the
handoff nested inside it, and "step" is the peak of the whole step.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.phase_memory import PhaseMemory, instrumented  # noqa: E402

# The recipe's per-step time keys, in the order a step runs them, with table labels.
PHASES = [("generation", "time/generation", "generation"),
          ("reward", "time/reward", "reward (verifier, advantages, collation)"),
          ("pack", "time/pack", "micro-batch packing (host)"),
          ("logprobs", "time/logprobs", "log-probs (old / ref)"),
          ("update", "time/update", "update (forward, backward, optimizer)"),
          ("handoff", "time/handoff", "weight handoff"),
          ("phase_switch", "time/phase_switch", "phase switch (excl. handoff)")]
COLOCATION = ("handoff", "phase_switch")
# Benchmark hygiene, applied unless the command line sets the same key: a small held-out set
# (the recipe evaluates at step 0 and at the end; evaluation is outside the step timer), no
# TensorBoard or plots, a train split no bigger than needed (tokenising 20k prompts takes a while).
DEFAULT_OVERRIDES = ["trainer.total_steps=4", "data.train_size=512", "data.eval_size=8",
                     "rollout.eval_max_new_tokens=16", "logger=[jsonl]", "plots=false"]


# ----------------------------------------------------------------------------- pure logic (tested)
def merge_overrides(defaults: list[str], user: list[str]) -> list[str]:
    """Hydra overrides: `defaults` whose key the user does not set, then the user's."""
    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    user_keys = {key(o) for o in user}
    return [o for o in defaults if key(o) not in user_keys] + list(user)


def breakdown(rows: list[dict], skip: int) -> dict:
    """Per-phase seconds over the steps kept after `skip`: mean, median, share of the mean step.

    `other` = step - sum(phases) (bookkeeping inside the step), so shares sum to exactly 1.
    """
    from colo_rl.bottleneck import charged_steps
    from colo_rl.profiling import is_profiled

    steps = charged_steps(rows)  # an evaluation's switch charged to the step after it
    if not steps:
        raise ValueError("no step rows with time/step in metrics")
    kept = steps[common.kept_steps(len(steps), skip):]
    step_mean = statistics.fmean(r["time/step"] for r in kept)
    phases: dict[str, dict] = {}
    for name, key, label in PHASES:
        vals = [float(r.get(key) or 0.0) for r in kept]
        phases[name] = {"label": label, "seconds_mean": statistics.fmean(vals),
                        "seconds_median": statistics.median(vals)}
    others = [r["time/step"] - sum(float(r.get(k) or 0.0) for _, k, _ in PHASES) for r in kept]
    phases["other"] = {"label": "other (in-step bookkeeping)", "seconds_mean": statistics.fmean(others),
                       "seconds_median": statistics.median(others)}
    for p in phases.values():
        p["share"] = p["seconds_mean"] / step_mean if step_mean > 0 else float("nan")
    colo = sum(phases[k]["seconds_mean"] for k in COLOCATION)
    gen_tok = [r.get("throughput/gen_tokens_per_s") for r in kept if r.get("throughput/gen_tokens_per_s")]
    train_tok = [r["throughput/train_tokens"] / r["time/update"] for r in kept
                 if r.get("throughput/train_tokens") and r.get("time/update")]
    return {
        "steps_total": len(steps), "steps_kept": [int(r["step"]) for r in kept],
        "steps_profiled": [int(r["step"]) for r in rows if is_profiled(r)],  # left out (charged_steps)
        "step_seconds_mean": step_mean, "step_seconds_median": statistics.median(r["time/step"] for r in kept),
        "phases": phases,
        "colocation_seconds_mean": colo, "colocation_share": colo / step_mean if step_mean > 0 else float("nan"),
        "gen_tokens_per_s": statistics.fmean(gen_tok) if gen_tok else None,
        "train_response_tokens_per_s": statistics.fmean(train_tok) if train_tok else None,
        "response_len_mean": statistics.fmean(r.get("response/len_mean", 0.0) for r in kept),
        "reward_mean": statistics.fmean(r.get("reward/mean", 0.0) for r in kept),
    }


def run_checks(rows: list[dict]) -> dict:
    """What the whole run says besides its timings: the handoff check over every step (the largest
    engine-vs-trainer log-prob gap: the per-step mean and the single largest token), and held-out
    accuracy at the first and last evaluation."""
    checked = [r for r in rows if r.get("handoff/logprob_diff_mean") is not None]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    out: dict = {"handoff_checked_steps": len(checked)}
    if checked:
        worst = max(checked, key=lambda r: r["handoff/logprob_diff_mean"])
        out.update({"logprob_gap_mean_max": worst["handoff/logprob_diff_mean"], "logprob_gap_mean_max_step": worst["step"],
                    "logprob_gap_token_max": max(r.get("handoff/logprob_diff_max", 0.0) for r in checked)})
    if evals:
        out.update({"held_out_accuracy_start": evals[0]["eval/accuracy"], "held_out_start_step": evals[0]["step"],
                    "held_out_accuracy_end": evals[-1]["eval/accuracy"], "held_out_end_step": evals[-1]["step"],
                    "held_out_count": evals[-1].get("eval/count")})
    return out


# ----------------------------------------------------------------------------- running the recipe
def load_recipe():
    spec = importlib.util.spec_from_file_location("colo_rl_bench_grpo_recipe", ROOT / "recipes" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from colo_rl.config import register_configs

    register_configs()  # the recipes' YAML lists the schema first
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_recipe(overrides: list[str], mem: PhaseMemory) -> float:
    recipe = load_recipe()
    cfg = compose_config(overrides)
    t0 = time.perf_counter()
    with instrumented(mem):
        recipe.main(cfg)  # hydra.main passes a given config straight to the function
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    b, cfg = result["breakdown"], result["config"]
    mem = result["memory"]
    kind = "RSS" if result["memory_kind"] == "rss" else "device used"
    profiled_out = [s for s in b.get("steps_profiled", []) if s not in b["steps_kept"]]
    lines = [f"# Step breakdown: {result['device']}, {result['date']}", "",
             f"`{cfg['model']}`, {cfg['dtype']}, {cfg['world_size']} rank(s), {cfg['prompts_per_step']} prompts x "
             f"{cfg['group_size']} completions, <= {cfg['max_new_tokens']} new tokens, micro-batch "
             f"{cfg['micro_batch_size']}; steps {b['steps_kept'][0]}-{b['steps_kept'][-1]} of "
             f"{b['steps_total'] + len(profiled_out)} (first {b['steps_total'] - len(b['steps_kept'])} dropped as warm-up"
             + "".join(f"; step {s} profiled (trainer.profile_steps), left out" for s in profiled_out) + "). "
             f"Mean response {b['response_len_mean']:.1f} tokens.", "",
             f"| phase | s/step mean | s/step median | share of step | peak memory (GiB, {kind}) |",
             "|---|---|---|---|---|"]
    for name, p in b["phases"].items():
        peak = mem.get(name, {}).get("peak_gib")
        lines.append(f"| {p['label']} | {p['seconds_mean']:.3f} | {p['seconds_median']:.3f} | "
                     f"{100 * p['share']:.1f} % | {'' if peak is None else f'{peak:.2f}'} |")
    step_peak = mem.get("step", {}).get("peak_gib")
    lines.append(f"| **step** | **{b['step_seconds_mean']:.3f}** | **{b['step_seconds_median']:.3f}** | 100 % | "
                 f"{'' if step_peak is None else f'{step_peak:.2f}'} |")
    verdict = "meets" if b["colocation_share"] < 0.05 else "misses"
    gen = b["gen_tokens_per_s"]
    tr = b["train_response_tokens_per_s"]
    lines += ["",
              f"- **colocation share** (handoff + phase switch): **{100 * b['colocation_share']:.2f} %** of the step "
              f"({b['colocation_seconds_mean']:.3f} s) - {verdict} the < 5 % target",
              f"- generation: {gen:.1f} tokens/s" if gen else "- generation: n/a",
              f"- training: {tr:.1f} response tokens/s through the update (forward + backward + step)" if tr else
              "- training: n/a",
              f"- reward/mean over the kept steps: {b['reward_mean']:.3f}",
              f"- wall clock of the run (start-up, evaluations, export included): {result['wall_seconds']:.0f} s"]
    if result.get("harness_seconds_per_step") is not None:
        lines.append(f"- this harness's memory samples at phase boundaries: {1000 * result['harness_seconds_per_step']:.1f} ms "
                     "per step, inside the step's phases and other")
    c = result.get("checks") or {}
    if c.get("handoff_checked_steps"):
        lines.append(f"- engine-vs-trainer log-prob gap over {c['handoff_checked_steps']} checked steps (all steps): "
                     f"largest per-step mean {c['logprob_gap_mean_max']:.2e} (step {c['logprob_gap_mean_max_step']}), "
                     f"largest single token {c['logprob_gap_token_max']:.2e}")
    if "held_out_accuracy_start" in c:
        lines.append(f"- held-out accuracy (greedy, {c['held_out_count']:.0f} problems): "
                     f"{c['held_out_accuracy_start']:.3f} at step {c['held_out_start_step']} -> "
                     f"{c['held_out_accuracy_end']:.3f} at step {c['held_out_end_step']}")
    lines.append("")
    trans = result.get("transitions") or {}
    if trans:
        lines += ["| transition (ledger, kept steps) | count | s mean | s max | GiB moved off device | freed (GiB) |",
                  "|---|---|---|---|---|---|"]
        for name, t in trans.items():
            lines.append(f"| {name} | {t['count']} | {t['seconds_mean']:.4f} | {t['seconds_max']:.4f} | "
                         f"{t['gib_moved_off_device_mean']:.2f} | {t['freed_gib_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from colo_rl.metrics import save_figure

    b, mem = result["breakdown"], result["memory"]
    names = list(b["phases"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    left = 0.0
    colors = plt.cm.tab10.colors
    for i, n in enumerate(names):
        s = b["phases"][n]["seconds_mean"]
        ax1.barh([0], [s], left=left, color=colors[i % 10], label=f"{n} {100 * b['phases'][n]['share']:.1f}%")
        left += s
    ax1.set_yticks([])
    ax1.set_xlabel("seconds per step (mean)")
    ax1.set_title(f"GRPO step: colocation {100 * b['colocation_share']:.2f} % of {b['step_seconds_mean']:.1f} s")
    ax1.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    labels = [n for n in ["generation", "reward", "logprobs", "update", "handoff", "phase_switch", "step"] if n in mem]
    ax2.bar(labels, [mem[n]["peak_gib"] for n in labels], color="tab:gray")
    ax2.set_ylabel(f"peak GiB ({'RSS' if result['memory_kind'] == 'rss' else 'device used'})")
    ax2.set_title("peak memory per phase")
    ax2.tick_params(axis="x", rotation=30, labelsize=8)
    return save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Anything else on the command line is a Hydra override for the recipe.")
    p.add_argument("--skip", type=int, default=1, help="leading steps dropped as warm-up (default 1)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--run-dir", type=Path, default=None, help="the recipe's run directory (default outputs/bench/...)")
    p.add_argument("--no-readme", action="store_true", help="do not refresh results/README.md")
    p.add_argument("--name", default="step_breakdown", help="results file name (<name>-<device>-<date>)")
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        p.error(f"unknown option {bad[0]} (Hydra overrides are key=value)")
    run_dir = args.run_dir or ROOT / "outputs" / "bench" / f"step_breakdown-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = merge_overrides(DEFAULT_OVERRIDES + [f"run_dir={run_dir}"], overrides)

    mem = PhaseMemory().start()
    wall = run_recipe(overrides, mem)
    mem.stop()

    from colo_rl.loggers import read_jsonl
    from omegaconf import OmegaConf

    from benchmarks.phase_switch import summarise

    rows = read_jsonl(run_dir / "metrics.jsonl")
    b = breakdown(rows, args.skip)
    loop_steps = [s - 1 for s in b["steps_kept"]]  # metrics step k is loop step k-1
    ledger = [r for r in read_jsonl(run_dir / "ledger.jsonl") if r["step"] in loop_steps]
    cfg = OmegaConf.load(run_dir / "config.yaml")
    from colo_rl.models import resolve_dtype

    result = {
        "config": {"model": cfg.model.path if not cfg.model.random_init else
                   f"random {cfg.model.hidden_size}x{cfg.model.num_layers} ({cfg.model.path} tokenizer)",
                   "dtype": str(resolve_dtype(cfg.model.dtype)).replace("torch.", ""),
                   "world_size": 1, "engine": cfg.rollout.engine,
                   "prompts_per_step": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
                   "max_new_tokens": cfg.rollout.max_new_tokens, "micro_batch_size": cfg.trainer.micro_batch_size,
                   "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
                   "total_steps": cfg.trainer.total_steps, "overrides": overrides},
        "breakdown": b, "checks": run_checks(rows), "memory_kind": mem.kind, "memory": mem.summary(loop_steps),
        "harness_seconds_per_step": mem.boundary_seconds_per_step(loop_steps),
        "memory_method": "sampler thread every 10 ms + a sample at each phase boundary; CPU: process RSS "
                         "(psutil), GPU: device used (cudaMemGetInfo)",
        "transitions": summarise(ledger) if ledger else {}, "wall_seconds": wall,
        "run_dir": str(run_dir), "steps": rows,
    }
    result["device"], result["date"] = common.device_slug(), common.today()
    common.publish(args.name, result, markdown(result), args.out, chart, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
