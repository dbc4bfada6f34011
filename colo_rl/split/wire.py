"""What travels between the pools, over the job's process group (gloo on CPU, NCCL on GPU).

Rollouts: pickled objects, generation rank -> trainer rank, point-to-point. A message is a header
(int64: payload bytes, kind) and the payload (uint8); the generator sends without blocking
(`isend`), so up to the queue's capacity of rollouts are in flight while it generates the next.
Weights: the leader trainer broadcasts in buckets to the weight group (leader + generators):
an int64 header (version, stop, evaluate), then each bucket as one flat uint8 buffer. A generation rank
posts its receives ahead (async) and looks between generate calls whether they completed, so
its engine switches version only between generate calls.
On NCCL every buffer lives on the rank's GPU (`wire_device`): that is the only GPU-specific line; empty
buffers are allocated there directly (`wire_empty`), never staged on the host.

A wait on a weight broadcast polls (`wait`) and ends with an error as soon as a rank of the job on
this node is gone (`watch_peers`): gloo does not always fail a broadcast whose peer died (a
leader's bucket broadcast to a SIGKILLed generation rank waited in `Work::wait` for the process
group's timeout, 30 min, until torchrun's SIGKILL 30 s later).
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil
import torch
import torch.distributed as tdist

from colo_rl import dist

KIND_OBJECT, KIND_END = 0, 1
ALIGN = 16  # bytes: each tensor of a bucket starts aligned, so a uint8 slice views as any dtype


def wire_device() -> torch.device:
    """Where the backend wants its tensors: the GPU for NCCL, the host for gloo."""
    return dist.device() if tdist.get_backend() == "nccl" else torch.device("cpu")


def on_wire(t: torch.Tensor) -> torch.Tensor:
    """A tensor with contents, where the backend wants it."""
    return t.to(wire_device())


def wire_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer to receive or pack into, allocated where the backend wants it: no model-sized host
    buffer staged and copied to the GPU for every bucket of every weight version."""
    return torch.empty(n, dtype=dtype, device=wire_device())


@dataclass
class PeerWatch:
    """The job's other ranks on this node, job rank -> pid: a wait on the other pool ends when one
    of them is gone (exited, or a zombie its launcher has not reaped yet). Ranks on other nodes are
    left to the backend's error and torchrun's agent, which stops every rank of a failed node."""
    pids: dict[int, int]

    def gone(self) -> Optional[str]:
        for r, pid in self.pids.items():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            return f"rank {r} (pid {pid}) exited"
        return None


_WATCH: Optional[PeerWatch] = None
CHECK_EVERY_S = 0.25  # how often a wait looks at the peers' processes
MAX_POLL_S = 0.02  # a wait's longest sleep between completion checks (its added latency)


def watch_peers() -> PeerWatch:
    """Every rank of the job calls it once (a collective of the default group), before the pools
    talk: from then on `wait` watches the other ranks on this node."""
    global _WATCH
    everyone = dist.all_gather_objects((dist.node_rank(), os.getpid()))  # before set_scope: the whole job
    me = dist.job_rank()
    _WATCH = PeerWatch({r: pid for r, (node, pid) in enumerate(everyone) if node == dist.node_rank() and r != me})
    return _WATCH


def wait(works: list) -> None:
    """Wait for `works` (async collectives: the weight broadcasts) by polling them, with back-off
    up to MAX_POLL_S, and look at the peers' processes every CHECK_EVERY_S: a peer gone raises
    RuntimeError naming it (the caller's `peer()` turns it into a PoolError). A work that failed
    raises the backend's error from its `wait()`, which also orders a GPU stream (NCCL).
    Not for gloo's point-to-point works: their `is_completed()` stays False until `wait()` (the
    rollouts' sends and receives block in `wait()`; gloo fails them when the peer dies)."""
    delay, check_at = 0.0005, time.monotonic() + CHECK_EVERY_S
    for w in works:
        while _WATCH is not None and not w.is_completed():
            if time.monotonic() >= check_at:
                if why := _WATCH.gone():
                    raise RuntimeError(why)
                check_at = time.monotonic() + CHECK_EVERY_S
            time.sleep(delay)
            delay = min(2 * delay, MAX_POLL_S)
        w.wait()


class Pending:
    """Sends in flight: their works, and the tensors they read (kept alive until done)."""

    def __init__(self, works: list, tensors: list[torch.Tensor]):
        self.works, self.tensors = works, tensors

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def send_object(obj: Any, dst: int, group) -> Pending:
    """Start sending `obj` (pickled) to job rank `dst` over `group`, a gloo group (`dist.new_host_groups`:
    host bytes; an NCCL send would spin a kernel on the generator's GPU until the trainer reads it,
    through the engine's generation); None sends the end marker."""
    if obj is None:
        header = torch.tensor([0, KIND_END], dtype=torch.int64)
        return Pending([tdist.isend(header, dst, group=group)], [header])
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    header = torch.tensor([payload.numel(), KIND_OBJECT], dtype=torch.int64)
    return Pending([tdist.isend(header, dst, group=group), tdist.isend(payload, dst, group=group)], [header, payload])


def recv_object(src: int, group) -> Optional[Any]:
    """The next object from job rank `src` over the gloo `group` (blocking); None at its end marker."""
    header = torch.empty(2, dtype=torch.int64)
    tdist.recv(header, src, group=group)
    n, kind = (int(x) for x in header)
    if kind == KIND_END:
        return None
    payload = torch.empty(n, dtype=torch.uint8)
    tdist.recv(payload, src, group=group)
    return pickle.loads(payload.numpy().tobytes())


def send_beat(slot: Optional[int], dst: int, group) -> Pending:
    """A generator's heartbeat to a rank of its TP engine (`roles.EngineHelper`) over their gloo
    group (`dst`: the job rank): the slot just sent, or the end (None). Host memory only: the
    helper's GPU belongs to the engine."""
    beat = torch.tensor([-1 if slot is None else slot], dtype=torch.int64)
    return Pending([tdist.isend(beat, dst, group=group)], [beat])


def recv_beat(src: int, group) -> Optional[int]:
    """The next heartbeat from job rank `src` over `group` (blocking); None at the end."""
    beat = torch.empty(1, dtype=torch.int64)
    tdist.recv(beat, src, group=group)
    return None if int(beat) < 0 else int(beat)


# ------------------------------------------------------------------ weights
@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the bucket

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def bucket_layout(params: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[list[Slot]]:
    """Consecutive (name, shape, dtype) in buckets of at most `bucket_bytes` (a larger tensor alone),
    each tensor at an ALIGN-ed offset: the same layout on the leader and the generators."""
    buckets: list[list[Slot]] = []
    used = 0
    for name, shape, dtype in params:
        nbytes = Slot(name, tuple(shape), dtype, 0).nbytes
        fits = bool(buckets) and used + nbytes <= bucket_bytes
        offset = used if fits else 0
        if not fits:
            buckets.append([])
        buckets[-1].append(Slot(name, tuple(shape), dtype, offset))
        used = -(-(offset + nbytes) // ALIGN) * ALIGN
    return buckets


def bucket_bytes(bucket: list[Slot]) -> int:
    last = bucket[-1]
    return -(-(last.offset + last.nbytes) // ALIGN) * ALIGN


def unpack(bucket: list[Slot], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket's named tensors as views of its flat buffer."""
    return [(s.name, flat[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in bucket]


def pack(bucket: list[Slot], tensors: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
    """Copy the named tensors into the flat buffer at the bucket's offsets."""
    for s, (name, t) in zip(bucket, tensors):
        assert name == s.name, (name, s.name)
        flat[s.offset:s.offset + s.nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))


class WeightSender:
    """The trainer's side: every trainer joins the ZeRO-3 gathers, the leader broadcasts.

    `weights` is the trainer's weights as an engine takes them (`train.adapters.EngineWeights`):
    `plan(bucket_bytes)` gives, per gather, the names gathered and the (name, shape, dtype) of the
    tensors it yields (HF names; a LoRA model's merged weights), `gathered(names)` yields them."""

    def __init__(self, weights, group, leader: int, max_bucket_bytes: int):
        self.weights, self.group, self.leader = weights, group, leader
        self.is_leader = dist.job_rank() == leader
        plan = weights.plan(max_bucket_bytes)
        self.gathers = [names for names, _ in plan]
        # one wire bucket per gather: its tensors are packed as they come out
        self.buckets = [bucket_layout(specs, bucket_bytes=1 << 62)[0] for _, specs in plan]
        if self.is_leader:  # the generators allocate their receive buffers from it
            tdist.broadcast_object_list([self.buckets], src=leader, group=group)

    def send(self, version: int, stop: bool, evaluate: bool = False) -> dict[str, float]:
        """Weights of `version` to every generator (`stop`: the last send, the run ends;
        `evaluate`: the generators evaluate these weights on the held-out set)."""
        t0, sent = time.perf_counter(), 0
        if self.is_leader:
            wait([tdist.broadcast(on_wire(torch.tensor([version, int(stop), int(evaluate)], dtype=torch.int64)),
                                  src=self.leader, group=self.group, async_op=True)])
        for names, bucket in zip(self.gathers, self.buckets):
            with self.weights.gathered(names) as tensors:  # a collective of the trainers
                if self.is_leader:
                    flat = wire_empty(bucket_bytes(bucket), torch.uint8)
                    pack(bucket, tensors, flat)
                    wait([tdist.broadcast(flat, src=self.leader, group=self.group, async_op=True)])
                    sent += flat.numel()
        return {"time/weight_sync": time.perf_counter() - t0, "split/weight_sync_bytes": float(sent)}


class WeightReceiver:
    """A generation rank's side: receives posted ahead, taken between generate calls."""

    def __init__(self, group, leader: int):
        self.group, self.leader = group, leader
        self.evaluate = False  # the header of the weights taken last asked for a held-out evaluation
        self.load_seconds = 0.0  # loading the weights taken last into the engine
        box = [None]
        tdist.broadcast_object_list(box, src=leader, group=group)
        self.buckets: list[list[Slot]] = box[0]
        # one copy of the weights, received into again and again (the start-up memory plan's one copy)
        self.header = wire_empty(3, torch.int64)
        self.flats = [wire_empty(bucket_bytes(b), torch.uint8) for b in self.buckets]
        self._post()

    def _post(self) -> None:
        """Receive the next weights into the same buffers. The engine has read the last ones: HF copies
        them into its parameters, SGLang into its own flattened payload, both queued on this process's
        current stream, which the next collective waits for before it writes."""
        self.works = [tdist.broadcast(t, src=self.leader, group=self.group, async_op=True)
                      for t in (self.header, *self.flats)]

    def ready(self) -> bool:
        """Have the next weights arrived (all buckets)?"""
        return all(w.is_completed() for w in self.works)

    def take(self, engine) -> tuple[int, bool]:
        """Wait for the next weights, load them into `engine`, post the receives of the ones after
        (unless this was the last send); (version, stop). `self.evaluate` says whether the trainer
        asked for these weights' held-out evaluation."""
        wait(self.works)
        version, stop, evaluate = (int(x) for x in self.header.cpu())
        self.evaluate = bool(evaluate)
        self._load(engine)
        if not stop:
            self._post()
        return version, bool(stop)

    def _load(self, engine) -> None:
        t0 = time.perf_counter()
        for bucket, flat in zip(self.buckets, self.flats):
            engine.load_weights(unpack(bucket, flat))
        engine.finish_weight_update()
        self.load_seconds = time.perf_counter() - t0
