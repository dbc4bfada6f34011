"""The memory manager: what each phase holds, what moves between phases, and the ledger.

update -> generation: page trainer states (optimizer moments, fp32 master weights, gradient
buffers) to host memory, wake the engine's weights, hand off the new weights, wake the KV cache.
generation -> update: release the engine (KV cache, weights, CUDA graphs), reload trainer states.

Every transition appends one ledger record: the moves (what, from, to, bytes, seconds, whether
anything really moved) and device memory before / after. On CPU the paging moves are no-ops,
but the records are still written, so the protocol is exercised everywhere.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from colo_rl import dist
from colo_rl.rollout.base import ALL_TAGS, CUDA_GRAPH, KV_CACHE, WEIGHTS

GIB = 1 << 30
log = logging.getLogger("colo_rl")
LATE_KINDS = ("lp_params",)  # paged after the handoff when the plan's handoff_first allows
# freed by the page-out and allocated again by the reload, never copied: in `bytes` (memory the move
# frees), not in `copied_bytes` (what a bandwidth figure may divide)
UNCOPIED_KINDS = ("contiguous_grad_buffer",)


def copied_bytes(actor, kinds) -> int:
    """The bytes a page-out or reload of `kinds` copies (UNCOPIED_KINDS left out)."""
    return actor.paged_bytes(tuple(k for k in kinds if k not in UNCOPIED_KINDS))


def freeze_collector() -> dict:
    """Collect, then move every object alive now into the collector's permanent generation
    (`gc.freeze`), so later full collections skip them. Returns {"frozen_objects", "seconds"}.

    Why: DeepSpeed's `offload_states` and `empty_partition_cache` end with `gc.collect()`, which
    scans every tracked object of a process holding torch, transformers, DeepSpeed and SGLang's
    tokenizer manager: ~0.4 s per page-out whatever it moves. Frozen objects are still freed by
    reference counting; only cycles among them would never be collected, hence the collection
    first (nothing unreachable is frozen). Cycles created later are collected as before, so
    DeepSpeed's purpose (freeing cyclic garbage that holds device tensors) is kept. SGLang does the
    same (`Engine.freeze_gc`)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return {"frozen_objects": gc.get_freeze_count(), "seconds": time.perf_counter() - t0}


def memory_snapshot() -> dict[str, float]:
    """Device memory (CUDA) or process memory (CPU) right now, in GiB."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"device": "cuda", "free_gib": free / GIB, "used_gib": (total - free) / GIB,
                "allocated_gib": torch.cuda.memory_allocated() / GIB,
                "reserved_gib": torch.cuda.memory_reserved() / GIB}
    import psutil

    return {"device": "cpu", "rss_gib": psutil.Process().memory_info().rss / GIB,
            "available_gib": psutil.virtual_memory().available / GIB}


def release_cached_memory() -> int:
    """Give the trainer's cached, unused device blocks back to the driver (IPC blocks the engine
    has let go of included); returns the bytes released. No-op without CUDA."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return max(0, before - torch.cuda.memory_reserved())


class Ledger:
    """Append-only jsonl of phase transitions (rank 0 writes; every rank keeps its records)."""

    def __init__(self, path: Optional[Path], plan: Optional[dict] = None):
        self.path = path
        self.records: list[dict] = []
        self.plan = plan  # the paging plan's decision and numbers: kept on the first record

    def append(self, record: dict) -> None:
        if not self.records and self.plan is not None:
            record = {**record, "paging_plan": self.plan}
        self.records.append(record)
        if self.path is not None and dist.is_rank0():
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def weight_sync(self, step: int, nbytes: int, seconds: float) -> None:
        """Split placement's broadcast of the trainer's weights to the generation ranks, recorded as a
        colocated handoff's move is (bytes, seconds)."""
        self.append({"step": step, "transition": "weight sync", "rank": dist.rank(), "moves": [
            {"what": "weights broadcast", "from": "trainer", "to": "generation ranks", "moved": True,
             "bytes": int(nbytes), "seconds": seconds}]})


class _Transition:
    def __init__(self, name: str, step: int):
        self.record = {"step": step, "transition": name, "rank": dist.rank(), "moves": []}

    @contextmanager
    def move(self, what: str, src: str, dst: str, nbytes: int = 0):
        entry = {"what": what, "from": src, "to": dst, "bytes": int(nbytes), "moved": True}
        t0 = time.perf_counter()
        yield entry
        entry["seconds"] = time.perf_counter() - t0
        self.record["moves"].append(entry)


class MemoryManager:
    def __init__(self, actor, engine, handoff, ledger: Ledger, owns_engine: bool = True, frozen: tuple = (),
                 handoff_first: bool = False):
        self.actor = actor
        # the paging plan's order: hand off before the weight partitions leave the device (the
        # gathers then copy nothing back, and at world size 1 the engine reads DeepSpeed's own buffer)
        self.handoff_first = handoff_first
        self.frozen = tuple(frozen)  # frozen models paged with the trainer (FrozenModelPaging): name, *_states
        self.engine = engine
        self.handoff = handoff
        self.ledger = ledger
        self.owns_engine = owns_engine
        self.last_handoff = None

    def _run(self, name: str, step: int, body) -> dict:
        t = _Transition(name, step)
        t.record["memory_before"] = memory_snapshot()
        t0 = time.perf_counter()
        body(t)
        t.record["seconds"] = time.perf_counter() - t0
        t.record["memory_after"] = memory_snapshot()
        self.ledger.append(t.record)
        return t.record

    def to_generation(self, step: int) -> dict:
        def body(t: _Transition) -> None:
            later = LATE_KINDS if self.handoff_first else ()
            first = tuple(k for k in self.actor.paged_kinds if k not in later)
            with t.move("trainer states", "device", "host", self.actor.paged_bytes(first)) as m:
                m["copied_bytes"] = copied_bytes(self.actor, first)
                m["moved"] = bool(self.actor.offload_states(first))
                m["kinds"] = list(first)
                # the update's activations stay reserved in the trainer's caching allocator unless
                # returned, and a resident trainer's page-out (none) does not return them
                m["cache_released_bytes"] = release_cached_memory()
            for model in self.frozen:
                with t.move(model.name, "device", "host", model.state_bytes()) as m:
                    m["moved"] = model.offload_states()
            if self.owns_engine:
                with t.move("engine weights (allocate)", "none", "device") as m:
                    m["bytes"] = self.engine.wake([WEIGHTS])
            with t.move("weights handoff", "trainer", "engine") as m:
                stats = self.handoff.push()
                m["bytes"] = stats.bytes
                m["buckets"] = stats.buckets
                m["moved"] = self.handoff.feeds_engine
                if stats.content != "full":  # LoRA: what travelled (the default's records stay as they were)
                    m["content"] = stats.content
                # The gathers copy this rank's paged-out bf16 partitions back to the device when
                # they left before the handoff (NOTES.md, "Paging lp_params").
                lp_out = "lp_params" in first
                m["h2d_bytes"] = self.actor.handoff_h2d_bytes(self.handoff.gathered_names) if lp_out else 0
                m["zero_copy"] = bool(stats.zero_copy)
                # The buckets and their flattened copies stay reserved in the trainer's caching
                # allocator (up to 2 x handoff_bucket_mb) unless returned before the engine's
                # KV cache, sized to leave only colocate.memory_margin_gib, comes back.
                m["cache_released_bytes"] = release_cached_memory()
                self.last_handoff = stats
            rest = tuple(k for k in self.actor.paged_kinds if k in later)
            if rest:  # the weight partitions, now that the engine has its copy
                with t.move("trainer weight partitions", "device", "host", self.actor.paged_bytes(rest)) as m:
                    m["moved"] = bool(self.actor.offload_states(rest))
            if self.owns_engine:
                with t.move("engine KV cache (allocate)", "none", "device") as m:
                    m["bytes"] = self.engine.wake([KV_CACHE, CUDA_GRAPH])

        return self._run("update->generation", step, body)

    def to_train(self, step: int) -> dict:
        def body(t: _Transition) -> None:
            if self.owns_engine and self.handoff.keeps_engine_weights:
                # LoRA adapter handoff: the engine's base stays (never re-sent), only its KV cache goes.
                with t.move("engine KV cache (release; weights kept)", "device", "none") as m:
                    m["bytes"] = self.engine.sleep([KV_CACHE, CUDA_GRAPH])
            elif self.owns_engine:
                with t.move("engine KV cache + weights (release)", "device", "none") as m:
                    m["bytes"] = self.engine.sleep(ALL_TAGS)
            with t.move("trainer states", "host", "device", self.actor.paged_bytes()) as m:
                m["copied_bytes"] = copied_bytes(self.actor, self.actor.paged_kinds)
                m["moved"] = self.actor.reload_states()
            for model in self.frozen:
                with t.move(model.name, "host", "device", model.state_bytes()) as m:
                    m["moved"] = model.reload_states()

        return self._run("generation->update", step, body)
