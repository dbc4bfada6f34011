"""The python tool's launcher: run inside the sandbox as `python -I -S -u -c <this file's text>`
(colo_rl/envs/sandbox.py reads it; never imported). Reads the job from stdin, stays the namespace's
pid 1 as a reaper where it is one, sets the per-process limits, replays earlier cells
(env.python_keep_state) with their output hidden, runs the last one, and writes what failed as JSON
on the status fd."""
import json, os, resource, sys
job = json.loads(sys.stdin.buffer.read())
null = os.open("/dev/null", os.O_RDONLY); os.dup2(null, 0); os.close(null)
status_fd = job["status_fd"]
os.set_inheritable(status_fd, False)
reaper = os.getpid() == 1
if reaper:
    # pid 1 of the call's namespace (bwrap --as-pid-1) ignores signals it has no handler for (the
    # code's alarm(), abort(), kill(getpid())) and inherits every orphan: it stays a reaper and the
    # code runs in a child of it; when that child ends, so does the namespace, with its exit status.
    child = os.fork()
    if child:
        os.close(status_fd)
        code = 1
        while True:
            try:
                pid, wait_status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child:
                code = os.waitstatus_to_exitcode(wait_status)
                break
        os._exit(code if code >= 0 else 128 - code)
for name, value in job["rlimits"].items():
    value += 1 if reaper and name == "RLIMIT_NPROC" else 0  # the reaper is one of the uid's processes
    resource.setrlimit(getattr(resource, name), (value, value))
import contextlib, io, traceback
def describe(exc, filename):
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    if isinstance(exc, SyntaxError):
        line = exc.lineno if exc.filename == filename else None
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return text + (f" (line {line})" if line is not None else "")
status = {"replay_failed": [], "error": None}
scope = {"__name__": "__main__"}
cells = job.pop("cells")
del job
for k, cell in enumerate(cells[:-1]):
    name = f"<earlier call {k + 1}>"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(cell, name, "exec"), scope)
        except SystemExit:  # it ended its own call early; the calls after it still run
            pass
        except BaseException as exc:
            status["replay_failed"].append([k, describe(exc, name)])
code = 0
try:
    exec(compile(cells[-1], "<tool>", "exec"), scope)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if exc.code is not None and not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr)
except BaseException as exc:
    status["error"], code = describe(exc, "<tool>"), 1
try:
    sys.stdout.flush(); sys.stderr.flush()
except Exception:
    pass
try:
    os.write(status_fd, json.dumps(status).encode())
except OSError:
    pass
os._exit(code)
