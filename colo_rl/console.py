"""What a run prints: rank-aware logging (rank 0 at INFO, the other ranks warnings only), written to
whatever sys.stdout is at the time so that log lines and the progress bar share the terminal."""

from __future__ import annotations

import logging
import sys
import warnings

from colo_rl import dist


class CurrentStdout:
    """Writes to whatever sys.stdout is at the time: while the progress bar runs, rich swaps it for a
    proxy that prints above the bar; a handler bound to the original stream would glue each log
    line onto the stale bar instead."""

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()


def setup_logging(debug: bool = False) -> None:
    """Rank-aware logging: rank 0 logs at INFO; other ranks only warnings unless debugging."""
    if not debug:  # torch's per-call deprecation notices from DeepSpeed's collectives
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    level = logging.INFO if (dist.is_rank0() or debug) else logging.WARNING
    fmt = f"[%(asctime)s r{dist.rank()}] %(message)s" if debug else "[%(asctime)s] %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=CurrentStdout(), force=True)
    logging.getLogger("colo_rl").setLevel(level)
    # DeepSpeed and transformers are chatty on every rank.
    for name in ("DeepSpeed", "deepspeed", "transformers", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING if dist.is_rank0() or debug else logging.ERROR)
    # SGLang's side of the engine in this process logs at its schedulers' level (log_level="error"): its
    # start-up notes (server_args, model registrations, features it turned off) are not the run's news.
    logging.getLogger("sglang").setLevel(logging.INFO if debug else logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING if dist.is_rank0() or debug else logging.ERROR)
    except Exception:
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:
        pass
