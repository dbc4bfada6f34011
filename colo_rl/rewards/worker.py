"""One reward worker process (colo_rl/rewards/pool.py starts it): loads the user's reward functions,
then answers calls over its stdin / stdout pipes until stdin closes.

The protocol keeps the real stdout to itself: the user's prints go to stderr, so a `print` in a
reward function cannot corrupt a reply.
"""

from __future__ import annotations

import os
import sys

from colo_rl.errors import USER_CODE_FAILURES, RewardError, failure_text
from colo_rl.rewards.pool import receive, send
from colo_rl.rewards.sources import load_source


def serve() -> None:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    fd = sys.stdin.fileno()
    specs = receive(fd)
    try:
        sources = [load_source(s) for s in specs]
    except USER_CODE_FAILURES as e:  # reported to the trainer, which names it
        send(out, ("fatal", failure_text(e)))
        return
    send(out, "ready")
    while (call := receive(fd)) is not None:
        index, completions, truths, fields = call
        source = sources[index]
        try:
            send(out, ("ok", source.call(completions, truths, fields)))
        except RewardError as e:  # a wrong return: the trainer stops with this message
            send(out, ("return", None, str(e)))
        except USER_CODE_FAILURES as e:  # isolated: the trainer counts a failure
            send(out, ("error", None, failure_text(e)))


if __name__ == "__main__":
    serve()
