"""Wiring the colocated pieces: engine, trainer, handoff, memory manager, phase switcher."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from colo_rl import dist
from colo_rl.colocate.handoff import WeightHandoff, choose_lora_handoff
from colo_rl.colocate.memory import Ledger, MemoryManager
from colo_rl.colocate.switch import PhaseSwitcher
from colo_rl.envs import turns_end_at_strings
from colo_rl.phase import PhaseGuard
from colo_rl.rollout import ENGINES
from colo_rl.rollout.base import ALL_TAGS, RolloutEngine
from colo_rl.rollout.tp_group import TPGroupEngine, current_layout
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.adapters import BaseReference
from colo_rl.train.ds_config import paging_needed
from colo_rl.train.host_paging import FrozenModelPaging
from colo_rl.train.reward_model import RewardModel

log = logging.getLogger("colo_rl")


@dataclass
class Colocated:
    actor: DeepSpeedActor
    ref: Optional[DeepSpeedActor | BaseReference]
    engine: RolloutEngine  # with rollout.tp_size > 1, a TPGroupEngine on every rank of the group
    switch: PhaseSwitcher
    guard: PhaseGuard
    ledger: Ledger
    reward_model: Optional[RewardModel] = None  # reward.model.path


@contextlib.contextmanager
def trainer_paged_out(actor, enabled: bool = True, frozen: tuple = ()):
    """Page the trainer's states (and the `frozen` models') out while the engine starts (every rank
    calls it: it holds barriers), so SGLang sizes its static memory from what the generation phase
    really has.
    A rank whose engine fails to start raises at once: a barrier there would hang every rank
    (torchrun stops the others when one exits with an error)."""
    if not enabled:
        yield
        return
    actor.offload_states()
    for model in frozen:
        model.offload_states()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    dist.barrier()  # every GPU of a TP group is paged out before its engine measures memory
    yield
    dist.barrier()  # every engine has released its memory before any trainer reloads
    actor.reload_states()
    for model in frozen:
        model.reload_states()


def build_engine(cfg, tokenizer, dtype: torch.dtype, guard: PhaseGuard):
    """The run's engine (rollout.engine, from the ENGINES registry) for this rank. With tool calls it
    is asked to stop a turn at a call's closing tag (`stop_strings`)."""
    engine_cls = ENGINES.get(cfg.rollout.engine)
    stops = turns_end_at_strings(cfg.env)
    if stops and not engine_cls.capabilities.stop_strings:
        log.info("%s does not stop at a tool call's closing tag: it samples on to EOS and each turn is cut after "
                 "the call", engine_cls.title)
    return engine_cls.create(cfg, tokenizer, dtype, guard, stop_strings=stops)


def build_colocated(cfg, tokenizer, dtype: torch.dtype, run_dir: Optional[Path], total_steps: int,
                    grad_accum: int, with_optimizer: bool = True) -> Colocated:
    """with_optimizer=False: a frozen ZeRO-3 actor whose only job is to hand its weights to the
    engine (recipes/eval.py)."""
    guard = PhaseGuard()
    engine_cls = ENGINES.get(cfg.rollout.engine)
    tp_size = cfg.rollout.tp_size if engine_cls.capabilities.tensor_parallel else 1
    layout = current_layout(tp_size)
    actor = DeepSpeedActor(cfg, dtype, total_steps=total_steps, grad_accum=grad_accum, with_optimizer=with_optimizer,
                           guard=guard)
    ref = reference_model(cfg, actor, dtype, total_steps, guard) if cfg.algo.kl_coef > 0 else None
    reward_model = RewardModel(cfg, dtype, guard=guard) if cfg.reward.model.path else None
    frozen = frozen_paging(cfg, guard, ref, reward_model)
    # An engine that sizes its memory from what is free when it starts (SGLang) starts with the trainer paged out.
    with trainer_paged_out(actor, enabled=engine_cls.sizes_memory_at_start, frozen=frozen):
        engine = build_engine(cfg, tokenizer, dtype, guard) if layout["owns_engine"] else None
        if engine is not None:
            engine.sleep(ALL_TAGS)  # weights come from the trainer's handoff, never from disk
    if tp_size > 1:  # every rank of a TP group reaches its group's engine through the group's first rank
        engine = TPGroupEngine.build(engine, tp_size, guard=guard, prepare_payload=engine_cls.tp_rank_payload)
    mode, why = choose_lora_handoff(cfg.model, engine)
    if mode != "full":
        log.info("LoRA handoff: %s (%s)", "adapters only, the base once" if mode == "adapter" else
                 "merged into the base, the whole model each step", why)
    handoff = WeightHandoff(actor, engine, cfg.colocate.handoff_bucket_mb, feeds_engine=engine is not None, mode=mode)
    ledger = Ledger(run_dir / "ledger.jsonl" if run_dir is not None else None)
    manager = MemoryManager(actor, engine, handoff, ledger, owns_engine=engine is not None, frozen=frozen)
    return Colocated(actor=actor, ref=ref, engine=engine, switch=PhaseSwitcher(manager, guard), guard=guard,
                     ledger=ledger, reward_model=reward_model)


def frozen_paging(cfg, guard: PhaseGuard, ref, reward_model: Optional[RewardModel]) -> tuple[FrozenModelPaging, ...]:
    """The frozen models paged with the trainer between phases (colocate.paging): a full
    fine-tune's reference model and the reward model. A LoRA reference is the actor's own base,
    paged with the actor."""
    pages = paging_needed(True, guard, cfg.colocate.paging)
    models = [("reference model", ref if isinstance(ref, DeepSpeedActor) else None), ("reward model", reward_model)]
    return tuple(FrozenModelPaging(name, model.engine, pages, cfg.colocate.offload_pin_memory)
                 for name, model in models if model is not None)


def reference_model(cfg, actor: DeepSpeedActor, dtype: torch.dtype, total_steps: int,
                    guard: Optional[PhaseGuard]) -> DeepSpeedActor | BaseReference:
    """The frozen reference (GRPO's KL, DPO): with LoRA the actor's own base, adapters disabled (no
    second copy); otherwise a frozen ZeRO-3 copy of the starting model."""
    if actor.lora:
        return BaseReference(actor)
    return DeepSpeedActor(cfg, dtype, total_steps=total_steps, with_optimizer=False, guard=guard)


def build_actor(cfg, dtype: torch.dtype, tokenizer, run_dir: Optional[Path], total_steps: int, grad_accum: int,
                with_engine: bool) -> tuple[DeepSpeedActor, Optional[Colocated]]:
    """SFT / DPO's trainer: the DeepSpeed actor alone, or (with_engine: greedy held-out accuracy)
    the colocated actor + rollout engine."""
    if with_engine:
        colo = build_colocated(cfg, tokenizer, dtype, run_dir, total_steps=total_steps, grad_accum=grad_accum)
        return colo.actor, colo
    return DeepSpeedActor(cfg, dtype, total_steps=total_steps, grad_accum=grad_accum), None
