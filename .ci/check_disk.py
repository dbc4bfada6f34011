"""Refuse to start an install that cannot finish: `make install` (and every target that builds .venv)
writes ~3.5 GiB into the venv and unpacks wheels under the temporary directory; a full disk would
otherwise end it minutes later in pip's "[Errno 28] No space left on device".

    python3 .ci/check_disk.py GIB PATH [PATH ...]   exit 1 unless every PATH's filesystem has GIB free

Standard library only: it runs before the venv exists."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile


def existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists (the venv's folder is made later)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def shortfalls(need_gib: float, paths: list[str]) -> list[str]:
    """One line per filesystem (by path) with less than `need_gib` GiB free."""
    out, seen = [], set()
    for path in paths:
        where = existing(path)
        dev = os.stat(where).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        free = shutil.disk_usage(where).free / 2**30
        if free < need_gib:
            out.append(f"{path}: {free:.1f} GiB free on its filesystem, the install needs about {need_gib:g} GiB")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    need, paths = float(argv[0]), argv[1:] + [tempfile.gettempdir()]
    short = shortfalls(need, paths)
    for line in short:
        print(f"error: not enough disk space: {line}. Free some space (old virtual environments, "
              f"/tmp, outputs/), or put the environment elsewhere with VENV=/path/on/a/larger/disk "
              f"and TMPDIR=/path/with/room.", file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
