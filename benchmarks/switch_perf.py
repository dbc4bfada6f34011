"""The phase switch and the weight handoff against their targets (issue 33): a stage for `make
gpu-perf`. For each model shape and colocate.paging mode it runs benchmarks/phase_switch.py (its own
process: each starts an engine) and reads the ledger back:

- switch excluding the handoff (update->generation without the handoff + generation->update);
- page-out and page-in GB/s (the trainer moves that really moved: states, weight partitions,
  frozen models), when paging;
- the handoff: ms, GB/s, the ratio to a device-to-device copy of the same bytes, zero-copy or not;
- the paging plan's decision (the ledger's first record).

    python benchmarks/switch_perf.py                       # GPU: SGLang, smollm2-135m and 0.5b, auto and on
    python benchmarks/switch_perf.py --small --engine hf   # CPU rehearsal, tiny shapes

Writes results/switch_perf-<device>-<date>.json + .md; the steady state drops each run's first step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

TARGETS = {"switch_resident_s": 0.1, "page_out_2.25gib_s": 0.1, "handoff_0.5b_ms": 15.0}


def moves_from(record: dict, moved_from: str) -> list[dict]:
    return [m for m in record["moves"] if m["from"] == moved_from and m["to"] == "host" and m["moved"]] \
        if moved_from == "device" else [m for m in record["moves"] if m["from"] == "host" and m["moved"]]


def rate(moves: list[dict]) -> dict:
    """Bytes, seconds and GB/s of a set of moves (None without bytes). GB/s divides the bytes copied:
    ZeRO's gradient bucket is freed and allocated again, not copied (the ledger's `copied_bytes`)."""
    nbytes, seconds = sum(m["bytes"] for m in moves), sum(m["seconds"] for m in moves)
    copied = sum(m.get("copied_bytes", m["bytes"]) for m in moves)
    return {"bytes": nbytes, "copied_bytes": copied, "seconds": seconds,
            "gb_per_s": copied / seconds / 1e9 if copied and seconds else None}


def switch_figures(result: dict) -> dict:
    """What the targets need, from one phase_switch.py result (its raw ledger records), steady state."""
    records = result["records"]
    plan = next((r["paging_plan"] for r in records if "paging_plan" in r), None)
    steps = sorted({r["step"] for r in records})
    steady = [s for s in steps if s != steps[0]] or steps
    per_step, outs, ins = [], [], []
    for step in steady:
        recs = [r for r in records if r["step"] == step]
        handoff = sum(m["seconds"] for r in recs for m in r["moves"] if m["what"] == "weights handoff")
        per_step.append(sum(r["seconds"] for r in recs) - handoff)
        outs += [rate(moves_from(r, "device")) for r in recs if r["transition"] == "update->generation"]
        ins += [rate(moves_from(r, "host")) for r in recs if r["transition"] == "generation->update"]
    h = result.get("handoff") or {}
    zero_copy = [m.get("zero_copy", False) for r in records for m in r["moves"] if m["what"] == "weights handoff"]
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "model": result["model"], "engine": result["engine"], "paging_plan": plan,
        "switch_excl_handoff_s": median(per_step),
        "page_out": {"bytes": median([o["bytes"] for o in outs]), "seconds": median([o["seconds"] for o in outs]),
                     "gb_per_s": median([o["gb_per_s"] for o in outs if o["gb_per_s"]])},
        "page_in": {"bytes": median([i["bytes"] for i in ins]), "seconds": median([i["seconds"] for i in ins]),
                    "gb_per_s": median([i["gb_per_s"] for i in ins if i["gb_per_s"]])},
        "handoff": {"ms": 1000 * h["seconds_median"] if h else None, "bytes": h.get("bytes"),
                    "gb_per_s": (h.get("bytes_per_s") or 0) / 1e9 or None,
                    "device_copy_ms": 1000 * h["device_copy_seconds"] if h.get("device_copy_seconds") else None,
                    "ratio_to_device_copy": h.get("ratio_to_device_copy"),
                    "zero_copy": bool(zero_copy) and all(zero_copy[1:] or zero_copy)},
    }


def markdown(result: dict) -> str:
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"# Phase switch and handoff against the targets: {result['device']}, {result['date']}", "",
             f"Engine `{result['engine']}`, {result['steps']} steps per run (first dropped). Targets: switch "
             "excluding the handoff <= 0.1 s when resident; page-out <= 0.1 s for 2.25 GiB; handoff of the "
             "0.5B-class model <= 15 ms.", "",
             "| model | paging | paged | switch excl. handoff s | page-out GiB / s / GB/s | page-in GB/s | "
             "handoff ms | handoff GB/s | x device copy | zero-copy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        f, plan = run["figures"], run["figures"]["paging_plan"] or {}
        po, pi, h = f["page_out"], f["page_in"], f["handoff"]
        lines.append(f"| {run['model']} | {run['paging']} | {', '.join(plan.get('paged', [])) or 'nothing'} | "
                     f"{fmt(f['switch_excl_handoff_s'])} | {fmt((po['bytes'] or 0) / common.GIB, '.2f')} / "
                     f"{fmt(po['seconds'])} / {fmt(po['gb_per_s'], '.1f')} | {fmt(pi['gb_per_s'], '.1f')} | "
                     f"{fmt(h['ms'], '.1f')} | {fmt(h['gb_per_s'], '.1f')} | {fmt(h['ratio_to_device_copy'], '.1f')} | "
                     f"{h['zero_copy']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CPU rehearsal: the tiny model")
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "0.5b"])
    p.add_argument("--paging", nargs="+", default=["auto", "on"])
    p.add_argument("--engine", choices=["hf", "sglang"], default="sglang")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sglang-kwargs", default="")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    models = ["small"] if args.small else args.models
    result = {"device": common.device_slug(), "date": common.today(), "engine": args.engine, "steps": args.steps,
              "targets": TARGETS, "runs": []}
    with tempfile.TemporaryDirectory(prefix="colo_rl-switch-perf-") as tmp:
        for model in models:
            for paging in args.paging:
                name = f"switch_perf_{model}_{paging}"
                cmd = [sys.executable, str(ROOT / "benchmarks" / "phase_switch.py"), "--engine", args.engine,
                       "--model", model, "--paging", paging, "--steps", str(args.steps), "--name", name,
                       "--no-itemise", "--out", tmp] + (["--small", "--max-new-tokens", "8"] if args.small else []) + \
                      (["--sglang-kwargs", args.sglang_kwargs] if args.sglang_kwargs else [])
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode != 0:
                    result["runs"].append({"model": model, "paging": paging, "error": proc.stderr[-3000:]})
                    continue
                (path,) = Path(tmp).glob(f"{name}-*.json")
                run = json.loads(path.read_text())
                result["runs"].append({"model": model, "paging": paging, "figures": switch_figures(run)})
    failed = [r for r in result["runs"] if "error" in r]
    result["runs"] = [r for r in result["runs"] if "error" not in r]
    result["failed"] = failed
    common.publish("switch_perf", result, markdown(result), args.out, readme=False)
    for r in failed:
        print(f"FAILED {r['model']} paging={r['paging']}:\n{r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
