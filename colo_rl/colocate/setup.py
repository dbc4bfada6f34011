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
from colo_rl.colocate.memory import Ledger, MemoryManager, freeze_collector
from colo_rl.colocate.paging_plan import (CUDA_GRAPH_BYTES, GIB, MemoryNeeds, PagingPlan, device_budget,
                                          kv_cache_needed, micro_batch_tokens, plan_paging)
from colo_rl.colocate.switch import PhaseSwitcher
from colo_rl.envs import turns_end_at_strings
from colo_rl.models import weight_bytes
from colo_rl.phase import PhaseGuard
from colo_rl.rollout import ENGINES
from colo_rl.rollout.base import ALL_TAGS, RolloutEngine
from colo_rl.rollout.sglang.compat import kv_bytes_per_token, kv_cache_bytes
from colo_rl.rollout.tp_group import TPGroupEngine, current_layout
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.activation_memory import activation_bytes
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
    plan = apply_paging_plan(plan_trainer_paging(cfg, actor, frozen, tp_size, engine_cls), actor, frozen)
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
    ledger = Ledger(run_dir / "ledger.jsonl" if run_dir is not None else None, plan=plan.record())
    manager = MemoryManager(actor, engine, handoff, ledger, owns_engine=engine is not None, frozen=frozen,
                            handoff_first=plan.handoff_first)
    # Set-up is done: what exists now lives for the run, so the page-outs' gc.collect() need not
    # scan it again (freeze_collector: ~0.4 s of every page-out otherwise).
    log.info("collector frozen after set-up: %(frozen_objects)d objects, %(seconds).2fs", freeze_collector())
    return Colocated(actor=actor, ref=ref, engine=engine, switch=PhaseSwitcher(manager, guard), guard=guard,
                     ledger=ledger, reward_model=reward_model)


class NoPhases:
    """The phase switcher of a rank that only trains (split placement): nothing to switch."""
    step = 0

    def begin_step(self, step: int) -> None:
        self.step = step

    generation = update = staticmethod(contextlib.nullcontext)

    def timed_phase_seconds(self) -> dict[str, float]:
        return {}


def build_split_trainer(cfg, dtype: torch.dtype, run_dir: Optional[Path], total_steps: int) -> Colocated:
    """A split run's trainer rank: the DeepSpeed actor (+ reference, + reward model) over the
    trainer pool only (dist's scope is the pool: DeepSpeed is given its group), no engine, nothing
    paged."""
    actor = DeepSpeedActor(cfg, dtype, total_steps=total_steps, grad_accum=1)
    ref = reference_model(cfg, actor, dtype, total_steps, None) if cfg.algo.kl_coef > 0 else None
    reward_model = RewardModel(cfg, dtype) if cfg.reward.model.path else None
    ledger = Ledger(run_dir / "ledger.jsonl" if run_dir is not None else None, plan={"mode": "split"})
    return Colocated(actor=actor, ref=ref, engine=None, switch=NoPhases(), guard=PhaseGuard(), ledger=ledger,
                     reward_model=reward_model)


def build_split_generator(cfg, tokenizer, dtype: torch.dtype) -> Colocated:
    """A split run's generation rank: its engine only, always awake; its weights come from the
    trainer ranks (colo_rl/split), never from the disk. On a GPU the engine starts while this rank
    holds the room of the weight receiver's buffers (one copy of the weights, colo_rl/split/wire.py,
    plus slack), so an engine that sizes its memory from what is free leaves it; freed, the block
    stays in torch's cache, where the receiver's buffers take it."""
    room = None
    if torch.cuda.is_available() and ENGINES.get(cfg.rollout.engine).sizes_memory_at_start:
        room = torch.empty(weight_bytes(cfg.model, dtype) + RECEIVER_SLACK_BYTES, dtype=torch.uint8,
                           device=dist.device())
    engine = build_engine(cfg, tokenizer, dtype, None)
    del room
    return Colocated(actor=None, ref=None, engine=engine, switch=NoPhases(), guard=PhaseGuard(), ledger=Ledger(None))


RECEIVER_SLACK_BYTES = 64 << 20  # the wire buckets' alignment and header, with room to spare


def sequence_tokens(cfg) -> int:
    """The longest sequence a generation phase makes: prompt + response (a multi-turn episode's
    response tokens, observations included, where an environment runs)."""
    response = cfg.env.max_total_tokens if cfg.env.name != "none" else cfg.rollout.max_new_tokens
    return int(cfg.data.max_prompt_tokens) + int(response)


def plan_trainer_paging(cfg, actor: DeepSpeedActor, frozen: tuple, tp_size: int, engine_cls) -> PagingPlan:
    """colocate.paging's plan for this run from this rank's measured trainer states and the run's
    shapes (colo_rl/colocate/paging_plan.py). Every rank plans with the smallest device budget, so
    every rank pages the same kinds."""
    dtype_bytes = torch.empty((), dtype=actor.dtype).element_size()
    states = dict(actor.state_bytes_by_kind())
    states["frozen_models"] = sum(m.state_bytes() for m in frozen)
    on_cuda = torch.cuda.is_available()
    budget = device_budget(cfg.colocate.device_memory_gib, dist.device_free_bytes() if on_cuda else None,
                           torch.cuda.memory_reserved() if on_cuda else 0)
    if budget is not None:
        budget = int(-dist.all_reduce_max([-float(budget)])[0])
    model = actor.config.to_dict()
    extra = engine_cls.engine_kwargs(cfg)
    tokens = sequence_tokens(cfg)
    engines = max(1, dist.world_size() // tp_size)
    sequences = -(-cfg.rollout.prompts_per_step * cfg.rollout.group_size // engines)
    kv_token = kv_bytes_per_token(model, kv_cache_bytes(extra, actor.dtype), tp_size) or 0
    weights = sum(nbytes for _, nbytes in actor.named_parameter_sizes())
    graphs = on_cuda and engine_cls.cuda_graphs(cfg)
    needs = MemoryNeeds(
        device_bytes=budget, trainer_states=states,
        activations=activation_bytes(model, micro_batch_tokens(cfg.trainer, tokens), dtype_bytes,
                                     bool(cfg.model.gradient_checkpointing), actor.chunked_lm_head),
        engine_weights=-(-weights // tp_size), kv_cache=kv_cache_needed(sequences, tokens, kv_token),
        cuda_graphs=CUDA_GRAPH_BYTES if graphs else 0,
        handoff_buckets=2 * min(weights, int(cfg.colocate.handoff_bucket_mb) << 20),
        margin=int(cfg.colocate.memory_margin_gib * GIB))
    # an actor that cannot page (no optimizer, not colocated) is planned as off
    mode = cfg.colocate.paging if actor.pages or budget is None else "off"
    return plan_paging(needs, mode)


def apply_paging_plan(plan: PagingPlan, actor: DeepSpeedActor, frozen: tuple) -> PagingPlan:
    """The actor and the frozen models page what the plan says; the decision is logged (rank 0)."""
    actor.set_paged_kinds(plan.paged)
    for model in frozen:
        model.pages = model.pages and "frozen_models" in plan.paged
    if dist.is_rank0() and actor.with_optimizer:
        (log.info if plan.fits else log.warning)("%s", plan.summary())
    return plan


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
