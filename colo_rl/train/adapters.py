"""The actor's LoRA side: the frozen base as reference, merged and adapter-only gathers (handoff, export).

Everything here is a collective under ZeRO-3 (GatheredParameters): every rank calls it with the
same names, in the same order.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from colo_rl import dist
from colo_rl.lora import external_name, is_adapter, lora_scaling, merge_units, merged_tensors, transposed_modules
from colo_rl.train.actor import DeepSpeedActor, plan_buckets


class BaseReference:
    """The reference model for KL (GRPO) and DPO: the actor's own frozen base with its adapters
    disabled, so no second copy of the model is built or sharded. Same call as a frozen actor."""

    def __init__(self, actor: DeepSpeedActor):
        if not actor.lora:
            raise ValueError("BaseReference needs an actor with LoRA adapters (model.lora.rank > 0)")
        self.actor = actor
        self.dtype = actor.dtype

    def to_device(self, batch):
        return self.actor.to_device(batch)

    def response_logprobs(self, batch, temperature: float = 1.0, with_entropy: bool = False, grad: bool = False,
                          entropy_grad: bool = False):
        with self.actor.module.disable_adapter():
            return self.actor.response_logprobs(batch, temperature, with_entropy, grad=False)


def adapter_names(actor: DeepSpeedActor) -> list[str]:
    return [n for n, _ in actor.named_parameter_sizes() if is_adapter(n)]


def base_names(actor: DeepSpeedActor) -> list[str]:
    return [n for n, _ in actor.named_parameter_sizes() if not is_adapter(n)]


def sized_buckets(actor: DeepSpeedActor, names: list[str], bucket_bytes: int) -> list[list[str]]:
    sizes = dict(actor.named_parameter_sizes())
    return plan_buckets([(n, sizes[n]) for n in names], bucket_bytes)


def merge_buckets(actor: DeepSpeedActor, bucket_bytes: int) -> list[list[str]]:
    """Buckets of whole merge units (a wrapped Linear's base weight with its two adapter matrices)."""
    sizes = dict(actor.named_parameter_sizes())
    units = merge_units(list(sizes))
    planned = plan_buckets([(str(i), sum(sizes[n] for n in u)) for i, u in enumerate(units)], bucket_bytes)
    return [[n for key in bucket for n in units[int(key)]] for bucket in planned]


@contextlib.contextmanager
def gathered_merged(actor: DeepSpeedActor, names: list[str]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """HF-named tensors of the merged model for a merge bucket (valid inside the context)."""
    with actor.gathered(names) as tensors:
        yield merged_tensors(tensors, lora_scaling(actor.cfg.model.lora), transposed_modules(actor.module))


@contextlib.contextmanager
def gathered_external(actor: DeepSpeedActor, names: list[str]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Tensors under the names they travel by (HF names for base weights, adapter-file names)."""
    with actor.gathered(names) as tensors:
        yield [(external_name(n), t) for n, t in tensors]


def merged_state_dict_on_rank0(actor: DeepSpeedActor, bucket_bytes: int = 256 << 20) -> Optional[dict]:
    """The merged model's HF state dict on rank 0's CPU (None elsewhere)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in merge_buckets(actor, bucket_bytes):
        with gathered_merged(actor, bucket) as tensors:
            if dist.is_rank0():
                out.update((n, t.detach().to("cpu", copy=True)) for n, t in tensors)
    return out if dist.is_rank0() else None


def adapter_state_dict_on_rank0(actor: DeepSpeedActor, bucket_bytes: int = 256 << 20) -> Optional[dict]:
    """The adapter weights under the wrapped model's own names, on rank 0's CPU (None elsewhere):
    what PeftModel.save_pretrained(state_dict=...) takes."""
    out: dict[str, torch.Tensor] = {}
    for bucket in sized_buckets(actor, adapter_names(actor), bucket_bytes):
        with actor.gathered(bucket) as tensors:
            if dist.is_rank0():
                out.update((n, t.detach().to("cpu", copy=True)) for n, t in tensors)
    return out if dist.is_rank0() else None


class EngineWeights:
    """The actor's weights as a rollout engine takes them: HF-named full tensors, a LoRA model's
    merged (W + scaling B A) so an engine without adapter support serves the policy. What a split
    run's trainers broadcast (colo_rl/split/wire.WeightSender); every call is a collective."""

    def __init__(self, actor: DeepSpeedActor, merged: Optional[bool] = None):
        self.actor = actor
        self.merged = actor.lora if merged is None else merged  # W + scaling B A (default: a LoRA actor's)

    def plan(self, bucket_bytes: int) -> list[tuple[list[str], list[tuple[str, tuple, torch.dtype]]]]:
        """Per gather of at most ~`bucket_bytes`: the parameter names gathered, and the name, shape
        and dtype of each tensor `gathered` yields for them, in its order."""
        specs = {n: (tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for n, p in self.actor.module.named_parameters()}
        if not self.merged:
            return [(names, [(n, *specs[n]) for n in names])
                    for names in plan_buckets(self.actor.named_parameter_sizes(), bucket_bytes)]
        return [(names, [(external_name(n), *specs[n]) for n in names if not is_adapter(n)])
                for names in merge_buckets(self.actor, bucket_bytes)]  # whole merge units: base + A + B

    def gathered(self, names: list[str]):
        return gathered_merged(self.actor, names) if self.merged else self.actor.gathered(names)

