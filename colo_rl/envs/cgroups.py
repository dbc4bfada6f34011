"""A python tool call's limits (`Limits`: per process as rlimits; for the whole call as a cgroup) and
those cgroups: memory, processes and one CPU for a call's whole process tree, where this process can
make one (cgroup v1 hierarchies, or a v2 subtree it can write). Used by envs/sandbox.py;
docs/sandbox.md says which bound holds where."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("colo_rl.envs.sandbox")


@dataclass(frozen=True)
class Limits:
    """One call's bounds. memory_mb: per process (RLIMIT_AS) and, with a cgroup, for the whole call."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    processes: int = 16  # tasks (threads count) alive at once in the call
    output_bytes: int = 1 << 16  # stdout + stderr read before the call is killed
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: the largest file one process may write

    def rlimits(self, nproc: bool) -> dict[str, int]:
        out = {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": max(1, int(self.timeout_s + 1)),
               "RLIMIT_FSIZE": self.file_bytes, "RLIMIT_CORE": 0}
        if nproc:
            out["RLIMIT_NPROC"] = self.processes
        return out


def _cgroup_dirs() -> dict[str, str]:
    """Where this process's cgroups are, per controller ("" = the v2 unified tree), by mount point."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                own[c] = path
    out: dict[str, str] = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fstype, opts, *_ = line.split()
            if fstype == "cgroup2" and "" in own:
                out.setdefault("", mnt + own[""])
            elif fstype == "cgroup":
                for c in ("memory", "pids", "cpu"):
                    if c in opts.split(",") and c in own:
                        out.setdefault(c, mnt + own[c])
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CgroupPlan:
    """Per-call cgroups under this process's own: v1 `memory`, `pids`, `cpu` hierarchies, or a v2
    subtree with those controllers enabled. `probe()` returns None where we cannot create them."""

    def __init__(self, parents: dict[str, str], v2: bool):
        self.parents, self.v2 = parents, v2

    @classmethod
    def probe(cls) -> Optional["CgroupPlan"]:
        try:
            dirs = _cgroup_dirs()
        except OSError:
            return None
        v1 = {c: os.path.join(dirs[c], "colo_rl_py") for c in ("memory", "pids") if c in dirs}
        if len(v1) == 2:
            if "cpu" in dirs:
                v1["cpu"] = os.path.join(dirs["cpu"], "colo_rl_py")
            plan = cls(v1, v2=False)
        elif "" in dirs and os.path.exists(os.path.join(dirs[""], "cgroup.controllers")):
            plan = cls({"": os.path.join(dirs[""], "colo_rl_py")}, v2=True)
        else:
            return None
        try:
            for parent in plan.parents.values():
                os.makedirs(parent, exist_ok=True)
                plan._remove_stale(parent)
            if plan.v2:
                _write(os.path.join(plan.parents[""], "cgroup.subtree_control"), "+memory +pids +cpu")
            probe = plan.create(f"{os.getpid()}_probe", Limits())  # ranks probe at once: a name of its own
            plan.remove(probe)
        except OSError as e:
            log.info("no per-call cgroup here (%s): the process limit times the per-process memory limit bounds a call", e)
            return None
        return plan

    @staticmethod
    def _remove_stale(parent: str) -> None:
        """Empty call cgroups left by a trainer that died mid-call (named <pid>_<n>; that pid is gone),
        and an older version's shared "probe"."""
        for name in os.listdir(parent):
            pid = name.split("_", 1)[0]
            if name == "probe" or (pid.isdigit() and not os.path.exists(f"/proc/{pid}")):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass

    def create(self, name: str, limits: Limits) -> list[str]:
        made: list[str] = []
        try:
            for ctrl, parent in self.parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                made.append(path)
                for key, value in self._settings(ctrl, limits).items():
                    try:
                        _write(os.path.join(path, key), value)
                    except OSError:
                        if key not in ("memory.memsw.limit_in_bytes", "memory.swap.max"):  # no swap accounting
                            raise
        except OSError:
            self.remove(made)
            raise
        return made

    def _settings(self, ctrl: str, limits: Limits) -> dict[str, str]:
        mem, procs = str(limits.memory_mb << 20), str(limits.processes)
        if self.v2:
            return {"memory.max": mem, "memory.swap.max": "0", "pids.max": procs, "cpu.max": "100000 100000"}
        return {"memory": {"memory.limit_in_bytes": mem, "memory.memsw.limit_in_bytes": mem},
                "pids": {"pids.max": procs}, "cpu": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}}[ctrl]

    @staticmethod
    def procs_files(made: list[str]) -> list[str]:
        return [os.path.join(p, "cgroup.procs") for p in made]

    @staticmethod
    def oom_killed(made: list[str]) -> bool:
        for path in made:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    with open(os.path.join(path, name)) as f:
                        for line in f:
                            key, _, value = line.partition(" ")
                            if key == "oom_kill" and int(value) > 0:
                                return True
                except OSError:
                    pass
        return False

    @staticmethod
    def remove(made: list[str]) -> None:
        """Kill whatever is still in the call's cgroups, then remove them (bounded: 2 s)."""
        deadline = time.monotonic() + 2.0
        for path in made:
            while True:
                try:
                    with open(os.path.join(path, "cgroup.procs")) as f:
                        pids = [int(p) for p in f.read().split()]
                except OSError:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        log.warning("could not remove the python tool's cgroup %s", path)
                        break
                    time.sleep(0.001)  # its last processes are still being reaped
