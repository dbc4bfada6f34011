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


def test_a_world_of_one_ignores_an_inherited_master_port_held_by_another_store():
    """A single-process run whose environment carries MASTER_PORT (a test process that started its
    own group, a shell that exported one) must not bind that port: another process's store holds it."""
    import os
    import socket
    import subprocess
    import sys

    from conftest import ROOT, child_env, child_python_path

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = "from colo_rl import dist; import os; dist.init(); print('port', os.environ['MASTER_PORT'])"
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=child_env(PYTHONPATH=child_python_path(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                            WORLD_SIZE="1", RANK="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"port {port}" not in proc.stdout and "port " in proc.stdout
    assert "MASTER_PORT" not in os.environ or os.environ["MASTER_PORT"] != str(port)
