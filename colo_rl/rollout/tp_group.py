"""Engines with tensor parallelism inside a node: one engine per TP group, driven by its first rank.

Ranks [g*tp, (g+1)*tp) form group g, local ranks of one node (`engine_rank_layout`). Every rank
holds a TPGroupEngine with the protocol's methods; only the owner (the group's first rank) holds
the real engine. Traffic goes over a per-group gloo process group (objects are small pickles:
prompt ids, completions, IPC handles):

- generate: every rank gathers its prompts to the owner, the owner generates them all in one call
  (one batch keeps the engine busy), and scatters each rank exactly its own completions back.
- load_weights: every rank prepares a payload for its own GPU (the engine's TP rank i maps memory
  on GPU owner + i), the owner passes all of them to the engine in one update, then tells the
  group whether it worked; every rank keeps its producer tensors alive until then.
- sleep / wake: the owner releases or resumes; barriers make sure no trainer rank reloads its
  states onto a GPU the engine still occupies, and no engine resumes onto a GPU a trainer still holds.

A failure on the owner is sent to every rank of the group, which raises too (no rank hangs in a
collective the owner never joins).
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as tdist

from colo_rl import dist
from colo_rl.errors import ConfigError, HandoffError
from colo_rl.phase import Phase
from colo_rl.rollout.base import ALL_TAGS, Capabilities, Completion, SamplingParams


def engine_rank_layout(world_size: int, tp_size: int, local_world_size: Optional[int] = None) -> list[dict]:
    """Trainer rank -> engine TP group, laid out by local rank so that a group never spans nodes.

    torchrun numbers the ranks of a node consecutively (rank = node * local_world_size + local
    rank), so with tp_size dividing the ranks per node, ranks [g*tp, (g+1)*tp) are local ranks
    [l, l+tp) of one node: they share its GPUs, as an engine's TP ranks must. The group's first rank
    owns the engine (the others only feed their prompts to it and take back their completions).
    `local_world_size` defaults to one node. Returns one dict per rank.
    """
    local = world_size if local_world_size is None else local_world_size
    if local < 1 or world_size % local:
        raise ConfigError(f"{world_size} ranks cannot be {local} per node: start every node with the same "
                         f"--nproc_per_node")
    if tp_size < 1 or local % tp_size:
        raise ConfigError(f"rollout.tp_size={tp_size} must divide the ranks per node ({local}): an engine's "
                         f"tensor-parallel ranks share one node's GPUs")
    out = []
    for r in range(world_size):
        owner = r - (r % local) % tp_size  # the first rank of this rank's tp_size-block within its node
        out.append({"rank": r, "node": r // local, "local_rank": r % local, "group": r // tp_size,
                    "group_ranks": list(range(owner, owner + tp_size)), "owner": owner, "owns_engine": r == owner})
    return out


def current_layout(tp_size: int) -> dict:
    return engine_rank_layout(dist.world_size(), tp_size, dist.local_world_size())[dist.rank()]


class TPGroupError(RuntimeError):
    """The engine owner of this TP group failed; the message is the owner's error."""


def new_tp_group(tp_size: int):
    """(this rank's layout dict, its group's gloo process group). Collective: every rank of the
    world must call it, with the same tp_size (torch creates every group on every rank). Checks
    that each group's ranks are on one node (torchrun's GROUP_RANK), as the layout assumes."""
    world, rank = dist.world_size(), dist.rank()
    layouts = engine_rank_layout(world, tp_size, dist.local_world_size())
    nodes = dist.all_gather_objects(dist.node_rank())
    for g in range(world // tp_size):
        if len({nodes[r] for r in layouts[g * tp_size]["group_ranks"]}) > 1:
            raise ConfigError(f"engine TP group {g} (ranks {layouts[g * tp_size]['group_ranks']}) spans nodes "
                             f"{sorted({nodes[r] for r in layouts[g * tp_size]['group_ranks']})}: start every "
                             f"node with the same --nproc_per_node, a multiple of rollout.tp_size")
    mine = None
    for g in range(world // tp_size):
        ranks = list(range(g * tp_size, (g + 1) * tp_size))
        group = tdist.new_group(ranks=ranks, backend="gloo")
        if rank in ranks:
            mine = group
    return layouts[rank], mine


def split_by_counts(items: list, counts: list[int]) -> list[list]:
    """Consecutive slices of `items` of the given lengths."""
    if sum(counts) != len(items):
        raise ValueError(f"{len(items)} items cannot be split into {counts}")
    out, start = [], 0
    for n in counts:
        out.append(items[start:start + n])
        start += n
    return out


def share_owner_authkey(layout: dict, group) -> None:
    """Every rank of the group takes the owner's multiprocessing authkey. A payload that passes a
    file descriptor (a CPU tensor through torch's ForkingPickler) is fetched from the rank that made
    it over a connection authenticated with that rank's authkey, and the engine's processes,
    children of the owner, hold the owner's: without this a non-owner's payload failed in the
    scheduler that opened it ("AuthenticationError: digest received was wrong"). CUDA IPC handles
    need no connection."""
    box = [bytes(multiprocessing.current_process().authkey)] if layout["owns_engine"] else [None]
    tdist.broadcast_object_list(box, src=layout["owner"], group=group)
    multiprocessing.current_process().authkey = box[0]


class TPGroupEngine:
    """The engine protocol for every rank of a TP group; the owner forwards to `inner`."""

    # generate is a collective of the group: every rank calls it equally often with the same params
    # (colo_rl/rollout/multiturn.py then runs every turn on every rank, with nothing to generate if need be)
    capabilities = Capabilities(lockstep_generate=True, wraps_engine=True)

    def __init__(self, inner, layout: dict, group, guard=None,
                 prepare_payload: Optional[Callable[[list], tuple[Any, Any]]] = None):
        # prepare_payload(named_tensors) -> (payload, keepalive): this rank's share of a weight update
        # (the engine class's tp_rank_payload, passed in by colocate/setup.py).
        if layout["owns_engine"] != (inner is not None):
            raise ValueError(f"rank {layout['rank']}: the group's first rank must hold the engine and only it "
                             f"(owns_engine={layout['owns_engine']}, engine given: {inner is not None})")
        self.inner = inner
        self.layout = layout
        self.group = group
        self.owner = layout["owner"]
        self.is_owner = layout["owns_engine"]
        self.guard = guard
        self.prepare_payload = prepare_payload

    @classmethod
    def build(cls, inner, tp_size: int, guard=None, prepare_payload=None) -> "TPGroupEngine":
        """Collective (creates the groups): every rank calls it; `inner` only on group owners."""
        layout, group = new_tp_group(tp_size)
        share_owner_authkey(layout, group)
        return cls(inner, layout, group, guard=guard, prepare_payload=prepare_payload)

    # ---------------------------------------------------------------- group plumbing
    def _gather(self, obj) -> Optional[list]:
        box = [None] * len(self.layout["group_ranks"]) if self.is_owner else None
        tdist.gather_object(obj, box, dst=self.owner, group=self.group)
        return box

    def _scatter(self, per_rank: Optional[list]):
        out = [None]
        tdist.scatter_object_list(out, per_rank, src=self.owner, group=self.group)
        return out[0]

    def _broadcast(self, obj):
        box = [obj]
        tdist.broadcast_object_list(box, src=self.owner, group=self.group)
        return box[0]

    def _barrier(self) -> None:
        tdist.barrier(group=self.group)

    def _run_on_owner(self, fn):
        """Run fn() on the owner; every rank gets its result or raises the owner's error."""
        status = None
        result = None
        if self.is_owner:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - sent to the group, re-raised below
                status = f"{type(e).__name__}: {e}"
        status = self._broadcast(status)
        if status is not None:
            raise TPGroupError(f"engine owner (rank {self.owner}) failed: {status}")
        return result

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.guard is not None:
            self.guard.require(Phase.GENERATION, "engine.generate")
        gathered = self._gather(([list(p) for p in prompts], params))
        per_rank = None
        if self.is_owner:
            per_rank = self._generate_for_group(gathered)
        status, completions = self._scatter(per_rank)
        if status != "ok":
            raise TPGroupError(f"engine owner (rank {self.owner}) failed to generate: {completions}")
        return completions

    def _generate_for_group(self, gathered: list) -> list:
        """[(status, completions of rank i)] for each group rank, in group order."""
        try:
            params = gathered[0][1]
            differing = [self.layout["group_ranks"][i] for i, (_, p) in enumerate(gathered) if p != params]
            if differing:
                raise ValueError(f"ranks {differing} asked for sampling params different from rank {self.owner}'s "
                                 "in one generate call; the group generates in one batch with one set of params")
            counts = [len(p) * params.n for p, _ in gathered]
            flat = [p for prompts, _ in gathered for p in prompts]
            completions = self.inner.generate(flat, params)
            if len(completions) != sum(counts):
                raise RuntimeError(f"engine returned {len(completions)} completions for {sum(counts)} requests")
            return [("ok", part) for part in split_by_counts(completions, counts)]
        except Exception as e:  # noqa: BLE001 - every rank of the group raises it
            return [("error", f"{type(e).__name__}: {e}")] * len(gathered)

    # ---------------------------------------------------------------- memory
    # Each rank reports the memory its own GPU gained or lost (the engine's TP rank on it); without
    # CUDA the owner reports what its engine said and the others 0.
    def sleep(self, tags: Iterable[str] = ALL_TAGS) -> int:
        tags = list(tags)
        before = dist.device_free_bytes()
        released = self._run_on_owner(lambda: self.inner.sleep(tags)) or 0
        self._barrier()  # the engine's memory is gone from every GPU before anyone reloads
        after = dist.device_free_bytes()
        return released if before is None else max(0, after - before)

    def wake(self, tags: Iterable[str] = ALL_TAGS) -> int:
        tags = list(tags)
        self._barrier()  # every rank has paged its trainer states out before the engine resumes
        before = dist.device_free_bytes()
        taken = self._run_on_owner(lambda: self.inner.wake(tags)) or 0
        after = dist.device_free_bytes()  # after the owner's broadcast: the engine has resumed
        return taken if before is None else max(0, before - after)

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        payload, keepalive = self.prepare_payload(named_tensors)
        gathered = self._gather(payload)
        try:
            # The broadcast inside also keeps every rank here, producers alive, until the
            # engine has copied from all of them.
            self._run_on_owner(lambda: self.inner.load_rank_payloads(gathered))
        except TPGroupError as e:
            raise HandoffError(str(e)) from e
        finally:
            del keepalive
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()

    def finish_weight_update(self) -> None:
        try:
            self._run_on_owner(lambda: self.inner.finish_weight_update())
        except TPGroupError as e:
            raise HandoffError(str(e)) from e

    def shutdown(self) -> None:
        if self.is_owner and self.inner is not None:
            self.inner.shutdown()
