"""A graceful stop on SIGINT / SIGTERM for every rank (`StopSignal`), and whether this process has
caught one (`received`): an error raised after it can say that the stop, not a fault, ended a child."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Optional

from colo_rl import dist

log = logging.getLogger("colo_rl")

_RECEIVED: Optional[int] = None  # the first SIGINT / SIGTERM a StopSignal caught in this process
_RELAYED: int = 0  # a stop signal another process caught and told this one of (a split run's generator)


def relay(signum: int) -> None:
    """A rank outside this loop's collective (a split run's generation rank) was signalled: the next
    `StopSignal.requested()` here answers as if this rank had been."""
    global _RELAYED
    _RELAYED = _RELAYED or int(signum)


def received() -> Optional[str]:
    """The name of the stop signal this process has caught ("SIGTERM"), or None: an error raised
    after it (a child process that got the same signal) can say that the stop, not a fault, ended it."""
    return signal.Signals(_RECEIVED).name if _RECEIVED else None


class StopSignal:
    """Graceful stop on SIGINT / SIGTERM, for every rank.

    The handler only sets a flag; the training loop calls `requested()` once per step (a
    collective: every rank calls it at the same point) and stops when any rank was signalled, so
    all ranks stop after the same step and can write a checkpoint together. Ctrl-C in a terminal
    signals torchrun and every rank; torchrun forwards the signal and SIGKILLs ranks still alive
    30 s later, so a step plus a checkpoint must fit in that grace period. Signalling rank 0 alone
    (`kill -INT <pid>`) stops every rank after the current step the same way. A second signal more
    than `force_after_s` after the first restores the default behaviour (KeyboardInterrupt /
    termination now): torchrun's forwarded copy arrives at once and must not count as a second.
    """

    def __init__(self, signals=(signal.SIGINT, signal.SIGTERM), force_after_s: float = 3.0):
        self.signum: Optional[int] = None
        self.first_at = 0.0
        self.force_after_s = force_after_s
        self._previous = {}
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            global _RECEIVED
            self.signum, self.first_at = signum, now
            _RECEIVED = _RECEIVED or signum
            log.warning("rank %d got %s: stopping after the current step (send it again to stop now)",
                        dist.job_rank(), signal.Signals(signum).name)
            return
        if now - self.first_at > self.force_after_s:
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)

    def requested(self) -> Optional[str]:
        """The signal's name when any rank was signalled, else None (the same answer on every rank)."""
        signalled = dist.all_reduce_max([float(self.signum or _RELAYED or 0)])[0]
        return signal.Signals(int(signalled)).name if signalled else None

    @staticmethod
    def exit_code(name: str) -> int:
        """The shell's code for a process ended by that signal (128 + signal number)."""
        return 128 + int(signal.Signals[name])

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass
        self._previous = {}
