"""`reward.workers=N`: the user's reward functions called in N worker processes per rank, each call
given `reward.timeout_s` seconds.

A worker is a plain `python -m colo_rl.rewards.worker` subprocess (not a fork of a trainer that holds
a process group and CUDA state) that loads the user's files itself and answers one call at a time
over a pipe. A call past its deadline gets its worker killed and replaced, and comes back as a
timeout: the scorer counts it as a failure like an exception, so a hung verifier costs one
timeout, never the run. A worker found dead between calls (the kernel's OOM killer, a thread of the
user's library calling exit) is replaced before it is given one.
"""

from __future__ import annotations

import logging
import os
import pickle
import selectors
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from colo_rl.child_env import child_python_path
from colo_rl.errors import RewardError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")


def send(fh, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    fh.write(_HEADER.pack(len(data)) + data)
    fh.flush()


def read_exact(fd: int, n: int) -> Optional[bytes]:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None  # the other end closed
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def readable(fds: list[int], timeout: float) -> list[int]:
    """The fds among `fds` with something to read within `timeout` seconds (epoll / poll: no
    select(2), which refuses fds above 1023, common in a trainer holding many files and sockets)."""
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            sel.register(fd, selectors.EVENT_READ)
        return [key.fd for key, _ in sel.select(timeout)]


def receive(fd: int) -> Optional[Any]:
    head = read_exact(fd, _HEADER.size)
    if head is None:
        return None
    body = read_exact(fd, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


@dataclass
class Call:
    source: int  # index into the pool's specs
    completions: list[str]
    truths: list[str]
    fields: list[dict[str, Any]]


@dataclass
class Outcome:
    kind: str  # ok | error (the function raised) | return (wrong return: fatal) | timeout | died
    values: Optional[list[float]] = None
    message: str = ""


class _Worker:
    def __init__(self, specs: list[str]):
        env = {**os.environ, "PYTHONPATH": child_python_path()}
        self.proc = subprocess.Popen([sys.executable, "-m", "colo_rl.rewards.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.fd = self.proc.stdout.fileno()
        send(self.proc.stdin, specs)
        self.ready = False
        self.call: Optional[int] = None  # index of the call it is running
        self.deadline = 0.0

    def wait_ready(self, timeout: float) -> None:
        """The worker's start-up answer (its files loaded), or RewardError."""
        reply = receive(self.fd) if readable([self.fd], timeout) else None
        if reply != "ready":
            self.kill()
            why = reply[1] if isinstance(reply, tuple) else f"no answer within {timeout:.0f}s"
            raise RewardError(f"a reward worker (reward.workers) could not start: {why}")
        self.ready = True

    def start(self, index: int, call: Call, timeout_s: float) -> None:
        send(self.proc.stdin, (call.source, call.completions, call.truths, call.fields))
        self.call, self.deadline = index, time.monotonic() + timeout_s

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for fh in (self.proc.stdin, self.proc.stdout):
            try:
                fh.close()
            except OSError:
                pass


class RewardPool:
    """`workers` processes calling the reward functions `specs` (`path/file.py:function`)."""

    START_TIMEOUT_S = 120.0  # importing a user's file (and what it imports) in a fresh interpreter

    def __init__(self, specs: list[str], workers: int, timeout_s: float):
        self.specs, self.size, self.timeout_s = list(specs), workers, timeout_s
        self.workers: list[_Worker] = []

    def _spawn(self) -> _Worker:
        w = _Worker(self.specs)
        w.wait_ready(self.START_TIMEOUT_S)
        return w

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Every call's outcome, in order; at most `workers` at a time, `timeout_s` each."""
        while len(self.workers) < self.size:
            self.workers.append(self._spawn())
        outcomes: list[Optional[Outcome]] = [None] * len(calls)
        pending = list(range(len(calls)))[::-1]
        busy: dict[int, _Worker] = {}
        while pending or busy:
            for w in list(self.workers):
                if w.call is not None or not pending:
                    continue
                if w.proc.poll() is not None:  # died while idle: no call of ours was lost
                    log.warning("a reward worker (reward.workers) exited between calls (code %s): replaced",
                                w.proc.returncode)
                    w = self._replace(w)
                j = pending.pop()
                try:
                    w.start(j, calls[j], self.timeout_s)
                except OSError:  # it died just now, before reading the call
                    outcomes[j] = Outcome("died", message=f"the reward worker exited (code {w.proc.wait()})")
                    self._replace(w)
                    continue
                busy[w.fd] = w
            if not busy:
                continue
            wait = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for fd in readable(list(busy), wait):
                w = busy.pop(fd)
                reply = receive(fd)
                j, w.call = w.call, None
                if reply is None:
                    outcomes[j] = Outcome("died", message=f"the reward worker exited (code {w.proc.wait()})")
                    self._replace(w)
                else:
                    outcomes[j] = Outcome(*reply)
            now = time.monotonic()
            for fd, w in list(busy.items()):
                if w.call is not None and now >= w.deadline:
                    outcomes[w.call] = Outcome("timeout", message=f"timed out after {self.timeout_s:g}s "
                                                                  f"(reward.timeout_s)")
                    del busy[fd]
                    self._replace(w)
        return outcomes  # type: ignore[return-value]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = self.workers[self.workers.index(worker)] = self._spawn()
        return fresh

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []
