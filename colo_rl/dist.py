"""Process groups and rank helpers. nccl on GPU, gloo on CPU; works without torchrun (world of 1)."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from colo_rl import solo_gathers
from colo_rl.host_malloc import keep_freed_host_memory
from colo_rl.op_builds import check_no_interrupted_build
from colo_rl.process_exit import exit_with_parent

log = logging.getLogger("colo_rl")


# The pool this process belongs to (split placement, colo_rl/split): its process group and the
# job ranks in it. While set, rank() / world_size() and the collectives below act within the pool,
# so the trainer's code (ZeRO-3 sums, the data shard, metrics on "rank 0") sees its own world.
_SCOPE: Optional[tuple[Any, tuple[int, ...]]] = None


def set_scope(group: Any, ranks: Optional[list[int]]) -> None:
    """Act within `group` (job ranks `ranks`) from now on; `set_scope(None, None)`: the whole job."""
    global _SCOPE
    _SCOPE = None if group is None else (group, tuple(ranks))
    if group is not None:
        _scope_deepspeed_comm()


def _scope_deepspeed_comm() -> None:
    """DeepSpeed's collectives without a group are the job's: ZeRO-3 holds barriers over the whole job
    (stage3.py, while it builds partitions and optimizer states; engine.py around checkpoints) and
    checks its parameter trace with broadcasts from rank 0 (zero/utils.py), not over its
    data-parallel group. Within a scope its world is the pool: every method of DeepSpeed's
    communication backend called without a group gets the pool's group, and a peer rank
    (src / dst) given as a world rank is mapped to the job rank (a rank the other pool never
    reaches would hang it). get_rank() / get_world_size() are the pool's too, so "rank 0" is the
    pool's first rank. DeepSpeed is also given `PoolMPU`: it never builds a world group of its own."""
    import deepspeed.comm.comm as ds_comm

    backend = ds_comm.cdb
    if backend is None or getattr(backend, "colo_rl_scoped", False):
        return
    for name in dir(type(backend)):
        original = _undecorated(getattr(type(backend), name), name) if not name.startswith("_") else None
        if original is not None and "group" in inspect.signature(original).parameters:
            setattr(backend, name, _pool_call(getattr(backend, name), inspect.signature(original), backend))
    backend.colo_rl_scoped = True


def _undecorated(fn: Any, name: str) -> Optional[Callable]:
    """The function `name` itself under DeepSpeed's decorators (they keep no __wrapped__: found
    among the closures), for its signature; None if there is none."""
    todo, seen = [fn], 0
    while todo and seen < 16:
        f = todo.pop(0)
        seen += 1
        if inspect.isfunction(f) and f.__name__ == name:
            return f
        todo += [c.cell_contents for c in (getattr(f, "__closure__", None) or ())
                 if inspect.isfunction(getattr(c, "cell_contents", None))]
    return None


def _pool_call(method: Callable, signature: inspect.Signature, owner: Any) -> Callable:
    def call(*args, **kwargs):
        if _SCOPE is None:
            return method(*args, **kwargs)
        bound = signature.bind_partial(owner, *args, **kwargs)
        if bound.arguments.get("group") is not None:
            return method(*args, **kwargs)
        bound.arguments["group"] = _SCOPE[0]
        for peer in ("src", "dst"):
            if isinstance(bound.arguments.get(peer), int):
                bound.arguments[peer] = _SCOPE[1][bound.arguments[peer]]
        return method(*bound.args[1:], **bound.kwargs)

    return call


def new_pool_groups(pools: list[list[int]]) -> list[Any]:
    """One process group per pool (job ranks), plus a single-rank group per rank for DeepSpeed's
    model-parallel group (`PoolMPU`). Every rank of the job must call it, with the same pools:
    torch creates every group on every rank."""
    global _SINGLE
    groups = [dist.new_group(ranks) for ranks in pools]
    _SINGLE = [dist.new_group([r]) for r in range(world_size())]
    return groups


_SINGLE: list[Any] = []


def new_host_groups(rank_lists: list[list[int]], timeout_minutes: float) -> list[Any]:
    """Process groups over gloo whatever the job's backend, for small messages that must stay in
    host memory (an NCCL communicator would take buffers on a GPU another process uses), with
    their own timeout (gloo's default is 30 minutes). Every rank of the job calls it, with the
    same lists."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    return [dist.new_group(ranks, backend="gloo", timeout=timeout) for ranks in rank_lists]


class PoolMPU:
    """DeepSpeed's `mpu` for a pool: ZeRO partitions, reduces gradients and counts its world over
    the pool's group only (split placement: the generation ranks never join the trainer's
    collectives); no model parallelism (a model-parallel group of one rank)."""

    def __init__(self, group: Any, ranks: tuple[int, ...]):
        self.group, self.ranks = group, list(ranks)

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return len(self.ranks)

    def get_data_parallel_rank(self) -> int:
        return self.ranks.index(job_rank())

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ranks

    def get_model_parallel_group(self):
        return _SINGLE[job_rank()]

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size


def deepspeed_mpu() -> Optional[PoolMPU]:
    """The `mpu` DeepSpeed is given: the pool's while a scope is set (split placement), else None."""
    return PoolMPU(*_SCOPE) if _SCOPE else None


def _in_scope() -> dict:
    """A collective's group argument: the pool's within a scope, none (the default group) otherwise."""
    return {"group": _SCOPE[0]} if _SCOPE else {}


def job_rank() -> int:
    """This process's rank in the whole job (torchrun's RANK), whatever the scope."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def job_world_size() -> int:
    """The whole job's ranks (torchrun's WORLD_SIZE), whatever the scope."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    if _SCOPE:
        return _SCOPE[1].index(job_rank())
    return job_rank()


def world_size() -> int:
    if _SCOPE:
        return len(_SCOPE[1])
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; one node when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def node_rank() -> int:
    """This node's index (torchrun's GROUP_RANK: one agent per node); 0 when unset."""
    return int(os.environ.get("GROUP_RANK", 0))


def is_rank0() -> bool:
    return rank() == 0


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


def device_free_bytes() -> Optional[int]:
    """Free memory on this process's GPU once its queued work is done (device-wide: other
    processes' allocations count, an engine's included); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


# How long a collective may wait for a peer before it fails (instead of hanging): a rank that
# died mid-run makes the others raise within this time. torchrun also stops the whole group as soon
# as one rank exits with an error (SIGTERM, then SIGKILL after its 30 s grace), and under gloo a peer
# that died closes its sockets, so the others usually fail at once; the timeout is the last resort.
# Long enough for the slowest legitimate wait (one rank generating while another waits to train).
TIMEOUT_ENV = "COLO_RL_DIST_TIMEOUT_MIN"
_TIMEOUT_MINUTES = [30.0]  # the job group's, as `init` set it (the groups made later take the same)


def timeout_minutes() -> float:
    """The collective timeout `init` gave the job's process group, in minutes."""
    return _TIMEOUT_MINUTES[0]


def init(timeout_minutes: Optional[float] = None, debug: bool = False) -> None:
    """Initialise the default process group the way DeepSpeed expects.

    Single-process runs (plain `python recipes/grpo.py`) get a world of one, so the same code
    path runs with and without torchrun. The collective timeout is `timeout_minutes`, else
    $COLO_RL_DIST_TIMEOUT_MIN, else 30 minutes. Only rank 0 hears DeepSpeed's start-up unless `debug`.
    Without a GPU, glibc keeps freed host memory for reuse ($COLO_RL_KEEP_HOST_MEMORY, host_malloc.py).
    """
    if timeout_minutes is None:
        timeout_minutes = float(os.environ.get(TIMEOUT_ENV, 30.0))
    _TIMEOUT_MINUTES[0] = timeout_minutes
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: do not outlive it
        exit_with_parent()
    keep_freed_host_memory(on_gpu=torch.cuda.is_available())  # a CPU run's tensors reuse freed heap (host_malloc.py)
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    if "MASTER_PORT" not in os.environ or (os.environ["WORLD_SIZE"] == "1" and not launched):
        # A world of one started by hand needs no agreed port, and an inherited MASTER_PORT may be another
        # process's live store. Under torchrun the port is the agent's store, which the rank joins as a client.
        os.environ["MASTER_PORT"] = str(free_port())
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    check_no_interrupted_build()  # DeepSpeed builds its CPU collective op here: a stale lock would hang
    with _deepspeed_startup_quiet(not (debug or is_rank0())):
        import deepspeed

        # gloo on CPU: DeepSpeed's CPU accelerator picks gloo when oneCCL is absent.
        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo",
            timeout=datetime.timedelta(minutes=timeout_minutes),
            verbose=False,
        )
    solo_gathers.install()  # a world of one's gathers: local copies, not gloo's threads (solo_gathers.py)


@contextlib.contextmanager
def _deepspeed_startup_quiet(quiet: bool):
    """DeepSpeed's start-up says the same on every rank before console.setup_logging can rank-filter it: its
    accelerator choice (a WARNING on CPU, logged while `import deepspeed` creates its logger) and, on
    CPU, a bare print that its shared-memory collective op loaded. Quiet: that logger keeps only
    errors (what console.setup_logging leaves another rank) and stdout is muted while the group starts.
    stdout is redirected only after the import: DeepSpeed's log handler binds sys.stdout as it is
    when the logger is created, and must not keep a stream that this block closes."""
    if not quiet:
        yield
        return
    ds_logger = logging.getLogger("DeepSpeed")  # the same object DeepSpeed's LoggerFactory configures

    def errors_only(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    ds_logger.addFilter(errors_only)
    try:
        import deepspeed  # noqa: F401  (creates the logger and its handler outside the redirect)

        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            yield
    finally:
        ds_logger.removeFilter(errors_only)


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier() -> None:
    if dist.is_initialized() and world_size() > 1:
        dist.barrier(**_in_scope())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s object on every rank."""
    if not dist.is_initialized() or world_size() == 1:
        return obj
    box = [obj if rank() == src else None]
    dist.broadcast_object_list(box, src=_SCOPE[1][src] if _SCOPE else src, **_in_scope())
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized() or world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, **_in_scope())
    return out


def all_reduce_sum(values: list[float] | dict[str, float]) -> list[float] | dict[str, float]:
    """Sum floats over ranks (float64: exact enough for counts and sums). A dict is summed key by key
    (every rank must pass the same keys; the order does not matter) and comes back as a dict."""
    if isinstance(values, dict):
        keys = sorted(values)
        return dict(zip(keys, all_reduce_sum([values[k] for k in keys])))
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.to(device())
        dist.all_reduce(t, **_in_scope())
    return t.cpu().tolist()


def host_floats(values: dict[str, Any]) -> dict[str, float]:
    """Floats, 0-d tensors or both, keyed -> Python floats with one device-to-host transfer (one
    sync) for all the tensors, however many: statistics accumulated on the device during a step
    are read once at its end, not once per micro-batch."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in values.items() if k not in tensors}
    if tensors:
        on = next(iter(tensors.values())).device
        stacked = torch.stack([(t if t.device == on else t.to(on)).detach().to(torch.float64).reshape(())
                               for t in tensors.values()])
        out.update(zip(tensors, stacked.cpu().tolist()))
    return {k: out[k] for k in values}


def all_reduce_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.to(device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, **_in_scope())
    return t.cpu().tolist()


def shard(items: list[Any]) -> list[Any]:
    """This rank's contiguous share of `items` (ranks differ by at most one item)."""
    n, r, w = len(items), rank(), world_size()
    start = r * n // w
    return items[start:(r + 1) * n // w]


def cleanup() -> None:
    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()
