"""Run under torchrun (2 gloo ranks): the algorithms that reduce over ranks, each rank holding its
half of one batch. Writes <out>.rank<r>.json (tests/test_algos_numerics.py compares the halves with
hand-computed values for the whole batch)."""

from __future__ import annotations

import json
import math
import sys

import torch

from colo_rl import algos, dist, process_exit
from colo_rl.metrics import StepSums


def main(out: str) -> None:
    dist.init()
    r = dist.rank()
    # rewards on an offset, the batch split unevenly: rank 0 has 3 values, rank 1 has 2 (+1 padded)
    values = [[100.00, 100.01, 100.02], [100.03, 100.04, math.nan]][r]
    mask = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]][r]
    whitened = algos.global_whiten(torch.tensor([values]), torch.tensor([mask]))
    # REINFORCE++: every completion right, a small KL in the reward (the case), one sequence a rank
    klp = 1e-4 * torch.linspace(-0.05, 0.05, 16).view(2, 8)[r:r + 1]
    reinforce = algos.reinforce_pp_advantages(torch.ones(1), 1, None, torch.ones(1, 8), klp)
    # mismatch metrics: rank 0 one token of ratio 3, rank 1 one of ratio 0.5
    old = torch.tensor([[math.log([3.0, 0.5][r]), 0.0]])
    sums = StepSums(maxima=algos.MISMATCH_MAX_KEYS)  # the sums over ranks, the maxima's maximum
    sums.add(algos.mismatch_sums(old, torch.zeros(1, 2), torch.ones(1, 2)))
    # generation throughput: rank 0 sampled 4 tokens in 1 s, rank 1 8 tokens in 4 s (the slow one)
    from colo_rl.rollout.batch_metrics import batch_metrics
    from colo_rl.samples import Completion, Rollout, groups_of

    n = [2, 4][r]
    completions = [Completion([1], list(range(n)), [-0.5] * n, "stop") for _ in range(2)]
    batch = Rollout(groups=groups_of(["p"], 2, {"s": [0.0, 1.0]}, completions=completions, rewards=[0.0, 1.0],
                                     correct=[False, True], lenient=[False, True], formatted=[True, True],
                                     texts=["a", "b"]))
    report = {"whitened": whitened[0].tolist(), "reinforce": reinforce[0].tolist(),
              "mismatch": algos.mismatch_metrics(sums.totals()),
              "gen_tokens_per_s": batch_metrics(batch, generation_seconds=[1.0, 4.0][r])["throughput/gen_tokens_per_s"]}
    with open(f"{out}.rank{r}.json", "w") as fh:
        json.dump(report, fh)
    dist.cleanup()


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(sys.argv[1]))
