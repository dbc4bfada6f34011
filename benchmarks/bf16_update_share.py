"""How much of a small update reaches a bf16 forward: master weights on the bf16 grid (colo_rl: the
model loaded in bf16, DeepSpeed's fp32 master built from it) against the checkpoint's own fp32 values
(TRL: fp32 weights rounded to bf16 per matmul under autocast).

    python benchmarks/bf16_update_share.py            # the embedded model, Adam-sized steps of 1e-5

Each weight takes k steps of lr * s in one direction (s a random sign: Adam's first steps move every
weight by about lr); the share is the projection of what the bf16 weights actually moved onto what
was asked, sum(realised * asked) / sum(asked ** 2), per k. 1.0: the forward follows the update.
Results: results/bf16_update_share-<device>-<date>.json / .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402


def update_shares(weights: list[torch.Tensor], lr: float, steps: int, on_grid: bool, seed: int = 0) -> list[float]:
    """Share of k steps of lr * sign reaching the bf16 weights, k = 1..steps.

        master_0 = bf16(w) if on_grid else w,   realised_k = bf16(master_0 + k lr s) - bf16(master_0)
        share_k  = sum(realised_k * k lr s) / sum((k lr s)^2)"""
    gen = torch.Generator().manual_seed(seed)
    num, den = [0.0] * steps, [0.0] * steps
    for w in weights:
        w = w.detach().float().flatten()
        master = w.to(torch.bfloat16).float() if on_grid else w
        start = master.to(torch.bfloat16).float()
        sign = torch.randint(0, 2, w.shape, generator=gen).float() * 2 - 1
        for k in range(1, steps + 1):
            asked = sign * (k * lr)
            realised = (master + asked).to(torch.bfloat16).float() - start
            num[k - 1] += float((realised.double() * asked.double()).sum())
            den[k - 1] += float((asked.double() ** 2).sum())
    return [n / d for n, d in zip(num, den)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    from safetensors.torch import load_file

    from colo_rl.models import embedded_model_dir

    state = load_file(str(embedded_model_dir() / "model.safetensors"))
    weights = list(state.values())
    total = sum(w.numel() for w in weights)
    off_grid = sum(int((w.float() != w.to(torch.bfloat16).float()).sum()) for w in weights) / total
    grid, fp32 = (update_shares(weights, args.lr, args.steps, on_grid) for on_grid in (True, False))
    result = {"lr": args.lr, "steps": args.steps, "weights": total, "off_grid_share": off_grid,
              "share_on_grid": grid, "share_fp32_master": fp32}
    lines = [f"# {common.TITLES['bf16_update_share']}", "",
             f"The embedded model's {total / 1e6:.0f}M weights; {100 * off_grid:.1f} % of its fp32 checkpoint values "
             f"lie between bf16 values. Each weight takes k steps of {args.lr:g} in one random direction; the share is "
             f"how much of that the bf16 weights a forward uses moved (1.0 = all of it).", "",
             "| steps k | master on the bf16 grid (colo_rl, model loaded in bf16) "
             "| fp32 checkpoint values (TRL autocast) |",
             "|---|---|---|"]
    lines += [f"| {k + 1} | {g:.3f} | {f:.3f} |" for k, (g, f) in enumerate(zip(grid, fp32))]
    common.publish("bf16_update_share", result, "\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
