"""The two pools of a split run: the generation ranks' loop and the trainer's side of the flow.

    generation rank                                  trainer ranks (the leader broadcasts weights)
    take weights v0  <------------------------------ send weights v0 (set-up)
    loop, between generate calls:
      newest weights that arrived -> engine
      wait: until version >= slot - k (counted)
      rollout(version) -> its groups to each trainer  receive the next slot from every generator;
      (isend; at most max(1, k) slots in flight)        drop it if step - version > k (counted)
                                                      update -> version step + 1
                     <------------------------------ send weights (every placement.sync_every steps;
    evaluate flag in the weights: this rank's share   evaluate: the shares of every generator, summed
      of the held-out set -> to each trainer            (the step-0 weights and every eval step's)
    stop flag in the weights -> END to each trainer    the last send carries stop)
                                                      drain until END from every generator
A TP engine's other ranks (roles.EngineHelper) get a heartbeat per slot from their generator, then END.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from colo_rl import dist, stop_signal
from colo_rl.errors import CheckpointError
from colo_rl.samples import Group, Rollout
from colo_rl.split import staleness as st
from colo_rl.split.roles import SplitRole, peer
from colo_rl.split.wire import Pending, WeightReceiver, WeightSender, recv_object, send_beat, send_object
from colo_rl.stop_signal import StopSignal

log = logging.getLogger("colo_rl")


@dataclass
class RolloutPart:
    """One generator's groups of one slot for one trainer, with what the generator measured."""
    slot: int
    version: int  # the weights that generated every group here
    groups: list[Group]
    slot_groups: int  # the generator's groups in this slot (all trainers' parts)
    failures: int = 0  # the reward calls that failed, set-aside groups used (DAPO), tokens generated: in one
    filled: int = 0  # trainer's part
    generated_tokens: int = 0
    rounds: int = 1
    gen_interval: tuple[float, float] = (0.0, 0.0)  # wall clock (time.time) of the generation
    seconds: dict[str, float] = field(default_factory=dict)  # time/generation, time/reward
    idle_seconds: float = 0.0  # waiting for weights or queue space since the previous slot
    waits: int = 0  # times it waited for newer weights (wait policy) since the previous slot
    in_flight: int = 0  # slots sent and not known received when this one was queued (gloo: not yet waited on)
    position: Any = None  # the generator's data position (and sampling RNG) after this slot: what a resume restores
    stop_signal: int = 0  # a SIGINT / SIGTERM the generator caught: the trainers stop after the step that reads it


@dataclass
class Start:
    """The leader's first message to a generation rank: the slot to generate first (the step a run
    starts or resumes at) and, on a resume, this generator's position after the last slot the
    trainers consumed (None: a fresh run)."""
    slot: int
    position: Any = None


@dataclass
class HeldOutShare:
    """One generator's share of the held-out evaluations of the weights of `version`: per metric
    prefix ("eval/", and "eval_no_tools/" where an environment's tools are also left out),
    colo_rl.evaluation.evaluate_shard's sums and samples."""
    version: int
    results: dict[str, tuple[dict[str, float], list[dict]]]
    seconds: float = 0.0


EvaluateShard = Callable[[int], dict[str, tuple[dict[str, float], list[dict]]]]


class GenerationPool:
    """A generation rank's loop: weights in, rollouts out, until the trainer's last weights say stop.
    Weights the trainer marks for evaluation are evaluated here (`evaluate_shard`: this rank's share
    of the held-out set) before the next rollout, and the share goes to every trainer."""

    def __init__(self, role: SplitRole, cfg, engine, make_rollout: Callable[[int], tuple[Rollout, dict]],
                 total_steps: int, evaluate_shard: EvaluateShard | None = None,
                 position: Callable[[], Any] = lambda: None, restore: Callable[[Any], None] = lambda position: None):
        """`position()`: this rank's data position (and sampling RNG) now, sent with every slot;
        `restore(position)`: go back to one (a resumed run's Start)."""
        self.layout, self.engine, self.make_rollout = role.layout, engine, make_rollout
        self.position, self.restore = position, restore
        self.k, self.policy, self.total_steps = cfg.rollout.max_staleness, cfg.rollout.staleness_policy, total_steps
        self.evaluate_shard, self.tp_group = evaluate_shard, role.tp_group
        self.receiver = WeightReceiver(role.weight_group, role.layout.leader)
        self.objects = role.object_group
        self.index = role.layout.generation.index(dist.job_rank())
        self.work_seconds = 0.0  # loading weights and evaluating since the last slot: not idle time
        self.eval_sends: list[Pending] = []
        self.trainers_named = f"a trainer rank (ranks {list(self.layout.trainers)}, the trainer pool)"

    def serve(self) -> int:
        """Runs to the end of training; returns the slots generated."""
        # Ctrl-C: the trainer ranks stop the run and this rank follows their stop; a signal to this rank
        # alone goes to them with the next slot (RolloutPart.stop_signal)
        self.stop_signal = StopSignal()
        try:
            return self._serve()
        finally:
            self.stop_signal.restore()

    def _take(self) -> tuple[int, bool]:
        """The next weights into the engine (between generate calls only); their held-out evaluation
        when the trainer asked for it."""
        with peer(f"trainer rank {self.layout.leader} (it broadcasts the weights)"):
            version, stop = self.receiver.take(self.engine)
        self.work_seconds += self.receiver.load_seconds  # the wait for them is idle, loading them is not
        if self.receiver.evaluate:
            if self.evaluate_shard is None:
                raise RuntimeError("the trainer asked for a held-out evaluation this generation rank cannot run")
            t0 = time.perf_counter()
            results = self.evaluate_shard(version)
            seconds = time.perf_counter() - t0
            self.work_seconds += seconds
            share = HeldOutShare(version, results, seconds)
            with peer(self.trainers_named):
                self.eval_sends += [send_object(share, dst, self.objects) for dst in self.layout.trainers]
        return version, stop

    def _serve(self) -> int:
        with peer(f"trainer rank {self.layout.leader} (it starts the generators)"):
            begin: Start = recv_object(self.layout.leader, self.objects)
        if begin.position is not None:
            self.restore(begin.position)
        version, stop = self._take()  # the trainer's starting (or resumed) weights
        pending: deque[list[Pending]] = deque()
        beats: list[Pending] = []  # the heartbeat to this engine's helper ranks (EngineHelper)
        capacity = max(1, self.k)
        slot, waits, free_since = begin.slot, 0, time.perf_counter()
        while not stop:
            if self.policy == "wait" and slot >= self.total_steps:  # every slot is trained: wait for the stop
                version, stop = self._take()
                continue
            while not stop and (self.receiver.ready() or
                                (self.policy == "wait" and not st.may_generate(slot, version, self.k))):
                waits += not self.receiver.ready()
                version, stop = self._take()  # between generate calls only
            if stop:
                break
            g0, start = time.time(), time.perf_counter()
            rollout, seconds = self.make_rollout(version)
            interval, done = (g0, time.time()), time.perf_counter()
            while len(pending) >= capacity:  # the bounded queue: the oldest slot must be received first
                with peer(self.trainers_named):
                    for p in pending.popleft():
                        p.wait()
            in_flight = sum(not all(p.done() for p in sends) for sends in pending)
            # weights, then queue space (loading them or a held-out evaluation meanwhile is work, not idle)
            idle = max(0.0, start - free_since - self.work_seconds) + (time.perf_counter() - done)
            with peer(self.trainers_named):
                pending.append(self._send(slot, version, rollout, interval, seconds, idle, waits, in_flight))
            beats = self._beat(beats, slot)
            slot, waits, free_since, self.work_seconds = slot + 1, 0, time.perf_counter(), 0.0
        with peer(self.trainers_named):
            ends = [send_object(None, dst, self.objects) for dst in self.layout.trainers]
            for sends in [*pending, self.eval_sends, ends]:
                for p in sends:
                    p.wait()
        self._beat(beats, None)
        log.info("generation rank %d: %d slot(s) generated, stopped at weights version %d", dist.job_rank(),
                 slot - begin.slot, version)
        return slot - begin.slot

    def _beat(self, previous: list[Pending], slot: Optional[int]) -> list[Pending]:
        """The slot to this engine's helper ranks (None: the end, waited for); the previous beat is
        waited for first (a helper is always in its receive, so that wait is short)."""
        helpers = self.layout.helpers_of(dist.job_rank())
        with peer(f"rank(s) {list(helpers)} (they hold their GPUs for this rank's engine)"):
            for p in previous:
                p.wait()
            beats = [send_beat(slot, h, self.tp_group) for h in helpers]
            if slot is None:
                for p in beats:
                    p.wait()
        return beats

    def _send(self, slot, version, rollout: Rollout, interval, seconds, idle, waits, in_flight) -> list[Pending]:
        n, sends, position = len(rollout.groups), [], self.position()
        for i, dst in enumerate(self.layout.trainers):
            share = self.layout.groups_for(self.index, i, n)
            part = RolloutPart(slot, version, rollout.groups[share.start:share.stop], n,
                               failures=rollout.failures if i == 0 else 0, filled=rollout.filled if i == 0 else 0,
                               generated_tokens=rollout.generated_tokens if i == 0 else 0, rounds=rollout.rounds,
                               gen_interval=interval, seconds=seconds, idle_seconds=idle, waits=waits,
                               in_flight=in_flight, position=position, stop_signal=self.stop_signal.signum or 0)
            sends.append(send_object(part, dst, self.objects))
        return sends


def saved_positions(positions: Optional[dict], generators: tuple[int, ...]) -> dict[int, Any]:
    """A checkpoint's generator positions (job rank -> position; None: a fresh run) for this run's
    generators, or a CheckpointError where they are other ranks: each generator draws its own share
    of the prompts, so a position cannot move to another."""
    out = {int(k): v for k, v in (positions or {}).items()}
    if positions is not None and set(out) != set(generators):
        raise CheckpointError(
            f"the checkpoint holds the data positions of generators {sorted(out)}, this run's generators are ranks "
            f"{list(generators)}: other generators would skip or repeat prompts. Resume with the checkpoint's "
            f"placement.generation_ranks and rollout.tp_size (placement.generation_ranks=auto may have chosen another "
            f"split)")
    return out


class TrainerPool:
    """The trainer ranks' side: rollouts in (the bound applied), weights out."""

    def __init__(self, role: SplitRole, cfg, weights, total_steps: int,
                 evaluates: Callable[[int], bool] = lambda version: False):
        """`weights`: the trainer's weights as the engines take them (wire.WeightSender's)."""
        self.layout, self.cfg, self.total_steps = role.layout, cfg, total_steps
        self.objects = role.object_group
        self.evaluates = evaluates  # which versions the generation ranks evaluate (the loop's eval steps)
        # messages taken from a generator's stream ahead of their turn (rollouts received while
        # waiting for a held-out share), per generation rank
        self.inbox: dict[int, deque] = {src: deque() for src in self.layout.generation}
        self.generators_named = f"a generation rank (ranks {list(self.layout.generation)}, the generation pool)"
        self.k = cfg.rollout.max_staleness
        self.sender = WeightSender(weights, role.weight_group if dist.job_rank() == role.layout.leader else None,
                                   role.layout.leader, int(cfg.colocate.handoff_bucket_mb) << 20)
        self.stats = st.StalenessStats()
        self.last_update: tuple[float, float] | None = None
        self.version = 0
        self.stopped = False
        self.unused_slots = 0
        # each generator's position after the last slot received (trained or dropped), by job rank:
        # what a checkpoint saves, so a resume neither skips nor repeats a prompt
        self.positions: dict[int, Any] = {}

    def start(self, step: int = 0, positions: Optional[dict] = None) -> dict[str, float]:
        """Start the generators at `step` (0, or the step a run resumes at: `positions` as saved),
        and send them the weights of that version: their engines never read the disk's."""
        self.version, self.positions = step, saved_positions(positions, self.layout.generation)
        if dist.job_rank() == self.layout.leader:
            with peer(self.generators_named):
                for p in [send_object(Start(step, self.positions.get(g)), g, self.objects)
                          for g in self.layout.generation]:
                    p.wait()
        return self._send_weights(step, stop=False, evaluate=step == 0 and self.evaluates(0))

    def _send_weights(self, version: int, stop: bool, evaluate: bool = False) -> dict[str, float]:
        with peer(self.generators_named):
            return self.sender.send(version, stop, evaluate)

    def _recv(self, src: int):
        with peer(f"generation rank {src} (the generation pool)"):
            return recv_object(src, self.objects)

    def _next(self, src: int):
        return self.inbox[src].popleft() if self.inbox[src] else self._recv(src)

    def evaluation(self, version: int) -> dict[str, tuple[dict[str, float], list[dict]]]:
        """The held-out evaluations of the weights of `version`, per metric prefix: every generator's
        share, summed (evaluate_shard's sums), and the first generator's samples. Rollouts that
        arrive first wait in the inbox for `receive`."""
        shares = []
        for src in self.layout.generation:
            while not isinstance(msg := self._recv(src), HeldOutShare):
                if msg is None:
                    raise RuntimeError(f"generation rank {src} ended before sending its held-out evaluation")
                self.inbox[src].append(msg)
            if msg.version != version:
                raise RuntimeError(f"generation rank {src} evaluated version {msg.version}, the trainer expected "
                                   f"{version}")
            shares.append(msg)
        return {prefix: ({k: sum(s.results[prefix][0][k] for s in shares) for k in sums}, samples)
                for prefix, (sums, samples) in shares[0].results.items()}

    def receive(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """The rollout this trainer trains at `step`: the next slot within the bound (older ones dropped)."""
        t0 = time.perf_counter()
        while True:
            parts = [self._next(src) for src in self.layout.generation]
            if any(p is None for p in parts):
                raise RuntimeError("a generation rank ended before the trainer stopped it")
            if any(isinstance(p, HeldOutShare) for p in parts):
                raise RuntimeError("a held-out evaluation arrived where a rollout was expected: the trainer "
                                   "evaluates at other steps than it asked the generation ranks to")
            for p in parts:
                if p.stop_signal:
                    stop_signal.relay(p.stop_signal)  # the loop's next stop check stops every trainer
            version = min(p.version for p in parts)
            self.positions.update({src: p.position for src, p in zip(self.layout.generation, parts)})
            if st.admitted(step, version, self.k):
                break
            self.stats.record_dropped(sum(p.slot_groups for p in parts))
        wait = time.perf_counter() - t0
        rollout = Rollout(groups=[g for p in parts for g in p.groups], policy_version=version,
                          failures=sum(p.failures for p in parts), filled=sum(p.filled for p in parts),
                          generated_tokens=sum(p.generated_tokens for p in parts), rounds=max(p.rounds for p in parts))
        self.stats.record_trained(st.staleness(step, version), sum(p.slot_groups for p in parts))
        generated = (min(p.gen_interval[0] for p in parts), max(p.gen_interval[1] for p in parts))
        out = {"time/trainer_wait": wait, "time/generation_idle": max(p.idle_seconds for p in parts),
               **{k: max(p.seconds.get(k, 0.0) for p in parts) for k in parts[0].seconds},
               "split/queue_depth": float(max(p.in_flight for p in parts)),
               "split/policy_version": float(version), "split/generator_waits": float(sum(p.waits for p in parts)),
               "split/generation_start": generated[0], "split/generation_end": generated[1],
               "split/overlap_seconds": st.overlap_seconds(generated, self.last_update) if self.last_update else 0.0}
        return rollout, out

    def after_update(self, step: int, update_interval: tuple[float, float]) -> dict[str, float]:
        """The update of `step` is done (weights of version step + 1): send them when due; the last
        step's send carries the stop."""
        self.last_update, self.version = update_interval, step + 1
        out = {"split/update_start": update_interval[0], "split/update_end": update_interval[1], **self.stats.pop()}
        last, evaluate = step + 1 >= self.total_steps, self.evaluates(step + 1)
        if last or evaluate or (step + 1) % self.cfg.placement.sync_every == 0:
            out.update(self._send_weights(step + 1, stop=last, evaluate=evaluate))
            self.stopped = last
        return out

    def _unblock_generators(self) -> None:
        """Under drop a generator with a full queue waits for a trainer to read its oldest slot, and
        takes no weights meanwhile, so it has not posted the receive a stop's broadcast needs (a gloo
        broadcast ends on the sender once the receiver posts): the stop would wait forever. Read
        each generator's next rollout first (under drop it always sends more); it waits in the inbox."""
        for src in self.layout.generation:
            while True:
                msg = self._recv(src)
                if msg is None:
                    raise RuntimeError(f"generation rank {src} ended before the trainer stopped it")
                self.inbox[src].append(msg)
                if isinstance(msg, RolloutPart):
                    break

    def close(self) -> int:
        """The run ends (done or stopped by a signal): stop the generators, take what they still had in
        flight (unused); returns those slots."""
        if not self.stopped:
            if self.cfg.rollout.staleness_policy == "drop":
                self._unblock_generators()
            self._send_weights(self.version, stop=True)
            self.stopped = True
        for src in self.layout.generation:
            self.unused_slots += sum(isinstance(m, RolloutPart) for m in self.inbox[src])
            self.inbox[src].clear()
            while (msg := self._recv(src)) is not None:
                self.unused_slots += isinstance(msg, RolloutPart)
        return self.unused_slots
