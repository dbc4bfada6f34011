"""`python -m colo_rl.launch [torchrun options] recipes/<recipe>.py [overrides]`: torchrun, quietly.

The same launcher as `torchrun` (same options, same rendezvous), with three differences:

- when a rank fails, torchrun prints a "ChildFailedError" report (and its logger an error line per
  rank) after the rank's own message. colo_rl's ranks already print one line, `error: <what and
  what to do>` (runtime.clean_errors), so this launcher ends with that rank's exit code and no
  report; a rank that died another way (a signal such as the OOM killer's SIGKILL, an uncaught
  exception) is named in one line: which rank, of which signal or exit code, where its output is.
- Ctrl-C (SIGINT / SIGTERM) is passed to every rank, which stops after its current step with a
  checkpoint (colo_rl.stop_signal.StopSignal); the launcher then exits 0 after the ranks' "continue with
  resume=auto" line. A second one is passed on too and stops the ranks now (SIGKILL after
  SECOND_SIGNAL_GRACE_S): exit 128 + the signal's number. A rank signalled on its own stops every
  rank the same way, and the launcher exits 0 too.
- rank 0's clean refusal (exit 2) is not repeated.

`make demo`, `make sft` and `make dpo` use it; plain `torchrun` works the same, only louder.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

CLEAN_ERROR_EXIT = 2  # runtime.clean_errors: the rank already said what failed and what to do
SECOND_SIGNAL_GRACE_S = 5.0  # after a second Ctrl-C, the ranks still alive this long later are killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def root_cause(failures: dict):
    """(global rank, ProcessFailure) of the rank whose failure the others followed. The first seen
    (torchelastic's timestamp); among those a death by signal other than the agent's own SIGTERM (a
    rank killed from outside: the others then fail on a closed connection), then an exit code, then SIGTERM."""
    def order(item):
        f = item[1]
        kind = 0 if f.exitcode < 0 and -f.exitcode != signal.SIGTERM else 1 if f.exitcode > 0 else 2
        return getattr(f, "timestamp", 0), kind, item[0]

    return min(failures.items(), key=order)


def exit_code(failures: dict) -> int:
    """The launcher's exit status: the root cause's, as a shell reports it (128 + N for signal N)."""
    code = root_cause(failures)[1].exitcode
    return 128 - code if code < 0 else code or 1


def describe_failure(rank: int, failure) -> Optional[str]:
    """One line naming the rank that died, how, and where its output is; None for a rank's clean
    refusal (it printed its own `error:` line)."""
    code = failure.exitcode
    if code == CLEAN_ERROR_EXIT:
        return None
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        how = f"was killed by {name}" + (" (the kernel's out-of-memory killer sends it: `dmesg | grep -i oom`; "
                                          "lower the batch or sequence sizes)" if -code == signal.SIGKILL else "")
    else:
        how = f"exited with code {code}"
    log = Path(failure.error_file).parent / "stderr.log" if failure.error_file else None
    where = f"its output: {log}" if log is not None and log.exists() else \
        "its output is above (torchrun --log-dir DIR --redirects 3 keeps each rank's in DIR)"
    return (f"error: rank {rank} (pid {failure.pid}) {how}; the other ranks' errors follow from it. {where}")


def stopped_cleanly(failures: dict, signals=STOP_SIGNALS) -> bool:
    """Every rank ended as the loop ends a stop on one of `signals` (exit 128 + N after its checkpoint,
    or the agent's SIGTERM once another had). With no signal to the launcher, a rank was signalled on
    its own (`kill -INT <rank pid>`, a scheduler that signals the trainer's processes): not a failure."""
    codes = [f.exitcode for f in failures.values()]
    stops = {128 + s for s in signals}
    return any(c in stops for c in codes) and all(c in stops or c == -signal.SIGTERM for c in codes)


def child_pids(parent: Optional[int] = None) -> list[int]:
    """The children of `parent` (default: this process; torchrun's agent starts the ranks as direct
    children)."""
    me, out = os.getpid() if parent is None else parent, []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.append(int(entry))
    return out


class StopForwarder:
    """SIGINT / SIGTERM handler of the launcher: each signal goes to every rank (torchrun starts them
    in sessions of their own, so a terminal's Ctrl-C reaches only the launcher). The first asks for
    a clean stop; from the second on the ranks are killed if still alive SECOND_SIGNAL_GRACE_S later."""

    def __init__(self):
        self.received: list[int] = []

    def exit_code(self, failures: dict) -> int:
        """0 after a clean stop: one signal, and the ranks exited 128 + N after their checkpoint (a rank
        that was slower to exit may have had the agent's SIGTERM: the checkpoint was complete by then,
        every rank finishes it before any exits). Else 128 + the last signal's number."""
        clean = len(self.received) == 1 and stopped_cleanly(failures, self.received)
        return 0 if clean else 128 + self.received[-1]

    def install(self, args) -> None:
        """Handle STOP_SIGNALS here. torchrun's agent would turn them into an exception that ends it at
        once (a traceback, exit 1, the ranks given 30 s): they are taken off its --signals-to-handle
        (it keeps SIGHUP / SIGQUIT)."""
        args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",")
                                          if s.strip() not in {sig.name for sig in STOP_SIGNALS})
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)

    def __call__(self, signum, frame) -> None:
        self.received.append(signum)
        pids = child_pids()
        for pid in pids:
            _kill(pid, signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            print(f"launch: {name}: every rank stops after its current step with a checkpoint; "
                  f"{name} again to stop now", file=sys.stderr, flush=True)
            return
        print(f"launch: second {name}: stopping the ranks now", file=sys.stderr, flush=True)
        timer = threading.Timer(SECOND_SIGNAL_GRACE_S, lambda: [_kill(p, signal.SIGKILL) for p in pids])
        timer.daemon = True
        timer.start()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # torchrun's own default (one thread per rank unless set), without its banner saying so
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun's own lines about a failed rank: the rank said what failed already
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    stop = StopForwarder()
    stop.install(args)
    try:
        run(args)
    except ChildFailedError as e:
        if stop.received:
            sys.exit(stop.exit_code(e.failures))
        if stopped_cleanly(e.failures):  # the ranks said "stopped by ...; continue with resume=auto"
            sys.exit(0)
        rank, failure = root_cause(e.failures)
        line = describe_failure(rank, failure)
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.exit(exit_code(e.failures))
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
