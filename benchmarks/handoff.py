"""Weight handoff vs model size, against the machine's memcpy bandwidth.

For each size of one architecture (Llama / SmolLM2 family: head_dim 64, GQA 3:1, tied embeddings,
49k vocabulary; random weights), builds the real pieces - a ZeRO-3 DeepSpeedActor, the HF rollout
engine, colo_rl's WeightHandoff - and times the handoff as the memory manager runs it every step:
release the engine's weights, allocate fresh ones, then `push()` (gather each bucket from ZeRO-3,
copy it into the engine). Reports seconds and bytes/s per size, the ZeRO-3 gather alone (a push that
feeds no engine), and the ratio of the handoff's bytes/s to the memcpy bandwidth measured on the same
machine (a plain `dst.copy_(src)` of a large buffer into warm memory: the physical limit; a copy into
freshly allocated memory is reported too, since the engine's buffers are fresh every step).

    python benchmarks/handoff.py                       # CPU: 30M / 135M / 500M
    python benchmarks/handoff.py --sizes 135m,500m,1.7b --repeats 5   # GPU sizes

Bytes are the bytes the engine receives (each tensor once; tied embeddings once). On GPU both the
actor and the engine live on the device and memcpy is device-to-device.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

VOCAB = 49152
# One architecture, several sizes (parameters counted with tied embeddings).
SIZES = {
    "30m": dict(hidden_size=384, num_hidden_layers=6, intermediate_size=1024, num_attention_heads=6,
                num_key_value_heads=2),
    "135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3),  # SmolLM2-135M's own shape
    "500m": dict(hidden_size=1152, num_hidden_layers=32, intermediate_size=3072, num_attention_heads=18,
                 num_key_value_heads=6),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=8192, num_attention_heads=32,
                 num_key_value_heads=32),  # SmolLM2-1.7B's shape
}


# ----------------------------------------------------------------------------- pure logic (tested)
def parameter_count(dims: dict, vocab: int = VOCAB) -> int:
    h, L, inter = dims["hidden_size"], dims["num_hidden_layers"], dims["intermediate_size"]
    hd = h // dims["num_attention_heads"]
    attn = 2 * h * dims["num_attention_heads"] * hd + 2 * h * dims["num_key_value_heads"] * hd
    return vocab * h + L * (attn + 3 * h * inter + 2 * h) + h


def bandwidth_ratio(nbytes: float, seconds: float, memcpy_bytes_per_s: float) -> float:
    """The handoff's bytes/s as a fraction of the memcpy bandwidth (1.0 = as fast as a plain copy)."""
    if seconds <= 0 or memcpy_bytes_per_s <= 0:
        raise ValueError("seconds and memcpy bandwidth must be > 0")
    return (nbytes / seconds) / memcpy_bytes_per_s


# ----------------------------------------------------------------------------- measurements
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memcpy_bandwidth(nbytes: int, repeats: int, device: torch.device, fresh: bool = False) -> float:
    """Best bytes/s of `dst.copy_(src)` for an `nbytes` float32 buffer (fresh: a new dst each time)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        if fresh:
            del dst
            dst = torch.empty_like(src)
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return nbytes / best


def fresh_memcpy_with_thp(nbytes: int, repeats: int) -> float | None:
    """CPU only: fresh-memory memcpy bandwidth when PyTorch's allocator asks for transparent huge
    pages (THP_MEM_ALLOC_ENABLE=1, read once at start-up, hence a child process). Shows what the
    page faults of freshly allocated engine buffers cost."""
    import os
    import subprocess

    if torch.cuda.is_available():
        return None
    code = ("import sys; sys.path.insert(0, %r); import torch; from benchmarks.handoff import memcpy_bandwidth; "
            "print(memcpy_bandwidth(%d, %d, torch.device('cpu'), fresh=True))" % (str(ROOT), nbytes, repeats))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"})
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def measure_size(name: str, dims: dict, dtype: torch.dtype, dtype_name: str, repeats: int, bucket_mb: int,
                 work: Path) -> dict:
    from benchmarks.phase_switch import write_random_llama
    from colo_rl import dist
    from colo_rl.colocate.handoff import WeightHandoff
    from colo_rl.config import ModelConfig, RunConfig
    from colo_rl.models import load_model
    from colo_rl.rollout.base import WEIGHTS
    from colo_rl.rollout.hf import HFEngine
    from colo_rl.train.actor import DeepSpeedActor

    model_dir = write_random_llama(work / name, **dims, vocab_size=VOCAB)
    cfg = RunConfig()
    cfg.model = ModelConfig(path=str(model_dir), dtype=dtype_name, random_init=True)
    cfg.trainer.zero_stage = 3
    t0 = time.perf_counter()
    # The frozen actor partitions and gathers exactly like the training one; it skips optimizer
    # states, which the handoff never touches (and which would not fit a 500M model in CPU RAM twice).
    actor = DeepSpeedActor(cfg, dtype, total_steps=1, with_optimizer=False)
    engine = HFEngine(load_model(cfg.model, dtype, seed=1).to(dist.device()), [2], 0)
    build_s = time.perf_counter() - t0
    handoff = WeightHandoff(actor, engine, bucket_mb)
    gather_only = WeightHandoff(actor, engine, bucket_mb, feeds_engine=False)

    def one_push() -> tuple[float, int]:
        engine.sleep([WEIGHTS])  # as the memory manager does every step: fresh engine buffers
        engine.wake([WEIGHTS])
        stats = handoff.push()
        return stats.seconds, stats.bytes

    one_push()  # warm-up (first gather builds DeepSpeed's buffers)
    pushes = [one_push() for _ in range(repeats)]
    secs = [s for s, _ in pushes]
    nbytes = pushes[0][1]
    gathers = [gather_only.push().seconds for _ in range(repeats)]
    # Check the engine really holds the trainer's weights (one tensor; the tests check them all).
    first = actor.named_parameter_sizes()[0][0]
    with actor.gathered([first]) as ((_, t),):
        same = bool(torch.equal(engine.params[first].data, t))
    out = {"size": name, **dims, "vocab_size": VOCAB, "parameters": parameter_count(dims),
           "bytes": nbytes, "gib": nbytes / common.GIB, "buckets": len(handoff.buckets),
           "seconds_median": statistics.median(secs), "seconds_min": min(secs), "seconds_all": secs,
           "gather_only_seconds_median": statistics.median(gathers), "build_seconds": build_s,
           "engine_matches_trainer": same}
    out["bytes_per_s"] = nbytes / out["seconds_median"]
    del handoff, gather_only, engine, actor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run(args) -> dict:
    from colo_rl import console, dist
    from colo_rl.models import resolve_dtype

    dist.init()
    console.setup_logging()
    device = dist.device()
    dtype = resolve_dtype(args.dtype)
    nbytes = args.memcpy_mb << 20
    memcpy_warm = memcpy_bandwidth(nbytes, args.repeats + 2, device)
    memcpy_fresh = memcpy_bandwidth(nbytes, args.repeats + 2, device, fresh=True)
    memcpy_fresh_thp = fresh_memcpy_with_thp(nbytes, args.repeats + 2)
    work = Path(tempfile.mkdtemp(prefix="colo_rl-handoff-"))
    sizes = []
    for name in args.sizes:
        r = measure_size(name, SIZES[name], dtype, args.dtype, args.repeats, args.bucket_mb, work)
        r["ratio_to_memcpy"] = bandwidth_ratio(r["bytes"], r["seconds_median"], memcpy_warm)
        r["ratio_to_fresh_memcpy"] = bandwidth_ratio(r["bytes"], r["seconds_median"], memcpy_fresh)
        sizes.append(r)
        print(f"{name}: {r['gib']:.3f} GiB in {r['seconds_median']:.3f} s = {r['bytes_per_s'] / common.GIB:.2f} GiB/s, "
              f"{100 * r['ratio_to_memcpy']:.0f} % of memcpy", flush=True)
    dist.cleanup()
    return {"device": common.device_slug(), "date": common.today(), "dtype": str(dtype).replace("torch.", ""),
            "engine": "hf", "zero_stage": 3, "world_size": 1, "bucket_mb": args.bucket_mb, "repeats": args.repeats,
            "memcpy": {"buffer_mib": args.memcpy_mb, "warm_bytes_per_s": memcpy_warm,
                       "fresh_bytes_per_s": memcpy_fresh, "fresh_thp_bytes_per_s": memcpy_fresh_thp,
                       "method": "best of repeats, dst.copy_(src) of a float32 buffer; bytes copied per second"},
            "sizes": sizes}


def markdown(result: dict) -> str:
    m = result["memcpy"]
    lines = [f"# Weight handoff: {result['device']}, {result['date']}", "",
             f"Random-weight Llama (SmolLM2 family), {result['dtype']}, ZeRO-3 actor -> `{result['engine']}` engine, "
             f"{result['bucket_mb']} MiB buckets, median of {result['repeats']} handoffs (each into freshly "
             f"allocated engine buffers, as every step does). memcpy ({m['buffer_mib']} MiB buffer): "
             f"**{m['warm_bytes_per_s'] / common.GIB:.2f} GiB/s** into warm memory (the limit), "
             f"{m['fresh_bytes_per_s'] / common.GIB:.2f} GiB/s into fresh memory" +
             (f" ({m['fresh_thp_bytes_per_s'] / common.GIB:.2f} GiB/s with THP_MEM_ALLOC_ENABLE=1: the engine's "
              "buffers are fresh every step, so page faults, not copying, bound the handoff)."
              if m.get("fresh_thp_bytes_per_s") else "."), "",
             "| size | parameters | GiB | buckets | handoff s | GiB/s | ratio to memcpy | ratio to fresh memcpy | "
             "ZeRO-3 gather alone s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["sizes"]:
        lines.append(f"| {r['size']} | {r['parameters'] / 1e6:.0f}M | {r['gib']:.3f} | {r['buckets']} | "
                     f"{r['seconds_median']:.3f} | {r['bytes_per_s'] / common.GIB:.2f} | "
                     f"**{r['ratio_to_memcpy']:.2f}** | {r['ratio_to_fresh_memcpy']:.2f} | "
                     f"{r['gather_only_seconds_median']:.3f} |")
    bad = [r["size"] for r in result["sizes"] if not r["engine_matches_trainer"]]
    lines += ["", "The engine held the trainer's weights after every size's handoff." if not bad else
              f"**The engine did not match the trainer after the handoff for {', '.join(bad)}.**"]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from colo_rl.metrics import save_figure

    rs = result["sizes"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [r["parameters"] / 1e6 for r in rs]
    ax.plot(xs, [r["bytes_per_s"] / common.GIB for r in rs], marker="o", label="handoff")
    ax.axhline(result["memcpy"]["warm_bytes_per_s"] / common.GIB, color="k", ls="--", label="memcpy (warm)")
    ax.axhline(result["memcpy"]["fresh_bytes_per_s"] / common.GIB, color="gray", ls=":", label="memcpy (fresh)")
    for x, r in zip(xs, rs):
        ax.annotate(f"{r['seconds_median']:.2f} s", (x, r["bytes_per_s"] / common.GIB), textcoords="offset points",
                    xytext=(4, 6), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("GiB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"weight handoff bandwidth ({result['device']}, {result['dtype']})")
    ax.legend()
    return save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [x.strip().lower() for x in s.split(",") if x.strip()],
                   default=["30m", "135m", "500m"], help=f"comma-separated, from {list(SIZES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256, help="handoff bucket (colocate.handoff_bucket_mb)")
    p.add_argument("--memcpy-mb", type=int, default=512, help="memcpy benchmark buffer")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args(argv)
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size {unknown[0]!r}; choose from {list(SIZES)}")
    result = run(args)
    common.publish("handoff", result, markdown(result), args.out, chart, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    from colo_rl import process_exit

    process_exit.run_and_exit(main)
