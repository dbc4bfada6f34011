"""A failed SGLang child process (it sends SIGQUIT to the trainer): turned into SGLangEngineError
instead of SGLang's kill of the whole process tree."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from typing import Any, Mapping, Optional

from colo_rl import stop_signal
from colo_rl.errors import SGLangEngineError


# ===================================================================== a failed SGLang child (SIGQUIT)
CHILD_FAILED = (
    "the SGLang scheduler process failed (SIGQUIT from a child): see its traceback above; common causes: "
    "CUDA out of memory when the KV cache resumes or while generating (raise colocate.memory_margin_gib), "
    "a weight name or shape the engine's model lacks (update_weights_from_tensor), a kernel missing from the "
    "installed sgl_kernel (e.g. FA3's flash_ops: rollout.sglang_kwargs={attention_backend:triton}), a failed "
    "JIT build (nvcc / ninja), or 'libcudart.so.13: cannot open shared object file' (exit code 127: the "
    "CUDA runtime is not on LD_LIBRARY_PATH)")


def child_failed_message() -> str:
    """CHILD_FAILED, or, once this process has caught a stop signal, what most likely happened: the
    signal went to the whole process group (Ctrl-C, a job's time limit, `timeout`), SGLang's children
    got it too and ended, and nothing is wrong with the engine."""
    stop = stop_signal.received()
    if stop is None:
        return CHILD_FAILED
    return (f"the SGLang scheduler process ended after this rank got {stop}: the signal reached the whole "
            "process group (Ctrl-C, a job's time limit, `timeout`) and SGLang's processes stopped with it, so "
            "the step in progress could not finish and the run stopped without its checkpoint for it; nothing "
            "points to a fault in SGLang. To stop after the current step with a checkpoint, signal the rank "
            "processes (or torchrun) only, not their process group; resume with resume=auto. Had no stop been "
            f"sent, the usual causes: {CHILD_FAILED}")


class ChildFailure:
    """SGLang's children send SIGQUIT to this process when one fails (scheduler.py, its subprocess
    watchdog), and SGLang's own handler then kills this process's tree, trainer included, before
    any error can be reported. Ours records the failure and raises SGLangEngineError in the main
    thread (Python runs signal handlers there), so the caller's error handling and test reports run."""

    def __init__(self):
        self.failed = False
        self.previous: Any = None
        self.installed = False

    def __call__(self, signum=None, frame=None):
        if self.failed:  # every TP scheduler and SGLang's watchdog may signal: raise once, not in cleanup
            return
        self.failed = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the trainer's own code: stop it here
            raise SGLangEngineError(child_failed_message()) from None
        # Inside the engine's running loop (a call waiting for an answer the dead scheduler never sends):
        # raised here, the error would land in whichever task runs, and SGLang's tasks kill the process
        # tree on any exception (print_exception_wrapper). Stopping the loop ends the pending call,
        # which SGLangEngine._call turns into our error.
        loop.stop()

    def check(self) -> None:
        """Refuse to talk to an engine whose child already failed (a dead scheduler never answers)."""
        if self.failed:
            raise SGLangEngineError(child_failed_message() + " (earlier; the engine cannot be used any more)")

    def install(self) -> bool:
        """Make ours the SIGQUIT handler; the first install remembers the handler to restore.
        Only possible from the main thread (False elsewhere, as for SGLang's)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.signal(signal.SIGQUIT, _sigquit_from_child)
        if not self.installed:
            self.previous = previous
            self.installed = True
        return True

    def restore(self) -> None:
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed = False


_CHILD_FAILURE: Optional[ChildFailure] = None


def _sigquit_from_child(signum, frame):
    # A module-level function, not the ChildFailure: SGLang pickles ServerArgs (which carries it
    # as custom_sigquit_handler) into its spawned children, and a function pickles by name.
    handler = _CHILD_FAILURE
    if handler is None:
        raise SGLangEngineError(child_failed_message())
    handler(signum, frame)


def watch_child_failures() -> ChildFailure:
    """A ChildFailure for the engine about to start, installed; SIGQUIT (one handler per process)
    reaches the newest one. An engine that failed earlier keeps its own, failed, record."""
    global _CHILD_FAILURE
    _CHILD_FAILURE = ChildFailure()
    _CHILD_FAILURE.install()
    return _CHILD_FAILURE


def flush_until_idle(flush, timeout_s: float, poll_s: float = 0.05):
    """Call SGLang's flush_cache until it succeeds or `timeout_s` passes; returns the last answer
    as (success, message). The scheduler flushes only when idle, and right after a generate (or
    right after start) it may not be idle yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = flush()
        if isinstance(result, bool):  # some releases answer a bare bool
            result = (result, "")
        success = result.get("success") if isinstance(result, Mapping) else (
            result[0] if isinstance(result, (tuple, list)) else getattr(result, "success", None))
        if result is None or success is True or time.monotonic() >= deadline:
            return result
        time.sleep(poll_s)


def run_in_engine_loop(engine, fn) -> None:
    """Call `fn` inside the engine's event loop (Engine.loop, which every offline call runs).

    SGLang >= 0.5.21 creates the tokenizer manager's handle loop on the *running* loop, and with
    none running on a new one (get_or_create_event_loop): called from outside, the handle loop
    lands on a loop nobody runs and every later engine call waits forever for its answer."""
    loop = getattr(engine, "loop", None)
    if loop is None or not hasattr(loop, "run_until_complete") or loop.is_running():
        fn()
        return

    async def call():
        fn()

    loop.run_until_complete(call())


def take_over_signals(engine, child_failure: ChildFailure) -> None:
    """Take SIGQUIT and SIGTERM back from SGLang's tokenizer manager.

    SGLang passes custom_sigquit_handler to signal.signal while the engine starts, but its tokenizer
    manager's first request (auto_create_handle_loop) adds two handlers to its event loop: SIGQUIT,
    which kills the process tree, and SIGTERM, whose watchdog drains the engine and then kills the
    tree too (a server's graceful exit: it would end the trainer's own, before its checkpoint).
    Run that step now and drop both inside the running loop: uvloop's remove_signal_handler does
    nothing outside it (it returns False), and uvloop re-arms every handler it still holds each time
    the loop runs. Then ours handles SIGQUIT and the trainer's handler SIGTERM (StopSignal's)."""
    tm = getattr(engine, "tokenizer_manager", None)
    create = getattr(tm, "auto_create_handle_loop", None)
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None

    def create_then_drop():
        if create is not None:
            create()
        loop = getattr(tm, "event_loop", None) or getattr(engine, "loop", None)
        if loop is not None and hasattr(loop, "remove_signal_handler"):
            for sig in (signal.SIGQUIT, signal.SIGTERM):
                with contextlib.suppress(Exception):  # not registered there / not the main thread: nothing to undo
                    loop.remove_signal_handler(sig)

    run_in_engine_loop(engine, create_then_drop)
    if sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)
    child_failure.install()
