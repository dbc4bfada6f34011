"""Tool turns with and without stopping at the call's closing tag (the HF engine's stop strings).

A multi-turn episode's turn ends at its first tool call: whatever the policy samples after
`</calculator>` is cut and never trained on. Without engine-side stop strings the engine samples on
to EOS (or the turn's token limit) and the driver cuts afterwards; with them the engine stops at the
token that completes the tag. This measures what that saves on one rollout batch of the tools demo
(`make demo-tools`: calculator, hard arithmetic, its prompts x group size, its turn and token limits),
same prompts, same sampling seed, the HF engine in one process:

    python benchmarks/tool_turns.py                                   # the embedded model
    python benchmarks/tool_turns.py --model <run>/checkpoint-final    # e.g. the demo's trained policy

Reported per mode (median over --repeats batches): generation seconds, tokens the engine sampled
per episode, tokens kept (policy tokens in the episodes), tool calls per episode. The episodes
themselves differ between the modes after the first early stop (a row that stops early leaves the
batch, so later random draws land on other rows): the comparison is of cost, at equal work.
Results: results/tool_turns-<device>-<date>.json / .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402


class CountingEngine:
    """The engine, counting the tokens it samples and the calls it gets."""

    def __init__(self, engine):
        self.engine, self.sampled, self.calls = engine, 0, 0

    def generate(self, prompts, params):
        outs = self.engine.generate(prompts, params)
        self.sampled += sum(len(o.token_ids) for o in outs)
        self.calls += 1
        return outs


def measure(args) -> dict:
    import torch
    from omegaconf import OmegaConf

    from benchmarks.step_breakdown import compose_config
    from colo_rl.data.prompts import PromptBuilder, load_problems
    from colo_rl.envs import build_environment
    from colo_rl.models import eos_token_ids, load_model, load_tokenizer, resolve_model_path
    from colo_rl.rollout.base import SamplingParams
    from colo_rl.rollout.hf import HFEngine
    from colo_rl.rollout.multiturn import MultiTurnRollout

    cfg = OmegaConf.to_object(compose_config(["env=calculator", "data=arithmetic_hard", f"model.path={args.model}",
                                              f"model.dtype={args.dtype}", *args.override]))
    tok = load_tokenizer(cfg.model.path)
    env = build_environment(cfg.env, tok, cfg.data.use_chat_template)
    builder = PromptBuilder(tok, cfg.data, env=env)
    problems = load_problems(cfg.data)[0]
    prompts_per_batch = args.prompts or cfg.rollout.prompts_per_step
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = load_model(cfg.model, dtype, seed=cfg.trainer.seed)
    eos = eos_token_ids(tok, resolve_model_path(cfg.model.path))
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, n=cfg.rollout.group_size)
    modes: dict[str, dict] = {}
    for mode in ("run on to EOS, then cut", "stop at the closing tag"):
        stop = mode.startswith("stop")
        rows = []
        for r in range(args.repeats):
            batch = problems[r * prompts_per_batch:(r + 1) * prompts_per_batch]
            prompts = [builder.encode(p) for p in batch]
            engine = CountingEngine(HFEngine(model, eos, tok.pad_token_id, max_batch=cfg.rollout.eval_batch_size,
                                             seed=cfg.rollout.seed + r, tokenizer=tok))
            rollout = MultiTurnRollout(env, tok, cfg.env.max_turns, cfg.env.max_total_tokens)
            if not stop:
                rollout.stop = ()
            t0 = time.perf_counter()
            episodes = rollout.generate(engine, prompts, params)
            seconds = time.perf_counter() - t0
            n = len(episodes)
            rows.append({"seconds": seconds, "sampled_per_episode": engine.sampled / n,
                         "kept_per_episode": sum(sum(e.policy_mask) for e in episodes) / n,
                         "tool_calls_per_episode": sum(e.tool_calls for e in episodes) / n,
                         "engine_calls": engine.calls, "episodes": n})
            print(f"{mode}: batch {r}: {seconds:.1f} s, {rows[-1]['sampled_per_episode']:.1f} sampled / "
                  f"{rows[-1]['kept_per_episode']:.1f} kept tokens per episode", flush=True)
        modes[mode] = {"batches": rows, **{k: statistics.median(row[k] for row in rows) for k in rows[0]}}
    return {"model": args.model, "dtype": args.dtype, "prompts_per_batch": prompts_per_batch,
            "group_size": cfg.rollout.group_size, "max_turns": cfg.env.max_turns,
            "max_new_tokens_per_turn": cfg.rollout.max_new_tokens, "max_total_tokens": cfg.env.max_total_tokens,
            "modes": modes}


def table(result: dict) -> str:
    lines = [f"# Tool turns: stopping at the closing tag vs sampling on to EOS ({result['model']}, {result['dtype']})",
             "",
             f"One rollout batch of the tools demo: {result['prompts_per_batch']} prompts x {result['group_size']} "
             f"episodes, <= {result['max_turns']} turns of <= {result['max_new_tokens_per_turn']} tokens, HF engine, "
             "one process; medians over the batches.",
             "",
             "| mode | generation s | sampled tokens / episode | kept tokens / episode | tool calls / episode |",
             "|---|---|---|---|---|"]
    for mode, m in result["modes"].items():
        lines.append(f"| {mode} | {m['seconds']:.1f} | {m['sampled_per_episode']:.1f} | {m['kept_per_episode']:.1f} | "
                     f"{m['tool_calls_per_episode']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded", help="model.path: embedded, or an HF model directory")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompts", type=int, default=0, help="prompts per batch (0: the demo's prompts_per_step)")
    p.add_argument("--repeats", type=int, default=2, help="batches per mode (different prompts, the same in both)")
    p.add_argument("--override", action="append", default=[], help="a config override (repeatable), e.g. model=tiny")
    p.add_argument("--name", default="tool_turns", help="results file name (one per model)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--no-readme", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    common.publish(args.name, result, table(result), args.out, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
