"""What every benchmark shares: the machine and versions it ran on, the load on the machine while it
ran, writing `results/<name>-<device>-<date>.json` + `.md`, and refreshing `results/README.md`.

A result is a dict; `write_results` adds a `meta` block (machine, versions, command, date, the
1-minute load average at start / end / max while the process ran) and writes the pair of files.
`refresh_readme` rebuilds results/README.md from the JSON files it finds: for each benchmark and
device, the latest run's table with the machine, versions and command that produced it.

Importing this module starts a daemon thread that samples the 1-minute load average every few
seconds, so every result says how contended the machine was (timings on a loaded machine are slow).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GIB = 1 << 30
# Order of the sections in results/README.md (others follow alphabetically).
ORDER = ["step_breakdown", "step_breakdown_sglang", "step_breakdown_hf", "step_breakdown_sglang_tools", "handoff",
         "phase_switch", "phase_switch_sglang_0.5b", "phase_switch_sglang_smollm2", "race_trl", "race_learning",
         "algorithms", "algorithms_subset", "engine_compare", "engine_sampling", "split_pools"]
TITLES = {
    "step_breakdown": "Step breakdown: where a GRPO step's time and memory go",
    "handoff": "Weight handoff vs model size, against memcpy bandwidth",
    "phase_switch": "Phase switch: seconds and memory per transition (ledger)",
    "race_trl": "Peer race: colo_rl vs TRL GRPOTrainer, same work",
    "race_learning": "Learning per step: colo_rl vs TRL GRPOTrainer, same work, several seeds",
    "bf16_update_share": "bf16: how much of a small update reaches the forward, master on the bf16 grid or not",
    "algorithms": "Algorithms: estimators and policy losses on the demo's task and budget",
    "algorithms_subset": "Algorithms: a rerun of some variants (benchmarks/algorithms.py --variants)",
    "engine_compare": "Engines: the demo with the HF engine and with SGLang, same seeds",
    "engine_sampling": "Engines' samplers: do they draw from the distribution the trainer computes?",
    "split_pools": "Placement: colocated vs split pools (1 generation + 1 trainer rank), the demo's work",
    "update_overhead": "Update overhead: the GRPO update's host cost per step and per micro-batch, before / after",
    "update_overhead_demo": "Update overhead: the demo's update seconds per step, before / after",
    "update_overhead_compile": "Update overhead: every variant of today's code, with compiled decoder layers",
    "host_overhead": "Host overhead: the update's host time per micro-batch, arithmetic negligible, by ZeRO-3 setting",
    "packed_attention_memory": "Packed-row attention: peak memory of an 8k-token row, dense mask vs FlexAttention",
    "step_breakdown_sglang": "Step breakdown, GRPO with the SGLang engine (GPU)",
    "step_breakdown_hf": "Step breakdown, GRPO with the HF engine (GPU, same work)",
    "step_breakdown_sglang_tools": "Step breakdown, multi-turn GRPO with the calculator tool on SGLang (GPU)",
    "step_breakdown_perf_toy": "make gpu-perf: GRPO on the embedded model's shape, new defaults (GPU)",
    "step_breakdown_perf_toy_old": "make gpu-perf: the same work with the old switches (GPU)",
    "step_breakdown_perf_toy_whole": "make gpu-perf: the same work, LM head over whole logits (GPU)",
    "step_breakdown_perf_big": "make gpu-perf: GRPO on a 0.5B-class model, 128 x 768 (GPU)",
    "update_mfu": "make gpu-perf: the 0.5B-class update alone, MFU and GPU-busy fraction (GPU)",
    "update_mfu_leaf_off": "make gpu-perf: the same update without ZeRO-3 leaf modules (GPU)",
    "update_mfu_flex": "make gpu-perf: the same update with FlexAttention (GPU)",
    "update_mfu_unpacked": "make gpu-perf: the same update, a row per sequence (GPU)",
    "update_mfu_unpacked_compile": "make gpu-perf: a row per sequence, decoder layers compiled (GPU)",
    "update_mfu_whole_logits": "make gpu-perf: the same update, LM head over whole logits (GPU)",
    "gpu_perf": "make gpu-perf: the summary table (GPU)",
    "phase_switch_sglang_0.5b": "Phase switch with SGLang: 0.5B-class random Llama (GPU)",
    "phase_switch_sglang_smollm2": "Phase switch with SGLang: the embedded model's shape (GPU)",
}


# ----------------------------------------------------------------------------- load average
class LoadWatch:
    """Samples os.getloadavg()[0] in a daemon thread (every `interval` s) from creation on."""

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        now = os.getloadavg()[0]
        s = self.samples + [now]
        return {"start": round(s[0], 2), "end": round(now, 2), "max": round(max(s), 2),
                "mean": round(statistics.fmean(s), 2), "cores": os.cpu_count()}


LOAD = LoadWatch()


# ----------------------------------------------------------------------------- machine, versions
def device_slug() -> str:
    """`cpu`, or the GPU's name in lower-case-with-dashes (`nvidia-h100-80gb-hbm3`)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    import psutil
    import torch

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / GIB, 1),
            "os": platform.platform(), "torch_threads": torch.get_num_threads()}
    try:
        from colo_rl.models import cpu_supports_bf16

        info["cpu_bf16"] = cpu_supports_bf16()
    except Exception:  # noqa: BLE001 - informational only
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                    gpu_memory_gib=round(props.total_memory / GIB, 1))
    return info


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> Optional[str]:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    out = {"python": platform.python_version(), "colo_rl": git_commit()}
    for pkg in ("torch", "transformers", "deepspeed", "trl", "accelerate", "sglang"):
        v = _version(pkg)
        if v is not None:
            out[pkg] = v
    return out


def command(argv: Optional[list[str]] = None) -> str:
    """The command line that produced a result, relative to the repo root where possible."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        p = Path(argv[0]).resolve()
        if p.is_relative_to(ROOT):
            argv[0] = str(p.relative_to(ROOT))
        argv.insert(0, "python")
    root = f"{ROOT}/"  # committed results name paths inside the repo relative to it
    return shlex.join(a[len(root):] if a.startswith(root) else a for a in argv)


def meta(argv: Optional[list[str]] = None) -> dict:
    now = _dt.datetime.now()
    return {"machine": machine(), "versions": versions(), "command": command(argv),
            "timestamp": now.isoformat(timespec="seconds"), "load_avg_1m": LOAD.summary()}


# ----------------------------------------------------------------------------- writing results
def today() -> str:
    return time.strftime("%Y-%m-%d")


def result_stem(name: str, device: str, date: str, out_dir: Path = RESULTS) -> Path:
    return Path(out_dir) / f"{name}-{device}-{date}"


def result_file(stem: Path, ext: str) -> Path:
    """`<stem><ext>`. Not Path.with_suffix: a name like phase_switch_sglang_0.5b has a dot, and
    with_suffix would replace everything after it (the whole result went to phase_switch_sglang_0.json)."""
    return stem.with_name(stem.name + ext)


def contended(load: dict) -> bool:
    """Other work competed for the CPU: the benchmark's own threads keep the load average near the
    core count, so only a load a full core above it counts."""
    return load["max"] > load["cores"] + 1


def provenance(m: dict) -> str:
    """Markdown lines saying where a result comes from."""
    mc, v, load = m["machine"], m["versions"], m["load_avg_1m"]
    hw = f"{mc['cpu']}, {mc['cores']} cores, {mc['ram_gib']} GiB RAM"
    if mc.get("gpu"):
        hw = f"{mc['gpu']} x{mc.get('gpu_count', 1)} ({mc.get('gpu_memory_gib')} GiB); " + hw
    vs = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return "\n".join([
        f"- machine: {hw}",
        f"- versions: {vs}",
        f"- command: `{m['command']}`",
        f"- run at {m['timestamp']}; 1-minute load average start {load['start']} / max {load['max']} / "
        f"end {load['end']} on {load['cores']} cores" + (" (contended: timings are slower than on an idle machine)"
                                                         if contended(load) else ""),
    ])


def write_results(name: str, result: dict, table_md: str, out_dir: Path = RESULTS,
                  argv: Optional[list[str]] = None) -> Path:
    """Write `<name>-<device>-<date>.json` and `.md` (the table plus its provenance); returns the
    stem. `result` gains `benchmark`, `device`, `date` (when missing) and `meta`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result.setdefault("benchmark", name)
    result.setdefault("device", device_slug())
    result.setdefault("date", today())
    result["meta"] = meta(argv)
    stem = result_stem(name, result["device"], result["date"], out_dir)
    result_file(stem, ".json").write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    md = table_md.rstrip() + "\n\n" + provenance(result["meta"]) + "\n"
    result_file(stem, ".md").write_text(md)
    return stem


def publish(name: str, result: dict, table_md: str, out_dir: Path, chart=None, readme: bool = True) -> Path:
    """What every benchmark does at the end: write the results files, draw `chart(result, png)`
    when given, refresh the results README, print the table and where it went."""
    stem = write_results(name, result, table_md, out_dir)
    wrote = [".json", ".md"]
    if chart is not None:
        chart(result, result_file(stem, ".png"))
        wrote.append(".png")
    if readme:
        refresh_readme(out_dir)
    print(table_md)
    print(f"wrote {stem} ({', '.join(wrote)})")
    return stem


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


# ----------------------------------------------------------------------------- results README
def latest_results(out_dir: Path = RESULTS) -> dict[tuple[str, str], dict]:
    """(benchmark, device) -> the newest result (by date, then timestamp) among the JSON files."""
    best: dict[tuple[str, str], tuple[tuple, dict]] = {}
    for path in sorted(Path(out_dir).glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(r, dict) or "benchmark" not in r or "device" not in r:
            continue
        r["_stem"] = path.with_suffix("").name
        key = (r["benchmark"], r["device"])
        rank = (r.get("date", ""), r.get("meta", {}).get("timestamp", ""))
        if key not in best or rank >= best[key][0]:
            best[key] = (rank, r)
    return {k: v[1] for k, v in best.items()}


def _strip_title(md: str) -> str:
    lines = md.strip().splitlines()
    while lines and (lines[0].startswith("# ") or not lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines)


def refresh_readme(out_dir: Path = RESULTS) -> Path:
    """Rebuild results/README.md: per benchmark and device, the latest table (its .md file) and chart."""
    path = Path(out_dir) / "README.md"
    path.write_text(readme_text(out_dir))
    return path


def readme_text(out_dir: Path = RESULTS) -> str:
    """results/README.md as `refresh_readme` writes it (notes belong in runs.md or a run's .md: an
    edit of the README itself is lost at the next benchmark)."""
    out_dir = Path(out_dir)
    latest = latest_results(out_dir)
    names = sorted({b for b, _ in latest}, key=lambda b: (ORDER.index(b) if b in ORDER else len(ORDER), b))
    parts = ["# Benchmark results", "",
             "Written by `benchmarks/common.py` (`refresh_readme`) from the JSON files in this folder: for each "
             "benchmark and device, the latest run. Reproduce with `make bench` (CPU) or `make bench-gpu`; each "
             "section names the exact command, machine and versions. Older runs stay in this folder as "
             "`<benchmark>-<device>-<date>.json/.md`.", ""]
    runs = out_dir / "runs.md"
    if runs.exists():  # the recipes' measured runs, written by hand (the README's figures moved here)
        body = _strip_title(runs.read_text())
        parts += ["## Measured runs", "", "\n".join("#" + ln if ln.startswith("## ") else ln
                                                 for ln in body.splitlines()), ""]
    for name in names:
        for (b, device), r in sorted(latest.items()):
            if b != name:
                continue
            stem = r["_stem"]
            md_path = out_dir / f"{stem}.md"
            body = _strip_title(md_path.read_text()) if md_path.exists() else "(table missing)"
            parts += [f"## {TITLES.get(name, name)} ({device}, {r.get('date', '?')})", "",
                      f"From [`{stem}.json`]({stem}.json).", "", body, ""]
            for png in sorted(out_dir.glob(f"{stem}*.png")):
                parts += [f"![{png.stem}]({png.name})", ""]
    checks = sorted(out_dir.glob("gpu_check-*/SUMMARY.md")) + sorted(out_dir.glob("gpu_perf-*/SUMMARY.md"))
    if checks:  # make gpu-check's and gpu-perf's runs: what passed and failed, what was changed, their logs
        parts += ["## GPU runs (`make gpu-check`, `make gpu-perf`)", ""]
        parts += [f"- [`{s.parent.name}`]({s.parent.name}/SUMMARY.md)" for s in checks] + [""]
    return "\n".join(parts).rstrip() + "\n"


# ----------------------------------------------------------------------------- small helpers
def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def kept_steps(n_steps: int, skip: int) -> int:
    """How many leading steps to drop as warm-up: `skip`, but always keep at least one step."""
    return max(0, min(skip, n_steps - 1))
