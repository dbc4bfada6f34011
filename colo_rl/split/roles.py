"""Who a rank of a split run is: its pool's process groups (enter_split), and the TP engine's helper
ranks, which only hold their GPU for a generator's engine (EngineHelper). Talking to the other pool
goes through `peer`, which turns a dead rank's closed connection into one PoolError."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from colo_rl import console, dist
from colo_rl.errors import PoolError
from colo_rl.split.placement import SplitLayout, split_layout
from colo_rl.split.wire import recv_beat, watch_peers
from colo_rl.stop_signal import StopSignal

log = logging.getLogger("colo_rl")


@contextmanager
def peer(who: str):
    """Talking to the other pool: the error a dead peer's closed connection raises (gloo: "Connection
    closed by peer"; NCCL: a remote error) becomes one PoolError naming the rank(s) and the pool."""
    try:
        yield
    except PoolError:
        raise
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError included) are RuntimeErrors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PoolError(f"placement.mode=split: {who} stopped answering ({first}). That rank died or failed "
                        f"(its own output, or the launcher's line, says why); a split run needs every rank of both "
                        f"pools, so this rank stops too") from e


HELPER_TIMEOUT_MINUTES = 7 * 24 * 60.0


@dataclass
class SplitRole:
    layout: SplitLayout
    generates: bool  # this rank is a generator (drives an engine)
    weight_group: Any  # the weight broadcast's process group (leader + generators)
    helps: bool = False  # this rank holds its GPU for a generator's TP engine (EngineHelper)
    tp_group: Any = None  # with rollout.tp_size > 1: this rank's TP group, over gloo (the heartbeats)
    object_group: Any = None  # every job rank, over gloo: rollouts, held-out shares, start and end messages


def enter_split(cfg, generation_ranks: int) -> SplitRole:
    """Make the pools' process groups (every rank calls it) and scope this rank's helpers to its pool:
    from here on dist.rank() / world_size() and the collectives are the pool's (dist.set_scope)."""
    layout = split_layout(dist.world_size(), generation_ranks, cfg.rollout.tp_size,
                          cfg.rollout.prompts_per_step, dist.local_world_size(), cfg.trainer.mini_batches_per_step)
    helpers = list(layout.engine_helpers)
    gen_group, train_group, weight_group, *helper_group = dist.new_pool_groups(
        [list(layout.generation), list(layout.trainers), list(layout.weight_ranks)] + ([helpers] if helpers else []))
    # Pickled objects travel over gloo whatever the job's backend: host bytes, and no NCCL send
    # kernel waiting on a generator's GPU while its engine generates (wire.send_object).
    (object_group,) = dist.new_host_groups([list(range(dist.world_size()))], timeout_minutes=dist.timeout_minutes())
    # A helper's wait spans the whole run, its first one the generator's and the trainers' start-up:
    # no timeout of its own (a generator that dies closes the socket; a hung job hits the others').
    tp_groups = dist.new_host_groups([[owner, *layout.helpers_of(owner)] for owner in layout.generation]
                                     if helpers else [], timeout_minutes=HELPER_TIMEOUT_MINUTES)
    watch_peers()  # a wait on the other pool ends when a rank on this node is gone (wire.wait)
    me = dist.job_rank()
    generates, helps = layout.generates(me), me in helpers
    log.info("split placement: ranks %s generate%s, ranks %s train (ZeRO-3 among them); rollout.max_staleness=%d, "
             "staleness_policy=%s", list(layout.generation),
             f" (each with the next {layout.tp_size - 1} rank(s)' GPUs for its tp_size={layout.tp_size} engine)"
             if helpers else "", list(layout.trainers), cfg.rollout.max_staleness, cfg.rollout.staleness_policy)
    if helps:
        dist.set_scope(helper_group[0], helpers)
    else:
        dist.set_scope(gen_group if generates else train_group, layout.generation if generates else layout.trainers)
    console.setup_logging(cfg.debug)  # each pool's first rank logs (the trainer's: the step lines)
    tp_group = dict(zip(layout.generation, tp_groups)).get(layout.owner_of(me))  # None: a trainer, or tp_size 1
    return SplitRole(layout, generates, weight_group, helps, tp_group, object_group)


class EngineHelper:
    """A TP group's other rank in the generation pool: its GPU runs a scheduler process of the
    generator's engine (SGLang starts it there), so this process only waits for the run's end.
    The generator sends it a heartbeat per slot (a wait longer than the process group's timeout
    would fail) and the end marker after its last slot; a generator that dies closes the
    connection, and this rank stops with a PoolError naming it."""

    def __init__(self, role: SplitRole):
        self.owner, self.group = role.layout.owner_of(dist.job_rank()), role.tp_group

    def serve(self) -> int:
        """Runs to the end of training; returns the heartbeats received (the generator's slots)."""
        stop_signal = StopSignal()  # Ctrl-C: the generator follows the trainers' stop, then ends this rank
        beats = 0
        try:
            with peer(f"generation rank {self.owner} (its engine runs on this rank's GPU)"):
                while recv_beat(self.owner, self.group) is not None:
                    beats += 1
        finally:
            stop_signal.restore()
        log.info("generation rank %d: held its GPU for rank %d's engine, %d slot(s)", dist.job_rank(), self.owner, beats)
        return beats
