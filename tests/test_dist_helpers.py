"""dist's reductions as the recipes call them. Across 2 ranks they run in every recipe test (the
pinned rewards and losses are all-rank sums); here, what a dict of sums sends and comes back as."""

from __future__ import annotations

import torch

from colo_rl import dist


def test_a_dict_of_sums_goes_by_key_whatever_the_insertion_order(monkeypatch):
    # ranks build their dicts in different orders (a stat first seen on another micro-batch): each
    # must send its sums in the same order, or one rank's loss is added to another's token count
    sent = []

    def all_reduce(t, op=None):  # a second rank with the same values: the sum doubles them
        sent.append(t.tolist())
        t.mul_(2)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    a = dist.all_reduce_sum({"tokens": 3.0, "loss": 1.5, "kl": 0.25})
    b = dist.all_reduce_sum({"kl": 0.25, "loss": 1.5, "tokens": 3.0})
    assert sent[0] == sent[1]
    assert a == b == {"kl": 0.5, "loss": 3.0, "tokens": 6.0}
    assert dist.all_reduce_sum([1.0, 2]) == [2.0, 4.0]
