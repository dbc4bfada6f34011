"""Weight handoff: the trainer's new weights into the engine, bucket by bucket, no files.

The trainer gathers ZeRO-3 partitions one bucket at a time (bounded extra memory) and the engine
takes each bucket in place:
- CPU / HF engine: the engine copies into its own preallocated buffers (one memcpy per tensor).
- GPU / SGLang: the bucket is flattened and passed as CUDA IPC handles; the engine maps the
  trainer's memory and copies device-to-device (see colo_rl/rollout/sglang/weights.py).
"""

from __future__ import annotations

import time
from typing import Optional

from colo_rl import dist
from colo_rl.errors import HandoffError
from colo_rl.rollout.base import HandoffStats
from colo_rl.train.actor import plan_buckets


class WeightHandoff:
    """Moves the actor's weights into the rollout engine.

    `feeds_engine` is False on ranks that take part in the ZeRO-3 gather but do not own an engine
    (with SGLang tensor parallelism only the first rank of each TP group drives the engine).
    """

    def __init__(self, actor, engine, bucket_mb: int, feeds_engine: bool = True):
        self.actor = actor
        self.engine = engine
        self.bucket_bytes = int(bucket_mb) << 20
        self.feeds_engine = feeds_engine
        self.buckets = plan_buckets(actor.named_parameter_sizes(), self.bucket_bytes)

    def push(self) -> HandoffStats:
        t0 = time.perf_counter()
        stats = HandoffStats()
        for names in self.buckets:
            with self.actor.gathered(names) as tensors:
                if self.feeds_engine:
                    self.engine.load_weights(tensors)
                stats.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                stats.buckets += 1
        if self.feeds_engine:
            self.engine.finish_weight_update()
        stats.seconds = time.perf_counter() - t0
        return stats


class LogprobAgreement:
    """Do the engine and the trainer agree on the log-probs of what the engine generated?

    Accumulate (engine log-prob, trainer log-prob) pairs over the micro-batches of a step, then
    `check` reduces over ranks and raises HandoffError above the threshold: the engine is then
    not sampling from the trainer's weights (a failed or skipped weight update).
    """

    def __init__(self) -> None:
        self.abs_sum = 0.0
        self.count = 0.0
        self.max = 0.0

    def add(self, rollout_logp, trainer_logp, mask) -> None:
        dev = trainer_logp.device  # the engine's log-probs and the mask come from the CPU-side batch
        m = mask.float().to(dev)
        diff = (rollout_logp.float().to(dev) - trainer_logp.detach().float()).abs() * m
        self.abs_sum += float(diff.sum())
        self.count += float(m.sum())
        if m.sum() > 0:
            self.max = max(self.max, float(diff.max()))

    def check(self, threshold: Optional[float]) -> dict[str, float]:
        total, count = dist.all_reduce_sum([self.abs_sum, self.count])
        (mx,) = dist.all_reduce_max([self.max])
        mean = total / max(count, 1.0)
        if threshold is not None and not (mean <= threshold):  # NaN fails too
            raise HandoffError(
                f"the engine's log-probs differ from the trainer's by {mean:.4f} per token on average "
                f"(max {mx:.4f}; colocate.handoff_check_max_mean_abs={threshold}): the engine is not on "
                "the trainer's weights. Check the weight handoff (engine update errors above); raise the "
                "threshold only for a known precision mismatch between engine and trainer."
            )
        return {"handoff/logprob_diff_mean": mean, "handoff/logprob_diff_max": mx}

