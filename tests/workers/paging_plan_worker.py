"""Run under torchrun (2 gloo ranks): colocate.paging=auto with an injected device budget
(colocate.device_memory_gib), on the real pieces (ZeRO-3 actor, HF engine, memory manager, ledger).

The budget is chosen, from this run's own measured states and the plan's rule, so that the plan
must page exactly the gradient bucket and Adam's moments. The report (tests/test_paging_plan_dist.py)
holds what DeepSpeed really had paged in each phase, the ledger, and the losses and weights of the
same two steps run with colocate.paging=off."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from benchmarks.phase_switch import grpo_like_update
from colo_rl import dist, process_exit
from colo_rl.colocate.paging_plan import GIB, PAGE_ORDER, plan_paging
from colo_rl.colocate.setup import build_colocated, plan_trainer_paging
from colo_rl.config import ModelConfig, RunConfig, TrainerConfig
from colo_rl.models import load_tokenizer
from colo_rl.rollout import ENGINES
from colo_rl.rollout.base import SamplingParams

EXPECTED = ("contiguous_grad_buffer", "optim_states")


def config(paging: str, budget_gib=None) -> RunConfig:
    cfg = RunConfig(model=ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"),
                    trainer=TrainerConfig(zero_stage=3, lr=1e-2, micro_batch_size=1))
    # short sequences: the update's activations (mostly logits over a 49k vocabulary) stay below
    # what the handoff needs beside the resident states, so some paging is needed and enough fits
    cfg.data.max_prompt_tokens = 16
    cfg.trainer.micro_batch_tokens = "32"  # one group of 2 x (16 + 8): auto would plan its 1024-token floor
    cfg.colocate.paging, cfg.colocate.device_memory_gib = paging, budget_gib
    cfg.colocate.memory_margin_gib = 0.001
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 2, 8
    return cfg


def budget_paging_exactly(colo, kinds: tuple) -> int:
    """The smallest device budget under which the plan pages `kinds` (a prefix of PAGE_ORDER)."""
    needs = plan_trainer_paging(config("auto", 1.0), colo.actor, (), 1, ENGINES.get("hf")).needs
    resident = sum(needs.state(k) for k in PAGE_ORDER if k not in kinds)
    generation = resident + needs.engine_weights + needs.kv_cache + needs.cuda_graphs + needs.margin
    handoff = resident + needs.engine_weights + needs.handoff_buckets + needs.margin
    update = sum(needs.state(k) for k in PAGE_ORDER) + needs.activations + needs.margin
    budget = max(generation, handoff, update) + 16  # 16 bytes of slack for the GiB float round trip
    plan = plan_paging(dataclasses.replace(needs, device_bytes=budget))
    assert plan.paged == kinds, (plan.summary(), needs)
    return budget


def offloaded(actor) -> list[str]:
    return sorted(s.value for s in actor.engine.optimizer.offloaded_states)


def run_steps(colo, tok, steps: int = 2) -> dict:
    out = {"losses": [], "offloaded_in_generation": [], "offloaded_in_update": []}
    prompt = tok("What is 12 + 30?")["input_ids"]
    for step in range(steps):
        colo.switch.begin_step(step)
        with colo.switch.generation():
            out["offloaded_in_generation"].append(offloaded(colo.actor))
            completions = colo.engine.generate([prompt, prompt[:-1]], SamplingParams(max_new_tokens=8, n=2))
        with colo.switch.update():
            out["offloaded_in_update"].append(offloaded(colo.actor))
            out["losses"].append(grpo_like_update(colo.actor, completions))
    out["weights"] = [p.ds_tensor.detach().clone() for p in colo.actor.module.parameters()]
    return out


def main(out_path: str, run_dir: str) -> None:
    dist.init()
    tok = load_tokenizer("embedded")
    for name in ("off", "auto"):
        (Path(run_dir) / name).mkdir(parents=True, exist_ok=True)
    off = build_colocated(config("off"), tok, torch.float32, Path(run_dir) / "off", total_steps=4, grad_accum=1)
    budget = budget_paging_exactly(off, EXPECTED)
    auto = build_colocated(config("auto", budget / GIB), tok, torch.float32, Path(run_dir) / "auto",
                           total_steps=4, grad_accum=1)
    plain, paged = run_steps(off, tok), run_steps(auto, tok)
    report = {"budget": budget, "paged_kinds": list(auto.actor.paged_kinds),
              "paged_bytes": auto.actor.paged_bytes(), "state_bytes_by_kind": auto.actor.state_bytes_by_kind(),
              "state_bytes": auto.actor.state_bytes(),
              **{k: paged[k] for k in ("offloaded_in_generation", "offloaded_in_update")},
              "losses_plain": plain["losses"], "losses_paged": paged["losses"],
              "weights_equal": all(torch.equal(a, b) for a, b in zip(plain["weights"], paged["weights"])),
              "off_offloaded_in_generation": plain["offloaded_in_generation"],
              "ledger": auto.ledger.records}
    Path(f"{out_path}.rank{dist.rank()}.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(*sys.argv[1:]))
