"""The optimizer's state at set-up and resume: what DeepSpeed 0.19 leaves undone or inexact
(why, with the measurements, in each function's docstring). Called by the actor
(colo_rl/train/actor.py); each takes DeepSpeed's objects, not the actor."""

from __future__ import annotations

import logging

import torch

from colo_rl import dist
from colo_rl.models import fp32_checkpoint_tensors

log = logging.getLogger("colo_rl")


def master_weights_from_checkpoint(engine, model_cfg) -> None:
    """A bf16 / fp16 run's fp32 master weights from the checkpoint's own fp32 values.

    Why: DeepSpeed builds the masters from the low-precision model, so each starts exactly on the
    bf16 grid, and an update reaches the weights the forward uses only once a master has drifted
    half a bf16 step from it: 2.5 % of an lr-1e-5 step after one step, 20 % after eight
    (benchmarks/bf16_update_share.py). Started from the checkpoint's fp32 values (off the grid),
    the rounding follows the update from the first step, as in a trainer that keeps fp32 weights
    under autocast (TRL, verl's FSDP). A checkpoint stored in bf16 is on the grid either way:
    nothing to do. The low-precision weights are unchanged (round(fp32) is what was loaded)."""
    from deepspeed.utils import safe_set_full_fp32_param

    trained = dict((n, p) for n, p in engine.module.named_parameters() if p.requires_grad)
    values = fp32_checkpoint_tensors(model_cfg, set(trained))
    for name, value in values.items():
        safe_set_full_fp32_param(trained[name], value.to(engine.device))
    if values and dist.is_rank0():
        log.info("fp32 master weights from the checkpoint's fp32 values (%d of %d tensors)", len(values),
                 len(trained))


def materialise_adam_states(zero, opt) -> None:
    """Create FusedAdam's moments now, as its first step would (zeros, the group's step count).

    Why: DeepSpeed 0.19's ZeRO-3 leaves them to the first `step()`, so until then the device
    holds the trainer without its largest state (2 x fp32 per weight: 3.4 GiB at 0.5B). The
    paging plan counts them and SGLang sizes its KV cache from what is free when it starts:
    measured without them, the KV cache no longer fit beside a resident trainer after the first
    step (H100, 2026-11-26: torch_memory_saver's resume ran out of memory). The step's arithmetic
    is unchanged: FusedAdam initialises exactly these values when a state is empty."""
    try:
        from deepspeed.ops.adam.fused_adam import FusedAdam
    except ImportError:
        return
    # ZeRO-3 keys the states by its flat fp32 partitions, put into their param group only
    # for the duration of a step (stage3.py _optimizer_step): the group is read by index
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    if not isinstance(opt, FusedAdam) or flats is None or getattr(zero, "offload_optimizer", False):
        return
    for i, flat in enumerate(flats):
        state = opt.state[flat]
        if len(state) == 0:
            state["step"] = opt.param_groups[zero.sub_group_to_group_id[i]].get("step", 0)
            state["exp_avg"] = torch.zeros_like(flat.data)
            state["exp_avg_sq"] = torch.zeros_like(flat.data)


def replay_cpu_adam_steps(opt) -> None:
    """Make the first step after a resume bit-identical on CPU.

    DeepSpeed's CPU FusedAdam kernel (csrc/includes/cpu_adam.h, 0.19) keeps beta^t in one
    process-wide float32 that it multiplies by beta once per step, and recomputes it with
    pow(beta, t) when the step jumps, as on the first step after a resume. The two differ in
    the last bit, and so would every update after it. Replaying steps 1..t on a one-element
    dummy tensor puts the kernel's float in exactly the state an uninterrupted run has. (The
    CUDA kernel computes the correction from t each step: nothing to do there.)"""
    try:
        from deepspeed.ops.adam.fused_adam import FusedAdam, multi_tensor_applier
    except ImportError:
        return
    if not isinstance(opt, FusedAdam):
        return
    steps = max((int(st.get("step", 0)) for st in opt.state.values()), default=0)
    group = opt.param_groups[0]
    beta1, beta2 = group["betas"]
    g, p, m, v = (torch.zeros(1) for _ in range(4))
    for t in range(1, steps + 1):
        multi_tensor_applier(opt.multi_tensor_adam, opt._dummy_overflow_buf, [[g], [p], [m], [v]], group["lr"],
                             beta1, beta2, group["eps"], t, opt.adam_w_mode,
                             1 if group["bias_correction"] else 0, group["weight_decay"])
