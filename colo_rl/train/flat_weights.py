"""The zero-copy handoff's producer: at world size 1 DeepSpeed's ZeRO-3 keeps every trained weight
in one contiguous low-precision buffer (stage3.py, `lp_param_buffer = defragment(partitions)`; each
parameter's `ds_tensor` is a narrow view of it, re-pointed by `reload_states`), so the engine can
be given that buffer and each weight's place in it: no gather, no concatenation, no second copy.

Each weight's place is read off its view (`data_ptr`), not off DeepSpeed's group order, so a
layout change in DeepSpeed makes this refuse (None: the bucketed handoff runs), never mislabel.
"""

from __future__ import annotations

from typing import Optional

import torch


def flat_weight_views(named: list[tuple[str, torch.Tensor, torch.Size]],
                      buffer: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
    """[(name, the weight as a view of `buffer` in its full shape)] for (name, partition, full shape)
    triples, or None unless every partition is a whole, contiguous, same-dtype view inside `buffer`
    (a sharded partition, world size > 1, holds only part of its weight)."""
    if buffer.dim() != 1 or not buffer.is_contiguous() or not named:
        return None
    start, size = buffer.data_ptr(), buffer.element_size()
    end = start + buffer.numel() * size
    out = []
    for name, part, shape in named:
        numel = 1
        for d in shape:
            numel *= int(d)
        ptr = part.data_ptr()
        if (part.dtype != buffer.dtype or part.device != buffer.device or not part.is_contiguous()
                or part.numel() != numel or not (start <= ptr and ptr + numel * size <= end)
                or (ptr - start) % size):
            return None
        offset = (ptr - start) // size
        out.append((name, buffer.narrow(0, offset, numel).view(shape)))
    return out


def deepspeed_flat_weights(module, zero_optimizer) -> Optional[tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]]:
    """(DeepSpeed's flat weight buffer, every named parameter as a view of it), or None where the
    zero-copy handoff does not apply: no such buffer, frozen parameters outside it (LoRA), a
    partition that is not the whole weight (world size > 1)."""
    buffer = getattr(zero_optimizer, "lp_param_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        return None
    named = []
    for name, p in module.named_parameters():
        part = getattr(p, "ds_tensor", None)
        if part is None or not p.requires_grad:
            return None
        named.append((name, part, getattr(p, "ds_shape", p.shape)))
    views = flat_weight_views(named, buffer)
    return None if views is None else (buffer, views)
