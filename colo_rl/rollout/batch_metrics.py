"""The metrics of a step's sampled batch (docs/metrics.md): rewards by source, the groups without a
signal, response lengths and stops, sampling rounds, multi-turn episodes; summed over ranks (a
collective: every rank calls it)."""

from __future__ import annotations

from typing import Any, Optional

from colo_rl import algos, dist
from colo_rl.rollout.multiturn import episode_metrics
from colo_rl.samples import Rollout


def batch_metrics(rollout: Rollout, generation_seconds: float, env: Optional[Any] = None,
                  overlong_shaping: bool = False, dynamic_sampling: bool = False) -> dict[str, float]:
    """`rollout`'s metrics over all ranks. `generation_seconds`: this rank's; throughput divides
    every rank's tokens by the slowest rank's time, the wall time the phase took. `env`: the run's
    environment (episode metrics), None without one; `overlong_shaping` / `dynamic_sampling`: add
    those options' metrics."""
    completions, raw, sources = rollout.completions, rollout.rewards, rollout.sources()
    shaped = rollout.total()
    sums = dist.all_reduce_sum({
        "reward": float(raw.sum()), "reward_sq": float((raw ** 2).sum()), "n": float(len(raw)),
        "correct": sum(rollout.flat("correct")), "lenient": sum(rollout.flat("lenient")),
        "formatted": sum(rollout.flat("formatted")), "response_tokens": sum(len(c.token_ids) for c in completions),
        # what the engine sampled, every round's: a multi-turn episode's observations are the
        # environment's, not generated
        "gen_tokens": float(rollout.generated_tokens),
        "stopped": sum(c.finish_reason == "stop" for c in completions), "failures": rollout.failures,
        "shaped_reward": float(shaped.sum()), "filled": rollout.filled,
        # groups whose shaped rewards are all equal: a zero group advantage, no learning signal
        "groups": float(len(rollout.groups)),
        "flat_groups": float((~algos.informative_groups(shaped, rollout.group_size)).sum()) if rollout.groups else 0.0,
        **{f"source:{name}": float(sum(v)) for name, v in sources.items()}})
    (slowest,) = dist.all_reduce_max([generation_seconds])
    n, mean = sums["n"], sums["reward"] / sums["n"]
    out = {"reward/mean": mean, "reward/std": max(0.0, sums["reward_sq"] / n - mean ** 2) ** 0.5,
           "reward/accuracy": sums["correct"] / n, "reward/accuracy_lenient": sums["lenient"] / n,
           "reward/format_rate": sums["formatted"] / n, "reward/failures": sums["failures"],
           "reward/zero_std_groups": sums["flat_groups"] / max(sums["groups"], 1.0),
           "response/len_mean": sums["response_tokens"] / n, "response/stop_rate": sums["stopped"] / n,
           "throughput/gen_tokens_per_s": sums["gen_tokens"] / max(slowest, 1e-9),
           **{f"reward_source/{name}": sums[f"source:{name}"] / n for name in sources}}
    if overlong_shaping:
        out["reward/overlong_penalty"] = (sums["shaped_reward"] - sums["reward"]) / n
    if dynamic_sampling:
        out.update({"sampling/rounds": float(rollout.rounds), "sampling/filled_groups": sums["filled"]})
    if env is not None:  # per episode: turns, tool calls, ...; tool_error_rate per call
        episodes = dist.all_reduce_sum(episode_metrics(completions))
        out.update({k: v / n for k, v in episodes.items()})
        if not env.answers_every_turn:  # tools: per call (a conversation's failures: env/tool_errors)
            out["env/tool_error_rate"] = episodes["env/tool_errors"] / max(episodes["env/tool_calls"], 1.0)
    return out
