"""The DeepSpeed actor: ZeRO-sharded model, log-probs in micro-batches, steps, paging, gathering
(its DeepSpeed config, schedule and paging rules: colo_rl/train/ds_config.py)."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, Optional

import torch

from colo_rl import dist
from colo_rl.cuda_toolkit import arch_list_for_deepspeed, prepare_jit_builds
from colo_rl.errors import ConfigError, NonFiniteError
from colo_rl.lora import FROZEN_BASE_KEY, apply_lora, check_frozen_base, frozen_fingerprint, lora_enabled
from colo_rl.models import load_model
from colo_rl.op_builds import check_no_interrupted_build
from colo_rl.phase import Phase, PhaseGuard
from colo_rl.train.activation_memory import agreed_token_budget
from colo_rl.train.batch import TokenBatch, response_logprobs
from colo_rl.train.compiled_layers import check_compile, compile_decoder_layers
from colo_rl.train.ds_config import (DEEPSPEED_STATE_KINDS, announce_op_build, build_ds_config, check_pageable,
                                     drop_offload_buffers, fit_grad_bucket, grad_bucket_bytes, has_dropout,
                                     lr_lambda, offload_buffers_set_aside, paged_state_bytes, paging_needed,
                                     reapply_schedule, set_zero3_hooks, state_bytes_by_kind, without_dropout)
from colo_rl.train.flat_weights import deepspeed_flat_weights
from colo_rl.train.host_paging import HostPager, pinnable
from colo_rl.train.lm_head import fusable_head
from colo_rl.train.optimizer_state import (master_weights_from_checkpoint, materialise_adam_states,
                                           replay_cpu_adam_steps)
from colo_rl.train.prebuilt_ops import load_prebuilt_ops

log = logging.getLogger("colo_rl")


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group (name, bytes) into consecutive buckets of at most `bucket_bytes`, in order.

    A tensor larger than a bucket travels alone. Order is kept: ZeRO-3 gathers are collectives,
    so every rank must plan the same buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"colocate.handoff_bucket_mb must be > 0 (got {bucket_bytes} bytes)")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


class DeepSpeedActor:
    """A causal LM under DeepSpeed. With `with_optimizer=False` it is a frozen reference model
    (ZeRO-3 inference engine, no optimizer states). With model.lora.rank > 0 the model is wrapped
    with PEFT LoRA adapters: the base is frozen (sharded, no optimizer state) and only the adapters
    train (colo_rl/train/adapters.py: the base as reference, merged / adapter-only gathers)."""

    def __init__(self, cfg, dtype: torch.dtype, total_steps: int, grad_accum: int = 1,
                 with_optimizer: bool = True, guard: Optional[PhaseGuard] = None):
        import deepspeed

        self.cfg = cfg
        self.dtype = dtype
        self.guard = guard
        self.zero_stage = cfg.trainer.zero_stage
        self.with_optimizer = with_optimizer
        ds_config = build_ds_config(cfg.trainer, dtype, with_optimizer, grad_accum)
        self.pages = paging_needed(with_optimizer, guard, cfg.colocate.paging,
                                   budget_given=cfg.colocate.device_memory_gib is not None)
        self.paged_kinds = DEEPSPEED_STATE_KINDS if self.pages else ()  # narrowed by the paging plan
        # One choice for the whole run: once DeepSpeed has pinned buffers, its reload_states restores
        # from them (stage3.py), so an unpinned page-out after a pinned one would bring back stale states.
        self.pin_memory = pinnable(cfg.colocate.offload_pin_memory)
        if self.pages:  # before loading anything: a bad combination costs seconds, not a model load
            check_pageable(self.zero_stage, ds_config)
        if with_optimizer and cfg.model.attn_implementation == "flex_attention" and not torch.cuda.is_available():
            raise ConfigError("model.attn_implementation=flex_attention trains on a GPU only: torch's FlexAttention "
                              "has no backward pass on the CPU. Use model.attn_implementation=sdpa here.")
        self.max_nonfinite_steps = cfg.trainer.max_nonfinite_steps
        self.nonfinite_total = 0  # optimizer steps skipped for a non-finite loss / gradient
        self.nonfinite_in_a_row = 0
        self._loss_nonfinite: Optional[torch.Tensor] = None  # on the device: any non-finite loss since the last step
        self._micro_batch_tokens: Optional[int] = None
        check_compile(cfg.model, cfg.trainer)  # before the model load, as the other combination checks
        model = load_model(cfg.model, dtype, seed=cfg.trainer.seed)
        self.lora = with_optimizer and lora_enabled(cfg.model)
        if self.lora:
            model = apply_lora(model, cfg.model.lora, seed=cfg.trainer.seed)
        if cfg.model.gradient_checkpointing and with_optimizer:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not with_optimizer:
            model.requires_grad_(False)
        self.config = model.config
        # ZeRO-3 hooks per decoder layer, not per linear, and autograd's linear where it holds little: the
        # host cost of a micro-batch (trainer.zero_leaf_modules, trainer.zero_memory_efficient_linear)
        self.leaf_classes, self.memory_efficient_linear = set_zero3_hooks(
            ds_config, model, cfg.trainer, self.lora, dtype, announce=with_optimizer and dist.is_rank0())
        kwargs = {}
        if with_optimizer:
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
            fit_grad_bucket(ds_config, sum(p.numel() for p in kwargs["model_parameters"]))
            sched = lr_lambda(cfg.trainer, total_steps)
            kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, sched)
        if with_optimizer and "fused_adam" not in load_prebuilt_ops():  # $COLO_RL_PREBUILT_OPS
            prepare_jit_builds()  # FusedAdam is JIT-built on a GPU: CUDA_HOME, headers
            announce_op_build("fused_adam", "DeepSpeed's FusedAdam optimizer op")
        check_no_interrupted_build()  # FusedAdam is built or loaded next: a killed build's lock would hang
        with arch_list_for_deepspeed():  # FusedAdam's build parses TORCH_CUDA_ARCH_LIST itself
            # mpu: a split run's trainer pool is DeepSpeed's whole world (None: the job's)
            self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
                model=model, config=ds_config, mpu=dist.deepspeed_mpu(), **kwargs)
        if with_optimizer:
            self.engine.train()
            if dtype in (torch.bfloat16, torch.float16) and not self.lora:
                master_weights_from_checkpoint(self.engine, cfg.model)
            materialise_adam_states(self.engine.optimizer, self._inner_optimizer())
        else:
            self.engine.eval()
        self.module = self.engine.module
        self._dropout = has_dropout(self.module)
        if cfg.model.compile:  # after DeepSpeed's hooks are in place: they stay outside the graph
            compile_decoder_layers(self.module, announce=dist.is_rank0() and with_optimizer)
        # DeepSpeed's offload_states maps every parameter's partition onto the buffer of the
        # trained ones (stage3.py, lp_params): with a frozen base (LoRA) it fails, so those
        # partitions are paged here and DeepSpeed pages the rest.
        self.frozen_pager = HostPager([p.ds_tensor for p in self.module.parameters()
                                       if not p.requires_grad and hasattr(p, "ds_tensor")]
                                      if with_optimizer and self.zero_stage == 3 else [], self.pin_memory)

    # ------------------------------------------------------------------ forward
    @property
    def chunked_lm_head(self) -> bool:
        """Whether the log-probs come from the chunked LM head (train/lm_head.py): no whole logits,
        which the activation estimate counts (train/activation_memory.py)."""
        return fusable_head(self.engine) is not None

    def micro_batch_tokens(self) -> int:
        """trainer.micro_batch_tokens in tokens, the same on every rank (the smallest; a collective).
        auto is sized once, the first time it is asked (in the update phase: the engine's memory is
        released), from the device memory free then; logged."""
        if self._micro_batch_tokens is None:
            self._micro_batch_tokens, free = agreed_token_budget(
                self.cfg.trainer.micro_batch_tokens, self.config, self.dtype, self.engine.device,
                gradient_checkpointing=bool(self.cfg.model.gradient_checkpointing), chunked_head=self.chunked_lm_head)
            if dist.is_rank0():
                log.info("micro-batches of up to %d tokens (trainer.micro_batch_tokens=%s%s)", self._micro_batch_tokens,
                         self.cfg.trainer.micro_batch_tokens,
                         f"; {free / 2**30:.1f} GiB free in the update phase, LM head "
                         f"{'chunked' if self.chunked_lm_head else 'whole logits'}" if free is not None else "")
        return self._micro_batch_tokens

    def response_logprobs(self, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False,
                          grad: bool = True, entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log pi(response tokens) [B, R] (float32) and optionally the entropy per position
        (differentiable with `entropy_grad`: an entropy bonus)."""
        if self.guard is not None:
            self.guard.require(Phase.UPDATE, "trainer forward")
        batch = batch.to_device(self.engine.device)
        with without_dropout(self.module, not grad and self.module.training and self._dropout), \
                contextlib.nullcontext() if grad else torch.no_grad():
            return response_logprobs(self.engine, batch, temperature, with_entropy, entropy_grad and grad)

    def to_device(self, batch: TokenBatch) -> TokenBatch:
        """`batch` on this actor's device (pinned and non-blocking from the host to a GPU)."""
        return batch.to_device(self.engine.device)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate gradients; `loss` is already normalised by the global token / sequence count,
        so DeepSpeed must not divide again by its accumulation steps. A non-finite loss is
        remembered in a flag on the device (no sync here): the next `step()` reads it once and
        skips the update on every rank."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        # ZeRO averages gradients over data-parallel ranks; our loss is a share of a global sum.
        self.engine.backward(loss * dist.world_size(), scale_wrt_gas=False)

    def step(self) -> dict[str, float]:
        """Optimizer step at the accumulation boundary; returns grad norm, lr and whether it was
        skipped. Every rank calls it. A step whose loss (any rank) or gradient is not finite is
        skipped on every rank: the ranks agree through one all-reduce, and under ZeRO 1-3
        DeepSpeed 0.19 itself discards a step whose global gradient norm is inf/NaN (the norm is
        reduced over ranks, so all ranks skip). After `trainer.max_nonfinite_steps` such steps in a
        row: NonFiniteError on every rank."""
        bad_loss = self._loss_nonfinite is not None and bool(self._loss_nonfinite)  # the step's one read of it
        self._loss_nonfinite = None
        bad_grad = False
        own_norm = None
        if self.zero_stage == 0:  # stage 0 steps whatever the gradients and reports no norm: do both here
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            # the gradients are already averaged over ranks (DeepSpeed all-reduces at the boundary)
            norms = [torch.linalg.vector_norm(g.float()) for g in grads]
            own_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
            bad_grad = not math.isfinite(own_norm)
        bad_loss, bad_grad = (v > 0 for v in dist.all_reduce_max([float(bad_loss), float(bad_grad)]))
        if bad_grad:  # stage 0 only: drop the gradients, no update
            self.engine.zero_grad()
            applied = False
        else:
            self.engine.step()
            applied = bool(self.engine.was_step_applied())
        applied = dist.all_reduce_max([0.0 if applied else 1.0])[0] == 0.0
        norm = self.engine.get_global_grad_norm() if own_norm is None else own_norm
        norm = float(norm) if norm is not None else float("nan")
        if bad_loss and applied and dist.is_rank0():
            log.warning("a loss was not finite but DeepSpeed found every gradient finite and applied the step")
        skipped = not applied
        if skipped:
            self.nonfinite_total += 1
            self.nonfinite_in_a_row += 1
            what = "loss" if bad_loss else "gradient"
            if dist.is_rank0():
                log.warning("optimizer step skipped: non-finite %s (%d in a row, %d in total; the run stops at "
                            "trainer.max_nonfinite_steps=%d in a row)", what, self.nonfinite_in_a_row,
                            self.nonfinite_total, self.max_nonfinite_steps)
            if 0 < self.max_nonfinite_steps <= self.nonfinite_in_a_row:
                raise NonFiniteError(
                    f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite {what} (grad norm "
                    f"{norm}) and were skipped; stopping at trainer.max_nonfinite_steps={self.max_nonfinite_steps}. "
                    f"The weights are those before these steps. Lower trainer.lr, check the data and reward "
                    f"functions, then continue from the last checkpoint (resume=auto).")
        else:
            self.nonfinite_in_a_row = 0
        return {"grad_norm": norm, "lr": float(self.engine.get_lr()[0]), "skipped": float(skipped)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, tag: str) -> None:
        """DeepSpeed's checkpoint: every rank writes its shards (model, optimizer, scheduler). With
        LoRA the frozen base is left out (it is model.path's weights, rebuilt on resume): only the
        adapters, their optimizer state and a fingerprint of this rank's base shards are written."""
        client = {FROZEN_BASE_KEY: frozen_fingerprint(self.module.named_parameters())} if self.lora else {}
        with offload_buffers_set_aside(self._inner_optimizer()):  # host copies of Adam's moments: not state
            self.engine.save_checkpoint(directory, tag=tag, client_state=client, save_latest=False,
                                        exclude_frozen_parameters=self.lora)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        """Load DeepSpeed's checkpoint into this freshly built engine (ZeRO-3 needs a pristine one).
        A LoRA checkpoint lacks the base (not strict); the base this run rebuilt must be the one the
        adapters were trained on (its fingerprint), else CheckpointError on every rank."""
        load_path, client = self.engine.load_checkpoint(directory, tag=tag, load_module_strict=not self.lora,
                                                        load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} under {directory}")
        # Checkpoints written before save_checkpoint left them out hold DeepSpeed's paging buffers;
        # loaded, they land on the device, and paging would then copy Adam's moments device to device.
        drop_offload_buffers(self._inner_optimizer())
        if self.lora:
            check_frozen_base((client or {}).get(FROZEN_BASE_KEY), self.module.named_parameters(), self.cfg.model,
                              directory)
        if self.with_optimizer and self.engine.device.type == "cpu":
            replay_cpu_adam_steps(self._inner_optimizer())
        reapply_schedule(self.lr_scheduler, announce=dist.is_rank0())  # the saved rate is the checkpoint schedule's

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps of the actor besides DeepSpeed's own state."""
        return {"nonfinite_total": self.nonfinite_total, "nonfinite_in_a_row": self.nonfinite_in_a_row}

    def load_counters(self, state: dict) -> None:
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))

    # ------------------------------------------------------------------ paging (memory manager)
    def set_paged_kinds(self, kinds) -> None:
        """The paging plan's decision (colo_rl/colocate/paging_plan.py): which DeepSpeed state kinds
        leave the device for every generation phase (a LoRA base's partitions go with lp_params)."""
        self.paged_kinds = tuple(k for k in DEEPSPEED_STATE_KINDS if k in kinds) if self.pages else ()

    def offload_states(self, kinds=None) -> bool:
        """Page the planned state kinds (those of `kinds` only, when given) to host memory; a kind
        already paged is skipped. Returns whether any kind was asked for."""
        todo = [k for k in self.paged_kinds if kinds is None or k in kinds]
        if not todo:
            return False
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        frozen = bool(self.frozen_pager.tensors)
        # DeepSpeed's lp_params move fails with a frozen base: those partitions are paged here
        include = [OffloadStateTypeEnum(k) for k in todo if not (frozen and k == "lp_params")]
        if include:  # DeepSpeed first: it also frees ZeRO-3's cache of gathered parameters
            self.engine.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=self.pin_memory,
                                       non_blocking=False)
        else:
            self.engine.empty_partition_cache()
        if frozen and "lp_params" in todo:
            self.frozen_pager.page_out()
        return True

    def reload_states(self) -> bool:
        if not self.paged_kinds:
            return False
        self.engine.reload_states(non_blocking=False)
        self.frozen_pager.page_in(self.engine.device)
        return True

    def state_bytes_by_kind(self) -> dict[str, int]:
        """This rank's pageable bytes per DeepSpeed state kind (ZeRO-3 with an optimizer; else none):
        what the paging plan weighs. They add up to `state_bytes()`."""
        if not (self.with_optimizer and self.zero_stage == 3):
            return {}
        numel = sum(p.ds_tensor.numel() for p in self.module.parameters() if p.requires_grad)
        kinds = state_bytes_by_kind(numel, self.dtype, self.grad_dtype(), grad_bucket_bytes(self.engine.optimizer))
        if self.frozen_pager.tensors:  # the adapters' partitions stay; the base's are paged by frozen_pager
            kinds["lp_params"] = self.frozen_pager.nbytes()
        return kinds

    def paged_bytes(self, kinds=None) -> int:
        """Bytes the planned kinds (those of `kinds`, when given) move."""
        by_kind = self.state_bytes_by_kind()
        return sum(by_kind.get(k, 0) for k in self.paged_kinds if kinds is None or k in kinds)

    def grad_dtype(self) -> torch.dtype:
        """The dtype of ZeRO's gradient buffer (DeepSpeed's gradient-accumulation dtype)."""
        get = getattr(self.engine, "get_data_types", None)
        return get()[1] if get is not None else self.dtype

    def state_bytes(self) -> int:
        """Bytes of this rank's trainer states that paging moves (see `paged_state_bytes`): the
        trained parameters' states, ZeRO's gradient bucket (freed, re-allocated on reload), and
        the weight partitions: the trained ones through DeepSpeed, a frozen base's through
        `frozen_pager`."""
        if not self.with_optimizer:
            return 0
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if self.zero_stage == 3:
            numel = sum(p.ds_tensor.numel() for p in trainable)
            frozen = self.frozen_pager.nbytes()
            return (paged_state_bytes(numel, self.dtype, self.grad_dtype(), include_lp_params=not frozen)
                    + grad_bucket_bytes(self.engine.optimizer) + frozen)
        numel = sum(p.numel() for p in trainable)
        if self.zero_stage in (1, 2):
            numel //= max(1, dist.world_size())
        return paged_state_bytes(numel, self.dtype, self.grad_dtype(), include_lp_params=True)

    def handoff_h2d_bytes(self, names: Optional[list[str]] = None) -> int:
        """Host-to-device bytes the handoff's ZeRO-3 gathers of `names` (default: every parameter)
        copy while the weight partitions are paged out: each gathered paged partition
        (`ds_tensor.to(device)`, partition_parameters.py). Persistent parameters count too: DeepSpeed's
        offload_states releases every parameter first (empty_partition_cache -> release_and_reset_all).
        With a frozen base (LoRA) the adapters' partitions stay on the device."""
        if self.zero_stage != 3:
            return 0
        chosen = set(names) if names is not None else None
        only_frozen = bool(self.frozen_pager.tensors)
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for n, p in self.module.named_parameters()
                   if (chosen is None or n in chosen) and hasattr(p, "ds_tensor")
                   and not (only_frozen and p.requires_grad))

    def flat_weights(self):
        """(DeepSpeed's flat weight buffer, every weight as a named view of it) for the zero-copy
        handoff, or None where it does not apply (train/flat_weights.py): world size > 1, LoRA, no
        optimizer, or the buffer paged out."""
        if self.zero_stage != 3 or not self.with_optimizer or self.lora or dist.world_size() != 1:
            return None
        if "lp_params" in {getattr(s, "value", s) for s in getattr(self.engine.optimizer, "offloaded_states", ())}:
            return None
        return deepspeed_flat_weights(self.module, self.engine.optimizer)

    def _inner_optimizer(self):
        """The torch optimizer under DeepSpeed's ZeRO wrapper (whose `state` DeepSpeed pages)."""
        return getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

    # ------------------------------------------------------------------ gathering (handoff, export)
    def named_parameter_sizes(self) -> list[tuple[str, int]]:
        """HF parameter names with their full (unsharded) byte sizes, in module order."""
        out = []
        for name, p in self.module.named_parameters():
            numel = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            out.append((name, numel * p.element_size()))
        return out

    @contextlib.contextmanager
    def gathered(self, names: list[str]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full tensors for `names` on every rank (a collective under ZeRO-3: all ranks call it
        with the same names). Valid only inside the context."""
        params = dict(self.module.named_parameters())
        chosen = [params[n] for n in names]
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(chosen, modifier_rank=None):
                yield [(n, p.data) for n, p in zip(names, chosen)]
        else:
            yield [(n, p.data) for n, p in zip(names, chosen)]

    def full_state_dict_on_rank0(self) -> Optional[dict[str, torch.Tensor]]:
        """The whole model's weights on rank 0's CPU (None elsewhere); every rank must call it."""
        out: dict[str, torch.Tensor] = {}
        for bucket in plan_buckets(self.named_parameter_sizes(), 256 << 20):
            with self.gathered(bucket) as tensors:
                if dist.is_rank0():
                    for name, t in tensors:
                        out[name] = t.detach().to("cpu", copy=True)
        return out if dist.is_rank0() else None
