"""Paging a fixed set of tensors to host memory and back, for what DeepSpeed's own `offload_states`
does not move: a frozen model's ZeRO-3 partitions (the reward model, the LoRA actor's base).

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
