"""Weight handoff: the trainer's new weights into the engine, bucket by bucket, no files.

The trainer gathers ZeRO-3 partitions one bucket at a time (bounded extra memory) and the engine
takes each bucket in place:
- CPU / HF engine: the engine copies into its own preallocated buffers (one memcpy per tensor).
- GPU / SGLang: the bucket is flattened and passed as CUDA IPC handles; the engine maps the
  trainer's memory and copies device-to-device (see colo_rl/rollout/sglang/weights.py).

With LoRA (model.lora.rank > 0) there are two more modes, chosen once by `choose_lora_handoff`:
- "adapter": the engine holds the base and LoRA adapters it applies unmerged. The base travels
  once (the first handoff); afterwards only the adapter tensors, and the engine keeps its base
  weights resident between phases (MemoryManager: `keeps_engine_weights`).
- "merged": the engine has no adapters (SGLang without load_lora_adapter_from_tensors, TP > 1,
  or model.lora.handoff=merged): the trainer merges W + scaling * B @ A bucket by bucket and
  hands off the whole model, as a full fine-tune does.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from colo_rl import dist
from colo_rl.errors import HandoffError
from colo_rl.lora import lora_enabled
from colo_rl.metrics import StepSums
from colo_rl.rollout.base import HandoffStats, capabilities_of
from colo_rl.train.adapters import EngineWeights, adapter_names, base_names, gathered_external, sized_buckets

log = logging.getLogger("colo_rl")

HANDOFF_MODES = ("full", "adapter", "merged")


def engine_takes_adapters(engine) -> bool:
    """Does this engine apply LoRA adapters it is given as tensors? It declares the capability
    (`Capabilities.adapters`) and, as started, says so (`supports_adapters()`)."""
    return capabilities_of(engine).adapters and bool(engine.supports_adapters())


def choose_lora_handoff(model_cfg, engine) -> tuple[str, str]:
    """(mode, why) for this run; the same on every rank (the gathers are collectives): adapters
    only when every rank's engine takes them (ranks without an engine count as taking them)."""
    if not lora_enabled(model_cfg):
        return "full", "full fine-tune"
    if model_cfg.lora.handoff == "merged":
        return "merged", "model.lora.handoff=merged"
    own = engine is None or engine_takes_adapters(engine)
    (lacking,) = dist.all_reduce_max([0.0 if own else 1.0])
    if lacking:
        return "merged", (f"the rollout engine ({type(engine).__name__}) cannot take LoRA adapters as tensors "
                          "(SGLang needs Engine.load_lora_adapter_from_tensors and tp_size 1)")
    return "adapter", "the engine applies the adapters unmerged"


class WeightHandoff:
    """Moves the actor's weights into the rollout engine.

    `feeds_engine` is False on ranks that take part in the ZeRO-3 gather but do not own an engine
    (with SGLang tensor parallelism only the first rank of each TP group drives the engine).
    """

    def __init__(self, actor, engine, bucket_mb: int, feeds_engine: bool = True, mode: str = "full"):
        if mode not in HANDOFF_MODES:
            raise ValueError(f"handoff mode {mode!r} is not one of {HANDOFF_MODES}")
        self.actor = actor
        self.engine = engine
        self.max_bucket_bytes = self.bucket_bytes = int(bucket_mb) << 20
        self.feeds_engine = feeds_engine
        self.mode = mode
        # full / merged: what an engine takes, planned and gathered one way (EngineWeights')
        self.weights = EngineWeights(actor, merged=mode == "merged")
        if mode in ("full", "merged"):
            self._plan(self.bucket_bytes)
        else:
            self.buckets = sized_buckets(actor, base_names(actor), self.bucket_bytes)  # the base, sent once
            self.adapter_buckets = sized_buckets(actor, adapter_names(actor), self.bucket_bytes)
        self.base_sent = False
        self.gathered_names: list[str] = []  # what the last push gathered (the ledger's h2d bytes)

    def _plan(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets = [names for names, _ in self.weights.plan(bucket_bytes)]

    def _size_buckets(self) -> None:
        """Buckets as large as this handoff's free memory allows (peak: two of them), at most
        colocate.handoff_bucket_mb: one engine call where it fits. Every rank plans with the least
        free memory of any rank (the gathers are collectives). Without CUDA: the cap."""
        free = dist.device_free_bytes()
        if free is None:
            return
        (fit,) = dist.all_reduce_max([-float(bucket_bytes_for(free, self.max_bucket_bytes))])
        if int(-fit) != self.bucket_bytes:
            self._plan(int(-fit))

    def _push_flat(self, stats: HandoffStats) -> bool:
        """The zero-copy handoff: the engine reads DeepSpeed's flat weight buffer as it is (world size
        1, weight partitions on the device). False where it does not apply."""
        load = getattr(self.engine, "load_flat_weights", None)
        if self.mode != "full" or not self.feeds_engine or not callable(load):
            return False
        flat = self.actor.flat_weights()
        if flat is None or not load(*flat):
            return False
        stats.bytes += sum(t.numel() * t.element_size() for _, t in flat[1])
        stats.buckets += 1
        stats.zero_copy = True
        return True

    @property
    def keeps_engine_weights(self) -> bool:
        """The engine keeps its weights between phases (adapter mode: the base is never re-sent)."""
        return self.mode == "adapter"

    def push(self) -> HandoffStats:
        t0 = time.perf_counter()
        stats = HandoffStats(content="merged" if self.mode == "merged" else "full")
        self.gathered_names = []
        if self.mode == "adapter":
            self._push_adapters(stats)
        elif self._push_flat(stats):
            pass
        else:
            self._size_buckets()
            for names in self.buckets:
                with self.weights.gathered(names) as tensors:
                    if self.feeds_engine:
                        self.engine.load_weights(tensors)
                    stats.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                    stats.buckets += 1
                self.gathered_names += names
        if self.feeds_engine:
            self.engine.finish_weight_update()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _push_adapters(self, stats: HandoffStats) -> None:
        """The base once (as it is: never merged), then every adapter tensor in one engine call."""
        stats.content = "adapters"
        if not self.base_sent:
            stats.content = "base+adapters"
            for names in self.buckets:
                with gathered_external(self.actor, names) as tensors:
                    if self.feeds_engine:
                        self.engine.load_weights(tensors)
                    stats.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                    stats.buckets += 1
                self.gathered_names += names
            self.base_sent = True
        adapters = []
        for names in self.adapter_buckets:
            with gathered_external(self.actor, names) as tensors:  # copied: the gathers end with the context
                adapters += [(n, t.detach().clone()) for n, t in tensors] if self.feeds_engine else []
                stats.bytes += sum(t.numel() * t.element_size() for _, t in tensors)
                stats.buckets += 1
            self.gathered_names += names
        if self.feeds_engine:
            self.engine.load_adapter(adapters)


# Free memory the handoff leaves alone: the engine's own transient work in load_weights.
HANDOFF_RESERVE_BYTES = 1 << 30
MIN_BUCKET_BYTES = 64 << 20


def bucket_bytes_for(free_bytes: int, max_bucket_bytes: int, reserve: int = HANDOFF_RESERVE_BYTES) -> int:
    """The handoff's bucket size: half of what is free beyond `reserve` (a gathered bucket and its
    flattened copy live together), between MIN_BUCKET_BYTES and `max_bucket_bytes`."""
    return int(min(max_bucket_bytes, max(MIN_BUCKET_BYTES, (free_bytes - reserve) // 2)))


class LogprobAgreement:
    """Do the engine and the trainer agree on the log-probs of what the engine generated?

    Accumulate (engine log-prob, trainer log-prob) pairs over the micro-batches of a step, then
    `check` reduces over ranks and raises HandoffError above the threshold: the engine is then
    not sampling from the trainer's weights (a failed or skipped weight update).
    """

    def __init__(self) -> None:
        self.sums = StepSums(["abs_sum", "count"], maxima=["max"])  # on the trainer's device, read once by `check`

    def add(self, rollout_logp, trainer_logp, mask) -> None:
        dev = trainer_logp.device  # the engine's log-probs and the mask may come from the CPU-side batch
        m = mask.float().to(dev)
        diff = (rollout_logp.float().to(dev) - trainer_logp.detach().float()).abs() * m
        # diff >= 0 (masked-out positions are 0): a max of 0 for an empty batch is neutral
        self.sums.add(abs_sum=diff.sum(), count=m.sum(), max=diff.max() if diff.numel() else 0.0)

    def check(self, threshold: Optional[float]) -> dict[str, float]:
        t = self.sums.totals()
        total, count, mx = t["abs_sum"], t["count"], t["max"]
        mean = total / max(count, 1.0)
        if threshold is not None and not (mean <= threshold):  # NaN fails too
            raise HandoffError(
                f"the engine's log-probs differ from the trainer's by {mean:.4f} per token on average "
                f"(max {mx:.4f}; colocate.handoff_check_max_mean_abs={threshold}): the engine is not on "
                "the trainer's weights. Check the weight handoff (engine update errors above); raise the "
                "threshold only for a known precision mismatch between engine and trainer."
            )
        return {"handoff/logprob_diff_mean": mean, "handoff/logprob_diff_max": mx}

