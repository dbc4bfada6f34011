"""colocate.paging=auto: page the trainer between phases only as far as the device needs it.

One pure function (`plan_paging`) decides from per-device byte counts; `estimate_*` give the terms
that are not measured. The rule (per device, in bytes):

    generation  = resident trainer states + engine weights + KV cache needed + CUDA graphs + margin
    handoff     = resident trainer states [+ weight partitions, if handed off before their page-out]
                  + engine weights + 2 handoff buckets + margin            (KV cache not yet allocated)
    update      = every trainer state + update activations + margin       (the engine released)

`auto` pages the shortest prefix of PAGE_ORDER whose generation and handoff sums fit the device;
nothing when everything fits (the trainer stays resident and SGLang sizes its KV cache around
it). `on` pages every kind, `off` none; all three report whether the run fits. A run whose update
phase does not fit, or whose generation phase does not fit with everything paged, is planned as
`on` and reported as not fitting (the estimates are estimates: the run is tried, with a warning).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from colo_rl.rollout.sglang.compat import kv_bytes_per_token
from colo_rl.train.activation_memory import AUTO_MIN_TOKENS, activation_bytes
from colo_rl.train.ds_config import DEEPSPEED_REDUCE_BUCKET, state_bytes_by_kind

GIB = 1 << 30

# Trainer state kinds (DeepSpeed's OffloadStateTypeEnum values, plus the frozen models paged beside
# the actor), in the order auto pages them. The gradient bucket first: paging it copies nothing
# (DeepSpeed drops it and allocates it again on reload). Then Adam's moments (half of the bytes,
# needed only by the optimizer step), the fp32 master weights (likewise), the gradient partitions,
# the frozen models (a reference or reward model, needed from the update's first forward), and last
# the weight partitions: the handoff reads them, so paging them costs a host-to-device copy per step
# unless the handoff runs before their page-out.
PAGE_ORDER = ("contiguous_grad_buffer", "optim_states", "hp_params", "lp_grads", "frozen_models", "lp_params")
PAGING_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class MemoryNeeds:
    """Bytes on one device. `trainer_states` maps PAGE_ORDER kinds to bytes (missing kinds: 0)."""

    device_bytes: Optional[int]  # what the trainer and the engine may use on one device; None = no limit (CPU)
    trainer_states: Mapping[str, int]
    activations: int  # the update phase's peak activations (one micro-batch)
    engine_weights: int
    kv_cache: int  # the KV cache one generation phase needs
    cuda_graphs: int
    handoff_buckets: int  # the handoff's transient buckets (two of them: a gathered one + its flat copy)
    margin: int  # colocate.memory_margin_gib: CUDA contexts, allocator slack, what the estimates miss

    def state(self, kind: str) -> int:
        return int(self.trainer_states.get(kind, 0))


@dataclasses.dataclass(frozen=True)
class PagingPlan:
    mode: str
    paged: tuple[str, ...]  # kinds paged for every generation phase, in PAGE_ORDER
    handoff_first: bool  # the weight partitions are on the device during the handoff
    fits: bool
    generation_bytes: int
    handoff_bytes: int
    update_bytes: int
    needs: MemoryNeeds
    reason: str

    @property
    def pages(self) -> bool:
        return bool(self.paged)

    def record(self) -> dict:
        """The decision and its numbers, as the ledger and the start-up log keep them (GiB)."""
        gib = lambda b: round(b / GIB, 3)  # noqa: E731
        n = self.needs
        return {"mode": self.mode, "paged": list(self.paged), "handoff_first": self.handoff_first,
                "fits": self.fits, "reason": self.reason,
                "device_gib": None if n.device_bytes is None else gib(n.device_bytes),
                "generation_gib": gib(self.generation_bytes), "handoff_gib": gib(self.handoff_bytes),
                "update_gib": gib(self.update_bytes),
                "trainer_states_gib": {k: gib(n.state(k)) for k in PAGE_ORDER if n.state(k)},
                "activations_gib": gib(n.activations), "engine_weights_gib": gib(n.engine_weights),
                "kv_cache_gib": gib(n.kv_cache), "cuda_graphs_gib": gib(n.cuda_graphs),
                "handoff_buckets_gib": gib(n.handoff_buckets), "margin_gib": gib(n.margin)}

    def summary(self) -> str:
        what = "trainer resident" if not self.paged else "paging " + ", ".join(self.paged)
        device = "no limit" if self.needs.device_bytes is None else f"{self.needs.device_bytes / GIB:.1f} GiB"
        return (f"colocate.paging={self.mode}: {what} ({self.reason}); per device: generation "
                f"{self.generation_bytes / GIB:.1f} GiB, handoff {self.handoff_bytes / GIB:.1f} GiB, update "
                f"{self.update_bytes / GIB:.1f} GiB of {device}")


def _fits(nbytes: int, needs: MemoryNeeds) -> bool:
    return needs.device_bytes is None or nbytes <= needs.device_bytes


def _phase_bytes(needs: MemoryNeeds, paged: tuple[str, ...]) -> tuple[int, int, bool]:
    """(generation, handoff, handoff_first) with `paged` kinds off the device."""
    resident = sum(needs.state(k) for k in PAGE_ORDER if k not in paged)
    generation = resident + needs.engine_weights + needs.kv_cache + needs.cuda_graphs + needs.margin
    handoff = resident + needs.engine_weights + needs.handoff_buckets + needs.margin
    lp = needs.state("lp_params") if "lp_params" in paged else 0
    handoff_first = _fits(handoff + lp, needs)
    return generation, handoff + (lp if handoff_first else 0), handoff_first


def plan_paging(needs: MemoryNeeds, mode: str = "auto") -> PagingPlan:
    """What to page for every generation phase (module docstring: the rule)."""
    if mode not in PAGING_MODES:
        raise ValueError(f"colocate.paging={mode!r} is not one of {PAGING_MODES}")
    update = sum(needs.state(k) for k in PAGE_ORDER) + needs.activations + needs.margin
    update_fits = _fits(update, needs)
    candidates = {"on": [PAGE_ORDER], "off": [()],
                  "auto": [PAGE_ORDER[:i] for i in range(len(PAGE_ORDER) + 1)]}[mode]
    chosen = None
    for paged in candidates:
        # a kind holding no bytes is not paged (nothing to gain), except when forced
        paged = tuple(k for k in paged if needs.state(k) or mode == "on")
        generation, handoff, first = _phase_bytes(needs, paged)
        if _fits(generation, needs) and _fits(handoff, needs):
            chosen = (paged, generation, handoff, first)
            break
    gen_fits = chosen is not None
    if chosen is None or not update_fits:  # it does not fit: page everything (unless off) and say so
        paged = tuple(k for k in PAGE_ORDER if needs.state(k) or mode == "on") if mode != "off" else ()
        chosen = (paged, *_phase_bytes(needs, paged))
    paged, generation, handoff, first = chosen
    if not update_fits:
        reason = ("does not fit: the update phase alone needs more than the device; use more GPUs (ZeRO-3 "
                  "shards the states), LoRA, gradient checkpointing or fewer tokens per micro-batch")
    elif not gen_fits:
        reason = ("does not fit: the engine's weights, KV cache and the resident states exceed the device "
                  + ("even with every state paged; lower rollout.max_new_tokens or the sequences per step, or "
                     "raise rollout.tp_size" if mode != "off" else "with paging off; use colocate.paging=auto"))
    elif mode != "auto":
        reason = f"forced by colocate.paging={mode}"
    elif needs.device_bytes is None:
        reason = "no device memory to plan against (CPU, colocate.device_memory_gib unset): nothing paged"
    elif not paged:
        reason = "everything fits with the trainer resident"
    else:
        reason = f"the least paging that fits ({len(paged)} of {len(PAGE_ORDER)} kinds)"
    return PagingPlan(mode=mode, paged=paged, handoff_first=first, fits=update_fits and gen_fits,
                      generation_bytes=generation, handoff_bytes=handoff, update_bytes=update, needs=needs,
                      reason=reason)


# ---------------------------------------------------------------- estimates of the unmeasured terms
KV_MARGIN = 1.2  # the KV cache a step needs, with room for the radix cache's fragmentation
CUDA_GRAPH_BYTES = 1 * GIB  # SGLang's decode graphs (batch sizes up to 160), measured 0.3-1 GiB on an H100


def kv_cache_needed(sequences: int, tokens_per_sequence: int, kv_bytes_per_token: float) -> int:
    """sequences x (prompt + max new tokens) x KV bytes per token (one device's share) x KV_MARGIN."""
    return int(sequences * tokens_per_sequence * kv_bytes_per_token * KV_MARGIN)


def micro_batch_tokens(trainer_cfg, tokens_per_sequence: int) -> int:
    """The update's tokens per micro-batch: trainer.micro_batch_tokens where the config has it (a
    token budget; auto: its floor, as auto fits the budget to what the update phase has free), else
    micro_batch_size sequences of the longest length."""
    budget = getattr(trainer_cfg, "micro_batch_tokens", None)
    if budget is not None and str(budget) == "auto":
        # sized in the update phase from the memory free then (train/batch.py), never below the floor
        return AUTO_MIN_TOKENS
    if budget:
        return int(budget)
    return int(trainer_cfg.micro_batch_size) * int(tokens_per_sequence)


def device_budget(override_gib: Optional[float], free_bytes: Optional[int], held_bytes: int) -> Optional[int]:
    """What the trainer and the engine may use on one device: colocate.device_memory_gib where set,
    else what is free now plus what this process's trainer already holds; None without a device."""
    if override_gib is not None:
        return int(override_gib * GIB)
    if free_bytes is None:
        return None
    return int(free_bytes) + int(held_bytes)


def full_finetune_needs(params: int, world: int, config: Mapping, sequences: int, tokens_per_sequence: int,
                        micro_batch_tokens: int, device_bytes: Optional[int], dtype: torch.dtype = torch.bfloat16,
                        gradient_checkpointing: bool = False, chunked_head: bool = True, tp_size: int = 1,
                        cuda_graphs: bool = True,
                        max_bucket_bytes: int = 2 * GIB, margin: int = 2 * GIB) -> MemoryNeeds:
    """One device's needs for a full fine-tune of a `params`-parameter Llama-style model (`config`:
    its config.json fields) under ZeRO-3 over `world` GPUs with AdamW: what colo_rl measures at
    start-up, from the shapes alone (what-if planning; the benchmark's sample cases). `sequences`
    per engine; the KV cache in the model's dtype; `chunked_head`: the LM head a GPU runs by default
    (train/lm_head.py, no whole logits)."""
    size = torch.empty((), dtype=dtype).element_size()
    states = state_bytes_by_kind(-(-params // world), dtype, dtype,
                                 bucket_bytes=size * min(DEEPSPEED_REDUCE_BUCKET, params))
    weights = size * params
    return MemoryNeeds(device_bytes=device_bytes, trainer_states=states,
                       activations=activation_bytes(config, micro_batch_tokens, size, gradient_checkpointing, chunked_head),
                       engine_weights=-(-weights // tp_size),
                       kv_cache=kv_cache_needed(sequences, tokens_per_sequence,
                                                kv_bytes_per_token(config, size, tp_size) or 0),
                       cuda_graphs=CUDA_GRAPH_BYTES if cuda_graphs else 0,
                       handoff_buckets=2 * min(max_bucket_bytes, weights), margin=margin)
