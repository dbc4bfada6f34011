"""Host overhead per micro-batch (issue 37): the update of a model with SmolLM2's depth and almost no
arithmetic, through colo_rl's DeepSpeed actor, so its time is the host's: Python, hooks, dispatch.

    python benchmarks/host_overhead.py                 # every variant, 2 rounds, one process each
    python benchmarks/host_overhead.py --rounds 3 --updates 16

The deep narrow model of `update_overhead.py` keeps the embedded tokenizer's 49k vocabulary, whose
LM head is most of its CPU time; here the vocabulary is 256 and the width 32 (28 layers), so what
is left is what a GPU's host pays per micro-batch whatever the model's size. Each run is its own
process (DeepSpeed's memory-efficient linear replaces torch.nn.functional.linear process-wide); the
variants alternate, round after round, and each figure is the median over rounds. The work is
`update_mfu.py`'s (packed GRPO groups, `response_logprobs`, backward, one optimizer step) at 4 groups
of 8 x (8 + 8) tokens, one group per micro-batch. Ratios are within this run, on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from colo_rl.child_env import child_python_path  # noqa: E402

DIMS = dict(hidden_size=32, num_hidden_layers=28, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
PERSISTENT = [("stage3_param_persistence_threshold", 1e12), ("stage3_model_persistence_threshold", 1e12)]
# name -> update_mfu.py options (the first is the reference of the ratios)
VARIANTS = {
    "default": {},
    "DeepSpeed's linear": {"linear": "on"},
    "leaf modules off": {"leaf": False},
    "every parameter persistent": {"zero": PERSISTENT},
    "ZeRO-0 (no partitioning hooks)": {"zero_stage": 0},
    "decoder layers compiled": {"compile": True},
    "ZeRO-0 and decoder layers compiled": {"zero_stage": 0, "compile": True},
}


def run_variant(name: str, updates: int, warmup: int = 3) -> dict:
    """In this process: build the actor with `name`'s options, `warmup` updates, then `updates`
    timed ones."""
    from benchmarks.gpu import update_mfu
    from benchmarks.gpu.ds_experiments import zero_settings
    from colo_rl import dist

    args = update_mfu.arg_parser().parse_args(["--dry-run", "--sequences", "32", "--prompt-len", "8",
                                               "--response-len", "8", "--groups-per-micro-batch", "1"])
    for key, value in VARIANTS[name].items():
        setattr(args, key, value)
    dist.init()
    with tempfile.TemporaryDirectory(prefix="host_overhead-") as tmp:
        with zero_settings(args.zero):
            actor, mbs, _ = update_mfu.build(args, DIMS, Path(tmp) / "model")
        n_tok = float(sum(mb.response_mask.sum() for mb in mbs))
        for _ in range(warmup):
            update_mfu.one_update(actor, mbs, n_tok)
        t0 = time.perf_counter()
        for _ in range(updates):
            update_mfu.one_update(actor, mbs, n_tok)
        seconds = (time.perf_counter() - t0) / updates
    return {"variant": name, "micro_batches": len(mbs), "update_ms": 1000 * seconds,
            "ms_per_micro_batch": 1000 * seconds / len(mbs),
            "memory_efficient_linear": actor.memory_efficient_linear}


def on_off(flag) -> str:
    return "-" if flag is None else "on" if flag else "off"  # None: not ZeRO-3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--updates", type=int, default=10, help="timed updates per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed updates first")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child run: print its JSON
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args(argv)
    if args.one:
        print("HOST_OVERHEAD " + json.dumps(run_variant(args.one, args.updates, args.warmup)), flush=True)
        return 0
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_python_path()}
    for r in range(args.rounds):
        for name in names:
            print(f"host_overhead: round {r + 1}/{args.rounds}, {name} ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--one", name, "--updates", str(args.updates),
                                   "--warmup", str(args.warmup)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HOST_OVERHEAD ")), None)
            if proc.returncode != 0 or line is None:
                raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(line.split(" ", 1)[1]))
    rows = [{"variant": n, "micro_batches": rs[0]["micro_batches"],
             "memory_efficient_linear": rs[0]["memory_efficient_linear"],
             "ms_per_micro_batch": statistics.median(x["ms_per_micro_batch"] for x in rs),
             "per_round": [round(x["ms_per_micro_batch"], 1) for x in rs]} for n, rs in runs.items()]
    ref = rows[0]["ms_per_micro_batch"]
    table = "\n".join([
        f"The update's host time per micro-batch: {DIMS['num_hidden_layers']} layers of width {DIMS['hidden_size']}, "
        f"vocabulary {DIMS['vocab_size']} (arithmetic negligible), 4 micro-batches of one packed group of "
        f"8 x (8 + 8) tokens, fp32, 1 rank, one thread; median of {args.rounds} alternating rounds of "
        f"{args.updates} updates, each variant its own process.", "",
        f"| variant | DeepSpeed's linear | ms per micro-batch | per round | vs {rows[0]['variant']} |",
        "|---|---|---|---|---|",
        *[f"| {r['variant']} | {on_off(r['memory_efficient_linear'])} | {r['ms_per_micro_batch']:.1f} | "
          f"{', '.join(map(str, r['per_round']))} | {r['ms_per_micro_batch'] / ref:.2f}x |" for r in rows]])
    common.publish("host_overhead", {"dims": DIMS, "rounds": args.rounds, "updates": args.updates, "rows": rows},
                   table, args.out, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
