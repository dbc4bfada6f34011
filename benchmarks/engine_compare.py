"""Engine comparison: does the rollout engine change what the demo learns? The embedded demo
(`make demo`: SmolLM2-135M-Instruct, arithmetic, 14 steps of 8 prompts x 8 completions, 2 ranks, fp32)
once with the HF engine and once with SGLang's real runtime, on the same seeds.

    python benchmarks/engine_compare.py                    # hf and sglang on seeds 7, 8, 9 (~6 runs x 10-20 min)
    python benchmarks/engine_compare.py --seeds 7 --engines sglang
    python benchmarks/engine_compare.py --smoke            # tiny random model, 1 step each: plumbing only

Run it alone on the machine (`flock /tmp/colo_heavy.lock ...` on a shared one). Without CUDA, SGLang
runs its CPU engine (SGLANG_USE_CPU_ENGINE=1, the test suite's rollout.sglang_kwargs from
tests/sglang_cpu.py with room for a whole step's requests); `make sglang-cpu` installs it. Held-out
accuracy (greedy, the demo's held-out problems) at the start and the end; reward per step; the
engine-vs-trainer mismatch every step (mismatch/kl_k1, kl_k3, ratio_max, handoff/logprob_diff_mean).
The verdict compares the engines' mean held-out accuracy at the end with the seed spread (twice the
larger of the two engines' standard deviations over seeds). A finished run (summary.json present) is
reused unless --fresh. Results: results/engine_compare-<device>-<date>.json / .md / .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.algorithms import (add_sweep_arguments, chosen, run_one, seed_list, summarise,  # noqa: E402
                                   sweep_log)

ENGINES = ("hf", "sglang")
# The dtype is pinned (--dtype, fp32 by default as in benchmarks/algorithms.py): the table must not
# depend on whether the CPU has bf16.
SHARED = ["logger=[jsonl]", "plots=false"]
SMOKE = ["model=tiny", "trainer.total_steps=1", "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8",
         "data.eval_size=8", "rollout.prompts_per_step=2", "rollout.group_size=2"]
MISMATCH_KEYS = ("handoff/logprob_diff_mean", "mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ratio_max")


def demo_rollout() -> list[str]:
    """The demo's rollout sizing (what `rollout=hf` composes to), pinned for every engine. The
    rollout=sglang group sizes the work for a real model on GPUs (64 prompts a step, 1024 new
    tokens, the schema's temperature 1.0): left to it, the SGLang runs would do other work than the
    HF runs (8x the prompts, 25x the tokens, another temperature) and the table would compare
    workloads, not engines. Every key either engine's group sets, except `engine`, at the value
    rollout=hf gives it (its file's, else the schema's default)."""
    from omegaconf import OmegaConf

    from colo_rl.config.schema import RolloutConfig

    hf, sglang = (OmegaConf.load(ROOT / "conf" / "rollout" / f"{e}.yaml") for e in ENGINES)
    defaults = RolloutConfig()
    keys = sorted((set(hf) | set(sglang)) - {"engine"})
    return [f"rollout.{k}={hf[k] if k in hf else getattr(defaults, k)}" for k in keys]


def sglang_overrides() -> list[str]:
    """rollout=sglang, and on a machine without CUDA the CPU engine's kwargs (the tests' own, one source)."""
    import torch

    if torch.cuda.is_available():
        return ["rollout=sglang"]
    sys.path.insert(0, str(ROOT / "tests"))
    import sglang_cpu  # test support: the CPU engine's kwargs and environment

    os.environ.update(sglang_cpu.env())
    # a whole step's 64 requests at once (the tests' 8 / 2048 keep their small runs small)
    kwargs = {**sglang_cpu.SGLANG_KWARGS, "max_total_tokens": 16384, "max_running_requests": 64}
    return ["rollout=sglang", f"rollout.sglang_kwargs={sglang_cpu.hydra_dict(kwargs)}"]


def run_summary(run_dir: Path) -> dict:
    """algorithms.summarise, plus each step's mismatch metrics and their means."""
    from colo_rl.loggers import read_jsonl

    out = summarise(run_dir)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    for key in MISMATCH_KEYS:
        values = [r[key] for r in steps if r.get(key) is not None]
        out[f"{key}_steps"] = values
        out[f"{key}_mean"] = statistics.fmean(values) if values else None
    return out


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "n": len(values)}


def compare(runs: dict[str, dict]) -> dict:
    """Per engine: held-out accuracy at the end over seeds; the verdict against the seed spread."""
    by_engine = {e: [r for r in runs.values() if r["engine"] == e] for e in ENGINES}
    out = {e: {"heldout_end": spread([r["heldout_end"] for r in rs]),
               "heldout_delta": spread([r["heldout_delta"] for r in rs]),
               "reward_last5": spread([r["reward_last5"] for r in rs])} for e, rs in by_engine.items() if rs}
    if set(out) != set(ENGINES):
        return {"engines": out, "verdict": "Only one engine ran: nothing to compare."}
    hf, sgl = out["hf"]["heldout_end"], out["sglang"]["heldout_end"]
    gap = sgl["mean"] - hf["mean"]
    stds = [s["std"] for s in (hf, sgl) if s["std"] is not None]
    if not stds:
        verdict = f"SGLang - HF = {100 * gap:+.1f} points with one seed each: no seed spread to judge it against."
    else:
        noise = 2 * max(stds)
        verdict = (f"SGLang - HF = {100 * gap:+.1f} points of held-out accuracy; twice the larger seed std is "
                   f"{100 * noise:.1f} points: " + ("beyond the seed spread." if abs(gap) > noise
                                                  else "within the seed spread (no difference shown)."))
    paired = paired_gaps(by_engine["hf"], by_engine["sglang"])
    if len(paired) > 1:
        lower = sum(g < 0 for g in paired)
        mean, sd = statistics.fmean(paired), statistics.stdev(paired)
        t = mean / (sd / len(paired) ** 0.5) if sd > 0 else float("inf") * (1 if mean > 0 else -1)
        verdict += (f" Paired by seed: SGLang lower on {lower} of {len(paired)} seeds (" +
                    ", ".join(f"{100 * g:+.1f}" for g in paired) +
                    f" points; mean {100 * mean:+.1f}, paired t = {t:.1f} with {len(paired) - 1} degrees of freedom).")
    return {"engines": out, "gap": gap, "paired_gaps": paired, "verdict": verdict}


def paired_gaps(hf: list[dict], sglang: list[dict]) -> list[float]:
    """SGLang - HF held-out accuracy at the end, per seed both engines ran (in seed order): the seed
    fixes the prompts' order and the sampling seed, so each pair shares everything but the engine."""
    by_seed = {r["seed"]: r["heldout_end"] for r in hf}
    return [r["heldout_end"] - by_seed[r["seed"]] for r in sorted(sglang, key=lambda r: r["seed"]) if r["seed"] in by_seed]


def table(result: dict) -> str:
    lines = [f"# {common.TITLES['engine_compare']}", "",
             f"The embedded demo per engine and seed (seeds {result['seeds']}), shared overrides "
             f"`{' '.join(result['shared'])}`. Held-out: greedy accuracy on the held-out problems.", "",
             "| engine | seed | held-out start | held-out end | change (points) | reward, last 5 steps | "
             "logprob diff (mean) | mismatch k1 | mismatch k3 | max ratio | s / step | wall (min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, d=4):
        return "" if x is None else f"{x:.{d}f}"

    for r in result["runs"].values():
        lines.append(f"| {r['engine']} | {r['seed']} | {r['heldout_start']:.3f} | {r['heldout_end']:.3f} | "
                     f"{100 * r['heldout_delta']:+.1f} | {r['reward_last5']:.3f} | "
                     f"{f(r['handoff/logprob_diff_mean_mean'], 5)} | {f(r['mismatch/kl_k1_mean'], 6)} | "
                     f"{f(r['mismatch/kl_k3_mean'], 6)} | {f(r['mismatch/ratio_max_mean'], 3)} | "
                     f"{r['s_per_step']:.1f} | {f(r['wall_s'] and r['wall_s'] / 60, 1)} |")
    lines += ["", "| engine | held-out end, mean (std) | change, mean | reward last 5, mean |", "|---|---|---|---|"]
    for engine, s in result["comparison"]["engines"].items():
        std = s["heldout_end"]["std"]
        lines.append(f"| {engine} | {s['heldout_end']['mean']:.3f} ({f(std, 3) or '-'}) | "
                     f"{100 * s['heldout_delta']['mean']:+.1f} | {s['reward_last5']['mean']:.3f} |")
    lines += ["", result["comparison"]["verdict"]] + (["", result["note"]] if result.get("note") else [])
    return "\n".join(lines) + "\n"


def chart(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_eval, ax_reward, ax_kl) = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = {"hf": "tab:blue", "sglang": "tab:orange"}
    for key, r in result["runs"].items():
        style = {"color": colours[r["engine"]], "alpha": 0.8, "label": key}
        ax_eval.plot(r["eval_steps"], r["eval_accuracy"], marker="o", **style)
        ax_reward.plot(r["reward_steps"], r["reward_mean"], **style)
        ax_kl.plot(r["reward_steps"][:len(r["mismatch/kl_k3_steps"])], r["mismatch/kl_k3_steps"], **style)
    for ax, title in ((ax_eval, "held-out accuracy (greedy)"), (ax_reward, "reward / mean"),
                      (ax_kl, "mismatch k3 (engine vs trainer)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="model.dtype of every run (bf16: the demo's and a GPU's precision, ~3x faster here)")
    add_sweep_arguments(p, "engine_compare", "1 step")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override for every run")
    p.add_argument("--note", default="", help="a paragraph added under the tables (e.g. the conclusion)")
    args = p.parse_args(argv)
    engines = chosen(p, args.engines, ENGINES, "engine")
    seeds = seed_list(args.seeds)
    shared = [f"model.dtype={args.dtype}"] + SHARED + (SMOKE if args.smoke else demo_rollout()) + args.override  # --smoke sizes its own
    per_engine = {"hf": ["rollout=hf"], "sglang": sglang_overrides() if "sglang" in engines else []}

    log = sweep_log("engine_compare")

    runs = {}
    for seed in seeds:  # seed-major: an interrupted run still has both engines for the first seeds
        for engine in engines:
            run_dir = run_one(engine, seed, shared + per_engine[engine], args.work, args.nproc, args.fresh, log)
            runs[f"{engine}-seed{seed}"] = {"engine": engine, "seed": seed, **run_summary(run_dir)}
    result = {"engines": engines, "seeds": seeds, "shared": shared, "runs": runs, "comparison": compare(runs),
              "note": args.note}
    if args.smoke:
        print(table(result))
        return 0
    common.publish("engine_compare", result, table(result), args.out, chart=chart)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
