"""Run under torchrun (2 gloo ranks, real DeepSpeed ZeRO-3): what tests/test_update_overhead.py
asserts about the update's host-side costs.

- "leaf": the same two steps with trainer.zero_leaf_modules off (per-submodule ZeRO-3 hooks, the
  configuration before the option) and on (decoder layers as DeepSpeed leaf modules), and on with
  the paging path (offload_states / reload_states around every step, as the GPU loop runs it):
  the trained weights of each, and how many modules DeepSpeed treats as leaves.
- "fused_head": the first micro-batches' log-probs, entropies and full gradients, and the weights
  after one step, with the LM head's chunked log-softmax (train/lm_head.py, the default) and with
  the whole-logits path, ZeRO-3 partitioning the tied head / embedding over the ranks.
- "linear": the same two steps with trainer.zero_memory_efficient_linear on (DeepSpeed's ZeRO-3
  linear), off (autograd's) and auto: gradients, weights, which F.linear ran, and the bytes of the
  storages autograd keeps after the first forward.
- "checkpointing": the same two steps with and without model.gradient_checkpointing, and how often
  the first layer's MLP ran.
- "compile": the same two steps with and without model.compile (decoder layers through
  torch.compile), plain and with gradient checkpointing; log-probs without gradients at the
  initial weights; dynamo's tallies (compilations, graph breaks) over the steps and over a
  forward of another length.
- "reads": GRPORecipe.update on one rollout batch split into 1, 2 and 4 micro-batches, packed and
  padded, with every tensor past `actor.to_device` standing for device memory: a host read of it
  (item / bool / float / int / tolist / cpu / numpy / .to("cpu")) is what synchronises with a GPU,
  and is counted (torch.cuda.set_sync_debug_mode's job, emulated on the CPU), and so is an
  operation mixing such a tensor with a host one.
- "off_policy_reads": the same with two optimizer steps (the old log-probs' pass first), in 2 and
  4 micro-batches.
- "offline_reads": the same counts for one SFT step (recipes/sft.py sft_step) and one DPO step
  (recipes/dpo.py dpo_step, cached reference log-probs), packed and padded, in 1, 2 and 4
  micro-batches; and for DPO's pass of sequence log-probs (train/offline.pair_logps).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import sys
import types
from pathlib import Path

import torch

from colo_rl import dist, process_exit
from colo_rl.algos import AdaptiveKLController
from colo_rl.config import ModelConfig, RunConfig
from colo_rl.metrics import Timer
from colo_rl.samples import Rollout
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.offline import pair_logps, pair_micro_batches, sft_micro_batches
from worker_support import (DeviceTensor, load_recipe, load_recipe_module, on_device, plain, scripted_batch,
                            scripted_offline_data, scripted_rollout)

TINY = dict(random_init=True, hidden_size=64, num_layers=3, dtype="fp32")


def tiny_cfg(**trainer) -> RunConfig:
    cfg = RunConfig(model=ModelConfig(**TINY))
    cfg.trainer.lr = 1e-2  # large steps: a wrong gradient shows in the weights
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two dicts of same-named tensors (0 when empty)."""
    return max(float((a[k] - b[k]).abs().max()) for k in a) if a else 0.0


def mean_diff(a: dict, b: dict) -> float:
    """The mean absolute difference over every element of two dicts of same-named tensors."""
    total = sum(float((a[k] - b[k]).abs().sum()) for k in a)
    return total / max(1, sum(a[k].numel() for k in a))


@functools.cache
def initial_weights() -> dict:
    """The tiny model's weights before any step (rank 0; {} elsewhere): what every report measures
    a step's change from, built once per process."""
    return DeepSpeedActor(tiny_cfg(), torch.float32, total_steps=4).full_state_dict_on_rank0() or {}


def full_grads(actor) -> dict:
    """Every parameter's whole fp32 gradient after the accumulation boundary's backward (a
    collective under ZeRO-3: every rank, same order)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().clone() for n, p in actor.module.named_parameters()}


def two_steps(actor, paged: bool = False, saved: list | None = None) -> tuple[dict, dict]:
    """Two optimizer steps of two micro-batches each (gradient accumulation across leaf-module
    fetches): the first step's full gradients and the weights after both. paged: DeepSpeed's
    offload_states / reload_states before each step, as colocate.paging=on on a GPU. saved: gets
    the tensors autograd saves in the first forward."""
    actor.pages = paged
    for step in range(2):
        if paged:
            actor.offload_states()
            actor.reload_states()
        for j in range(2):
            b = scripted_batch(2 * step + j)
            keep = saved if step == j == 0 and saved is not None else None
            hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: keep.append(t) or t, lambda t: t)
                     if keep is not None else contextlib.nullcontext())
            with hooks:
                lp, _ = actor.response_logprobs(b)
            actor.backward(-(lp * b.response_mask).sum() / (16.0 * dist.world_size()), last_micro_batch=j == 1)
        if step == 0:
            grads = full_grads(actor)
        actor.step()
    return grads, actor.full_state_dict_on_rank0() or {}


def trained_weights(leaf: bool, paged: bool) -> tuple[dict, int, dict]:
    actor = DeepSpeedActor(tiny_cfg(zero_leaf_modules=leaf), torch.float32, total_steps=4, grad_accum=2)
    from deepspeed.utils.z3_leaf_module import get_z3_leaf_modules

    leaves = len(get_z3_leaf_modules(actor.module))
    grads, weights = two_steps(actor, paged=paged)
    return weights, leaves, grads


def leaf_report() -> dict:
    base, base_leaves, base_grads = trained_weights(leaf=False, paged=False)
    leaf, leaves, leaf_grads = trained_weights(leaf=True, paged=False)
    paged, _, _ = trained_weights(leaf=True, paged=True)
    init = initial_weights()
    return {"leaf_modules_off": base_leaves, "leaf_modules_on": leaves, "layers": TINY["num_layers"],
            "max_diff_leaf_vs_off": max_diff(leaf, base), "max_diff_paged_vs_leaf": max_diff(paged, leaf),
            "max_change_from_init": max_diff(base, init), "names_equal": sorted(base) == sorted(leaf) == sorted(paged),
            "grad_max_diff": max_diff(leaf_grads, base_grads),
            "grad_max_abs": max(float(g.abs().max()) for g in base_grads.values())}


# ---------------------------------------------------------------------------------------- ZeRO-3 linear
def saved_storage_bytes(saved: list) -> int:
    """The bytes of the distinct storages behind autograd's saved tensors, read after the steps:
    what a released weight's Parameter holds then is its empty placeholder."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())


def trained_with_linear(mode: str) -> dict:
    """two_steps with trainer.zero_memory_efficient_linear=`mode`, and which
    torch.nn.functional.linear ran."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from colo_rl.train.ds_config import held_weight_bytes

    actor = DeepSpeedActor(tiny_cfg(zero_memory_efficient_linear=mode), torch.float32, total_steps=4, grad_accum=2)
    out = {"setting": actor.memory_efficient_linear,
           "deepspeed_linear": torch.nn.functional.linear is zero3_linear_wrap,
           "held_bytes": held_weight_bytes(actor.module, dist.world_size(), 4)}
    saved = []
    out["grads"], out["weights"] = two_steps(actor, saved=saved)
    out["saved_bytes"] = saved_storage_bytes(saved)
    return out


def linear_report() -> dict:
    """trainer.zero_memory_efficient_linear on (DeepSpeed's linear) against off (autograd's), and
    auto (this tiny model keeps ~6 MB: off), in that order: off after on must undo DeepSpeed's
    process-wide replacement of F.linear."""
    on, off, auto = (trained_with_linear(m) for m in ("on", "off", "auto"))
    return {"settings": [on["setting"], off["setting"], auto["setting"]],
            "deepspeed_linear": [on["deepspeed_linear"], off["deepspeed_linear"], auto["deepspeed_linear"]],
            "saved_bytes_on": on["saved_bytes"], "saved_bytes_off": off["saved_bytes"],
            "held_bytes": off["held_bytes"], "world_size": dist.world_size(),
            "grad_max_diff": max_diff(off["grads"], on["grads"]),
            "grad_max_abs": max(float(g.abs().max()) for g in on["grads"].values()),
            "weights_max_diff": max_diff(off["weights"], on["weights"]),
            "weights_auto_vs_off": max_diff(auto["weights"], off["weights"])}


# ---------------------------------------------------------------------------------------- checkpointing
def trained_checkpointed(checkpointing: bool) -> dict:
    """Two steps of two micro-batches with model.gradient_checkpointing (non-reentrant: each decoder
    layer's forward is recomputed in the backward, where ZeRO-3's hooks fetch and release it again)."""
    cfg = tiny_cfg()
    cfg.model.gradient_checkpointing = checkpointing
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=4, grad_accum=2)
    calls = []  # the first decoder layer's MLP forwards: twice per micro-batch when recomputed
    actor.module.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    grads, weights = two_steps(actor)
    return {"on": bool(actor.module.is_gradient_checkpointing), "layer_forwards": len(calls), "grads": grads,
            "weights": weights}


def checkpointing_report() -> dict:
    plain, ckpt = trained_checkpointed(False), trained_checkpointed(True)
    return {"on": [plain["on"], ckpt["on"]], "layer_forwards": [plain["layer_forwards"], ckpt["layer_forwards"]],
            "grad_max_diff": max_diff(ckpt["grads"], plain["grads"]),
            "grad_max_abs": max(float(g.abs().max()) for g in plain["grads"].values()),
            "weights_max_diff": max_diff(ckpt["weights"], plain["weights"])}


# ---------------------------------------------------------------------------------------- model.compile
def dynamo_counts() -> dict:
    """torch.compile's process-wide tallies: frames compiled (each compilation or recompilation),
    graphs, graph breaks."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "breaks": int(sum(counters["graph_break"].values()))}


def trained_compiled(compiled: bool, checkpointing: bool = False) -> dict:
    """With model.compile (and model.gradient_checkpointing): the log-probs of a batch without
    gradients, then two_steps, then a forward with gradients of a batch of another length (which
    must not compile again: lengths are symbolic)."""
    from colo_rl.train.batch import build_batch

    cfg = tiny_cfg()
    cfg.model.compile, cfg.model.gradient_checkpointing = compiled, checkpointing
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=4, grad_accum=2)
    logp, _ = actor.response_logprobs(scripted_batch(9), grad=False)  # the initial weights: comparable
    before = dynamo_counts()
    grads, weights = two_steps(actor)
    after_steps = dynamo_counts()
    g = torch.Generator().manual_seed(50 + dist.rank())
    other = build_batch(torch.randint(3, 400, (3, 9), generator=g).tolist(),
                        torch.randint(3, 400, (3, 7), generator=g).tolist(), pad_id=0)
    actor.response_logprobs(other)
    after = dynamo_counts()
    return {"grads": grads, "weights": weights, "logp": logp.detach().clone(),
            "compiled_forwards": sum(hasattr(layer.forward, "_torchdynamo_orig_callable")  # torch.compile's wrapper
                                     for layer in actor.module.model.layers),
            "steps": {k: after_steps[k] - before[k] for k in before}, "other_length": {k: after[k] - after_steps[k]
                                                                                      for k in before}}


def compile_report() -> dict:
    eager, comp = trained_compiled(False), trained_compiled(True)
    ckpt_eager, ckpt_comp = trained_compiled(False, True), trained_compiled(True, True)
    init = initial_weights()
    return {"compiled_forwards": [eager["compiled_forwards"], comp["compiled_forwards"]], "layers": TINY["num_layers"],
            "eager_dynamo": eager["steps"], "steps_dynamo": comp["steps"], "other_length_dynamo": comp["other_length"],
            "grad_max_diff": max_diff(comp["grads"], eager["grads"]),
            "grad_max_abs": max(float(g.abs().max()) for g in eager["grads"].values()),
            "weights_max_diff": max_diff(comp["weights"], eager["weights"]),
            "weights_mean_diff": mean_diff(comp["weights"], eager["weights"]),
            "mean_change_from_init": mean_diff(eager["weights"], init),
            "max_change_from_init": max_diff(eager["weights"], init),
            "no_grad_logp_max_diff": float((comp["logp"] - eager["logp"]).abs().max()),
            "checkpointed_grad_max_diff": max_diff(ckpt_comp["grads"], ckpt_eager["grads"]),
            "checkpointed_weights_max_diff": max_diff(ckpt_comp["weights"], ckpt_eager["weights"]),
            "checkpointed_breaks": ckpt_comp["steps"]["breaks"]}


# ---------------------------------------------------------------------------------------- host reads
def instrument(actor: DeepSpeedActor) -> None:
    """What crosses to the device becomes a DeviceTensor; the engine itself sees plain tensors
    (DeepSpeed's own synchronisations are not the recipe's)."""
    to_device, logprobs, engine_backward = actor.to_device, actor.response_logprobs, actor.engine.backward
    actor.to_device = lambda b: to_device(b).apply(on_device)
    actor.response_logprobs = lambda b, *a, **k: tuple(
        None if t is None else on_device(t) for t in logprobs(b.apply(plain), *a, **k))
    actor.engine.backward = lambda loss, **k: engine_backward(plain(loss), **k)


def rollout_of(G: int, groups: int) -> Rollout:
    """`groups` prompt groups of G scripted completions (random tokens and rewards, log-probs -1)."""
    g = torch.Generator().manual_seed(7 + dist.rank())
    parts = []
    for _ in range(groups):
        prompt = torch.randint(3, 400, (5,), generator=g).tolist()
        parts.append((prompt, [torch.randint(3, 400, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
                               for _ in range(G)]))
    return scripted_rollout(parts, torch.randint(0, 2, (groups * G,), generator=g).float().tolist(), -1.0)


def update_reads(packing: bool, micro_batch_size: int, mini_batches: int = 1) -> dict:
    """Device reads in one update split into micro-batches of at most `micro_batch_size` sequences
    (`mini_batches` optimizer steps: the old log-probs' pass first)."""
    G, groups = 4, 4
    cfg = tiny_cfg(packing=packing, micro_batch_size=micro_batch_size, mini_batches_per_step=mini_batches)
    cfg.trainer.micro_batch_tokens = "100000"  # the sequence cap decides the split
    cfg.rollout.group_size, cfg.rollout.prompts_per_step = G, groups * dist.world_size()
    cfg.colocate.handoff_check_max_mean_abs = None
    cls = load_recipe()
    recipe = cls.__new__(cls)  # the attributes update() reads, without __init__'s engine
    recipe.cfg, recipe.timer = cfg, Timer()
    recipe.tokenizer = types.SimpleNamespace(pad_token_id=0)
    recipe.kl_ctl = AdaptiveKLController(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=4)
    instrument(actor)
    recipe.colo = types.SimpleNamespace(actor=actor, ref=None)
    rollout = rollout_of(G, groups)
    recipe.update(copy.deepcopy(rollout))  # warm-up (DeepSpeed's first step builds its buffers)
    counted = counted_run(lambda: recipe.update(copy.deepcopy(rollout)))
    out = counted.pop("out")
    return {**counted, "micro_batches": int(out["train/micro_batches"]), "loss": out["train/loss"],
            "entropy": out.get("train/entropy"), "logprob_diff": out["handoff/logprob_diff_mean"]}


def counted_run(run) -> dict:
    """`run()`'s result, with the device reads and mixed host / device operations it made."""
    DeviceTensor.reads.clear()
    DeviceTensor.mixed.clear()
    out = run()
    return {"out": out, "reads": list(DeviceTensor.reads), "mixed": list(DeviceTensor.mixed)}


def offline_reads(recipe: str, packing: bool, micro_batch_size: int) -> dict:
    """Device reads in one SFT / DPO step (recipes/sft.py sft_step, recipes/dpo.py dpo_step with the
    cached reference log-probs) on 4 examples or pairs per rank, micro-batches of at most
    `micro_batch_size` of them."""
    examples, pairs, cached = scripted_offline_data(11 + dist.rank(), ref_slots=8)  # cached: by pair index 2 i
    cfg = tiny_cfg(packing=packing, micro_batch_size=micro_batch_size, batch_size=4 * dist.world_size())
    cfg.trainer.micro_batch_tokens = "100000"  # the count cap decides the split
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=4)
    instrument(actor)
    module = load_recipe_module(recipe)
    if recipe == "sft":
        def step():  # packed rows of at most 16 tokens: 3 rows of these examples
            batches = sft_micro_batches(examples, micro_batch_size, 0, packing, max_len=16,
                                        budget=actor.micro_batch_tokens())
            return len(batches), module.sft_step(actor, batches, 0, examples)
    else:
        def step():
            n = len(pair_micro_batches(pairs, micro_batch_size, 0, packing, budget=actor.micro_batch_tokens()))
            return n, module.dpo_step(cfg, actor, None, pairs, [2 * i for i in range(4)], cached, 0, False,
                                      torch.float32)
    step()  # warm-up (DeepSpeed's first step builds its buffers)
    counted = counted_run(step)
    n, out = counted.pop("out")
    if recipe == "dpo":  # the reference log-probs' pass (precomputed, and the held-out evaluation's)
        scored = counted_run(lambda: pair_logps(actor, pairs, micro_batch_size, 0, False, packing,
                                                budget=actor.micro_batch_tokens()))
        counted.update(logps_reads=scored["reads"], logps_mixed=scored["mixed"])
    return {**counted, "micro_batches": n, "loss": out["train/loss"]}


def head_run(fused: bool) -> tuple[list, dict, dict]:
    from colo_rl.train import batch as batch_module, lm_head

    real = batch_module.fusable_head
    lm_head.FUSE_ON_CPU = True  # the chunked head is for GPUs by default; checked here on the CPU
    if not fused:
        batch_module.fusable_head = lambda model: None
    try:
        actor = DeepSpeedActor(tiny_cfg(), torch.float32, total_steps=4, grad_accum=2)
        outputs = []
        for j in range(2):
            b = scripted_batch(j)
            lp, ent = actor.response_logprobs(b, 0.8, with_entropy=True, entropy_grad=True)
            outputs.append((lp.detach().clone(), ent.detach().clone()))
            n = 16.0 * dist.world_size()  # a loss on log-probs and an entropy bonus: both gradients
            actor.backward(-(lp * b.response_mask).sum() / n - 0.1 * (ent * b.response_mask).sum() / n,
                           last_micro_batch=j == 1)
        grads = full_grads(actor)
        actor.step()
        return outputs, grads, actor.full_state_dict_on_rank0() or {}
    finally:
        batch_module.fusable_head = real
        lm_head.FUSE_ON_CPU = False


def fused_head_report() -> dict:
    fused, fused_grads, fused_w = head_run(True)
    whole, whole_grads, whole_w = head_run(False)
    return {"logp_max_diff": max(float((f[0] - w[0]).abs().max()) for f, w in zip(fused, whole)),
            "entropy_max_diff": max(float((f[1] - w[1]).abs().max()) for f, w in zip(fused, whole)),
            "grad_max_diff": max_diff(fused_grads, whole_grads),
            "grad_max_abs": max(float(g.abs().max()) for g in whole_grads.values()),
            "embedding_grad_abs": float(whole_grads["model.embed_tokens.weight"].abs().max()),
            "weights_max_diff": max_diff(fused_w, whole_w)}


def main() -> int:
    dist.init()
    out_prefix = sys.argv[1]
    report = {"leaf": leaf_report(), "fused_head": fused_head_report(), "linear": linear_report(),
              "checkpointing": checkpointing_report(), "compile": compile_report(),
              "reads": {f"packed_mbs{m}": update_reads(True, m) for m in (8, 4)}
              | {f"padded_mbs{m}": update_reads(False, m) for m in (8, 4, 2)},
              "off_policy_reads": {f"packed_mbs{m}": update_reads(True, m, mini_batches=2) for m in (8, 4)},
              "offline_reads": {f"{recipe}_{'packed' if packing else 'padded'}_mbs{m}": offline_reads(recipe, packing, m)
                                for recipe in ("sft", "dpo") for packing in (True, False) for m in (4, 2, 1)}}
    Path(f"{out_prefix}.rank{dist.rank()}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    process_exit.run_and_exit(main)
