"""How a colo_rl process ends: with its status and Python's exit duties, but without the interpreter's
teardown (gloo's threads would abort it; `run_and_exit`), and with its torchrun parent
(`exit_with_parent`)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Any, Callable, NoReturn


def exit_with_parent(sig: int = signal.SIGTERM) -> None:
    """torchrun starts each rank in its own session, so a SIGKILLed torchrun (OOM killer, `kill -9`)
    would leave the ranks running, holding memory and GPUs. Ask Linux to send this process `sig`
    when its parent dies: SIGTERM reaches the StopSignal handler, so the ranks still stop together
    after the current step. No-op where prctl is unavailable."""
    try:
        import ctypes

        parent = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)
    except (OSError, AttributeError):
        pass


def run_and_exit(main: Callable[[], Any]) -> NoReturn:
    """Run a process's `main`, then exit as Python would but without the interpreter's teardown.
    The status is what `sys.exit(main())` would give.

    Why: gloo runs collectives on its own C++ threads, and such a thread drops a finished
    collective (and the tensors it holds) just after the waiting rank has been released. If that
    lands while the interpreter finalizes, the thread's request for the GIL ends it with
    pthread_exit, and the process aborts after its work is done: `terminate called without an
    active exception` (SIGABRT, so torchrun reports the run failed). destroy_process_group cannot
    join those threads first, since DeepSpeed's ZeRO-3 parameters keep the groups referenced.
    So everything Python's exit does for the program still happens (threads joined, atexit hooks:
    logging, TensorBoard, W&B, child processes), then os._exit skips only the teardown. An
    exception other than SystemExit propagates as usual.
    """
    try:
        status = _exit_status(main())
    except SystemExit as e:
        status = _exit_status(e.code)
    threading._shutdown()  # what Python's exit does first: join non-daemon threads (and executors)
    atexit._run_exitfuncs()
    exit_skipping_teardown(status)


def exit_skipping_teardown(status: int) -> NoReturn:
    """Flush stdout and stderr, then end the process now: no interpreter teardown (run_and_exit says
    why), and none of Python's exit duties either, so call it once they are done."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _exit_status(code: Any) -> int:
    """The status Python gives `sys.exit(code)`: None is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
