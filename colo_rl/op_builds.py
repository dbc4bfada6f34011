"""JIT op builds (DeepSpeed's FusedAdam, its CPU shared-memory collective) and the lock torch leaves.

torch's cpp_extension builds an op under a lock file, `<TORCH_EXTENSIONS_DIR>/<op>/lock`, and every
other process that needs the op waits until the file is gone, with no timeout (FileBaton.wait). A
build that is killed (Ctrl-C, `timeout`, an OOM kill) leaves the file behind, and from then on every
run hangs silently at start-up, before any log line. colo_rl checks before DeepSpeed loads an op and
stops with the path to delete instead (it does not delete it itself: on a shared file system another
machine may be building)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable, Optional

from colo_rl.errors import BuildLockError

# A live build holds the lock only while torch writes build.ninja and ninja runs in that directory;
# a younger lock may belong to a build that has not started ninja yet.
STALE_AFTER_S = 60.0


def working_directories() -> set[Path]:
    """Every local process's working directory (ninja and the compilers run inside the build
    directory); those this process cannot read are left out."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*/cwd"):
        try:
            found.add(Path(os.readlink(entry)).resolve())
        except OSError:
            continue
    return found


def interrupted_builds(root: Path, now: Optional[float] = None, busy: Optional[Iterable[Path]] = None,
                       stale_after_s: float = STALE_AFTER_S) -> list[Path]:
    """The lock files under `root` (one directory per op) that no build holds: older than
    `stale_after_s` and in a directory no process works in (`busy`, default: this machine's)."""
    locks = sorted(Path(root).glob("*/lock"))
    if not locks:
        return []
    now = time.time() if now is None else now
    busy = working_directories() if busy is None else {Path(p).resolve() for p in busy}
    stale = []
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # the build finished meanwhile
            continue
        if age > stale_after_s and lock.parent.resolve() not in busy:
            stale.append(lock)
    return stale


def check_no_interrupted_build(root: Optional[str] = None) -> None:
    """Raise BuildLockError naming each lock a killed build left in $TORCH_EXTENSIONS_DIR (or `root`)."""
    root = root or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root or not Path(root).is_dir():
        return
    stale = interrupted_builds(Path(root))
    if stale:
        ops = ", ".join(lock.parent.name for lock in stale)
        raise BuildLockError(
            f"a build of the JIT op(s) {ops} was interrupted and left torch's lock file; every run would wait "
            f"on it forever. No build is running there: delete {' and '.join(str(p) for p in stale)} "
            f"(`rm {' '.join(str(p) for p in stale)}`) and start again; the op is rebuilt on first use.")
