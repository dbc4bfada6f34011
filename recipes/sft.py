"""Supervised fine-tuning on the DeepSpeed ZeRO trainer: cross-entropy on completion tokens.

    make sft                                                    # embedded default, 2 CPU ranks
    torchrun --nproc_per_node=8 recipes/sft.py data.path=my.jsonl model.path=/models/x

One step (`SFTRecipe.train_step`):
    the next trainer.batch_size examples (each rank takes its share; an epoch's last batch is
    what is left of it)
    micro-batches (packed when trainer.packing) -> log-probs of the completion tokens
    -> NLL averaged over the step's completion tokens on all ranks -> backward -> optimizer step
Evaluation (start, every trainer.eval_every steps, end): held-out loss; where the held-out
examples carry answers (the embedded arithmetic task does), greedy accuracy with the rollout
engine: the same problems, prompts and answer extraction as GRPO's evaluation.
The loop around it (resume, evaluation, checkpoints, clean stop) is colo_rl/loop.py; the final HF
checkpoint (<run dir>/checkpoint-final) is a model.path for dpo.py and grpo.py.
"""

from __future__ import annotations

import contextlib
import logging
import time

import hydra
from omegaconf import DictConfig

from colo_rl import algos, dist, loop, process_exit, runtime
from colo_rl.checkpoint import export_hf
from colo_rl.colocate.setup import build_actor
from colo_rl.config import register_configs
from colo_rl.data.sampler import EpochSampler
from colo_rl.data.sft import load_sft_data
from colo_rl.evaluation import check_held_out_size, generates_for_accuracy, held_out_accuracy
from colo_rl.loggers import read_jsonl
from colo_rl.metrics import StepSums, json_text, plot_curves
from colo_rl.models import load_tokenizer
from colo_rl.rewards import RewardScorer
from colo_rl.train.offline import equalise, masked_token_count, plan_steps, sft_micro_batches

log = logging.getLogger("colo_rl")

CONSOLE = ["train/loss", "train/grad_norm", "train/lr", "throughput/tokens_per_s", "time/step", "eval/loss",
           "eval/accuracy"]


class SFTRecipe:
    """Set-up in __init__; the loop calls resume / evaluate / train_step / save / finish."""

    name = "SFT"

    def __init__(self, ctx):
        self.cfg, self.run_dir, self.dtype, self.t_start = ctx.cfg, ctx.run_dir, ctx.dtype, time.perf_counter()
        cfg, tr = self.cfg, self.cfg.trainer
        # ---- data: tokenised once, completion masks, over-length policy (counted)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pad = self.tokenizer.pad_token_id
        self.train, self.held, self.length_stats = load_sft_data(self.tokenizer, cfg.data)
        log.info("data: %d train / %d held-out examples from %s; data.overlong_policy=%s: %s", len(self.train),
                 len(self.held), cfg.data.path or "the embedded arithmetic task", cfg.data.overlong_policy,
                 self.length_stats.summary())
        self.plan = plan_steps(cfg, len(self.train), "examples")
        self.total_steps = self.plan.total_steps
        check_held_out_size(len(self.held), dist.world_size())
        self.sampler = EpochSampler(len(self.train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        log.info("plan: %d steps (%d epoch(s) x %d steps of %d examples; %d per rank, micro-batches of whole "
                 "examples up to trainer.micro_batch_tokens=%s%s)", self.plan.total_steps, tr.epochs,
                 self.plan.steps_per_epoch, tr.batch_size, self.plan.local_batch, tr.micro_batch_tokens,
                 ", packed" if cfg.trainer.packing else "")
        # ---- trainer; plus the rollout engine when the held-out examples can be scored by generation
        self.gen_eval = generates_for_accuracy(tr.eval_generate, self.held)
        if self.gen_eval:  # prompt + eval_max_new_tokens within the context, checked before the model loads
            runtime.check_held_out_generation(cfg, [ex.prompt_ids for ex in self.held])
        self.actor, self.colo = build_actor(cfg, ctx.dtype, self.tokenizer, ctx.run_dir, self.plan.total_steps,
                                            self.plan.grad_accum, with_engine=self.gen_eval)
        self.scorer = RewardScorer(cfg.reward) if self.gen_eval else None
        self.metrics = runtime.metrics_logger(ctx, CONSOLE)
        self.start_metrics: dict = {}

    def update_phase(self):
        """The trainer holds its states inside (with a colocated engine: the update phase)."""
        return self.colo.switch.update() if self.colo is not None else contextlib.nullcontext()

    @property
    def engine(self):
        return self.colo.engine if self.colo is not None else None

    def micro(self, examples: list) -> list:
        cfg = self.cfg
        return sft_micro_batches(examples, cfg.trainer.micro_batch_size, self.pad, cfg.trainer.packing,
                                 cfg.data.max_seq_len, self.dtype, self.actor.micro_batch_tokens())

    # ------------------------------------------------------------------ the loop's calls
    def resume(self, ckpt) -> int:
        with self.update_phase():  # DeepSpeed state, data position, RNGs
            return ckpt.maybe_resume(self.actor, self.sampler, self.engine)

    def evaluate(self, step: int) -> dict[str, float]:
        out: dict = {}
        if self.held:
            with self.update_phase():
                out.update(held_out_loss(self.actor, self.micro(dist.shard(self.held)), self.pad))
            log.info("eval @ step %d: held-out loss %.4f", step, out["eval/loss"])
        if self.gen_eval:
            out.update(held_out_accuracy(self.colo, self.tokenizer, [ex.prompt_ids for ex in self.held],
                                         [ex.answer for ex in self.held], self.scorer,
                                         self.cfg.rollout.eval_max_new_tokens, step))
        return out

    def train_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        tr = self.cfg.trainer
        if self.colo is not None:
            self.colo.switch.begin_step(step)
        examples = [self.train[i] for i in self.sampler.next_local(tr.batch_size, short_last=True)]
        with self.update_phase():
            out = sft_step(self.actor, self.micro(examples), self.pad, examples)
        out["throughput/tokens_per_s"] = out["train/tokens"] / (time.perf_counter() - t0)
        out["train/epoch"] = self.sampler.epochs_done()
        return out

    def save(self, ckpt, step: int) -> None:
        with self.update_phase():
            ckpt.save(step, self.actor, self.sampler, self.engine)

    def plot(self) -> None:
        """loss_curve.png from metrics.jsonl (cfg.plots)."""
        if self.cfg.plots:
            plot_curves(read_jsonl(self.run_dir / "metrics.jsonl"), self.run_dir / "loss_curve.png",
                        [("loss (completion-token NLL)", ["train/loss", "eval/loss"]),
                         ("held-out accuracy (greedy)", ["eval/accuracy", "eval/accuracy_lenient", "eval/format_rate"]),
                         ("train tokens / s", ["throughput/tokens_per_s"])], f"SFT {self.run_dir.name}")

    def finish(self, result: loop.LoopResult) -> None:
        with self.update_phase():
            final = export_hf(self.actor, self.tokenizer, self.run_dir / "checkpoint-final")
        self.plot()
        first, last = result.first_eval, result.last_eval
        stats = self.length_stats
        summary = {"recipe": "sft", "steps": self.plan.total_steps, "train_examples": len(self.train),
                   "held_out_examples": len(self.held), "resumed_at_step": result.start_step,
                   "overlong": vars(stats) | {"dropped_origins": stats.dropped_origins[:10]},
                   "start": first, "end": last, "checkpoint": str(final), "seconds": time.perf_counter() - self.t_start}
        if dist.is_rank0():
            (self.run_dir / "summary.json").write_text(json_text(summary))
        if self.gen_eval and "eval/accuracy" in first:
            log.info("held-out accuracy: %.3f before -> %.3f after SFT (%d problems)", first["eval/accuracy"],
                     last["eval/accuracy"], int(last["eval/count"]))
        log.info("next: recipes/dpo.py or recipes/grpo.py model.path=%s", final)


def sft_step(actor, batches: list, pad_id: int, examples: list) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; the loss is each rank's share of the
    token-mean over the step's completion tokens on all ranks (gradient accumulation and data
    parallelism then give the gradient of one big batch)."""
    local_tokens = masked_token_count(batches)
    batches, _ = equalise(batches, pad_id)
    n_tok, n_seq_tok = dist.all_reduce_sum([local_tokens, float(sum(len(ex) for ex in examples))])
    sums = StepSums(["loss"])  # on the device: no sync per micro-batch
    for j, mb in enumerate(batches):
        mb = actor.to_device(mb)  # pinned, non-blocking on a GPU
        logp, _ = actor.response_logprobs(mb)
        loss = algos.sft_loss(logp, mb.response_mask, num_tokens=n_tok)
        actor.backward(loss, last_micro_batch=j == len(batches) - 1)
        sums.add(loss=loss)
    stats = actor.step()
    return {"train/loss": sums.totals()["loss"], "train/grad_norm": stats["grad_norm"], "train/lr": stats["lr"],
            "train/completion_tokens": n_tok, "train/tokens": n_seq_tok, "train/micro_batches": len(batches)}


def held_out_loss(actor, batches: list, pad_id: int) -> dict[str, float]:
    batches, _ = equalise(batches, pad_id)
    sums = StepSums(["nll", "tokens"])
    for mb in batches:
        mb = actor.to_device(mb)
        logp, _ = actor.response_logprobs(mb, grad=False)
        sums.add(nll=-(logp * mb.response_mask).sum(), tokens=mb.response_mask.sum())
    t = sums.totals()
    return {"eval/loss": t["nll"] / max(t["tokens"], 1.0), "eval/tokens": t["tokens"]}


@hydra.main(config_path="../conf", config_name="sft", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    loop.main(SFTRecipe, hydra_cfg, "sft")


if __name__ == "__main__":
    register_configs()
    runtime.check_command_line("sft")
    process_exit.run_and_exit(main)
