"""GRPO-family RL, colocated (default: every rank generates with its engine, then trains with DeepSpeed
ZeRO-3) or split (`placement.mode=split`: generation and trainer pools at once, colo_rl/split/).

    torchrun --standalone --nproc_per_node=2 recipes/grpo.py                 # embedded default (make demo)
    torchrun --nproc_per_node=8 recipes/grpo.py model.path=/models/x rollout=sglang

One step (`GRPORecipe.train_step`):
    [generation phase]  the last update's weights reach the engine -> group_size completions per prompt
                        -> verifier rewards (DAPO: uninformative groups dropped, more prompts sampled)
    [update phase]      old / reference log-probs -> advantages (algo.adv_estimator) ->
                        micro-batches of whole groups -> algos.rl_loss -> optimizer step(s)
The loop around it (resume, evaluation, checkpoints, clean stop) is colo_rl/loop.py.
"""

from __future__ import annotations

import logging
import time

import hydra
import torch
from omegaconf import DictConfig

from colo_rl import algos, dist, loop, process_exit, runtime
from colo_rl.bottleneck import bottleneck_report, charged_rows, format_report, resolve_generation_ranks
from colo_rl.checkpoint import export_hf
from colo_rl.colocate.handoff import LogprobAgreement
from colo_rl.colocate.setup import build_colocated, build_split_generator, build_split_trainer
from colo_rl.config import ConfigError, register_configs
from colo_rl.data import DataError, PromptBuilder, load_problems
from colo_rl.data.sampler import EpochSampler
from colo_rl.envs import build_environment
from colo_rl.evaluation import (check_held_out_size, eval_metrics, evaluate_shard, held_out_accuracy, reported,
                                switch_seconds_paid)
from colo_rl.loggers import read_jsonl
from colo_rl.metrics import SAVE_SWITCH_KEYS, MetricsLogger, RolloutLog, Timer, json_text, plot_curves
from colo_rl.models import load_tokenizer
from colo_rl.rewards import RewardScorer, add_source, model_weight
from colo_rl.rollout.base import SamplingParams
from colo_rl.rollout.batch_metrics import batch_metrics
from colo_rl.rollout.multiturn import MultiTurnRollout, generate_completions, policy_texts
from colo_rl.samples import Rollout, groups_of
from colo_rl.split.pools import GenerationPool, TrainerPool
from colo_rl.split.roles import EngineHelper, enter_split
from colo_rl.split.position import generator_position, restore_generator_position
from colo_rl.train.adapters import EngineWeights
from colo_rl.train.packing import PackedRollout
from colo_rl.train.rl_update import pack_update_batches, rl_update

log = logging.getLogger("colo_rl")

REWARD_CHECK_RECORDS = 4  # records the user's reward functions are tried on at start-up
CONSOLE = ["reward/mean", "reward/accuracy", "response/len_mean", "env/tool_calls", "train/clip_frac",
           "train/grad_norm", "handoff/logprob_diff_mean", "time/step", "eval/accuracy"]


class GRPORecipe:
    """Set-up in __init__; the loop calls resume / evaluate / train_step / save / finish."""

    name = "GRPO"

    def __init__(self, ctx):
        self.cfg, self.run_dir, self.t_start = ctx.cfg, ctx.run_dir, time.perf_counter()
        # placement.mode=split: from here on this rank's world is its pool (generation or trainer ranks)
        self.split = None if ctx.cfg.placement.mode != "split" else enter_split(ctx.cfg, resolve_generation_ranks(
            ctx.cfg.placement, dist.world_size(), ctx.cfg.rollout.tp_size, ctx.cfg.rollout.prompts_per_step,
            dist.local_world_size(), ctx.cfg.trainer.mini_batches_per_step))
        if self.split is not None and self.split.helps:  # its GPU runs a TP rank of a generator's engine: no work here
            self.pool, self.metrics = EngineHelper(self.split), MetricsLogger(ctx.run_dir, (), CONSOLE)
            return
        cfg, world = self.cfg, dist.world_size()
        # ---- data: prompts tokenised once; over-length ones dropped or cut by policy (and counted)
        self.tokenizer = load_tokenizer(cfg.model.path)
        train_problems, eval_problems = load_problems(cfg.data)
        # the user's reward functions meet real records now, not after the model, engine and step-0 evaluation
        self.scorer = RewardScorer(cfg.reward)
        sample = train_problems[:REWARD_CHECK_RECORDS]
        self.scorer.check_on_records([p.answer for p in sample], [p.fields for p in sample], [p.origin for p in sample])
        if dist.is_rank0():
            both = train_problems + eval_problems
            self.scorer.count_unmatchable([p.answer for p in both], [p.origin for p in both], cfg.data.path or "data")
        # env.name != none: multi-turn episodes (the prompts tell the policy about its tools)
        self.env = build_environment(cfg.env, self.tokenizer, cfg.data.use_chat_template)
        self.multiturn = None if self.env is None else MultiTurnRollout(self.env, self.tokenizer, cfg.env.max_turns,
                                                                        cfg.env.max_total_tokens)
        self.builder = builder = PromptBuilder(self.tokenizer, cfg.data, env=self.env)
        self.train, self.eval_set = builder.encode_all(train_problems), builder.encode_all(eval_problems)
        plain = PromptBuilder(self.tokenizer, cfg.data)  # the same held-out set without tools, for comparison
        self.eval_no_tools = [] if self.env is None else plain.encode_all(eval_problems)
        log.info("data: %d train / %d held-out prompts (%d over-length dropped, %d truncated)",
                 len(self.train), len(self.eval_set), builder.stats.dropped, builder.stats.truncated)
        if not self.train:
            raise DataError(f"no training prompt is left: all {len(train_problems)} are longer than "
                            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} and were dropped "
                            f"(data.overlong_policy=drop); raise data.max_prompt_tokens or set "
                            f"data.overlong_policy=truncate")
        if len(self.train) < cfg.rollout.prompts_per_step:
            log.warning("data: %d training prompts, fewer than rollout.prompts_per_step=%d: a step repeats prompts "
                        "(an epoch is shorter than a step); use more data or fewer prompts per step",
                        len(self.train), cfg.rollout.prompts_per_step)
        check_held_out_size(len(self.eval_set), world)
        self.sampler = EpochSampler(len(self.train), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.start_metrics = {"data/overlong_dropped": builder.stats.dropped,
                              "data/overlong_truncated": builder.stats.truncated}

        # ---- shapes: each rank owns prompts_per_step / world prompts and their whole groups
        if cfg.rollout.prompts_per_step % world:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                              f"number of ranks ({world})")
        self.prompts_per_rank = cfg.rollout.prompts_per_step // world
        # every mini-batch holds at least one whole group of every rank (a split run's trainers: split_layout's)
        if self.split is None and self.prompts_per_rank % cfg.trainer.mini_batches_per_step:
            raise ConfigError(f"trainer.mini_batches_per_step={cfg.trainer.mini_batches_per_step} must divide the "
                              f"{self.prompts_per_rank} prompt groups per rank (rollout.prompts_per_step / ranks)")
        self.total_steps = cfg.trainer.total_steps
        optimizer_steps = self.total_steps * cfg.trainer.mini_batches_per_step * cfg.trainer.ppo_epochs

        # ---- the colocated pieces: DeepSpeed actor (+ reference), rollout engine, phase switcher
        # (the micro-batch count follows the step's lengths: each optimizer step sets its boundary itself)
        self.pool = None
        if self.split is None:
            self.colo = build_colocated(cfg, self.tokenizer, ctx.dtype, self.run_dir, total_steps=optimizer_steps,
                                        grad_accum=1)
        elif self.split.generates:  # an engine only; its weights come from the trainer, version by version
            self.colo = build_split_generator(cfg, self.tokenizer, ctx.dtype)
            self.pool = GenerationPool(self.split, cfg, self.colo.engine, self.generate_slot, self.total_steps,
                                       self.evaluate_shard,
                                       position=lambda: generator_position(self.sampler, self.colo.engine),
                                       restore=lambda pos: restore_generator_position(pos, self.sampler,
                                                                                      self.colo.engine))
        else:  # ZeRO-3 over the trainer ranks only, no engine
            self.colo = build_split_trainer(cfg, ctx.dtype, self.run_dir, optimizer_steps)
            self.pool = TrainerPool(self.split, cfg, EngineWeights(self.colo.actor), self.total_steps,
                                    evaluates=lambda version: bool(self.eval_set) and (
                                        version == 0 or loop.eval_due(version, self.total_steps, cfg.trainer.eval_every)))
            runtime.seed_everything(cfg.trainer.seed + dist.rank())  # the pool's rank, as a colocated run's
        # a split run's metrics are the trainer ranks' ("rank 0" of the generation pool writes none)
        self.metrics = MetricsLogger(ctx.run_dir, (), CONSOLE) if self.serves else runtime.metrics_logger(ctx, CONSOLE)
        self.sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens,
                                       temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                       n=cfg.rollout.group_size)
        self.kl_ctl = algos.AdaptiveKLController(cfg.algo.kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        self.timer = Timer()
        # what the policy writes, for reading: <run_dir>/rollouts.jsonl (the trainer's rank 0)
        self.rollout_log = RolloutLog(ctx.run_dir, 0 if self.serves else cfg.log_rollout_groups, builder.text,
                                      self.tokenizer.decode)

    # ------------------------------------------------------------------ the loop's calls
    def resume(self, ckpt) -> int:
        if self.split is not None:  # the trainer: DeepSpeed state and RNGs; the generators' positions go to them
            step = ckpt.maybe_resume(self.colo.actor)
            self.start_metrics.update(self.pool.start(step, ckpt.extra.get("split_positions")))
            self.pool.stats.load_state_dict(ckpt.extra.get("split_staleness"))  # the run's histogram goes on
        else:
            with self.colo.switch.update():  # DeepSpeed state, data position, RNGs (the engine's sampling RNG too)
                step = ckpt.maybe_resume(self.colo.actor, self.sampler, self.colo.engine)
        saved = ckpt.extra.get("kl_in_reward_coef")
        if saved is not None and self.cfg.algo.kl_target is not None:  # adaptive: its state goes on
            if float(saved) != self.cfg.algo.kl_coef:
                log.info("KL-in-reward coefficient continues at the checkpoint's adapted %.4g (algo.kl_coef=%g "
                         "is only its starting value)", float(saved), self.cfg.algo.kl_coef)
            self.kl_ctl.coef = float(saved)
        return step

    def evaluate(self, step: int) -> dict[str, float]:
        if self.split is not None:  # the generation ranks evaluated these weights (evaluate_shard)
            shares = self.pool.evaluation(step) if self.eval_set else {}
            return {k: v for prefix, res in shares.items() for k, v in reported(eval_metrics(*res), step, prefix).items()}
        out = held_out_accuracy(self.colo, self.tokenizer, [ids for _, ids in self.eval_set],
                                [p.answer for p, _ in self.eval_set], self.scorer,
                                self.cfg.rollout.eval_max_new_tokens, step, multiturn=self.multiturn,
                                problems=[p for p, _ in self.eval_set])
        if self.eval_no_tools:
            out.update(held_out_accuracy(self.colo, self.tokenizer, [ids for _, ids in self.eval_no_tools],
                                         [p.answer for p, _ in self.eval_no_tools], self.scorer,
                                         self.cfg.rollout.eval_max_new_tokens, step, prefix="eval_no_tools/",
                                         problems=[p for p, _ in self.eval_no_tools]))
        return out

    def train_step(self, step: int) -> dict[str, float]:
        colo = self.colo
        if self.split is not None:
            return self.split_train_step(step)
        colo.switch.begin_step(step)  # the ledger's records name it; the phase timers start from zero
        # Entering the generation phase pages the trainer's states out and hands the engine the
        # weights of the last update (the weight handoff), then wakes its KV cache.
        with colo.switch.generation():
            rollout = self.rollout(policy_version=step)
        with colo.switch.update():  # the engine releases its memory; the trainer's states come back
            self.shape_rewards(rollout)
            self.rollout_log.write(step + 1, rollout)
            train_metrics = self.update(rollout)
        return {**train_metrics, **self.rollout_metrics(rollout), **self.timer.pop(),
                **colo.switch.timed_phase_seconds()}

    def split_train_step(self, step: int) -> dict[str, float]:
        """A trainer rank's step in split placement: the next rollout within the staleness bound from the
        generation ranks, the update, the new weights to the generators (colo_rl/split/pools.py)."""
        rollout, flow = self.pool.receive(step)
        self.timer.seconds.update({k.removeprefix("time/"): v for k, v in flow.items()
                                   if k in ("time/generation", "time/reward")})
        self.shape_rewards(rollout)  # on the trainer ranks, as a colocated run's update phase
        self.rollout_log.write(step + 1, rollout)
        start = time.time()
        train_metrics = self.update(rollout, fresh=rollout.policy_version == step)
        sync = self.pool.after_update(step, (start, time.time()))
        if "time/weight_sync" in sync:
            self.colo.ledger.weight_sync(step, sync["split/weight_sync_bytes"], sync["time/weight_sync"])
        return {**train_metrics, **self.rollout_metrics(rollout), **self.timer.pop(), **flow, **sync}

    def generate_slot(self, version: int) -> tuple[Rollout, dict[str, float]]:
        """A generation rank's rollout with the weights of `version`, and its generation / reward seconds."""
        rollout = self.rollout(policy_version=version)
        return rollout, self.timer.pop()

    def evaluate_shard(self, version: int) -> dict[str, tuple[dict[str, float], list[dict]]]:
        """A generation rank's share of the held-out evaluations of the weights of `version` (split
        placement), per metric prefix as `evaluate` names them: the trainer adds up every
        generator's share, as a colocated run's ranks do."""
        sets = {"eval/": (self.eval_set, self.multiturn), "eval_no_tools/": (self.eval_no_tools, None)}
        return {prefix: evaluate_shard(self.colo.engine, self.tokenizer, [ids for _, ids in held_out],
                                       [p.answer for p, _ in held_out], self.scorer,
                                       self.cfg.rollout.eval_max_new_tokens, multiturn,
                                       problems=[p for p, _ in held_out])
                for prefix, (held_out, multiturn) in sets.items() if held_out}

    def serve(self) -> None:
        """A generation rank's whole run (split placement): rollouts until the trainer stops it."""
        self.pool.serve()

    @property
    def serves(self) -> bool:
        return self.split is not None and (self.split.generates or self.split.helps)

    def close(self) -> None:
        """The run ends: a split run's trainer stops its generators."""
        if self.pool is not None and not self.serves:
            unused = self.pool.close()
            log.info("split placement: generators stopped; %d slot(s) generated past the end were not trained",
                     unused)

    def save(self, ckpt, step: int) -> dict[str, float]:
        extra = {"kl_in_reward_coef": self.kl_ctl.coef}
        if self.split is not None:  # the data lives on the generation ranks: their positions after the last slot used
            ckpt.save(step, self.colo.actor, extra={**extra, "split_positions": self.pool.positions,
                                                    "split_staleness": self.pool.stats.state_dict()})
            return {}
        before = self.colo.switch.timed_phase_seconds()
        with self.colo.switch.update():  # an evaluation before it left the engine generating: switch back
            ckpt.save(step, self.colo.actor, self.sampler, self.colo.engine, extra=extra)
        return switch_seconds_paid(SAVE_SWITCH_KEYS, before, self.colo.switch.timed_phase_seconds())

    def plot(self) -> list[dict]:
        """reward_curve.png from metrics.jsonl (cfg.plots); returns the rows."""
        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        if self.cfg.plots:
            plot_curves(charged_rows(rows), self.run_dir / "reward_curve.png",  # evaluations' switches in their steps
                        [("reward", ["reward/mean", "reward/accuracy"]),
                         ("held-out accuracy (greedy)", ["eval/accuracy", "eval/accuracy_lenient"]),
                         ("seconds per step", ["time/generation", "time/update", "time/handoff",
                                               "time/phase_switch"])], f"GRPO {self.run_dir.name}")
        return rows

    def finish(self, result: loop.LoopResult) -> None:
        with self.colo.switch.update():
            export_hf(self.colo.actor, self.tokenizer, self.run_dir / "checkpoint-final")
        rows = self.plot()
        first, last = result.first_eval, result.last_eval
        if "eval/accuracy" in first and "eval/accuracy" in last:
            log.info("held-out accuracy (greedy, %d problems): %.3f -> %.3f (%+.1f points); lenient %.3f -> %.3f",
                     int(last["eval/count"]), first["eval/accuracy"], last["eval/accuracy"],
                     100 * (last["eval/accuracy"] - first["eval/accuracy"]), first["eval/accuracy_lenient"],
                     last["eval/accuracy_lenient"])
        summary = {"recipe": "grpo", "steps": self.total_steps, "resumed_at_step": result.start_step,
                   "start": first, "end": last, "seconds": time.perf_counter() - self.t_start}
        if self.split is None and any(r.get("time/step") for r in rows):  # colocated: phases in turn on every GPU
            summary["bottleneck"] = bottleneck_report(rows, dist.world_size())
            log.info("%s", format_report(summary["bottleneck"]))
        if dist.is_rank0():
            (self.run_dir / "summary.json").write_text(json_text(summary))

    # ------------------------------------------------------------------ generation phase
    def rollout(self, policy_version: int = 0) -> Rollout:
        """This rank's prompts_per_rank groups: prompts -> completions -> verifier scores.

        With algo.dynamic_sampling (DAPO), groups whose rewards are all equal carry no signal:
        they are set aside and every rank samples another batch of prompts, up to
        algo.max_sampling_rounds extra rounds, until each rank has its groups; groups still
        missing are filled with set-aside ones (counted). Every rank keeps the same number of
        groups, so the update's collective passes line up. A split run's generation ranks each
        decide their rounds alone (they run no collective among themselves)."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        out = Rollout(policy_version=policy_version)
        while True:
            problems = [self.train[i] for i in self.sampler.next_local(cfg.rollout.prompts_per_step)]
            with self.timer("generation"):  # tool calls included: they run between an episode's turns
                prompts = [ids for _, ids in problems]
                completions = generate_completions(self.colo.engine, prompts, self.sampling, self.multiturn,
                                                   [p for p, _ in problems])
            of_completion = [p for p, _ in problems for _ in range(G)]  # each completion's problem
            with self.timer("reward"):
                texts = policy_texts(self.tokenizer, completions)
                scored = self.scorer.score(texts, [p.answer for p in of_completion], [p.fields for p in of_completion])
                if self.env is not None and self.env.scores_episodes:  # your class: its reward() where it has one
                    # a source on every rank and round whatever the episodes gave (the sums over ranks go by
                    # key, and a rank whose episodes all failed would otherwise lack it); 0 where none
                    add_source(scored, "env", [getattr(c, "env_reward", None) or 0.0 for c in completions],
                               cfg.env.reward_weight)
            if scored.failures:  # scored 0 and counted; the run stops past reward.max_failure_rate
                log.warning("rank %d: %d reward call(s) failed this round; first: %s", dist.rank(), scored.failures,
                            scored.failure_messages[0])
            groups = groups_of([p for p, _ in problems], G, scored.per_source, completions=completions,
                               rewards=scored.rewards, correct=scored.correct, lenient=scored.correct_lenient,
                               formatted=scored.formatted, texts=texts)
            out.failures += scored.failures  # every round's, not only the last one's
            out.rounds += 1
            if not cfg.algo.dynamic_sampling:
                out.keep(groups)
                break
            out.keep(groups, algos.informative_groups(torch.tensor(scored.rewards), G).tolist())
            missing = float(self.prompts_per_rank - len(out.groups))
            if not self.serves:  # the same answer on every rank; a split run's generators decide alone (no
                (missing,) = dist.all_reduce_max([missing])  # collective between them: colo_rl/split/NOTES.md)
            if missing <= 0 or out.rounds > cfg.algo.max_sampling_rounds:
                break
        out.fill(self.prompts_per_rank)
        return out

    def shape_rewards(self, rollout: Rollout) -> None:
        """The update phase's additions to the verifiers' rewards, before the advantages: the reward
        model's score of each sample (a source weighted by reward.weights' last; its partitions are
        back on the device now), and DAPO's soft overlong penalty (algo.overlong_buffer_len)."""
        cfg, rm = self.cfg, self.colo.reward_model
        if rm is not None:
            with self.timer("reward_model"):
                problems = rollout.problems
                texts = rm.texts([self.builder.messages(p) for p in problems], [self.builder.text(p) for p in problems],
                                 rollout.flat("texts"))
                rollout.add_source("model", rm.score(texts), model_weight(cfg.reward))
        if cfg.algo.overlong_buffer_len:
            lengths = torch.tensor([len(c.token_ids) for c in rollout.completions])
            limit = cfg.rollout.max_new_tokens if self.env is None else cfg.env.max_total_tokens
            rollout.add_shaping("overlong", algos.overlong_penalty(lengths, limit, cfg.algo.overlong_buffer_len,
                                                                   cfg.algo.overlong_penalty))

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """Reward, response and sampling metrics of the step's training batch, over all ranks."""
        return batch_metrics(rollout, self.timer.seconds.get("generation", 0.0), self.env,
                             overlong_shaping=bool(self.cfg.algo.overlong_buffer_len),
                             dynamic_sampling=self.cfg.algo.dynamic_sampling)

    # ------------------------------------------------------------------ update phase
    def pack(self, rollout: Rollout) -> PackedRollout:
        return pack_update_batches(rollout, self.cfg, self.colo.actor, self.tokenizer.pad_token_id)

    def update(self, rollout: Rollout, fresh: bool = True) -> dict[str, float]:
        """The update phase's optimizer steps on one rollout (colo_rl/train/rl_update.py). `fresh`:
        generated with the trainer's current weights, so the engine-vs-trainer log-prob check applies."""
        with self.timer("pack"):  # host work that grows with the rollout's tokens: timed, not lost in the step
            packed = self.pack(rollout)
        agreement = LogprobAgreement() if fresh else None  # engine vs trainer on the same weights: did the handoff work?
        return rl_update(packed, rollout, self.cfg, self.colo.actor, self.colo.ref, self.kl_ctl, self.timer, agreement)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    loop.main(GRPORecipe, hydra_cfg, "grpo")


if __name__ == "__main__":
    register_configs()
    runtime.check_command_line("grpo")
    process_exit.run_and_exit(main)
