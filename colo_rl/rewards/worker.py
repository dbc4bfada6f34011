"""One reward worker process (colo_rl/rewards/pool.py starts it): loads the user's reward functions,
then answers calls over its stdin / stdout pipes until stdin closes.

The protocol keeps the real stdout to itself: the user's prints go to stderr, so a `print` in a
reward function cannot corrupt a reply.
"""

from __future__ import annotations

import os
import sys

from colo_rl.errors import RewardError
from colo_rl.rewards.pool import receive, send
from colo_rl.rewards.sources import load_source


def serve() -> None:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    fd = sys.stdin.fileno()
    specs = receive(fd)
    try:
        sources = [load_source(s) for s in specs]
    except Exception as e:  # noqa: BLE001 - reported to the trainer, which names it
        send(out, ("fatal", f"{type(e).__name__}: {e}"))
        return
    send(out, "ready")
    while (call := receive(fd)) is not None:
        index, completions, truths, fields = call
        source = sources[index]
        try:
            send(out, ("ok", source.call(completions, truths, fields)))
        except RewardError as e:  # a wrong return: the trainer stops with this message
            send(out, ("return", None, str(e)))
        except Exception as e:  # noqa: BLE001 - isolated: the trainer counts a failure
            send(out, ("error", None, f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    serve()
