"""Held-out evaluation: greedy decoding on every rank's share, accuracy reduced over ranks."""

from __future__ import annotations

import logging
import math
from typing import Optional

from colo_rl import dist
from colo_rl.metrics import EVAL_SWITCH_KEYS
from colo_rl.rollout.base import SamplingParams
from colo_rl.rollout.multiturn import generate_completions, policy_texts

log = logging.getLogger("colo_rl")


def evaluate(engine, tokenizer, prompt_ids: list[list[int]], answers: list[str], scorer,
             max_new_tokens: int, multiturn=None, problems: Optional[list] = None) -> dict[str, float]:
    """Strict accuracy (the stated final answer is right), lenient accuracy (the last number is
    right), the share of answers stated in the required format, and mean response length; with
    reward functions of the user's own, each one's mean score. `multiturn` (a MultiTurnRollout):
    episodes with the environment, scored on the policy's text; `problems` (one per prompt) are what
    its sessions start from, and their record fields the user's reward functions read."""
    sums, samples = evaluate_shard(engine, tokenizer, prompt_ids, answers, scorer, max_new_tokens, multiturn, problems)
    return eval_metrics(dist.all_reduce_sum(sums), samples)


def evaluate_shard(engine, tokenizer, prompt_ids: list[list[int]], answers: list[str], scorer,
                   max_new_tokens: int, multiturn=None, problems: Optional[list] = None
                   ) -> tuple[dict[str, float], list[dict]]:
    """This rank's share (dist.shard) greedily decoded and scored, not reduced over ranks: the sums
    (problems, correct, lenient, formatted, response tokens; with the user's reward functions each
    one's score and the failed calls) and up to 3 samples. Every rank has the same keys, an empty
    share too. A split run's generation ranks send these to the trainer, which adds them up
    (colo_rl/split/pools.py)."""
    local_ids, local_answers = dist.shard(prompt_ids), dist.shard(answers)
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    completions = generate_completions(engine, local_ids, params, multiturn, dist.shard(problems) if problems else None)
    # An empty share (fewer held-out problems than ranks) scores nothing: no decoded empty string.
    completions = completions[:len(local_ids)]
    texts = policy_texts(tokenizer, completions) if completions else []
    res = scorer.verify(texts, local_answers)  # correctness: the built-in verifier
    sums = {"count": float(len(texts)), "correct": float(sum(res.correct)),
            "lenient": float(sum(res.correct_lenient)), "formatted": float(sum(res.formatted)),
            "response_tokens": float(sum(len(c.token_ids) for c in completions))}
    sums.update(own_reward_sums(scorer, texts, local_answers, dist.shard(problems) if problems else None))
    return sums, [{"completion": t, "answer": a} for t, a in zip(texts[:3], local_answers[:3])]


def own_reward_sums(scorer, texts: list[str], answers: list[str], problems: Optional[list]) -> dict[str, float]:
    """The user's reward functions (reward.functions entries that are files) on the held-out
    completions: each one's summed unweighted score and the failed calls. A call that raises,
    returns NaN or times out scores 0 and is counted (eval/reward_failures), not fatal: an
    evaluation at the end of a long run is not lost to one bad answer. Nothing without such functions,
    or without `problems` (SFT / DPO held-out examples: no records for the functions' fields)."""
    names = scorer.own_source_metrics()
    if not names or problems is None:
        return {}
    sums = {f"reward_source/{name}": 0.0 for name in names}
    sums["reward_failures"] = 0.0
    if texts:
        scored = scorer.score(texts, answers, [p.fields for p in problems], failure_limit=1.0)
        for name in names:
            sums[f"reward_source/{name}"] = float(sum(scored.per_source[name]))
        sums["reward_failures"] = float(scored.failures)
        if scored.failures:
            log.warning("held-out evaluation: %d reward call(s) failed and scored 0; first: %s", scored.failures,
                        scored.failure_messages[0])
    return sums


def eval_metrics(sums: dict[str, float], samples: list[dict]) -> dict[str, float]:
    """The held-out metrics from the sums over every rank's share (evaluate_shard's keys)."""
    n = sums["count"]
    if n == 0:  # no held-out problems at all: nothing to report (callers skip evaluation then)
        return {"eval/count": 0.0, "eval/samples": []}
    out = {"eval/accuracy": sums["correct"] / n, "eval/accuracy_lenient": sums["lenient"] / n,
           "eval/format_rate": sums["formatted"] / n, "eval/response_len": sums["response_tokens"] / n,
           "eval/count": n}
    out.update({f"eval/reward_source/{k.removeprefix('reward_source/')}": v / n for k, v in sums.items()
                if k.startswith("reward_source/")})
    if "reward_failures" in sums:
        out["eval/reward_failures"] = sums["reward_failures"]
    out["eval/samples"] = samples
    return out


def check_held_out_size(n: int, world: int) -> bool:
    """Warn (rank 0) when fewer held-out examples than ranks: some ranks then evaluate nothing, and
    the figures rest on very few problems. Returns whether it warned."""
    if 0 < n < world:
        if dist.is_rank0():
            log.warning("only %d held-out example(s) for %d ranks: %d rank(s) evaluate nothing; raise data.eval_size "
                        "to at least the number of ranks for figures worth reading", n, world, world - n)
        return True
    return False


def generates_for_accuracy(eval_generate: bool, held: list) -> bool:
    """SFT / DPO (trainer.eval_generate): greedy held-out accuracy needs an answer on every held-out
    example (its `answer`); when some lack one it is off, and that is said with the first such
    record, not left to the missing eval/accuracy to tell."""
    if not (eval_generate and held):
        return False
    missing = [ex for ex in held if ex.answer is None]
    if not missing:
        return True
    if len(missing) < len(held):
        log.warning("trainer.eval_generate: %d of %d held-out examples have no answer (first: %s), so greedy held-out "
                    "accuracy is off (held-out loss only); give every record an answer, or set "
                    "trainer.eval_generate=false to say so", len(missing), len(held), missing[0].origin or missing[0].id)
    else:
        log.info("trainer.eval_generate: the held-out examples carry no answer: held-out loss only, no accuracy")
    return False


def held_out_accuracy(colo, tokenizer, prompt_ids: list[list[int]], answers: list[str], scorer, max_new_tokens: int,
                      step: int, multiturn=None, prefix: str = "eval/", problems: Optional[list] = None
                      ) -> dict[str, float]:
    """`evaluate` in the generation phase (the engine gets the trainer's current weights through
    the handoff first), with its log line: every recipe's greedy held-out accuracy. Its metrics
    are named `prefix` + name (eval/accuracy ...)."""
    if not prompt_ids:  # data.eval_size=0: no held-out problems, nothing to report
        return {}
    before = colo.switch.timed_phase_seconds()
    with colo.switch.generation():
        res = evaluate(colo.engine, tokenizer, prompt_ids, answers, scorer, max_new_tokens, multiturn, problems)
    paid = switch_seconds_paid(EVAL_SWITCH_KEYS, before, colo.switch.timed_phase_seconds())
    return {**reported(res, step, prefix), **paid}


def switch_seconds_paid(keys: dict[str, str], before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the switcher's `timed_phase_seconds` grew by between `before` and `after`, under `keys`;
    nothing when the phase was already right. An evaluation's switch spares the next step its own:
    the bottleneck report charges it to that step (colo_rl/bottleneck.py `charged_rows`), unless a
    save (time/save_phase_switch) switched back first."""
    if not after:  # a rank without phases (split placement's trainer)
        return {}
    paid = {ours: after[k] - before[k] for k, ours in keys.items()}
    return {k: v for k, v in paid.items() if v > 0}


def reported(res: dict, step: int, prefix: str = "eval/") -> dict[str, float]:
    """`evaluate`'s result logged (one line) and named `prefix` + name, its samples left out."""
    samples = res.pop("eval/samples")
    example = f"; e.g. {samples[0]['completion'][:120]!r} for answer {samples[0]['answer']}" if samples else ""
    own = "".join(f", {k.removeprefix('eval/reward_source/')} {v:.3f}" for k, v in res.items()
                  if k.startswith("eval/reward_source/"))  # the user's reward functions' means
    log.info("%s @ step %d: accuracy %.3f (lenient %.3f, format %.3f%s) on %d held-out problems%s",
             prefix.rstrip("/"), step, res["eval/accuracy"], res["eval/accuracy_lenient"], res["eval/format_rate"],
             own, int(res["eval/count"]), example)
    return {prefix + k.removeprefix("eval/"): v for k, v in res.items()}


# ---------------------------------------------------------------------------------------------
# pass@k (recipes/eval.py)
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): 1 - C(n-c, k) / C(n, k), the chance that k samples drawn
    without replacement from the n include a correct one. Exact integer binomials."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{k} from {c} correct of {n} samples: need 0 < k <= n and 0 <= c <= n")
    if n - c < k:  # every draw of k includes a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_counts(engine, tokenizer, prompt_ids: list[list[int]], answers: list[str], scorer,
                  params: SamplingParams, multiturn=None,
                  problems: Optional[list] = None) -> list[tuple[int, int, int]]:
    """(samples, correct, response tokens) per problem, in the order given, on every rank: each rank
    samples params.n completions (episodes, with `multiturn`) of its share and scores them with the
    verifiers (strict accuracy)."""
    local_ids, local_answers = dist.shard(prompt_ids), dist.shard(answers)
    n = params.n
    completions = generate_completions(engine, local_ids, params, multiturn,
                                       dist.shard(problems) if problems else None)[:len(local_ids) * n]
    texts = policy_texts(tokenizer, completions) if completions else []
    correct = scorer.verify(texts, [a for a in local_answers for _ in range(n)]).correct  # no reward function is called
    mine = [(n, sum(correct[i * n:(i + 1) * n]), sum(len(c.token_ids) for c in completions[i * n:(i + 1) * n]))
            for i in range(len(local_ids))]
    return [row for part in dist.all_gather_objects(mine) for row in part]  # shards are contiguous, in rank order


def pass_at_k_metrics(counts: list[tuple[int, int, int]], ks: list[int]) -> dict[str, float]:
    """pass@k per problem, averaged over problems; the sampled accuracy and mean response length."""
    samples = sum(n for n, _, _ in counts)
    out = {f"eval/pass@{k}": sum(pass_at_k(n, c, k) for n, c, _ in counts) / len(counts) for k in ks}
    out.update({"eval/sampled_accuracy": sum(c for _, c, _ in counts) / samples,
                "eval/sampled_response_len": sum(t for _, _, t in counts) / samples})
    return out
