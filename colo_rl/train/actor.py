"""The DeepSpeed actor: ZeRO-sharded model, log-probs in micro-batches, steps, paging, gathering."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, Optional

import torch

from colo_rl import dist
from colo_rl.colocate.phase import Phase, PhaseGuard
from colo_rl.models import load_model
from colo_rl.train.batch import TokenBatch, unpack_group

log = logging.getLogger("colo_rl")


def build_ds_config(trainer_cfg, dtype: torch.dtype, with_optimizer: bool, grad_accum: int = 1) -> dict:
    """DeepSpeed config from our trainer config (one home for every DeepSpeed knob we set)."""
    on_gpu = torch.cuda.is_available()
    zero = {
        "stage": trainer_cfg.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": on_gpu,
    }
    if trainer_cfg.zero_stage == 3:
        # Small models on CPU: keep tiny params (norms) unpartitioned to save gathers.
        zero["stage3_param_persistence_threshold"] = 1e4
        zero["stage3_prefetch_bucket_size"] = 5e7
    cfg = {
        "train_micro_batch_size_per_gpu": trainer_cfg.micro_batch_size,
        "gradient_accumulation_steps": max(1, grad_accum),
        "gradient_clipping": trainer_cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if with_optimizer:
        # "AdamW" resolves to DeepSpeed's FusedAdam, which offload_states/reload_states need.
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": trainer_cfg.lr, "betas": list(trainer_cfg.betas), "eps": 1e-8,
                       "weight_decay": trainer_cfg.weight_decay},
        }
    return cfg


def lr_lambda(trainer_cfg, total_steps: int):
    """Linear warm-up to lr, then constant or cosine decay to lr * min_lr_ratio."""
    warm = trainer_cfg.warmup_steps

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / (warm + 1)
        if trainer_cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total_steps - warm))
        return trainer_cfg.min_lr_ratio + (1 - trainer_cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class DeepSpeedActor:
    """A causal LM under DeepSpeed. With `with_optimizer=False` it is a frozen reference model
    (ZeRO-3 inference engine, no optimizer states)."""

    def __init__(self, cfg, dtype: torch.dtype, total_steps: int, grad_accum: int = 1,
                 with_optimizer: bool = True, guard: Optional[PhaseGuard] = None):
        import deepspeed

        self.cfg = cfg
        self.dtype = dtype
        self.guard = guard
        self.zero_stage = cfg.trainer.zero_stage
        self.with_optimizer = with_optimizer
        model = load_model(cfg.model, dtype, seed=cfg.trainer.seed)
        if cfg.model.gradient_checkpointing and with_optimizer:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not with_optimizer:
            model.requires_grad_(False)
        self.config = model.config
        ds_config = build_ds_config(cfg.trainer, dtype, with_optimizer, grad_accum)
        kwargs = {}
        if with_optimizer:
            kwargs["model_parameters"] = [p for p in model.parameters() if p.requires_grad]
            sched = lr_lambda(cfg.trainer, total_steps)
            kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, sched)
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=model, config=ds_config, **kwargs)
        if with_optimizer:
            self.engine.train()
        else:
            self.engine.eval()
        self.module = self.engine.module

    # ------------------------------------------------------------------ forward
    def response_logprobs(self, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False,
                          grad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """log pi(response tokens) [B, R] (float32) and optionally the entropy per position."""
        if self.guard is not None:
            self.guard.require(Phase.UPDATE, "trainer forward")
        from colo_rl.algos import entropy_from_logits, logprobs_from_logits

        batch = batch.to(self.engine.device)
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            packed = batch.logit_positions is not None
            out = self.engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False,
                              logits_to_keep=batch.logit_positions if packed else batch.response_len + 1)
            if packed:  # one group-packed row -> [G, R, V] in the padded layout
                logits = unpack_group(out.logits[0], batch.packed_lengths, batch.response_len)
            else:
                logits = out.logits[:, :-1]  # position P-1+j predicts response token j
            logp = logprobs_from_logits(logits, batch.response_ids, temperature)
            entropy = None
            if with_entropy:
                with torch.no_grad():
                    entropy = entropy_from_logits(logits.detach() / temperature)
        return logp, entropy

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Accumulate gradients; `loss` is already normalised by the global token / sequence count,
        so DeepSpeed must not divide again by its accumulation steps."""
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        # ZeRO averages gradients over data-parallel ranks; our loss is a share of a global sum.
        self.engine.backward(loss * dist.world_size(), scale_wrt_gas=False)

    def step(self) -> dict[str, float]:
        """Optimizer step at the accumulation boundary; returns grad norm and lr."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return {"grad_norm": norm, "lr": float(self.engine.get_lr()[0])}

    @property
    def global_step(self) -> int:
        return int(self.engine.global_steps)

    # ------------------------------------------------------------------ paging (memory manager)
    def offload_states(self, pin_memory: bool = True) -> bool:
        """Page optimizer state, master weights and gradient buffers to host memory (GPU only).
        Returns whether anything moved."""
        if not (self.with_optimizer and torch.cuda.is_available() and self.zero_stage == 3):
            return False
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

        self.engine.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=pin_memory, non_blocking=False)
        return True

    def reload_states(self) -> bool:
        if not (self.with_optimizer and torch.cuda.is_available() and self.zero_stage == 3):
            return False
        self.engine.reload_states(non_blocking=False)
        return True

    def state_bytes(self) -> int:
        """Bytes of this rank's trainer states that paging moves: fp32 master weights and Adam's
        two moments for the local partition, the low-precision copy when training in bf16, and
        the gradient buffer."""
        if not self.with_optimizer:
            return 0
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        if self.zero_stage == 3:
            numel = sum(p.ds_tensor.numel() for p in trainable)
        else:
            numel = sum(p.numel() for p in trainable)
            if self.zero_stage in (1, 2):
                numel //= max(1, dist.world_size())
        lp = 2 if self.dtype == torch.bfloat16 else 0
        return numel * (4 + 4 + 4 + lp + 4)

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
        from colo_rl.colocate.handoff import plan_buckets

        out: dict[str, torch.Tensor] = {}
        for bucket in plan_buckets(self.named_parameter_sizes(), 256 << 20):
            with self.gathered(bucket) as tensors:
                if dist.is_rank0():
                    for name, t in tensors:
                        out[name] = t.detach().to("cpu", copy=True)
        return out if dist.is_rank0() else None
