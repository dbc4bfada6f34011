"""Micro-batches by tokens: the loss does not depend on how a step is split. The recipe's update on
the real DeepSpeed ZeRO-3 actor under torchrun (2 gloo ranks, fp32) gives the same gradient for
1, 2 and 8 micro-batches per rank, for every algo.loss_agg mode, with the ranks holding unequal work
(8 and 3 groups: empty passes), a 1-token response and an all-zero policy mask
(tests/workers/micro_batch_invariance_worker.py)."""

import json

import pytest

from colo_rl.algos import LOSS_AGGREGATIONS
from conftest import WORKERS, run_torchrun

pytestmark = pytest.mark.slow


def test_same_gradient_for_1_2_and_8_micro_batches_for_every_loss_aggregation(tmp_path):
    out = tmp_path / "split"
    run_torchrun(WORKERS / "micro_batch_invariance_worker.py", [str(out)], timeout=600)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"split.rank{rank}.json").read_text())
        assert sorted(report) == sorted(LOSS_AGGREGATIONS.names())
        for mode, splits in report.items():
            assert [s["micro_batches"] for s in splits.values()] == [1, 2, 8], (mode, splits)
            for budget, s in splits.items():
                assert s["grad_max"] > 0, (mode, s)  # a real gradient, not zeros
                assert s["max_rel_diff"] < 1e-5, (mode, budget, s)
                assert s["loss_diff"] < 1e-6 * max(1.0, s["loss"]), (mode, budget, s)  # token-sum's loss is a sum
