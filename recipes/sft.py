"""Supervised fine-tuning on the DeepSpeed ZeRO trainer: cross-entropy on completion tokens.

    make sft                                                    # embedded default, 2 CPU ranks
    torchrun --nproc_per_node=8 recipes/sft.py data.path=my.jsonl model.path=/models/x trainer.zero_stage=3

One step:
    the next trainer.batch_size examples (each rank takes its share)
    micro-batches (packed when algo.packing) -> log-probs of the completion tokens
    -> NLL averaged over the step's completion tokens on all ranks -> backward -> optimizer step
Evaluation (start, every trainer.eval_every steps, end): held-out loss; where the held-out
examples carry answers (the embedded arithmetic task does), greedy accuracy with the rollout
engine: the same problems, prompts and answer extraction as GRPO's evaluation.
The final HF checkpoint (<run dir>/checkpoint-final) is a model.path for dpo.py and grpo.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colo_rl import algos, dist, runtime  # noqa: E402
from colo_rl.checkpoint import export_hf  # noqa: E402
from colo_rl.colocate.setup import build_colocated  # noqa: E402
from colo_rl.config import ConfigError, register_configs  # noqa: E402
from colo_rl.data.files import DataError  # noqa: E402
from colo_rl.data.sampler import EpochSampler  # noqa: E402
from colo_rl.data.sft import load_sft_data  # noqa: E402
from colo_rl.metrics import MetricsLogger, Progress, Timer, plot_curves, read_jsonl  # noqa: E402
from colo_rl.models import load_tokenizer  # noqa: E402
from colo_rl.rewards import RewardScorer  # noqa: E402
from colo_rl.train.actor import DeepSpeedActor  # noqa: E402
from colo_rl.train.offline import equalise, held_out_accuracy, masked_token_count, sft_micro_batches  # noqa: E402

log = logging.getLogger("colo_rl")
register_configs()

CONSOLE = ["train/loss", "train/grad_norm", "train/lr", "throughput/tokens_per_s", "time/step", "eval/loss",
           "eval/accuracy"]


@hydra.main(config_path="../conf", config_name="sft", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    t_start = time.perf_counter()
    ctx = runtime.start(hydra_cfg, recipe="sft")
    cfg, run_dir, tr = ctx.cfg, ctx.run_dir, ctx.cfg.trainer
    world = dist.world_size()

    # ---- data: tokenised once, completion masks, over-length policy (counted)
    tokenizer = load_tokenizer(cfg.model.path)
    pad = tokenizer.pad_token_id
    train, held, length_stats = load_sft_data(tokenizer, cfg.data)
    log.info("data: %d train / %d held-out examples from %s; data.overlong_policy=%s: %s", len(train), len(held),
             cfg.data.path or "the embedded arithmetic task", cfg.data.overlong_policy, length_stats.summary())
    if not train:
        raise DataError("no training examples left (all over-length?): raise data.max_seq_len")
    if tr.batch_size % world:
        raise ConfigError(f"trainer.batch_size={tr.batch_size} must be divisible by the number of ranks ({world})")
    if cfg.algo.packing and cfg.model.attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(f"algo.packing=true needs model.attn_implementation=sdpa or eager (4D attention masks), "
                          f"not {cfg.model.attn_implementation!r}")
    steps_per_epoch = math.ceil(len(train) / tr.batch_size)
    total_steps = tr.epochs * steps_per_epoch
    if tr.max_steps:
        total_steps = min(total_steps, tr.max_steps)
    local_batch = tr.batch_size // world
    sampler = EpochSampler(len(train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    log.info("plan: %d steps (%d epoch(s) x %d steps of %d examples; %d per rank, micro-batches of %d%s)",
             total_steps, tr.epochs, steps_per_epoch, tr.batch_size, local_batch, tr.micro_batch_size,
             ", packed" if cfg.algo.packing else "")

    # ---- trainer; plus the rollout engine when the held-out examples can be scored
    gen_eval = bool(tr.eval_generate and held and all(ex.answer is not None for ex in held))
    grad_accum = math.ceil(local_batch / tr.micro_batch_size)
    if gen_eval:
        colo = build_colocated(cfg, tokenizer, ctx.dtype, run_dir, total_steps=total_steps, grad_accum=grad_accum)
        actor, update_phase = colo.actor, colo.switch.update
        scorer = RewardScorer(cfg.reward)
    else:
        colo = None
        actor, update_phase = DeepSpeedActor(cfg, ctx.dtype, total_steps=total_steps, grad_accum=grad_accum), \
            contextlib.nullcontext
    metrics = MetricsLogger(run_dir, cfg.tensorboard, CONSOLE)

    def micro(examples):
        return sft_micro_batches(examples, tr.micro_batch_size, pad, cfg.algo.packing, cfg.data.max_seq_len,
                                 ctx.dtype)

    def run_eval(step: int) -> dict:
        out: dict = {}
        if held:
            with update_phase():
                out.update(held_out_loss(actor, micro(dist.shard(held)), pad))
        if gen_eval:
            out.update(held_out_accuracy(colo, tokenizer, held, scorer, cfg.rollout.eval_max_new_tokens, step))
        if "eval/loss" in out:
            log.info("eval @ step %d: held-out loss %.4f", step, out["eval/loss"])
        return out

    timer = Timer()
    with timer("eval"):
        first_eval = run_eval(0)
    metrics.log(0, {**first_eval, **timer.pop()}, console=False)
    progress = Progress(total_steps, "SFT")
    eval_every = tr.eval_every or total_steps
    last_eval = first_eval
    for step in range(total_steps):
        with timer("step"):
            examples = [train[i] for i in sampler.next_local(tr.batch_size)]
            with update_phase():
                step_metrics = train_step(actor, micro(examples), pad, examples)
        step_metrics.update(timer.pop())
        step_metrics["throughput/tokens_per_s"] = step_metrics["train/tokens"] / step_metrics["time/step"]
        step_metrics["train/epoch"] = (step + 1) * tr.batch_size / len(train)
        if (step + 1) % eval_every == 0 or step + 1 == total_steps:
            with timer("eval"):
                last_eval = run_eval(step + 1)
            step_metrics.update({**last_eval, **timer.pop()})
        metrics.log(step + 1, step_metrics)
        progress.advance()
    progress.close()

    # ---- outputs: HF checkpoint, loss curve, summary
    with update_phase():
        final = export_hf(actor, tokenizer, run_dir / "checkpoint-final")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if cfg.plots:
        plot_curves(rows, run_dir / "loss_curve.png",
                    [("loss (completion-token NLL)", ["train/loss", "eval/loss"]),
                     ("held-out accuracy (greedy)", ["eval/accuracy", "eval/accuracy_lenient", "eval/format_rate"]),
                     ("train tokens / s", ["throughput/tokens_per_s"])], f"SFT {run_dir.name}")
    summary = {"recipe": "sft", "steps": total_steps, "train_examples": len(train), "held_out_examples": len(held),
               "overlong": vars(length_stats) | {"dropped_origins": length_stats.dropped_origins[:10]},
               "start": first_eval, "end": last_eval, "checkpoint": str(final),
               "seconds": time.perf_counter() - t_start}
    if dist.is_rank0():
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    metrics.close()
    if gen_eval:
        log.info("held-out accuracy: %.3f before -> %.3f after SFT (%d problems)", first_eval["eval/accuracy"],
                 last_eval["eval/accuracy"], int(last_eval["eval/count"]))
    log.info("done in %.0fs: %s (next: recipes/dpo.py or recipes/grpo.py model.path=%s)",
             summary["seconds"], run_dir, final)
    runtime.finish()


def train_step(actor, batches: list, pad_id: int, examples: list) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; the loss is each rank's share of the
    token-mean over the step's completion tokens on all ranks (gradient accumulation and data
    parallelism then give the gradient of one big batch)."""
    local_tokens = masked_token_count(batches)
    batches, _ = equalise(batches, pad_id)
    n_tok, n_seq_tok = dist.all_reduce_sum([local_tokens, float(sum(len(ex) for ex in examples))])
    loss_sum = 0.0
    for j, mb in enumerate(batches):
        logp, _ = actor.response_logprobs(mb)
        loss = algos.sft_loss(logp, mb.response_mask, num_tokens=n_tok)
        actor.backward(loss, last_micro_batch=j == len(batches) - 1)
        loss_sum += float(loss.detach())
    stats = actor.step()
    (loss_total,) = dist.all_reduce_sum([loss_sum])
    return {"train/loss": loss_total, "train/grad_norm": stats["grad_norm"], "train/lr": stats["lr"],
            "train/completion_tokens": n_tok, "train/tokens": n_seq_tok, "train/micro_batches": len(batches)}


def held_out_loss(actor, batches: list, pad_id: int) -> dict[str, float]:
    batches, _ = equalise(batches, pad_id)
    nll = tok = 0.0
    for mb in batches:
        logp, _ = actor.response_logprobs(mb, grad=False)
        m = mb.response_mask.to(logp.device)
        nll += float(-(logp * m).sum())
        tok += float(m.sum())
    nll, tok = dist.all_reduce_sum([nll, tok])
    return {"eval/loss": nll / max(tok, 1.0), "eval/tokens": tok}


if __name__ == "__main__":
    main()
