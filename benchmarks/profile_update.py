"""Where the update phase's time goes: one GRPO update (8 groups of 8, --per-micro-batch groups
packed to a micro-batch as the race runs them) through plain PyTorch and through colo_rl's
DeepSpeed actor at a given ZeRO stage, in one process; optionally the top operators.

    python benchmarks/profile_update.py --stage 3            # DeepSpeed ZeRO-3 (the default)
    python benchmarks/profile_update.py --stage 0 --plain    # ZeRO-0, and plain PyTorch + AdamW
    python benchmarks/profile_update.py --stage 3 --ops 25   # + the 25 most expensive operators
    python benchmarks/profile_update.py --layers 30 --response-len 64 --ops 25  # the deep narrow model

Random token ids with the race's shapes (a 55-token prompt, 8 responses of 40 tokens per group);
the second of two updates is timed (the first builds DeepSpeed's buffers). Prints seconds per
update; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def packed_micro_batches(n_groups: int, group_size: int, prompt_len: int, response_len: int,
                         groups_per_micro_batch: int) -> list:
    from colo_rl.train.batch import build_batch
    from colo_rl.train.packing import pack_groups

    g = torch.Generator().manual_seed(0)
    groups = []
    for _ in range(n_groups):
        prompt = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
        responses = [torch.randint(100, 40000, (response_len,), generator=g).tolist() for _ in range(group_size)]
        groups.append((prompt, responses, build_batch([prompt] * group_size, responses, 0).select(list(range(group_size)))))
    return [pack_groups(groups[k:k + groups_per_micro_batch], torch.float32)
            for k in range(0, n_groups, groups_per_micro_batch)]


def model_settings(layers: int):
    """The embedded model, or with `layers` the deep narrow one (`model=tiny model.num_layers=N`)."""
    from colo_rl.config import ModelConfig

    return ModelConfig(random_init=True, hidden_size=64, num_layers=layers) if layers else ModelConfig()


def deepspeed_update(stage: int, mbs: list, layers: int = 0):
    from colo_rl.config import RunConfig
    from colo_rl.train.actor import DeepSpeedActor

    cfg = RunConfig()
    cfg.model = model_settings(layers)
    cfg.trainer.zero_stage = stage
    actor = DeepSpeedActor(cfg, torch.float32, total_steps=10, grad_accum=len(mbs))
    n_tok = float(sum(mb.response_mask.sum() for mb in mbs))

    def update() -> None:
        for j, mb in enumerate(mbs):
            logp, _ = actor.response_logprobs(mb, 1.0, with_entropy=True)
            actor.backward(-(logp * mb.response_mask).sum() / n_tok, last_micro_batch=j == len(mbs) - 1)
        actor.step()
    return update


def plain_update(mbs: list, layers: int = 0):
    from colo_rl.models import load_model
    from colo_rl.train.batch import response_logprobs

    model = load_model(model_settings(layers), torch.float32, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    n_tok = float(sum(mb.response_mask.sum() for mb in mbs))

    def update() -> None:
        for mb in mbs:
            logp, _ = response_logprobs(model, mb, 1.0, with_entropy=True)
            (-(logp * mb.response_mask).sum() / n_tok).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return update


def timed(update) -> float:
    update()  # warm-up
    t0 = time.perf_counter()
    update()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--plain", action="store_true", help="also time plain PyTorch + AdamW on the same batch")
    p.add_argument("--ops", type=int, default=0, help="print this many top operators of the DeepSpeed update")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-micro-batch", type=int, default=4,
                   help="groups per micro-batch (trainer.micro_batch_size // group_size)")
    p.add_argument("--layers", type=int, default=0,
                   help="the deep narrow model (hidden 64) with this many layers; 0 = the embedded model")
    p.add_argument("--prompt-len", type=int, default=55)
    p.add_argument("--response-len", type=int, default=40)
    args = p.parse_args(argv)
    from colo_rl import console, dist

    dist.init()
    console.setup_logging()
    groups = packed_micro_batches(args.groups, 8, args.prompt_len, args.response_len, args.per_micro_batch)
    if args.plain:
        print(f"plain PyTorch + AdamW: {timed(plain_update(groups, args.layers)):.2f} s per update "
              f"({torch.get_num_threads()} threads)")
    update = deepspeed_update(args.stage, groups, args.layers)
    print(f"DeepSpeed ZeRO-{args.stage}: {timed(update):.2f} s per update ({torch.get_num_threads()} threads)")
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            update()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    return 0


if __name__ == "__main__":
    from colo_rl import process_exit

    process_exit.run_and_exit(main)
