"""Peak memory of one long group-packed row's log-probs: the dense [L, L] additive mask with SDPA
against a FlexAttention block mask (issue 37, part 4).

    python benchmarks/packed_attention_memory.py                      # 150-token prompt + 8 x 1000
    python benchmarks/packed_attention_memory.py --responses 8 --response-len 1000 --layers 2

Each mode runs in its own process: the tiny random model (hidden 64), one row [prompt | r_1..r_8]
packed by `pack_groups`, log-probs without a gradient (the old / reference passes; on the CPU
FlexAttention has no backward, so the update itself keeps the dense mask there). Peak = the
process's resident memory sampled every 2 ms (psutil) during the measured call, minus its
resident memory just before it; the call is the second of two (the first compiles FlexAttention).
Model and activations other than attention are the same in both modes, so the difference is the
mask and what SDPA makes of it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"dense mask + SDPA (before)": "sdpa", "FlexAttention block mask (after)": "flex_attention"}


def measure(attn: str, prompt_len: int, responses: int, response_len: int, layers: int) -> dict:
    import psutil
    import torch

    from colo_rl.config import ModelConfig
    from colo_rl.models import load_model
    from colo_rl.train.batch import build_batch, response_logprobs
    from colo_rl.train.packing import pack_groups

    model = load_model(ModelConfig(random_init=True, hidden_size=64, num_layers=layers, dtype="fp32",
                                   attn_implementation=attn), torch.float32, seed=0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 400, (prompt_len,), generator=g).tolist()
    rs = [torch.randint(5, 400, (response_len,), generator=g).tolist() for _ in range(responses)]
    mb = pack_groups([(prompt, rs, build_batch([prompt] * responses, rs, 0).select(list(range(responses))))],
                     torch.float32)
    with torch.no_grad():
        response_logprobs(model, mb)  # warm-up (FlexAttention compiles here)
    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    before = proc.memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    with torch.no_grad():
        logp, _ = response_logprobs(model, mb)
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    return {"tokens": int(mb.input_ids.shape[1]), "peak_mib_above_start": (peak[0] - before) / 2**20,
            "seconds": seconds, "logp_sum": float(logp.sum()), "dense_mask_mib": mb.input_ids.shape[1] ** 2 * 4 / 2**20}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--responses", type=int, default=8)
    p.add_argument("--response-len", type=int, default=1000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child: measure this attention, print JSON
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args(argv)
    shape = (args.prompt_len, args.responses, args.response_len, args.layers)
    if args.one:
        print(json.dumps(measure(args.one, *shape)))
        return 0
    from benchmarks import common

    rows = {}
    for label, attn in MODES.items():
        cmd = [sys.executable, __file__, "--one", attn, "--prompt-len", str(args.prompt_len), "--responses",
               str(args.responses), "--response-len", str(args.response_len), "--layers", str(args.layers)]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            raise SystemExit(f"{label}: failed\n{out.stderr[-3000:]}")
        rows[label] = json.loads(out.stdout.strip().splitlines()[-1])
    first = next(iter(rows.values()))
    lines = [f"One group-packed row of {first['tokens']} tokens ({args.prompt_len}-token prompt + {args.responses} x "
             f"{args.response_len}), tiny random model ({args.layers} layers, hidden 64), log-probs without a "
             "gradient, CPU. Peak = resident memory sampled every 2 ms during the call, above its start.", "",
             "| attention | peak MiB above start | seconds | dense mask alone (MiB) |", "|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['peak_mib_above_start']:.0f} | {r['seconds']:.2f} | {r['dense_mask_mib']:.0f} |")
    logps = [r["logp_sum"] for r in rows.values()]
    lines += ["", f"- log-prob sums: {', '.join(f'{v:.4f}' for v in logps)} (same row, both attentions)"]
    common.publish("packed_attention_memory", {"shape": dict(zip(("prompt_len", "responses", "response_len", "layers"),
                                                                  shape)), "modes": rows}, "\n".join(lines),
                   args.out or common.RESULTS, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
