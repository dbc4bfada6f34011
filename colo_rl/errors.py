"""The errors colo_rl raises on purpose. Each message names the key, file or step and what to do;
the recipes print them as one line (`runtime.clean_errors`)."""

from __future__ import annotations

# What a call into the user's code (a reward function, an environment, their file's import) raises
# that is reported as that code's failure: SystemExit too, for sys.exit there would otherwise end
# the trainer (silently, and with status 0 for sys.exit(0)). KeyboardInterrupt stays Ctrl-C's.
USER_CODE_FAILURES = (Exception, SystemExit)


def failure_text(e: BaseException) -> str:
    """A USER_CODE_FAILURES exception as its report says it."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}); return a value or raise an exception instead"
    return f"{type(e).__name__}: {e}"


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what to do."""


class DataError(ValueError):
    """Bad input data; the message names the file, line and key, and what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and what to do."""


class RewardError(RuntimeError):
    """Reward functions failed on more of a batch than reward.max_failure_rate allows."""


class EnvError(RuntimeError):
    """An environment (env.name) failed on every episode of a batch: a bug in it, most likely."""


class PoolError(RuntimeError):
    """A split run's rank of the other pool died or stopped answering; the message names it."""


class PhaseError(RuntimeError):
    """An operation was attempted in the wrong phase (it would run on paged-out memory)."""


class HandoffError(RuntimeError):
    """The engine did not take, or is not sampling from, the trainer's weights."""


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class SGLangEngineError(RuntimeError):
    """SGLang answered something colo_rl cannot use, or its scheduler died (the message says what and what to do)."""


class EngineStateError(RuntimeError):
    """The engine was asked to do something its memory state does not allow."""


class BuildLockError(RuntimeError):
    """A JIT op build that was killed left torch's lock file: every later run would wait on it forever."""
