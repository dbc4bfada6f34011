"""`python -m colo_rl.launch [torchrun options] recipes/<recipe>.py [overrides]`: torchrun, quietly.

The same launcher as `torchrun` (same options, same rendezvous), with one difference: when a
rank fails, torchrun prints a "ChildFailedError" report (and its logger an error line per rank)
after the rank's own message. colo_rl's ranks already print one line, `error: <what and what to
do>` (runtime.clean_errors), so this launcher ends with that rank's exit code and no report.
`make demo`, `make sft` and `make dpo` use it; plain `torchrun` works the same, only louder.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional


def exit_code(failures: dict) -> int:
    """The failed ranks' exit status as a shell reports it: a rank's own error code first (the others
    may only have been stopped by the agent's SIGTERM), else 128 + N for a rank killed by signal N."""
    codes = [f.exitcode for _, f in sorted(failures.items())]
    own = [c for c in codes if c > 0]
    if own:
        return own[0]
    killed = [c for c in codes if c < 0]
    return 128 + abs(killed[0]) if killed else 1


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    # torchrun's own default (one thread per rank unless set), without its banner saying so
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun's own lines about a failed rank: the rank said what failed already
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        sys.exit(exit_code(e.failures))
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)


if __name__ == "__main__":
    main()
