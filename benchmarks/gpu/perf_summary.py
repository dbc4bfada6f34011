"""`make gpu-perf`'s last stage: one table of what the GPU performance issue asks, from the stages'
results (step_breakdown_perf_* and update_mfu* JSONs, each run's ledger.jsonl and metrics.jsonl).

    python benchmarks/gpu/perf_summary.py --res benchmarks/results --device nvidia-h100-80gb-hbm3 \
        --date 2026-11-26 --logs benchmarks/results/gpu_perf-nvidia-h100-80gb-hbm3-2026-11-26

Per GRPO run: the step split, tokens/s generated and trained, the update's approximate MFU (6 N per
trained response token: prompts and attention not counted, so a lower bound), micro-batches per
step, the paging plan's decision, page-out / page-in GB/s when paging, the handoff (ms, GB/s, beside
a device-to-device copy of the same bytes timed here), the colocation share. Per update_mfu run: MFU
and the GPU-busy fraction: the profiled update's kernel time over the best timed update's wall time
(the profiler slows the host, not the kernels), beside its share of the profiled update itself. Writes gpu_perf-<device>-<date>.json + .md. A stage
that did not run is listed as missing, never filled in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.gpu.trace_stats import busy_of_timed  # noqa: E402
from benchmarks.gpu.update_mfu import llama_params  # noqa: E402
from benchmarks.switch_perf import moves_from, rate  # noqa: E402
from colo_rl.profiling import is_profiled  # noqa: E402

RUNS = {"perf_toy": "toy, new defaults", "perf_toy_whole": "toy, whole-logits LM head (COLO_RL_CHUNKED_LM_HEAD=0)",
        "perf_toy_old": "toy, old switches", "perf_big": "0.5B, new defaults",
        "perf_toy_compile": "toy, decoder layers compiled (model.compile=true)"}
MFU_RUNS = {"update_mfu": "sdpa, leaf modules on", "update_mfu_leaf_off": "sdpa, leaf modules off",
            "update_mfu_flex": "flex_attention, leaf modules on",
            "update_mfu_unpacked": "sdpa, leaf modules on, a row per sequence (trainer.packing=false)",
            "update_mfu_unpacked_compile": "sdpa, leaf modules on, a row per sequence, decoder layers compiled",
            "update_mfu_whole_logits": "sdpa, leaf modules on, whole-logits LM head (COLO_RL_CHUNKED_LM_HEAD=0)",
            "update_mfu_persist": "sdpa, leaf modules on, every parameter persistent (no ZeRO-3 fetch)",
            "update_mfu_flex_mb4": "flex_attention, leaf modules on, 4 micro-batches of 4 rows",
            "update_mfu_ds_linear": "sdpa, leaf modules on, DeepSpeed's memory-efficient linear",
            "update_mfu_ckpt_mb16": "flex_attention, gradient checkpointing, 1 micro-batch of 16 rows",
            "update_mfu_compile": "sdpa, leaf modules on, decoder layers compiled (model.compile)",
            "update_mfu_flex_compile": "flex_attention, leaf modules on, decoder layers compiled (model.compile)",
            "update_mfu_ckpt_mb16_compile": "flex_attention, gradient checkpointing, 1 micro-batch of 16 rows, "
                                            "decoder layers compiled",
            "update_mfu_deepcompile": "sdpa, DeepCompile (the whole model, ZeRO-3's gathers in the graph), "
                                      "whole-logits LM head"}
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0}
HOST_PACKAGES = ("deepspeed", "torch", "transformers", "colo_rl")  # the host-time columns' order (cProfile)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ledger_figures(records: list[dict], skip: int, leave_out: frozenset = frozenset()) -> dict:
    """Paging decision, page-out / page-in rates and the handoff from a run's ledger (steps after
    `skip`, less those in `leave_out`: the ledger's 0-based steps, e.g. the profiled ones)."""
    plan = next((r["paging_plan"] for r in records if "paging_plan" in r), None)
    kept = [r for r in records if r["step"] > skip and r["step"] not in leave_out]
    outs = [m for r in kept if r["transition"] == "update->generation" for m in moves_from(r, "device")]
    ins = [m for r in kept if r["transition"] == "generation->update" for m in moves_from(r, "host")]
    handoffs = [m for r in kept for m in r["moves"] if m["what"] == "weights handoff"]
    steps = max(len({r["step"] for r in kept}), 1)

    def per_step(moves):
        total = rate(moves)
        return {"gib_per_step": total["bytes"] / steps / common.GIB, "s_per_step": total["seconds"] / steps,
                "gb_per_s": total["gb_per_s"]}

    h_ms = statistics.median([1000 * m["seconds"] for m in handoffs]) if handoffs else None
    h_bytes = statistics.median([m["bytes"] for m in handoffs]) if handoffs else None
    return {"paging_plan": plan, "page_out": per_step(outs), "page_in": per_step(ins),
            "handoff": {"ms": h_ms, "bytes": h_bytes, "gb_per_s": h_bytes / h_ms / 1e6 if h_ms else None,
                        "zero_copy": all(m.get("zero_copy", False) for m in handoffs) if handoffs else None,
                        "buckets": handoffs[-1].get("buckets") if handoffs else None}}


def device_copy_ms(nbytes: Optional[float]) -> Optional[float]:
    if not nbytes:
        return None
    from benchmarks.phase_switch import device_copy_seconds

    s = device_copy_seconds(int(nbytes))
    return 1000 * s if s else None


def run_figures(name: str, args, peak: float) -> dict:
    path = args.res / f"step_breakdown_{name}-{args.device}-{args.date}.json"
    if not path.exists():
        return {"missing": str(path)}
    sb = json.loads(path.read_text())
    b = sb["breakdown"]
    run_logs = args.logs / name
    skip = min(b["steps_kept"]) - 1 if b["steps_kept"] else 0
    rows = jsonl(run_logs / "metrics.jsonl")
    profiled = frozenset(m["step"] for m in rows if is_profiled(m))  # slowed by the profilers: left out
    metrics = [m for m in rows if "time/update" in m and m["step"] > skip and m["step"] not in profiled]
    model_path = next((o.split("=", 1)[1] for o in sb["config"]["overrides"] if o.startswith("model.path=")), None)
    config = json.loads((ROOT / model_path / "config.json").read_text()) if model_path and (ROOT / model_path / "config.json").exists() else None
    out = {"config": sb["config"], "phases_s": {k: v["seconds_mean"] for k, v in b["phases"].items()},
           "step_s": b["step_seconds_mean"], "colocation_share": b["colocation_share"],
           "step_s_median": b["step_seconds_median"],
           "phases_s_median": {k: v["seconds_median"] for k, v in b["phases"].items()},
           "gen_tokens_per_s": b["gen_tokens_per_s"], "train_response_tokens_per_s": b["train_response_tokens_per_s"],
           "micro_batches": statistics.median([m["train/micro_batches"] for m in metrics]) if metrics else None,
           "checks": sb.get("checks"), "wall_s": sb.get("wall_seconds")}
    if config and metrics and peak:
        params = llama_params(config)
        tokens = statistics.median([m["throughput/train_tokens"] for m in metrics])
        seconds = statistics.median([m["time/update"] for m in metrics])
        out["update_mfu_lower_bound"] = 6 * (params["layers"] + params["embedding"]) * tokens / seconds / 1e12 / peak
        out["params"] = params
    ledger = ledger_figures(jsonl(run_logs / "ledger.jsonl"), skip, frozenset(s - 1 for s in profiled))
    ledger["handoff"]["device_copy_ms"] = device_copy_ms(ledger["handoff"]["bytes"])
    out["ledger"] = ledger
    out["profiles"] = [json.loads(f.read_text()) for f in sorted((run_logs / "profile").glob("step*.json"))]
    return out


def profile_rows(result: dict) -> list[str]:
    """The runs' profiled steps (trainer.profile_steps, colo_rl/profiling.py): the step's and its
    update's seconds, the device busy in the update, the host's seconds by package."""
    lines = []
    for name, label in RUNS.items():
        for prof in result["runs"].get(name, {}).get("profiles", []):
            update = prof["sections"].get("update", {})
            busy = ("-" if prof.get("busy_s") is None or not update.get("wall_s")
                    else f"{100 * update['busy_s'] / update['wall_s']:.1f} %")
            by = prof["host"]["by_package"]
            lines.append(f"| {label} | {prof['step']} | {prof['step_s']:.3f} | {update.get('wall_s', 0.0):.3f} | {busy} | "
                         + " / ".join(f"{by.get(k, 0.0):.3f}" for k in HOST_PACKAGES)
                         + " |")
    if not lines:
        return []
    return ["", "Profiled steps (`trainer.profile_steps`; both profilers slow the host, so these steps are left out of "
            "the figures above; `<run>/profile/step<N>.md` has the rest):", "",
            "| run | step | step s | update s | device busy in the update | host s: DeepSpeed / torch / transformers / "
            "colo_rl |", "|---|---|---|---|---|---|", *lines]


def markdown(result: dict) -> str:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"# make gpu-perf: {result['device']}, {result['date']}", "",
             "Random weights (learning is not measured). toy: the demo's work (8 prompts x 8 completions, <= 40 new "
             "tokens) on the embedded model's shape; 0.5B: a 0.5B-class Llama, 128 sequences x 768 new tokens. "
             "Old switches: one group per micro-batch, ZeRO-3 leaf modules off, colocate.paging=on.", "",
             "Seconds per step: mean / median over the kept steps (the first steps' warm-up weighs on the mean).", "",
             "| run | step s | generation | reward | update | handoff | switch | colocation share | gen tok/s | "
             "train resp tok/s | micro-batches | update MFU >= |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in RUNS.items():
        r = result["runs"].get(name, {})
        if "missing" in r:
            lines.append(f"| {label} | not run | | | | | | | | | | |")
            continue
        p, q = r["phases_s"], r["phases_s_median"]
        mfu = r.get("update_mfu_lower_bound")
        two = lambda k: f"{f(p[k])} / {f(q[k])}"  # noqa: E731
        lines.append(f"| {label} | {f(r['step_s'])} / {f(r['step_s_median'])} | {two('generation')} | {two('reward')} | "
                     f"{two('update')} | {two('handoff')} | {two('phase_switch')} | {100 * r['colocation_share']:.1f} % | "
                     f"{f(r['gen_tokens_per_s'], '.0f')} | {f(r['train_response_tokens_per_s'], '.0f')} | "
                     f"{f(r['micro_batches'], '.0f')} | {'-' if mfu is None else f'{100 * mfu:.1f} %'} |")
    lines += ["", "| run | paging plan | paged | page-out GiB/step, s, GB/s | page-in GiB/step, s, GB/s | handoff ms | "
              "handoff GB/s | device copy ms | zero-copy | buckets |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in RUNS.items():
        r = result["runs"].get(name, {})
        if "missing" in r:
            continue
        lg = r["ledger"]
        plan, po, pi, h = lg["paging_plan"] or {}, lg["page_out"], lg["page_in"], lg["handoff"]
        decision = ("does not fit" if not plan.get("fits", True) else "pages" if plan.get("paged") else "resident")
        lines.append(f"| {label} | {plan.get('mode', '-')}: {decision} | "
                     f"{', '.join(plan.get('paged', [])) or 'nothing'} | {f(po['gib_per_step'], '.2f')}, "
                     f"{f(po['s_per_step'])}, {f(po['gb_per_s'], '.1f')} | {f(pi['gib_per_step'], '.2f')}, "
                     f"{f(pi['s_per_step'])}, {f(pi['gb_per_s'], '.1f')} | {f(h['ms'], '.1f')} | {f(h['gb_per_s'], '.1f')} | "
                     f"{f(h['device_copy_ms'], '.2f')} | {h['zero_copy']} | {h['buckets']} |")
    lines += profile_rows(result)
    lines += ["", "Update alone (benchmarks/gpu/update_mfu.py: 0.5B-class, 128 x 768, 150-token prompts, one "
              "optimizer step, profiled once):", "",
              "| update | micro-batches | s (best) | TFLOP/s | MFU | GPU busy: of the best update / of the profiled "
              "one | first update s (all warm-ups) | "
              "compiled vs eager, max abs | MB per token (measured / estimate) | host s under cProfile: "
              "DeepSpeed / torch / transformers / colo_rl |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in MFU_RUNS.items():
        m = result["mfu"].get(name)
        if m is None:
            lines.append(f"| {label} | not run | | | | | | | | |")
            continue
        mfu = "-" if m["mfu"] is None else f"{100 * m['mfu']:.1f} %"
        first = m.get("first_update_seconds")  # the warm-up update, with the compilation (older results: none)
        warmups = m.get("warmup_update_seconds") or []
        first = "-" if first is None else f"{first:.1f}" + (f" ({sum(warmups):.1f})" if len(warmups) > 1 else "")
        agreement = m.get("compiled_vs_eager")
        agreement = ("-" if agreement is None else "not compared" if "error" in agreement
                     else format(agreement["max_abs"], ".1e"))
        budget = m.get("micro_batch_tokens")  # auto plans (older results: fixed rows per micro-batch)
        micro = f"{m.get('micro_batches', '-')}" + (f" (<= {budget / 1000:.1f}k tokens)" if budget else "")
        lines.append(f"| {label} | {micro} | {min(m['update_seconds']):.3f} | {m['tflops_per_s']:.1f} | {mfu} | "
                     f"{100 * busy_of_timed(m['busy'], min(m['update_seconds'])):.1f} % / "
                     f"{100 * m['busy']['busy_fraction']:.1f} % | {first} | {agreement} | {memory_cell(m.get('memory'))} | "
                     f"{host_cell(m.get('host_python'))} |")
    return "\n".join(lines) + "\n"


def memory_cell(mem) -> str:
    """update_mfu's device memory above the states per token of its largest micro-batch, and that
    over the token budget's estimate (what a larger budget share would need to know)."""
    if not mem:
        return "-"
    ratio = mem.get("measured_over_estimate")
    return f"{mem['mb_per_token']:.2f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def host_cell(host) -> str:
    """update_mfu's cProfile'd update (`colo_rl.profiling`): seconds by package, and its wall time."""
    if not host:
        return "-"
    if "error" in host:
        return "not measured"
    by = host["by_package"]
    return (" / ".join(f"{by.get(k, 0.0):.2f}" for k in HOST_PACKAGES)
            + f" of {host['wall_s']:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--res", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--device", required=True)
    p.add_argument("--date", required=True)
    p.add_argument("--logs", type=Path, required=True, help="the check's log folder (each run's ledger, metrics)")
    args = p.parse_args(argv)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in args.device), 0.0)
    result = {"device": args.device, "date": args.date, "peak_tflops": peak,
              "runs": {name: run_figures(name, args, peak) for name in RUNS}, "mfu": {}}
    for name in MFU_RUNS:
        for suffix in ("", "_dry_run"):
            path = args.res / f"{name}{suffix}-{args.device}-{args.date}.json"
            if path.exists():
                result["mfu"][name] = json.loads(path.read_text())
    common.publish("gpu_perf", result, markdown(result), args.res, readme=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
