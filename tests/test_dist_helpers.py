"""dist's reductions as the recipes call them. Across 2 ranks they run in every recipe test (the
pinned rewards and losses are all-rank sums); here, what a dict of sums comes back as."""

from __future__ import annotations

from colo_rl import dist


def test_a_dict_of_sums_comes_back_by_key_whatever_the_insertion_order():
    # ranks build their dicts in different orders (a stat first seen on another micro-batch):
    # the reduction goes by key, so each sum is matched with its own name on every rank
    a = dist.all_reduce_sum({"tokens": 3.0, "loss": 1.5, "kl": 0.25})
    b = dist.all_reduce_sum({"kl": 0.25, "loss": 1.5, "tokens": 3.0})
    assert a == b == {"kl": 0.25, "loss": 1.5, "tokens": 3.0}
    assert dist.all_reduce_sum([1.0, 2]) == [1.0, 2.0]
