"""Paging a fixed set of tensors to host memory and back, for what DeepSpeed's own `offload_states`
does not move: a frozen model's ZeRO-3 partitions (the reference and reward models, the LoRA
actor's base).

Each tensor's `.data` is swapped in place, so every holder of the tensor object (ZeRO-3's
parameters, their `ds_tensor`) sees the move; ZeRO-3's gathers copy a partition found on the host
back to the device by themselves. The host buffers are allocated once (pinned when asked) and
reused by every later transition, as DeepSpeed does for its own states: pinning is slow, and a
fresh pinned allocation per phase switch would cost more than the copy.

The buffers are views into a few slabs, not one allocation per tensor: torch's pinned (caching
host) allocator rounds every request up to a power of two, which held ~1.9x the partitions' bytes
of host RAM (a 7B reference model's 14.2 GiB of partitions took 27 GiB pinned at world size 1).
A slab holds at most SLAB_BYTES, a power of two, so rounding adds at most one slab's tail per slab
(a tensor larger than a slab, alone in its own, is rounded as before).
"""

from __future__ import annotations

from typing import Optional

import torch


def pinnable(pin_memory: bool) -> bool:
    """Pinned host memory serves device copies: without CUDA there is nothing to pin for."""
    return pin_memory and torch.cuda.is_available()


SLAB_BYTES = 1 << 30
ALIGN_BYTES = 64  # each view starts aligned for any dtype (and for vectorised copies)


def slab_plan(sizes: list[int], slab_bytes: int = SLAB_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """Tensors of `sizes` bytes, in order, into slabs: (each slab's bytes, each tensor's (slab,
    offset)). A slab holds at most `slab_bytes` (a power of two, so the pinned allocator rounds it
    to no more than that); a tensor larger than a slab has one of its own."""
    slabs: list[int] = []
    where: list[tuple[int, int]] = []
    used = 0
    for n in sizes:
        offset = -(-used // ALIGN_BYTES) * ALIGN_BYTES
        if not slabs or offset + n > slab_bytes:
            slabs.append(0)
            offset = 0
        where.append((len(slabs) - 1, offset))
        used = offset + n
        slabs[-1] = max(slabs[-1], used)
    return slabs, where


class HostPager:
    """`pin_memory` is fixed for the pager's life: its host buffers are reused by every page-out."""

    def __init__(self, tensors: list[torch.Tensor], pin_memory: bool):
        self.tensors = list(tensors)
        self.pin_memory = pinnable(pin_memory)
        self._host: list[torch.Tensor] = []  # each tensor's host buffer: a view into a slab
        self._layout: Optional[tuple] = None  # the (shape, dtype) of each tensor the views were carved for
        self.slab_bytes: list[int] = []  # the host bytes allocated, per slab

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def _carve(self) -> None:
        """Host buffers for the tensors' current shapes: kept while the shapes stay, carved again
        (the old slabs freed first) when one changes."""
        layout = tuple((tuple(t.data.shape), t.dtype) for t in self.tensors)
        if layout == self._layout:
            return
        self._host, self._layout = [], None
        sizes = [t.data.numel() * t.element_size() for t in self.tensors]
        self.slab_bytes, where = slab_plan(sizes)
        slabs = [torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory) for n in self.slab_bytes]
        self._host = [slabs[k][offset:offset + n].view(t.dtype).view(t.data.shape)
                      for t, n, (k, offset) in zip(self.tensors, sizes, where)]
        self._layout = layout

    def page_out(self) -> None:
        """Copy every tensor into its host buffer and point the tensor at it; the device memory
        goes back to the driver (not only to the caching allocator), as the engine needs it next.
        A buffer follows its tensor's shape: ZeRO-3's persistent parameters hold no data (shape
        [0]) until their first forward, and their full data after it."""
        on_cuda = any(t.device.type == "cuda" for t in self.tensors)
        self._carve()
        for t, host in zip(self.tensors, self._host):
            host.copy_(t.data)
            t.data = host
        if on_cuda:
            torch.cuda.empty_cache()

    def page_in(self, device: torch.device | str) -> None:
        for t in self.tensors:
            t.data = t.data.to(device, non_blocking=False)


def partitions(module) -> list[torch.Tensor]:
    """What a frozen model keeps on its device between forwards once ZeRO-3's gathered copies are
    released: each parameter's partition (`ds_tensor`), or the parameter itself where it is not a
    ZeRO-3 parameter."""
    return [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in module.parameters()]


class FrozenModelPaging:
    """A frozen DeepSpeed model (a full fine-tune's reference model, the reward model) paged to host
    memory for every generation phase, next to the trainer's own states: the memory manager's
    `frozen` entries (`name`, `state_bytes`, `offload_states`, `reload_states`).

    ZeRO-3's gathered copies go first (`empty_partition_cache`, which also drops the persistent
    small parameters' full copies: the next forward gathers them again), so what is paged is this
    rank's partitions and nothing stays behind on the device."""

    def __init__(self, name: str, engine, pages: bool, pin_memory: bool):
        self.name, self.engine, self.pages = name, engine, pages
        self.pager = HostPager(partitions(engine.module), pin_memory)

    def state_bytes(self) -> int:
        return self.pager.nbytes()

    def offload_states(self) -> bool:
        """Returns whether anything moved (only when paging: colocate.paging, a GPU by default)."""
        if not self.pages:
            return False
        self.engine.empty_partition_cache()
        self.pager.page_out()
        return True

    def reload_states(self) -> bool:
        if not self.pages:
            return False
        self.pager.page_in(self.engine.device)
        return True
