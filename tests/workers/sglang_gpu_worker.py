"""The SGLang GPU checks, in a process of their own (tests/test_gpu.py runs it and asserts on its JSON).

A scheduler failure inside SGLang signals its parent process; run inside pytest it would take the
whole suite down with it. Here it takes down this worker only, and the test reports its output.

One engine (a random Llama, bf16, the real ZeRO-3 actor, the memory manager) serves three checks,
each recorded in the JSON as soon as it ran:
- `start`: the engine is released right after start; resuming every tag takes memory and
  releasing it again gives back at least 90 % of it;
- `agreement`: four generation phases (before training and after each of three optimizer steps):
  the handoff moved every byte and the engine's log-probs of its own samples agree with the
  trainer's (the recipe's check);
- `perturbed`: a handoff of shuffled tensors that SGLang accepts fails the check.

    python tests/workers/sglang_gpu_worker.py OUT.json WORKDIR ['{"attention_backend": "triton"}']  # rollout.sglang_kwargs
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.phase_switch import EOS, PAD, bench_config, grpo_like_update, write_random_llama  # noqa: E402

GIB = 1 << 30
# Peaked next-token distributions (initializer_range 0.1): an engine on other weights (SGLang's
# near-zero dummy weights, a shuffled copy) disagrees with the trainer by nats, not hundredths.
DIMS = dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1536, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=32000, initializer_range=0.1)


def random_prompts(n: int, length: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, DIMS["vocab_size"], (n, length), generator=g).tolist()


def logprob_agreement(cfg, colo, completions) -> dict:
    from colo_rl.colocate.handoff import LogprobAgreement
    from colo_rl.train.batch import build_batch

    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], PAD,
                        per_token={"rollout_logp": [c.logprobs for c in completions]})
    trainer_logp, _ = colo.actor.response_logprobs(batch, temperature=cfg.rollout.temperature, grad=False)
    agreement = LogprobAgreement()
    dev = trainer_logp.device
    agreement.add(batch.extras["rollout_logp"].to(dev), trainer_logp, batch.response_mask.to(dev))
    return agreement.check(cfg.colocate.handoff_check_max_mean_abs)


def main(out_path: str, work: str, sglang_kwargs: dict) -> int:
    from types import SimpleNamespace

    from colo_rl import console, dist
    from colo_rl.colocate.handoff import HandoffError
    from colo_rl.colocate.setup import build_colocated
    from colo_rl.rollout.base import SamplingParams

    report: dict = {"sglang_kwargs": sglang_kwargs}
    out = Path(out_path)

    def save() -> None:
        out.write_text(json.dumps(report, indent=1))

    dist.init()
    console.setup_logging()
    model_dir = write_random_llama(Path(work) / "model", **DIMS)
    cfg = bench_config(model_dir, "sglang", "bf16", steps=8, seqs=8)
    cfg.trainer.lr = 1e-3  # weights move visibly between steps
    cfg.colocate.memory_margin_gib = 8.0
    cfg.rollout.temperature = 1.0
    cfg.rollout.sglang_kwargs = dict(report["sglang_kwargs"])
    t0 = time.perf_counter()
    colo = build_colocated(cfg, SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD), torch.bfloat16,
                           run_dir=Path(work), total_steps=8, grad_accum=1)
    report["build_seconds"] = time.perf_counter() - t0
    save()
    try:
        engine = colo.engine
        released_at_start = sorted(engine.state.released)
        supported = list(engine.state.supported)
        taken = engine.wake(supported)
        freed = engine.sleep(supported)
        report["start"] = {"released_at_start": released_at_start, "supported": supported,
                           "taken_bytes": taken, "freed_bytes": freed,
                           "released_after": sorted(engine.state.released)}
        save()

        params = SamplingParams(max_new_tokens=16, temperature=cfg.rollout.temperature, n=2)
        steps = []
        for step in range(4):  # before training and after each of 3 optimizer steps
            colo.switch.begin_step(step)
            with colo.switch.generation():
                completions = colo.engine.generate(random_prompts(4, seed=step), params)
            stats = colo.switch.manager.last_handoff
            with colo.switch.update():
                check = logprob_agreement(cfg, colo, completions)
                if step < 3:
                    grpo_like_update(colo.actor, completions)
            steps.append({"handoff_bytes": stats.bytes, "handoff_seconds": stats.seconds,
                          "tokens": sum(len(c.token_ids) for c in completions), **check})
        report["agreement"] = {"steps": steps, "threshold": cfg.colocate.handoff_check_max_mean_abs,
                               "model_bytes": sum(n for _, n in colo.actor.named_parameter_sizes()),
                               "ledger": colo.ledger.records[-2:]}
        save()

        original = colo.engine.load_weights

        def perturbed(named_tensors):  # a handoff that "succeeds" with the wrong tensors: shuffled entries
            torch.manual_seed(0)
            original([(n, t.flatten()[torch.randperm(t.numel(), device=t.device)].view_as(t))
                      for n, t in named_tensors])

        colo.engine.load_weights = perturbed
        colo.switch.begin_step(100)
        with colo.switch.generation():
            completions = colo.engine.generate(random_prompts(4, seed=7), SamplingParams(max_new_tokens=16, n=2))
        with colo.switch.update():
            try:
                logprob_agreement(cfg, colo, completions)
                report["perturbed"] = {"raised": False}
            except HandoffError as e:
                report["perturbed"] = {"raised": True, "message": str(e)}
        save()
    except Exception as e:  # noqa: BLE001 - recorded for the test, then re-raised
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        save()
        raise
    finally:
        if colo.engine is not None:
            colo.engine.shutdown()
    report["done"] = True
    save()
    return 0


if __name__ == "__main__":
    from colo_rl import process_exit

    process_exit.run_and_exit(lambda: main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
