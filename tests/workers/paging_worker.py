"""Run under torchrun (2 gloo ranks): the trainer's real paging path (DeepSpeed's offload_states /
reload_states and colo_rl's own for a frozen base), which colo_rl runs only on a GPU.

DeepSpeed's code is the same on CPU (states go host -> host, unpinned), so forcing `actor.pages`
here runs everything the GPU's generation phase runs except the device copies. Per mode (full
fine-tuning, LoRA), a paged actor and an unpaged twin take the same two bf16 steps; the report
(tests/test_paging.py asserts on it) holds both runs' figures, what `state_bytes()` claims against
the bytes of the tensors DeepSpeed actually moves, and what a checkpoint written after paging holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from colo_rl import dist, process_exit
from colo_rl.config import LoraConfig, ModelConfig, RunConfig, TrainerConfig
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.ds_config import DEEPSPEED_STATE_KINDS
from worker_support import scripted_batch

TINY = dict(random_init=True, hidden_size=64, num_layers=2, dtype="bf16")
BUFFER = "_offload_buffer"  # DeepSpeed's key suffix for its host copies of Adam's moments


def make_actor(cfg, paged: bool) -> DeepSpeedActor:
    actor = DeepSpeedActor(cfg, torch.bfloat16, total_steps=4)
    actor.pages = paged  # as colocate.paging=on in a colocated run (auto pages on CUDA only)
    actor.set_paged_kinds(DEEPSPEED_STATE_KINDS)
    return actor


def train_step(actor, step: int) -> dict:
    b = scripted_batch(step)
    lp, _ = actor.response_logprobs(b)
    loss = -(lp * b.response_mask).sum() / (b.response_mask.sum() * dist.world_size())
    actor.backward(loss, last_micro_batch=True)
    return {"loss": float(loss), **actor.step()}


def moved_tensor_bytes(actor) -> int:
    """What the page-out moves, read off the engine's own tensors (stage3.py offload_states)."""
    opt = actor.engine.optimizer
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    states = [v for st in opt.optimizer.state.values() for k, v in st.items()
              if k in ("exp_avg", "exp_avg_sq")]
    buckets = [b.buffer for b in opt.ipg_buckets.values() if b.buffer is not None]
    lp = [opt.lp_param_buffer] if not actor.frozen_pager.tensors else []  # LoRA: DeepSpeed keeps the adapters'
    return (size(opt.fp32_partitioned_groups_flat) + size(states) + size([opt.grad_partitions_flat_buffer])
            + size(buckets) + size(lp) + actor.frozen_pager.nbytes())


def local_weights(actor) -> list[torch.Tensor]:
    return [p.ds_tensor.detach().clone() for p in actor.module.parameters()]


def buffer_keys(state: dict) -> list[str]:
    return sorted({k for st in state.values() for k in st if str(k).endswith(BUFFER)})


def run_mode(cfg, run_dir: Path) -> dict:
    plain, paged = make_actor(cfg, False), make_actor(cfg, True)
    out: dict = {"steps_plain": [], "steps_paged": [], "page_outs": 0}
    # before any step: what the paging plan and the engine's sizing see at set-up
    out["state_bytes_before_first_step"] = paged.state_bytes()
    out["moved_tensor_bytes_before_first_step"] = moved_tensor_bytes(paged)
    for step in range(2):
        out["steps_plain"].append(train_step(plain, step))
        paged.offload_states()  # the generation phase
        out["page_outs"] += 1
        paged.reload_states()
        out["steps_paged"].append(train_step(paged, step))
    out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(local_weights(plain), local_weights(paged)))
    out["state_bytes"] = paged.state_bytes()
    out["moved_tensor_bytes"] = moved_tensor_bytes(paged)
    out["trainable_numel"] = sum(p.ds_numel for p in paged.module.parameters() if p.requires_grad)
    out["reduce_bucket_size"] = paged.engine.optimizer.reduce_bucket_size
    out["frozen_paged_bytes"] = paged.frozen_pager.nbytes()
    out["buffers_in_state"] = buffer_keys(paged.engine.optimizer.optimizer.state)

    # Checkpoints: colo_rl's save leaves DeepSpeed's paging buffers out (and keeps them in memory);
    # one written without that (DeepSpeed's own call, as before) holds them, and loading drops them.
    paged.save_checkpoint(str(run_dir), "colo")
    paged.engine.save_checkpoint(str(run_dir), tag="raw", save_latest=False, exclude_frozen_parameters=paged.lora)
    out["buffers_in_state_after_save"] = buffer_keys(paged.engine.optimizer.optimizer.state)
    for tag in ("colo", "raw"):
        f = next((run_dir / tag).glob(f"*rank_{dist.rank()}_*optim_states.pt"))
        saved = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        out[f"buffers_in_{tag}_checkpoint"] = buffer_keys(saved["optimizer_state_dict"]["state"])
    fresh = make_actor(cfg, True)
    fresh.load_checkpoint(str(run_dir), "raw")
    out["buffers_after_loading_raw"] = buffer_keys(fresh.engine.optimizer.optimizer.state)
    out["loaded_weights_equal"] = all(torch.equal(a, b) for a, b in zip(local_weights(paged), local_weights(fresh)))
    fresh.offload_states()
    fresh.reload_states()
    out["after_load_step"] = train_step(fresh, 2)
    out["after_load_step_twin"] = train_step(paged, 2)
    return out


def main(out_path: str, run_dir: str) -> None:
    dist.init()
    trainer = TrainerConfig(zero_stage=3, lr=1e-2, micro_batch_size=4)
    modes = {"full": RunConfig(model=ModelConfig(**TINY), trainer=trainer),
             "lora": RunConfig(model=ModelConfig(**TINY, lora=LoraConfig(rank=4, alpha=8.0)), trainer=trainer)}
    report = {name: run_mode(cfg, Path(run_dir) / name) for name, cfg in modes.items()}
    Path(f"{out_path}.rank{dist.rank()}.json").write_text(json.dumps(report, default=str))
    dist.cleanup()


if __name__ == "__main__":
    process_exit.run_and_exit(lambda: main(sys.argv[1], sys.argv[2]))
