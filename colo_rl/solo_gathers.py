"""DeepSpeed's all-gathers among one rank done as local copies, for host tensors (a CPU run's trap).

ZeRO-3 all-gathers each layer's weights before it is used, at any world size. On gloo a gather runs
on one of the process group's worker threads, and the copy it makes there is one of torch's
intra-op parallel ops: the first such copy gives that thread an OpenMP team of its own. libgomp
then manages more OpenMP threads than the process has CPUs and stops spinning between parallel
regions (its "throttled" wait): each of the main thread's ~30k parallel ops per update wakes its
worker through a futex and waits for it. On 2 cores the deep narrow model's ZeRO-3 update ran no
faster on two threads than on one (3.5 s vs 3.3 s; ZeRO-0, which gathers nothing, 1.85 s on two).
A gather among one rank is a copy: done on the caller's thread it leaves gloo's threads idle, and
the update took 2.4 s (docs/update_overhead.md).

Only groups of one rank and host tensors are short-circuited: a GPU's gathers (NCCL) and groups of
several ranks go to DeepSpeed unchanged. `$COLO_RL_LOCAL_GATHERS=0` keeps DeepSpeed's own path
(benchmarks/update_overhead.py measures both).
"""

from __future__ import annotations

import os

import torch

LOCAL_GATHERS_ENV = "COLO_RL_LOCAL_GATHERS"


class DoneWork:
    """The handle of a collective that has completed (what DeepSpeed waits on)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def local_gathers_wanted() -> bool:
    """$COLO_RL_LOCAL_GATHERS: 0 keeps DeepSpeed's gathers, 1 or unset copies locally."""
    value = os.environ.get(LOCAL_GATHERS_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{LOCAL_GATHERS_ENV}={value!r}: use 1 (a gather among one rank is a local copy), "
                         "0 (DeepSpeed's collective) or leave it unset (1)")
    return value != "0"


def _solo(group, tensors) -> bool:
    """A group of one rank and every tensor in host memory."""
    return torch.distributed.get_world_size(group) == 1 and all(t.device.type == "cpu" for t in tensors)


def _done(async_op: bool):
    return DoneWork() if async_op else None


def install() -> bool:
    """Route DeepSpeed's torch backend's all-gathers (into a tensor, into a list: what ZeRO-3 calls;
    gloo has no coalesced gather) through a local copy where `_solo`. Idempotent; returns whether it
    is in effect."""
    if not local_gathers_wanted():
        return False
    from deepspeed.comm.torch import TorchBackend

    if getattr(TorchBackend, "_colo_local_gathers", False):
        return True
    into_tensor, into_list = TorchBackend.all_gather_into_tensor, TorchBackend.all_gather

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        if not _solo(group, (output_tensor, input_tensor)):
            return into_tensor(self, output_tensor, input_tensor, group=group, async_op=async_op)
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _done(async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        if not _solo(group, (tensor, *tensor_list)):
            return into_list(self, tensor_list, tensor, group=group, async_op=async_op)
        tensor_list[0].copy_(tensor)
        return _done(async_op)

    TorchBackend.all_gather_into_tensor = all_gather_into_tensor
    TorchBackend.all_gather = all_gather
    TorchBackend._colo_local_gathers = True
    return True
