"""The split placement's wire under torchrun, 2 ranks: rank 0 a generation rank, rank 1 the trainer
leader. Weights of two versions travel in buckets (mixed dtypes) over the weight group, a rollout
part and the end marker point-to-point; each rank writes what it saw to <out>/rank<r>.json.
gloo on CPU; NCCL when run on two GPUs (the GPU-only lines: wire.wire_device)."""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as tdist

from colo_rl import dist
from colo_rl.split import wire
from colo_rl.split.wire import WeightReceiver, WeightSender, bucket_bytes, recv_object, send_object


def model(version: int) -> torch.nn.Module:
    torch.manual_seed(version)
    m = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))
    m[1].to(torch.bfloat16)  # a second dtype in the same buckets
    return m.to(dist.device())


class Actor:  # what WeightSender reads (train.adapters.EngineWeights): plan() and gathered()
    def __init__(self, module):
        self.module = module

    def plan(self, bucket_bytes):  # one parameter per gather
        return [([n], [(n, tuple(p.shape), p.dtype)]) for n, p in self.module.named_parameters()]

    @contextlib.contextmanager
    def gathered(self, names):
        params = dict(self.module.named_parameters())
        yield [(n, params[n].data) for n in names]


class Engine:  # what WeightReceiver feeds: load_weights and finish_weight_update
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, named):
        self.loaded.update({n: t.clone() for n, t in named})

    def finish_weight_update(self):
        pass


def main(out: Path) -> None:
    dist.init()
    weight_group = tdist.new_group([1, 0])
    (objects,) = dist.new_host_groups([[0, 1]], timeout_minutes=5)  # rollouts: gloo whatever the backend
    seen = {}
    if dist.rank() == 1:
        actor = Actor(model(0))
        sender = WeightSender(actor, weight_group, leader=1, max_bucket_bytes=64)
        seen["buckets"] = len(sender.buckets)
        sender.send(0, stop=False)
        actor.module.load_state_dict(model(1).state_dict())
        sender.send(1, stop=True)
        part = recv_object(0, objects)
        seen["part"] = part
        seen["end"] = recv_object(0, objects) is None
    else:
        engine = Engine()
        live, peak, allocate = [], [0], wire.wire_empty  # the receive buffers alive as each one is allocated

        def tracked(n, dtype):
            t = allocate(n, dtype)
            peak[0] = max(peak[0], sum(r().nbytes for r in live if r() is not None) + t.nbytes)
            live.append(weakref.ref(t))
            return t
        wire.wire_empty = tracked
        receiver = WeightReceiver(weight_group, leader=1)
        versions = [receiver.take(engine)]
        first = {n: bool(torch.equal(t, p.data)) for n, t in engine.loaded.items()
                 for m, p in model(0).named_parameters() if m == n}
        versions.append(receiver.take(engine))
        wire.wire_empty = allocate
        second = {n: bool(torch.equal(t, p.data)) for n, t in engine.loaded.items()
                  for m, p in model(1).named_parameters() if m == n}
        seen.update(versions=versions, first=first, second=second,
                    dtypes=sorted({str(t.dtype) for t in engine.loaded.values()}), receive_peak_bytes=peak[0],
                    one_copy_bytes=sum(bucket_bytes(b) for b in receiver.buckets) + receiver.header.nbytes)
        for p in [send_object({"slot": 3, "version": 1, "groups": ["g0", "g1"]}, 1, objects),
                  send_object(None, 1, objects)]:
            p.wait()
    (out / f"rank{dist.rank()}.json").write_text(json.dumps(seen))
    dist.cleanup()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
