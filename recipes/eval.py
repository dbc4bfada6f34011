"""Evaluate a model: greedy accuracy and pass@k, on the embedded task's held-out problems or a dataset file.

    python -m colo_rl.launch --standalone --nproc_per_node=2 recipes/eval.py          # embedded model (make eval)
    ... recipes/eval.py model.path=outputs/grpo-<timestamp>             # a run directory: its checkpoint-final/
    ... recipes/eval.py model.path=/models/x data.path=test.jsonl eval.samples=16 eval.pass_k=[1,4,16]

The pieces training uses: the rollout engine (rollout.engine=hf|sglang) gets its weights from a frozen
ZeRO-3 copy of the model through the weight handoff, prompts are built by the data pipeline, answers
are checked by the built-in number verifier (strict: the stated final answer is right; lenient: the
last number); the functions of your own in reward.functions (files) are reported beside it, each
one's mean score on the greedy answers. Every rank takes its share of the problems. Greedy: one completion per problem (rollout.eval_max_new_tokens). Sampled:
eval.samples completions per problem at rollout.temperature / rollout.top_p; pass@k per problem
by the unbiased estimator, averaged. With an environment (env=calculator, env=retry,
env.name=path/to/file.py:Name) every completion is an episode, as in training, and the greedy
figures are also given without it (eval_no_tools/...). Writes <run_dir>/eval.json and eval.md, and
the figures to every logger (logger=[...]).
"""

from __future__ import annotations

import json
import logging
import time

import hydra
from omegaconf import DictConfig

from colo_rl import dist, process_exit, runtime
from colo_rl.checkpoint import hf_model_dir
from colo_rl.colocate.setup import build_colocated
from colo_rl.config import ConfigError, register_configs
from colo_rl.data import PromptBuilder, file_problems, load_problems
from colo_rl.envs import build_environment
from colo_rl.evaluation import evaluate, pass_at_k_metrics, sample_counts
from colo_rl.models import load_tokenizer
from colo_rl.rewards import RewardScorer
from colo_rl.rollout.base import SamplingParams
from colo_rl.rollout.multiturn import MultiTurnRollout

log = logging.getLogger("colo_rl")

CONSOLE = ["eval/accuracy", "eval/pass@1", "eval/response_len", "time/total"]


def run_eval(ctx) -> dict:
    """The evaluation (every rank); returns the report (rank 0 writes it)."""
    cfg, t0 = ctx.cfg, time.perf_counter()
    tokenizer = load_tokenizer(cfg.model.path)
    from_file = cfg.data.path is not None and cfg.eval.all_records
    problems = file_problems(cfg.data.path, cfg.data.prompt_key, cfg.data.answer_key) if from_file else load_problems(cfg.data)[1]
    env = build_environment(cfg.env, tokenizer, cfg.data.use_chat_template)
    multiturn = None if env is None else MultiTurnRollout(env, tokenizer, cfg.env.max_turns, cfg.env.max_total_tokens)
    builder = PromptBuilder(tokenizer, cfg.data, env=env)
    kept = builder.encode_all(problems)
    if not kept:
        raise ConfigError("no problems to evaluate: raise data.eval_size (the embedded task), or pass data.path "
                          "with records (over-length prompts are dropped: data.max_prompt_tokens)")
    prompt_ids, answers, kept_problems = [ids for _, ids in kept], [p.answer for p, _ in kept], [p for p, _ in kept]
    colo = build_colocated(cfg, tokenizer, ctx.dtype, ctx.run_dir, total_steps=1, grad_accum=1, with_optimizer=False)
    scorer = RewardScorer(cfg.reward)
    if dist.is_rank0():
        scorer.count_unmatchable(answers, [p.origin for p in kept_problems], cfg.data.path or "data")
    seconds = {"setup": time.perf_counter() - t0}
    with colo.switch.generation():  # the handoff gives the engine the model's weights
        t1 = time.perf_counter()
        greedy = evaluate(colo.engine, tokenizer, prompt_ids, answers, scorer, cfg.rollout.eval_max_new_tokens,
                          multiturn, kept_problems)
        seconds["greedy"] = time.perf_counter() - t1
        figures = {k: v for k, v in greedy.items() if k != "eval/samples"}
        if env is not None:  # the same problems answered once, without the environment
            plain = PromptBuilder(tokenizer, cfg.data)
            alone = plain.encode_all(kept_problems)
            once = evaluate(colo.engine, tokenizer, [ids for _, ids in alone], [p.answer for p, _ in alone], scorer,
                            cfg.rollout.eval_max_new_tokens, problems=[p for p, _ in alone])
            figures.update({"eval_no_tools/" + k.removeprefix("eval/"): v for k, v in once.items()
                            if k != "eval/samples"})
        if cfg.eval.samples:
            t2 = time.perf_counter()
            params = SamplingParams(max_new_tokens=cfg.rollout.eval_max_new_tokens, temperature=cfg.rollout.temperature,
                                    top_p=cfg.rollout.top_p, n=cfg.eval.samples)
            counts = sample_counts(colo.engine, tokenizer, prompt_ids, answers, scorer, params, multiturn,
                                   kept_problems)
            figures.update(pass_at_k_metrics(counts, list(cfg.eval.pass_k)))
            seconds["sampled"] = time.perf_counter() - t2
    seconds["total"] = time.perf_counter() - t0
    report = {"model": cfg.model.path, "data": cfg.data.path or "embedded arithmetic (held-out split)",
              "problems": len(kept), "over_length_dropped": builder.stats.dropped, "ranks": dist.world_size(),
              "engine": cfg.rollout.engine, "max_new_tokens": cfg.rollout.eval_max_new_tokens,
              "environment": cfg.env.name,
              "samples": cfg.eval.samples, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
              "accuracy_by": "the built-in number verifier (strict: the stated final answer; lenient: the last "
                             "number), not reward.functions",
              "reward_functions": scorer.own_source_metrics(), "figures": figures, "seconds": seconds,
              "examples": greedy["eval/samples"]}
    if cfg.eval.samples:
        report["per_problem"] = [{"id": p.id, "answer": p.answer, "correct": c, "samples": n}
                                 for (p, _), (n, c, _) in zip(kept, counts)]
    return report


def markdown(report: dict) -> str:
    f = report["figures"]
    lines = [f"# Evaluation of {report['model']}", "",
             f"{report['problems']} problems ({report['data']}), {report['ranks']} rank(s), "
             f"engine {report['engine']}, up to {report['max_new_tokens']} new tokens; accuracy by the built-in "
             f"number verifier (the stated final answer; lenient: the last number), not reward.functions"
             + (f", environment {report['environment']} (episodes)" if report["environment"] != "none" else "")
             + ".", "", "| metric | value |", "|---|---|",
             f"| greedy accuracy (stated answer right) | {f['eval/accuracy']:.4f} |",
             f"| greedy accuracy, lenient (last number right) | {f['eval/accuracy_lenient']:.4f} |",
             f"| greedy answers in the required format | {f['eval/format_rate']:.4f} |",
             f"| greedy mean response length (tokens) | {f['eval/response_len']:.1f} |"]
    lines += [f"| greedy mean score of your reward function {k.removeprefix('eval/reward_source/')} (unweighted) "
              f"| {v:.4f} |" for k, v in f.items() if k.startswith("eval/reward_source/")]
    if f.get("eval/reward_failures"):
        lines += [f"| reward calls that failed (scored 0) | {int(f['eval/reward_failures'])} |"]
    if "eval_no_tools/accuracy" in f:
        lines += [f"| greedy accuracy without the environment (one answer) | {f['eval_no_tools/accuracy']:.4f} |"]
    if report["samples"]:
        lines += [f"| pass@{k.split('@')[1]} ({report['samples']} samples, T={report['temperature']}, "
                  f"top_p={report['top_p']}) | {v:.4f} |" for k, v in f.items() if k.startswith("eval/pass@")]
        lines += [f"| sampled accuracy | {f['eval/sampled_accuracy']:.4f} |",
                  f"| sampled mean response length (tokens) | {f['eval/sampled_response_len']:.1f} |"]
    lines += ["", "Seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report["seconds"].items()), ""]
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="eval", version_base="1.3")
@runtime.clean_errors
def main(hydra_cfg: DictConfig) -> None:
    hydra_cfg.model.path = hf_model_dir(hydra_cfg.model.path)  # a run directory -> its checkpoint-final/
    ctx = runtime.start(hydra_cfg, recipe="eval")
    metrics = runtime.metrics_logger(ctx, CONSOLE)  # before the evaluation: a logger that cannot start says so first
    report = run_eval(ctx)
    if dist.is_rank0():  # the report first: nothing after it can lose the evaluation
        (ctx.run_dir / "eval.json").write_text(json.dumps(report, indent=2))
        (ctx.run_dir / "eval.md").write_text(markdown(report))
        log.info("%s", markdown(report))
        log.info("report: %s/eval.json, eval.md", ctx.run_dir)
    metrics.log(0, {**report["figures"], **{f"time/{k}": v for k, v in report["seconds"].items()}})
    metrics.close()
    runtime.finish()


if __name__ == "__main__":
    register_configs()
    runtime.check_command_line("eval")
    process_exit.run_and_exit(main)
