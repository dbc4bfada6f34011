"""Paging a fixed set of tensors to host memory and back, for what DeepSpeed's own `offload_states`
does not move: a frozen model's ZeRO-3 partitions (the reference and reward models, the LoRA
actor's base).

Each tensor's `.data` is swapped in place, so every holder of the tensor object (ZeRO-3's
parameters, their `ds_tensor`) sees the move; ZeRO-3's gathers copy a partition found on the host
back to the device by themselves. The host buffers are allocated once (pinned when asked) and
reused by every later transition, as DeepSpeed does for its own states: pinning is slow, and a
fresh pinned allocation per phase switch would cost more than the copy.
"""

from __future__ import annotations

from typing import Optional

import torch


def pinnable(pin_memory: bool) -> bool:
    """Pinned host memory serves device copies: without CUDA there is nothing to pin for."""
    return pin_memory and torch.cuda.is_available()


class HostPager:
    """`pin_memory` is fixed for the pager's life: its host buffers are reused by every page-out."""

    def __init__(self, tensors: list[torch.Tensor], pin_memory: bool):
        self.tensors = list(tensors)
        self.pin_memory = pinnable(pin_memory)
        self._host: list[Optional[torch.Tensor]] = [None] * len(self.tensors)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def page_out(self) -> None:
        """Copy every tensor into its host buffer and point the tensor at it; the device memory
        goes back to the driver (not only to the caching allocator), as the engine needs it next.
        A buffer follows its tensor's shape: ZeRO-3's persistent parameters hold no data (shape
        [0]) until their first forward, and their full data after it."""
        on_cuda = any(t.device.type == "cuda" for t in self.tensors)
        for i, t in enumerate(self.tensors):
            host = self._host[i]
            if host is None or host.shape != t.data.shape or host.dtype != t.dtype:
                host = self._host[i] = torch.empty(t.data.shape, dtype=t.dtype, device="cpu",
                                                   pin_memory=self.pin_memory)
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
