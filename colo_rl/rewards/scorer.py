"""Scoring a batch: every reward source, weighted and summed, with fault isolation.

A source that raises, returns NaN / inf or (in a worker) runs past `reward.timeout_s` scores that
sample 0 and is counted; the run stops only when the failed (sample, source) scores pass
`reward.max_failure_rate` of the batch's. A wrong return type is a mistake in the code, not in
one sample: RewardError at once, naming the file and the function.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from colo_rl.errors import USER_CODE_FAILURES, RewardError, failure_text
from colo_rl.rewards.pool import Call, RewardPool
from colo_rl.rewards.sources import RewardSource, resolve_sources, source_metric, split_spec
from colo_rl.rewards.verifiers import answers_match, extract_final_answer, extract_last_number, is_number_literal

log = logging.getLogger("colo_rl")


@dataclass
class RewardResult:
    rewards: list[float]  # the weighted sum of the sources plus the format bonus (empty from `verify`)
    correct: list[bool]  # strict: stated answer equals the truth
    correct_lenient: list[bool]  # last number anywhere equals the truth
    formatted: list[bool]
    failures: int = 0
    failure_messages: list[str] = field(default_factory=list)
    per_source: dict[str, list[float]] = field(default_factory=dict)  # metric name -> unweighted scores


def add_source(result: RewardResult, name: str, values: list[float], weight: float) -> None:
    """Add `weight` x `values` to the rewards, as a source of its own (metric reward_source/<name>):
    a score that comes from outside the verifiers (an environment's own)."""
    result.per_source[name] = list(values)
    result.rewards = [r + weight * v for r, v in zip(result.rewards, values)]


def model_weight(reward_cfg) -> float:
    """The reward model's weight: the last of reward.weights (1.0 when none are given)."""
    return float(reward_cfg.weights[-1]) if reward_cfg.weights and reward_cfg.model.path else 1.0


def _is_rank0() -> bool:
    # colo_rl.dist imports torch: not at module level, where the reward workers would pay for it
    from colo_rl import dist
    return dist.is_rank0()


class RewardScorer:
    def __init__(self, reward_cfg):
        self.sources = resolve_sources(list(reward_cfg.functions))
        self.weights: Optional[list[float]] = ([float(w) for w in reward_cfg.weights[:len(self.sources)]]
                                               if reward_cfg.weights else None)
        self.format_weight = reward_cfg.format_weight
        yours = [src.label for src in self.sources if src.file is not None]
        if self.format_weight and yours and _is_rank0():
            # the built-in bonus for a stated answer goes on top of your own scores: say so once
            log.warning("reward: reward.format_weight=%g adds a bonus for an answer stated as 'The answer is N' "
                        "(or '#### N', \\boxed{N}) to what %s score%s; reward.format_weight=0 leaves your "
                        "functions' scores alone", self.format_weight, ", ".join(yours), "" if len(yours) > 1 else "s")
        self.max_failure_rate = reward_cfg.max_failure_rate
        self.workers = reward_cfg.workers
        # The user's file functions go to the pool; registered functions are colo_rl's (or the
        # launching script's, which a fresh interpreter could not see) and run here.
        self.pooled = [k for k, s in enumerate(self.sources) if s.file is not None] if self.workers > 0 else []
        self.pool = None
        if self.pooled:
            specs = [f"{self.sources[k].file}:{split_spec(self.sources[k].label)[1]}" for k in self.pooled]
            self.pool = RewardPool(specs, self.workers, reward_cfg.timeout_s)
            self._finalizer = weakref.finalize(self, self.pool.close)  # workers end with the scorer

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def check_on_records(self, truths: list[str], fields: list[dict[str, Any]], origins: list[str]) -> None:
        """Call the user's reward functions on a few real records before anything slow (the model, the
        engine, the step-0 evaluation), each with the completion "The answer is <truth>.". A wrong return
        type, a record field a function needs that the data lacks, or a function that raises on every
        one of them is a RewardError now, naming the function and the records."""
        if not any(s.file is not None for s in self.sources) or not truths:
            return  # the registered functions are colo_rl's own
        where = f"the reward check on {len(truths)} record(s) of the data ({', '.join(origins)})"
        try:
            res = self.score([f"The answer is {t}." for t in truths], truths, fields, failure_limit=1.0)
        except RewardError as e:
            raise RewardError(f"{where}: {e}") from None
        for src in self.sources:
            failed = [m for m in res.failure_messages if m.startswith(f"{src.where}: ")]
            if len(failed) == len(truths):
                raise RewardError(f"{where}: reward function {src.where} failed on every one: "
                                  f"{failed[0][len(src.where) + 2:]}")

    def count_unmatchable(self, truths: list[str], origins: list[str], what: str) -> int:
        """Truths no stated answer can match (not a number literal: MATH's `\\frac{1}{2}`), counted and
        logged: reward/accuracy and eval/accuracy count them wrong, the built-in rewards score them 0."""
        bad = [k for k, t in enumerate(truths) if not is_number_literal(t)]
        if bad:
            builtin = [s.label for s in self.sources if s.file is None]
            log.warning("%s: %d of %d answers are not number literals (first: %r, %s); colo_rl's verifiers compare "
                        "numbers only, so accuracy counts them wrong%s. Score them with a reward function of your own "
                        "(reward.functions=[path/to/file.py:fn], docs/rewards.md)", what, len(bad), len(truths),
                        truths[bad[0]], origins[bad[0]] or "record 1",
                        f" and {builtin} score them 0" if builtin else "")
        return len(bad)

    def own_source_metrics(self) -> list[str]:
        """The metric names (reward_source/<name>) of the user's own functions: reward.functions
        entries that are files, in order."""
        return [source_metric(s) for s in self.sources if s.file is not None]

    def verify(self, completions: list[str], truths: list[str]) -> RewardResult:
        """Correctness and format only (held-out evaluation): no reward source is called."""
        return RewardResult(
            rewards=[],
            correct=[answers_match(extract_final_answer(t), a) for t, a in zip(completions, truths)],
            correct_lenient=[answers_match(extract_last_number(t), a) for t, a in zip(completions, truths)],
            formatted=[extract_final_answer(t) is not None for t in completions],
        )

    def score(self, completions: list[str], truths: list[str], fields: Optional[list[dict[str, Any]]] = None,
              failure_limit: Optional[float] = None) -> RewardResult:
        """Rewards of the completions; `fields`: each completion's record fields (the user's functions'
        keyword arguments). Failed calls beyond `failure_limit` (default reward.max_failure_rate) of
        the batch's raise RewardError; a wrong return type always does."""
        n = len(completions)
        fields = fields if fields is not None else [{} for _ in range(n)]
        values = [[0.0] * n for _ in self.sources]
        failed: list[str] = []
        if self.pool is not None:
            self._score_in_pool(completions, truths, fields, values, failed)
        for k, src in enumerate(self.sources):
            if k not in self.pooled:
                self._score_here(src, completions, truths, fields, values[k], failed)
        for k, src in enumerate(self.sources):  # NaN / inf: counted, scored 0
            for i, v in enumerate(values[k]):
                if not math.isfinite(v):
                    failed.append(f"{src.where}: ValueError: returned {v}")
                    values[k][i] = 0.0
        rewards = []
        for i in range(n):
            total = 0.0
            for k in range(len(self.sources)):
                total += values[k][i] if self.weights is None else self.weights[k] * values[k][i]
            rewards.append(total)
        res = self.verify(completions, truths)
        if self.format_weight:
            rewards = [r + self.format_weight * f for r, f in zip(rewards, res.formatted)]
        n_calls = max(1, n * len(self.sources))
        limit = self.max_failure_rate if failure_limit is None else failure_limit
        if len(failed) / n_calls > limit:
            raise RewardError(
                f"{len(failed)}/{n_calls} reward calls failed in this batch (> reward.max_failure_rate="
                f"{limit}); first: {failed[0]}"
            )
        res.rewards, res.failures, res.failure_messages = rewards, len(failed), failed
        res.per_source = {source_metric(s): values[k] for k, s in enumerate(self.sources)}
        return res

    @staticmethod
    def _score_here(src: RewardSource, completions, truths, fields, out: list[float], failed: list[str]) -> None:
        if src.batched:
            try:
                out[:] = src.call(completions, truths, fields)
            except RewardError:
                raise
            except USER_CODE_FAILURES as e:  # isolated: the batch's scores from this source are 0
                failed.extend([f"{src.where}: {failure_text(e)}"] * len(completions))
            return
        for i, (c, t, f) in enumerate(zip(completions, truths, fields)):
            try:
                out[i] = src.call([c], [t], [f])[0]
            except RewardError:
                raise
            except USER_CODE_FAILURES as e:  # isolated: this sample scores 0
                failed.append(f"{src.where}: {failure_text(e)}")

    def _score_in_pool(self, completions, truths, fields, values, failed: list[str]) -> None:
        """The pooled sources' calls: one per sample (per-sample functions) or one per worker's share
        of the batch (batched functions), all in flight together."""
        n, plan, calls = len(completions), [], []
        for slot, k in enumerate(self.pooled):
            if self.sources[k].batched:
                share = -(-n // max(1, min(self.workers, n)))
                chunks = [list(range(a, min(n, a + share))) for a in range(0, n, share)]
            else:
                chunks = [[i] for i in range(n)]
            for rows in chunks:
                plan.append((k, rows))
                calls.append(Call(slot, [completions[i] for i in rows], [truths[i] for i in rows],
                                  [fields[i] for i in rows]))
        for (k, rows), outcome in zip(plan, self.pool.run(calls)):
            where = self.sources[k].where
            if outcome.kind == "ok":
                for i, v in zip(rows, outcome.values):
                    values[k][i] = v
            elif outcome.kind == "return":
                raise RewardError(outcome.message)
            else:  # raised, timed out, or its worker died: these samples score 0 from this source
                failed.extend([f"{where}: {outcome.message}"] * len(rows))
