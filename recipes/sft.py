"""Supervised fine-tuning on the DeepSpeed ZeRO trainer: cross-entropy on completion tokens.

    make sft                                                    # embedded default, 2 CPU ranks
    torchrun --nproc_per_node=8 recipes/sft.py data.path=my.jsonl model.path=/models/x trainer.zero_stage=3

One step:
    the next trainer.batch_size examples (each rank takes its share)
    micro-batches (packed when algo.packing) -> log-probs of the completion tokens
    -> NLL averaged over the step's completion tokens on all ranks -> backward -> optimizer step
Checkpoints (every trainer.save_every steps, on SIGINT / SIGTERM, at the end) resume exactly
with resume=auto run_dir=<the run's directory>.
Evaluation (start, every trainer.eval_every steps, end): held-out loss; where the held-out
examples carry answers (the embedded arithmetic task does), greedy accuracy with the rollout
engine: the same problems, prompts and answer extraction as GRPO's evaluation.
The final HF checkpoint (<run dir>/checkpoint-final) is a model.path for dpo.py and grpo.py.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colo_rl import algos, dist, runtime  # noqa: E402
from colo_rl.checkpoint import export_hf  # noqa: E402
from colo_rl.config import register_configs  # noqa: E402
from colo_rl.data.sampler import EpochSampler  # noqa: E402
from colo_rl.data.sft import load_sft_data  # noqa: E402
from colo_rl.metrics import MetricsLogger, plot_curves, read_jsonl  # noqa: E402
from colo_rl.models import load_tokenizer  # noqa: E402
from colo_rl.train.offline import equalise, held_out_accuracy, masked_token_count, sft_micro_batches  # noqa: E402
from colo_rl.train.offline_loop import build_offline_trainer, plan_steps, run_offline_loop  # noqa: E402

log = logging.getLogger("colo_rl")
register_configs()

CONSOLE = ["train/loss", "train/grad_norm", "train/lr", "throughput/tokens_per_s", "time/step", "eval/loss",
           "eval/accuracy"]


@hydra.main(config_path="../conf", config_name="sft", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    t_start = time.perf_counter()
    ctx = runtime.start(hydra_cfg, recipe="sft")
    cfg, run_dir, tr = ctx.cfg, ctx.run_dir, ctx.cfg.trainer
    ckpt = ctx.ckpt  # resume=auto|<dir> resolved; a config that changes its meaning was refused

    # ---- data: tokenised once, completion masks, over-length policy (counted)
    tokenizer = load_tokenizer(cfg.model.path)
    pad = tokenizer.pad_token_id
    train, held, length_stats = load_sft_data(tokenizer, cfg.data)
    log.info("data: %d train / %d held-out examples from %s; data.overlong_policy=%s: %s", len(train), len(held),
             cfg.data.path or "the embedded arithmetic task", cfg.data.overlong_policy, length_stats.summary())
    plan = plan_steps(cfg, len(train), "examples")
    sampler = EpochSampler(len(train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    log.info("plan: %d steps (%d epoch(s) x %d steps of %d examples; %d per rank, micro-batches of %d%s)",
             plan.total_steps, tr.epochs, plan.steps_per_epoch, tr.batch_size, plan.local_batch, tr.micro_batch_size,
             ", packed" if cfg.algo.packing else "")

    # ---- trainer; plus the rollout engine when the held-out examples can be scored
    gen_eval = bool(tr.eval_generate and held and all(ex.answer is not None for ex in held))
    trainer = build_offline_trainer(cfg, ctx, tokenizer, plan, gen_eval)
    actor = trainer.actor
    metrics = MetricsLogger(run_dir, cfg.tensorboard, CONSOLE)

    def micro(examples):
        return sft_micro_batches(examples, tr.micro_batch_size, pad, cfg.algo.packing, cfg.data.max_seq_len,
                                 ctx.dtype)

    def run_eval(step: int) -> dict:
        out: dict = {}
        if held:
            with trainer.update_phase():
                out.update(held_out_loss(actor, micro(dist.shard(held)), pad))
        if gen_eval:
            out.update(held_out_accuracy(trainer.colo, tokenizer, held, trainer.scorer,
                                         cfg.rollout.eval_max_new_tokens, step))
        if "eval/loss" in out:
            log.info("eval @ step %d: held-out loss %.4f", step, out["eval/loss"])
        return out

    def step_fn(indices: list[int]) -> dict:
        examples = [train[i] for i in indices]
        return train_step(actor, micro(examples), pad, examples)

    # ---- the loop: resume or evaluate the base model, steps, evaluations, checkpoints
    result = run_offline_loop("SFT", cfg, plan, trainer, sampler, ckpt, metrics, step_fn, run_eval, len(train))
    if result.stopped_by:
        metrics.close()
        runtime.finish()
        sys.exit(result.exit_code)

    # ---- outputs: HF checkpoint, loss curve, summary
    with trainer.update_phase():
        final = export_hf(actor, tokenizer, run_dir / "checkpoint-final")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if cfg.plots:
        plot_curves(rows, run_dir / "loss_curve.png",
                    [("loss (completion-token NLL)", ["train/loss", "eval/loss"]),
                     ("held-out accuracy (greedy)", ["eval/accuracy", "eval/accuracy_lenient", "eval/format_rate"]),
                     ("train tokens / s", ["throughput/tokens_per_s"])], f"SFT {run_dir.name}")
    first_eval, last_eval = result.first_eval, result.last_eval
    summary = {"recipe": "sft", "steps": plan.total_steps, "train_examples": len(train),
               "held_out_examples": len(held), "resumed_at_step": result.start_step,
               "overlong": vars(length_stats) | {"dropped_origins": length_stats.dropped_origins[:10]},
               "start": first_eval, "end": last_eval, "checkpoint": str(final),
               "seconds": time.perf_counter() - t_start}
    if dist.is_rank0():
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    metrics.close()
    if gen_eval and "eval/accuracy" in first_eval:
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
