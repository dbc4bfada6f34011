"""The python tool's sandbox: the policy's code runs where it cannot harm the trainer, read the
answers or outlive its call (docs/sandbox.md says what is isolated and what is not).

`bwrap` (bubblewrap): a fresh interpreter (`python -I -S -u`, stdlib only) in new pid, mount,
network, IPC, UTS and cgroup namespaces (and a user namespace when the trainer is not root); the
filesystem is a read-only view of /usr, the interpreter's prefix and the loader's cache only, plus
a small private writable /tmp and /dev/shm; no capabilities, its own session, an unprivileged uid
(as root: a uid of its own per concurrent call); the launcher is pid 1 of its namespace (bwrap
--as-pid-1: bwrap reaps it, no zombie per call) and dies with the call (and with the trainer), and
every process in the namespace with it.
Limits per call: a cgroup (memory, processes, one CPU) where this process can make one (cgroup v1
hierarchies or a v2 subtree it can write); otherwise RLIMIT_NPROC (counting only the call's own
processes) times the per-process RLIMIT_AS. Per process always: RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE.
`none`: the same interpreter and per-process limits without namespaces, and no process limit
(RLIMIT_NPROC would count the user's every process, the trainer's too); a loud warning at start-up.

The code travels on stdin (never argv: no size limit, not in /proc/*/cmdline); output (stdout and
stderr, one pipe) is read as it comes, up to a byte cap; the launcher reports the exception (and
earlier cells that failed on replay) on its own pipe.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from colo_rl.envs.cgroups import CgroupPlan, Limits
from colo_rl.errors import ConfigError

log = logging.getLogger(__name__)

SANDBOX_KINDS = ("bwrap", "none")
# As root, each concurrent call runs as a uid of its own (no account needs to exist), from a range of
# CALL_UID_SLOTS that this process claims among CALL_UID_RANGES (`claim_uid_range`).
CALL_UID_BASE, CALL_UID_SLOTS, CALL_UID_RANGES = 1_900_000_000, 4096, 1024
TMP_BYTES = 16 << 20  # each of the call's /tmp and /dev/shm
STATUS_MAX_BYTES = 1 << 20  # the runner's report (its error, the replay's failures): far less than this

# Runs inside the sandbox before the policy's code (our code: argv is fine for it): a file of its
# own, passed as the interpreter's -c text.
_LAUNCHER = (Path(__file__).parent / "sandbox_launcher.py").read_text()


@dataclass
class CallResult:
    output: bytes
    returncode: Optional[int]
    error: Optional[str] = None  # the exception the code raised ("ZeroDivisionError: ... (line 3)")
    replay_failed: list[tuple[int, str]] = field(default_factory=list)  # (earlier cell index, its exception)
    stopped: Optional[str] = None  # "timeout" | "output" | "status" (its pipe flooded): why we killed it
    oom: bool = False  # the call's cgroup killed a process for memory


# ------------------------------------------------------------------------- the sandbox
def _interpreter() -> tuple[str, str]:
    """(the base interpreter, its prefix): the venv's python resolved to the one it was made from."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return (exe if os.path.exists(exe) else os.path.realpath(sys.executable)), prefix


class Sandbox:
    """How this machine runs the python tool's calls (probed once per process: `get_sandbox`).

    As root, bwrap runs privileged (it mounts as root: the interpreter may live under /root) and
    the code runs as a uid of its own per concurrent call (`setpriv` inside the sandbox): no user
    namespace, so RLIMIT_NPROC counts exactly that call's processes. Otherwise bwrap runs
    unprivileged in a new user namespace: the count is that namespace's."""

    def __init__(self, kind: str):
        self.kind = kind
        self.python, prefix = _interpreter()
        self.as_root = os.geteuid() == 0 and kind == "bwrap"
        self.cgroups = CgroupPlan.probe() if kind == "bwrap" else None
        self._lock = threading.Lock()
        first_uid, self._uid_claim = claim_uid_range() if self.as_root else (CALL_UID_BASE, None)
        self._free_uids = list(range(first_uid + CALL_UID_SLOTS - 1, first_uid - 1, -1))
        self._calls = 0
        self.view: list[str] = []  # bwrap's arguments for the read-only filesystem view
        if kind != "bwrap":
            return
        self.bwrap, self.setpriv = shutil.which("bwrap"), shutil.which("setpriv")
        self.view = ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/lib", "/lib64", "/lib32", "/sbin"):  # merged /usr: keep the links
            if os.path.islink(top):
                self.view += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                self.view += ["--ro-bind", top, top]
        if not prefix.startswith("/usr/"):
            parts = prefix.strip("/").split("/")
            for k in range(1, len(parts)):  # bwrap would make the parents 0700 (e.g. /root): searchable instead
                self.view += ["--perms", "0755", "--dir", "/" + "/".join(parts[:k])]
            self.view += ["--ro-bind", prefix, prefix]
        for path in ("/etc/ld.so.cache", "/etc/localtime"):
            if os.path.exists(path):
                self.view += ["--ro-bind", path, path]

    def describe(self) -> str:
        if self.kind == "none":
            return "none (UNSANDBOXED: the policy's code runs as the trainer's user, with its files and network)"
        bound = ("a cgroup per call (memory, processes, 1 CPU)" if self.cgroups is not None else
                 "RLIMIT_NPROC x per-process RLIMIT_AS (no writable cgroup here)")
        who = (f"a uid of its own per call ({self._free_uids[-1]}+)" if self.as_root else
               f"uid {os.geteuid()} in a user namespace of its own")
        return f"bwrap ({self.bwrap}), {who}, {bound}"

    def _command(self, uid: Optional[int]) -> list[str]:
        inner = [self.python, "-I", "-S", "-u", "-c", _LAUNCHER]
        if self.kind == "none":
            return inner
        if self.as_root:
            namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
                          "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            inner = [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                     "--", *inner]
        else:
            namespaces = ["--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        # --as-pid-1: the launcher is the namespace's pid 1 (a reaper; the code runs in its child) and
        # bwrap waits for it. bwrap's own init reports the exit code over an eventfd and bwrap exits
        # before reaping it: every call left one zombie for the nearest subreaper (a trainer that is
        # PID 1 of its container, torchrun).
        return [self.bwrap, *namespaces, "--as-pid-1", "--die-with-parent", "--new-session", "--hostname", "sandbox",
                *self.view,
                "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
                "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/dev/shm",
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                "--chdir", "/tmp", "--", *inner]

    def run(self, cells: Sequence[str], limits: Limits) -> CallResult:
        """Run the cells (earlier ones replayed silently, the last one's output kept) in one call."""
        with self._lock:
            self._calls += 1
            name = f"{os.getpid()}_{self._calls}"
            if self.as_root and not self._free_uids:
                raise RuntimeError(f"more than {CALL_UID_SLOTS} python tool calls at once")
            uid = self._free_uids.pop() if self.as_root else None
        made: list[str] = []
        status_r, status_w = os.pipe()
        scratch = None
        try:
            cmd = self._command(uid)
            if self.cgroups is not None:
                made = self.cgroups.create(name, limits)
                # The shell joins the call's cgroups, then becomes bwrap: everything after it is inside.
                joins = "".join(f"echo $$ > {shlex.quote(p)} && " for p in self.cgroups.procs_files(made))
                cmd = ["/bin/sh", "-c", joins + 'exec "$@"', "sh", *cmd]
            job = json.dumps({"cells": list(cells), "status_fd": status_w,
                              "rlimits": limits.rlimits(nproc=self.kind == "bwrap")}).encode()
            # none: a scratch directory of its own (bwrap: the sandbox's private /tmp).
            scratch = tempfile.TemporaryDirectory(prefix="colo_rl_py_") if self.kind == "none" else None
            cwd = scratch.name if scratch is not None else "/"
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    pass_fds=(status_w,), cwd=cwd, env={"PATH": "/usr/bin:/bin", "HOME": cwd},
                                    start_new_session=True)
            os.close(status_w)
            status_w = -1
            try:
                result = self._collect(proc, job, status_r, limits)
            finally:
                self._kill(proc)
                for pipe in (proc.stdin, proc.stdout):
                    pipe.close()
            if made:
                result.oom = self.cgroups.oom_killed(made)
            return result
        finally:
            if status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            if made:
                self.cgroups.remove(made)
            if scratch is not None:
                scratch.cleanup()
            if uid is not None:
                with self._lock:
                    self._free_uids.append(uid)

    def _kill(self, proc: subprocess.Popen) -> None:
        """The call's whole tree: its session (none), its pid namespace (bwrap): the namespace's pid 1
        first, so that bwrap reaps it and exits; killed first, bwrap would leave it (dying of
        --die-with-parent) to the nearest subreaper as a zombie."""
        if proc.poll() is None and self.kind == "bwrap":
            for pid in _children(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        elif self.kind == "none":
            try:  # children left behind in its session (a setsid'd child escapes: docs/sandbox.md)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait()

    @staticmethod
    def _collect(proc: subprocess.Popen, job: bytes, status_r: int, limits: Limits) -> CallResult:
        """Feed stdin and read output and status as they come, until the process exits (then a short
        drain: a stray child holding the pipe never blocks us), the deadline or the byte cap."""
        deadline = time.monotonic() + limits.timeout_s
        out, status = bytearray(), bytearray()
        sel = selectors.DefaultSelector()
        pidfd = os.pidfd_open(proc.pid)
        for f in (proc.stdin, proc.stdout):
            os.set_blocking(f.fileno(), False)
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(status_r, selectors.EVENT_READ, "status")
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
        pending, stopped, exited_at, reading = memoryview(job), None, None, 2
        try:
            while stopped is None and (exited_at is None or reading):
                now = time.monotonic()
                if exited_at is None and now >= deadline:
                    stopped = "timeout"
                    break
                if exited_at is not None and now - exited_at > 0.2:
                    break  # it exited but something it left holds the pipe: do not wait for it
                wait = deadline - now if exited_at is None else exited_at + 0.2 - now
                for key, _ in sel.select(timeout=max(wait, 0.0)):
                    if key.data == "in":
                        try:
                            pending = pending[os.write(proc.stdin.fileno(), pending):]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(proc.stdin)
                            proc.stdin.close()
                    elif key.data == "exit":
                        sel.unregister(pidfd)
                        exited_at = time.monotonic()
                    else:
                        try:
                            chunk = os.read(key.fd, 1 << 16)
                        except BlockingIOError:
                            continue
                        if not chunk:
                            sel.unregister(key.fileobj)
                            reading -= 1
                            continue
                        (out if key.data == "out" else status).extend(chunk)
                        # the status pipe is open inside the sandbox too: the code can write to it
                        if len(out) > limits.output_bytes:
                            stopped = "output"
                            break
                        if len(status) > STATUS_MAX_BYTES:
                            stopped = "status"
                            break
        finally:
            sel.close()
            os.close(pidfd)
        returncode = proc.poll() if stopped is None else None
        result = CallResult(bytes(out[:limits.output_bytes]), returncode, stopped=stopped)
        try:
            parsed = json.loads(status.decode()) if status and len(status) <= STATUS_MAX_BYTES else {}
            result.error = parsed.get("error") if isinstance(parsed.get("error"), str) else None
            result.replay_failed = [(int(k), str(e)) for k, e in parsed.get("replay_failed", [])]
        except (ValueError, TypeError, AttributeError):
            pass  # the code wrote over its status pipe: only its own report suffers
        return result

def claim_uid_range() -> tuple[int, Any]:
    """The first uid of a range no other process on this machine gives its calls: the first of
    CALL_UID_RANGES whose lock file this process can flock (held while it lives; the kernel drops it
    when the process dies), and the open lock. Every rank used one range before, so one rank's call
    counted against another's RLIMIT_NPROC and failed to fork."""
    for k in range(CALL_UID_RANGES):
        fh = open(os.path.join(tempfile.gettempdir(), f"colo_rl_sandbox_uids.{k}.lock"), "a")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            continue
        return CALL_UID_BASE + k * CALL_UID_SLOTS, fh
    raise RuntimeError(f"all {CALL_UID_RANGES} python tool uid ranges are held by other processes "
                       f"({tempfile.gettempdir()}/colo_rl_sandbox_uids.*.lock)")


def _children(pid: int) -> list[int]:
    """A process's children (Linux /proc; none where the kernel does not list them)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


_SANDBOXES: dict[str, Sandbox] = {}

_INSTALL = ("install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; Fedora/RHEL: `dnf install "
            "bubblewrap`; or `make install-sandbox` as root)")


def get_sandbox(kind: str) -> Sandbox:
    """This process's sandbox of that kind, probed on first use with a real call: a machine where it
    cannot be made is refused here (fail closed), naming what to install or enable."""
    if kind not in SANDBOX_KINDS:
        raise ConfigError(f"env.python_sandbox={kind!r} is not one of {list(SANDBOX_KINDS)}")
    if kind in _SANDBOXES:
        return _SANDBOXES[kind]
    if kind == "none":
        log.warning("env.python_sandbox=none: the python tool runs the POLICY'S CODE UNSANDBOXED, as this user: it can "
                    "read the training data and your files, kill the trainer, use the network and leave processes "
                    "behind. Use env.python_sandbox=bwrap (docs/sandbox.md) for anything but a trusted test.")
        _SANDBOXES[kind] = Sandbox("none")
        return _SANDBOXES[kind]
    if shutil.which("bwrap") is None:
        raise ConfigError(f"env.python_sandbox=bwrap: the python tool's sandbox needs the `bwrap` program, which is not "
                          f"on PATH: {_INSTALL}. env.python_sandbox=none runs the policy's code unsandboxed (unsafe).")
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        raise ConfigError("env.python_sandbox=bwrap as root needs `setpriv` (util-linux) to run the code as an "
                          "unprivileged uid: `apt-get install -y util-linux`")
    box = Sandbox("bwrap")
    result = box.run(["print(6 * 7)"], Limits(timeout_s=20.0))
    if result.output.strip() != b"42" or result.returncode != 0:
        said = result.output.decode(errors="replace").strip()[-400:]
        raise ConfigError(
            f"env.python_sandbox=bwrap: bubblewrap is installed but cannot make the sandbox here ({said or result.stopped}). "
            "It needs unprivileged user namespaces: enable them (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu "
            "24.04 sysctl kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap; in Docker "
            "run with --security-opt seccomp=unconfined --security-opt apparmor=unconfined). "
            "env.python_sandbox=none runs the policy's code unsandboxed (unsafe).")
    log.info("python tool sandbox: %s", box.describe())
    _SANDBOXES[kind] = box
    return box
