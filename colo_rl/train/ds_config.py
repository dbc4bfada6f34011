"""The actor's DeepSpeed set-up: its config from ours, the learning-rate schedule, and what paging
its states between phases needs and moves (DeepSpeed 0.19.8, source read)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Optional

import torch

from colo_rl import dist
from colo_rl.errors import ConfigError
from colo_rl.phase import PhaseGuard

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
        "train_micro_batch_size_per_gpu": max(1, trainer_cfg.micro_batch_size),
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


def decoder_layer_classes(model: torch.nn.Module) -> list[str]:
    """The class names of `model`'s repeated blocks (HF's `_no_split_modules`, e.g.
    ["LlamaDecoderLayer"]; found on the model or, under a PEFT wrapper, on the module it wraps)."""
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return [str(n) for n in names]
    return []


def set_zero3_leaf_modules(ds_config: dict, model: torch.nn.Module) -> list[str]:
    """ZeRO-3 fetches, releases and hooks each decoder layer as one unit (DeepSpeed's leaf modules,
    `zero_optimization.leaf_module`, applied at engine.py:2076 in 0.19.8) instead of every
    submodule: a layer's ~9 linear/norm modules cost one pre/post-forward and one pre/post-backward
    hook, not nine of each. Gradients are unchanged (tests/test_update_overhead.py); the gathered
    working set grows from one linear to one layer, which partitioning over ranks still bounds.
    DeepSpeed's default leaf classes (MoE blocks) are kept. Returns the classes set ([] = none found:
    the config is left as it is)."""
    classes = decoder_layer_classes(model)
    if classes and ds_config["zero_optimization"].get("stage") == 3:
        from deepspeed.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES

        ds_config["zero_optimization"]["leaf_module"] = {"classes": list(DEFAULT_LEAF_MODULE_CLASSES) + classes}
        return classes
    return []


# ZeRO-3's memory-efficient linear (trainer.zero_memory_efficient_linear=auto) is turned off where
# autograd's own linear would keep at most this many more bytes per rank.
HELD_WEIGHTS_LIMIT = 1 << 30


def held_weight_bytes(model: torch.nn.Module, world_size: int, dtype_bytes: int) -> int:
    """What autograd's own linear keeps alive under ZeRO-3, per rank, from a layer's forward to its
    backward: its saved `weight.t()` views hold the gathered weights, which ZeRO-3 would otherwise
    release after the forward. That is every linear weight (the tied LM head counted once) less this
    rank's partition of it: nothing at world size 1, where a gathered weight is its partition."""
    weights = {id(m.weight): getattr(m.weight, "ds_numel", m.weight.numel())  # ds_numel: once partitioned
               for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(weights.values()) * dtype_bytes * (world_size - 1) // max(1, world_size)


def set_zero3_linear(ds_config: dict, mode: str, held_bytes: int) -> Optional[bool]:
    """zero_optimization.memory_efficient_linear from trainer.zero_memory_efficient_linear.

    DeepSpeed's memory-efficient linear (its default) replaces torch.nn.functional.linear, process
    wide, by LinearFunctionForZeroStage3: a Python autograd function that saves the weight
    Parameter, not a view of its gathered data, so ZeRO-3 can release the weight after the forward
    and gather it again for the backward. It costs two Python calls per linear per micro-batch
    (~12 % of a micro-batch's host time at SmolLM2's depth on CPU, docs/update_overhead.md). auto turns
    it off where the memory it saves (`held_bytes`, from `held_weight_bytes`) is at most
    HELD_WEIGHTS_LIMIT. Off also undoes DeepSpeed's replacement if an earlier engine of this process
    made it: the replacement is global, and the actor and its reference choose alike (same model,
    same world). Returns the setting (None: not ZeRO-3, left alone)."""
    if ds_config["zero_optimization"].get("stage") != 3:
        return None
    efficient = mode == "on" or (mode == "auto" and held_bytes > HELD_WEIGHTS_LIMIT)
    ds_config["zero_optimization"]["memory_efficient_linear"] = efficient
    if not efficient:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

        original = getattr(patcher, "linear_bk", None)  # what DeepSpeed replaced, if it did
        if original is not None and torch.nn.functional.linear is not original:
            torch.nn.functional.linear = original
    return efficient


def set_zero3_hooks(ds_config: dict, model: torch.nn.Module, trainer_cfg, lora: bool, dtype: torch.dtype,
                    announce: bool) -> tuple[list[str], Optional[bool]]:
    """ZeRO-3's per-module host cost as the config chooses it: leaf modules per decoder layer
    (trainer.zero_leaf_modules, `set_zero3_leaf_modules`) and the linear
    (trainer.zero_memory_efficient_linear, `set_zero3_linear`). Leaf modules stay off with LoRA
    adapters: DeepSpeed 0.19.8's leaf-module backward met an adapter's size-0 partition
    (tests/test_lora_sft_dpo.py, tests/test_paging.py[lora]; colocate/NOTES.md). `announce`: log
    what differs from the option's word (rank 0 of a trained model). Returns (leaf classes, linear
    setting)."""
    leaf = trainer_cfg.zero_leaf_modules and not lora
    if trainer_cfg.zero_leaf_modules and lora and announce:
        log.info("ZeRO-3 leaf modules off: LoRA adapters are trained (model.lora.rank > 0)")
    classes = set_zero3_leaf_modules(ds_config, model) if leaf else []
    held = held_weight_bytes(model, dist.world_size(), torch.finfo(dtype).bits // 8)
    efficient = set_zero3_linear(ds_config, trainer_cfg.zero_memory_efficient_linear, held)
    if efficient is False and announce:
        log.info("ZeRO-3 linear: autograd's own (trainer.zero_memory_efficient_linear=%s; it keeps %.2f GiB more "
                 "per rank from forward to backward)", trainer_cfg.zero_memory_efficient_linear, held / 2**30)
    return classes, efficient


# DeepSpeed optimizer types that resolve to its FusedAdam (the only optimizer whose ZeRO-3 states
# `engine.offload_states` can move, DeepSpeed 0.19: stage3.py asserts it).
_FUSED_ADAM_TYPES = ("adam", "adamw")


def check_pageable(zero_stage: int, ds_config: dict) -> None:
    """Raise ConfigError when DeepSpeed cannot page this trainer's states to the host, which the
    colocated GPU loop does twice a step. DeepSpeed 0.19.8 (source read): stage 0 optimizers have
    no `offload_states`; ZeRO-3's requires FusedAdam; states under ZeRO offload cannot be moved.
    colo_rl pages ZeRO-3 only, so stages 1/2 are refused too, with what to use instead."""
    optimizer = ds_config.get("optimizer") or {}
    opt_type = str(optimizer.get("type", "<none>"))
    params = optimizer.get("params", {})
    zero = ds_config.get("zero_optimization", {})
    if zero_stage == 0:
        raise ConfigError(
            "trainer.zero_stage=0 cannot be paged: DeepSpeed has no offload_states for stage-0 optimizers, so "
            "the trainer's weights, gradients and Adam states would stay on the GPU while the rollout engine "
            "runs. Use trainer.zero_stage=3 for colocated training on GPU.")
    if zero_stage in (1, 2):
        raise ConfigError(
            f"trainer.zero_stage={zero_stage} is not paged by colo_rl (it moves ZeRO-3 states only), so the "
            "trainer's states would stay on the GPU while the rollout engine runs. Use trainer.zero_stage=3 "
            "for colocated training on GPU.")
    if opt_type.lower() not in _FUSED_ADAM_TYPES or params.get("torch_adam") or params.get("adam_w_mode") is False:
        raise ConfigError(
            f"trainer.zero_stage=3 with optimizer {opt_type!r}{' (torch_adam)' if params.get('torch_adam') else ''} "
            "cannot be paged: DeepSpeed 0.19's offload_states moves ZeRO-3 optimizer states only for its "
            "FusedAdam. Use the optimizer type 'AdamW' (or 'Adam') without torch_adam.")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            raise ConfigError(
                f"zero_optimization.{key}.device={device!r} cannot be combined with paging: DeepSpeed refuses "
                "to move states that ZeRO offload already manages. Drop the ZeRO offload setting; colo_rl pages "
                "the trainer's states itself between phases.")


def announce_op_build(name: str, what: str) -> bool:
    """Log a line before a JIT op build that would otherwise be minutes of silence (`make install`
    prebuilds them into the venv's TORCH_EXTENSIONS_DIR): a first build, or a rebuild that ninja
    (`ninja -n`, the ninja torch will run) says is due. Returns whether a build is coming."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return False
    built = sorted(Path(root).glob(f"{name}*/*.so"))
    if built and not ninja_has_work(built[0].parent):
        return False
    if dist.is_rank0():
        log.info("%s %s into %s (%s; a minute or more on a small CPU)", "rebuilding" if built else "building",
                 what, built[0].parent if built else root,
                 "ninja finds it out of date" if built else "once per environment")
    return True


def ninja_has_work(build_dir: Path) -> bool:
    """Whether the `ninja` on PATH would rebuild anything in `build_dir` (a dry run: nothing is written)."""
    ninja = shutil.which("ninja")
    if ninja is None or not (build_dir / "build.ninja").is_file():
        return False
    try:
        out = subprocess.run([ninja, "-n", "-C", str(build_dir)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "no work to do" not in out.stdout


def paging_needed(with_optimizer: bool, guard: Optional[PhaseGuard], mode: str = "auto",
                  budget_given: bool = False) -> bool:
    """Whether a trainer may page its states out for every generation phase: only a colocated
    (guarded) one, and then always (on), never (off), or (auto) where there is device memory to plan
    against: on a GPU, or with colocate.device_memory_gib set. Which states auto really pages is
    the paging plan's decision (colo_rl/colocate/paging_plan.py, applied by `set_paged_kinds`)."""
    if not (with_optimizer and guard is not None) or mode == "off":
        return False
    return mode == "on" or budget_given or torch.cuda.is_available()


# DeepSpeed's ZeRO-3 state kinds (OffloadStateTypeEnum values) in the order the paging plan pages them.
DEEPSPEED_STATE_KINDS = ("contiguous_grad_buffer", "optim_states", "hp_params", "lp_grads", "lp_params")


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


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether `model` drops anything in training mode: a Dropout module with p > 0, or a config
    rate (HF: attention_dropout, hidden_dropout, resid_pdrop, ...) above 0. Llama, Qwen, SmolLM2: no."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(("dropout" in k or k.endswith("_pdrop")) and isinstance(v, (int, float)) and not isinstance(v, bool)
               and v > 0 for k, v in fields.items())


@contextlib.contextmanager
def without_dropout(model: torch.nn.Module, active: bool) -> Iterator[None]:
    """`model` in eval mode inside (`active`: a training model that drops anything), back to
    training after: no-grad scoring (old / reference log-probs, held-out losses) without noise."""
    if not active:
        yield
        return
    model.train(False)
    try:
        yield
    finally:
        model.train(True)


def reapply_schedule(scheduler, announce: bool) -> None:
    """After a checkpoint's load: `schedule_rates`, and a warning (`announce`: rank 0) where this
    run's schedule differs from the checkpoint's."""
    rates = schedule_rates(scheduler)
    if announce and rates and rates[0] != rates[1]:
        log.warning("resume: the learning-rate schedule differs from the checkpoint's (trainer.total_steps, epochs, "
                    "max_steps, warmup_steps or lr_schedule changed): lr %.4g -> %.4g from this step, on this run's "
                    "schedule", *rates)


def schedule_rates(scheduler) -> Optional[tuple[float, float]]:
    """After a checkpoint's load: set the optimizer's rate from `scheduler`'s (a LambdaLR of
    `lr_lambda`) own function at its restored position, and return (the saved rate, this one).
    They differ when the run's length, warm-up or schedule changed; the same config gives the same
    float (LambdaLR's formula). None without a LambdaLR."""
    if scheduler is None or not hasattr(scheduler, "lr_lambdas"):
        return None
    groups = scheduler.optimizer.param_groups
    saved = groups[0]["lr"]
    for group, base, fn in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]
    return saved, groups[0]["lr"]


def paged_state_bytes(numel: int, param_dtype: torch.dtype, grad_dtype: torch.dtype, include_lp_params: bool) -> int:
    """Bytes `offload_states` moves for `numel` local parameter elements under ZeRO-3 + FusedAdam
    (DeepSpeed 0.19.8, stage3.py): fp32 master weights and Adam's two fp32 moments; the gradient
    partitions, whose flat buffer has the gradient-accumulation dtype (stage3.py:791, which defaults
    to the model dtype: engine.py get_data_types); the low-precision params when paged, except in
    fp32, where the master weights are the params themselves (stage3.py:1162-1167)."""
    size = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
    lp = size(param_dtype) if include_lp_params and param_dtype != torch.float32 else 0
    return numel * (4 + 4 + 4 + lp + size(grad_dtype))


def state_bytes_by_kind(numel: int, param_dtype: torch.dtype, grad_dtype: torch.dtype, bucket_bytes: int = 0,
                       frozen_base_bytes: int = 0) -> dict[str, int]:
    """`paged_state_bytes` split by DeepSpeed's state kind (OffloadStateTypeEnum values), for the
    paging plan: Adam's moments, fp32 master weights, the weight partitions (a LoRA base's, paged by
    colo_rl, included), the gradient partitions and ZeRO's gradient bucket."""
    size = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
    lp = size(param_dtype) if param_dtype != torch.float32 else 0
    return {"optim_states": 8 * numel, "hp_params": 4 * numel, "lp_params": lp * numel + frozen_base_bytes,
            "lp_grads": size(grad_dtype) * numel, "contiguous_grad_buffer": int(bucket_bytes)}


# DeepSpeed's default gradient bucket, in elements (stage3.py's reduce_bucket_size): ZeRO allocates it
# whole on the device for the update phase (`torch.empty(reduce_bucket_size)` per gradient dtype),
# whatever the model's size: 0.93 GiB in bf16.
DEEPSPEED_REDUCE_BUCKET = 500_000_000


def fit_grad_bucket(ds_config: dict, trainable_numel: int) -> None:
    """Cap ZeRO's gradient bucket at the trained parameters' element count. Reduction is unchanged
    (a bucket that large already never filled before the end of the backward pass); a small model
    stops holding most of a GiB of bucket on the device through every update phase."""
    ds_config["zero_optimization"]["reduce_bucket_size"] = int(max(1, min(DEEPSPEED_REDUCE_BUCKET, trainable_numel)))


def grad_bucket_bytes(zero_optimizer) -> int:
    """Bytes of ZeRO-3's contiguous gradient buckets (one per gradient dtype), which paging frees
    (`contiguous_grad_buffer`) and reloading allocates again."""
    if not getattr(zero_optimizer, "contiguous_gradients", False):
        return 0
    size = int(getattr(zero_optimizer, "reduce_bucket_size", 0))
    dtypes = getattr(zero_optimizer, "ipg_buckets", {})
    return sum(size * torch.empty((), dtype=dtype).element_size() for dtype in dtypes)


# DeepSpeed pages Adam's moments into host buffers kept in the optimizer's own state, under these
# keys (runtime/utils.py offload_adam_states: `f"{key}_offload_buffer"`), and reuses them if present.
_OFFLOAD_BUFFER_SUFFIX = "_offload_buffer"


def drop_offload_buffers(optimizer) -> dict:
    """Remove DeepSpeed's paging buffers from `optimizer.state`; returns them ({param: {key: tensor}}).

    They are not optimizer state: saved, they double the optimizer checkpoint; loaded, torch's
    Optimizer.load_state_dict puts them on the parameters' device, and DeepSpeed, finding them,
    would then "page" Adam's moments device to device, freeing nothing."""
    dropped: dict = {}
    for param, state in getattr(optimizer, "state", {}).items():
        keys = [k for k in state if isinstance(k, str) and k.endswith(_OFFLOAD_BUFFER_SUFFIX)]
        if keys:
            dropped[param] = {k: state.pop(k) for k in keys}
    return dropped


@contextlib.contextmanager
def offload_buffers_set_aside(optimizer) -> Iterator[None]:
    """Without the paging buffers for the duration (a checkpoint save); back afterwards, so the
    next page-out reuses its pinned host memory."""
    dropped = drop_offload_buffers(optimizer)
    try:
        yield
    finally:
        for param, buffers in dropped.items():
            optimizer.state[param].update(buffers)
