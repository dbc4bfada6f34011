"""colo_rl.launch: a dead rank is named (which, of what, where its output is); Ctrl-C is a clean
stop that exits 0, a second one stops now."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from colo_rl.launch import child_pids, describe_failure, exit_code, root_cause
from conftest import ROOT, WORKERS, child_env, child_python_path, wait_for_line


def _failure(code, t=100, pid=7, error_file=""):
    return SimpleNamespace(exitcode=code, timestamp=t, pid=pid, error_file=error_file)


def test_the_root_cause_is_the_first_failure_and_a_killed_rank_before_the_one_that_lost_it():
    # rank 1 SIGKILLed; rank 0 then failed on the closed connection (exit 1) in the same poll
    failures = {0: _failure(1), 1: _failure(-9)}
    assert root_cause(failures)[0] == 1 and exit_code(failures) == 137
    # a rank's own error, the others stopped by the agent's SIGTERM
    assert root_cause({0: _failure(-15), 1: _failure(2)})[0] == 1 and exit_code({0: _failure(-15), 1: _failure(2)}) == 2
    # an earlier failure wins over a later one of any kind
    assert root_cause({0: _failure(1, t=99), 1: _failure(-9, t=140)})[0] == 0


def test_the_dead_ranks_line_says_which_rank_of_what_and_where_its_output_is(tmp_path):
    line = describe_failure(1, _failure(-9, pid=4242))
    assert line.startswith("error: rank 1 (pid 4242) was killed by SIGKILL (the kernel's out-of-memory killer")
    assert "its output is above" in line
    (tmp_path / "stderr.log").write_text("boom\n")
    line = describe_failure(0, _failure(1, error_file=str(tmp_path / "error.json")))
    assert "rank 0 (pid 7) exited with code 1" in line and f"its output: {tmp_path / 'stderr.log'}" in line
    assert describe_failure(0, _failure(2)) is None  # runtime.clean_errors said it already


def _launch(*args):
    return subprocess.Popen([sys.executable, "-m", "colo_rl.launch", "--standalone", "--nproc_per_node=2",
                             str(WORKERS / "stop_worker.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1"))


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_is_named_by_the_launcher():
    proc = _launch("dead", "60")
    out, err = proc.communicate(timeout=180)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 137, out + err
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 (pid ") and "killed by SIGKILL" in lines[0], err


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_is_a_clean_stop_that_exits_0_and_a_second_one_stops_now(signals):
    # 12-second steps: a stop after the step and a stop now stay apart on a loaded machine (with 6 s
    # steps a loaded CI run saw the ranks' teardown cross the step's end)
    proc = _launch("stop", "20", "12")
    try:
        wait_for_line(proc, "ready")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if signals == 2:  # during the step, past StopSignal.force_after_s (a forwarded copy is not a second)
            time.sleep(3.5)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "SignalException" not in err, err
    if signals == 1:
        assert proc.returncode == 0 and "Traceback" not in err, out + err
        assert "stopped by SIGINT after step" in out and "continue with resume=auto" in out
    else:
        assert proc.returncode == 130, out + err
        assert "stopped by" not in out and "second SIGINT: stopping the ranks now" in err
        assert time.monotonic() - t0 < 12  # before the step would have ended


@pytest.mark.slow
def test_a_signal_to_one_rank_alone_stops_every_rank_and_the_launcher_exits_0():
    """`kill -INT <rank 0's pid>` (not the launcher): every rank stops after the step with the
    loop's own line, once, and the launcher calls it what it is, a clean stop, not a failed rank."""
    proc = _launch("stop", "20", "4")
    try:
        wait_for_line(proc, "ready")
        ranks = child_pids(proc.pid)  # the agent runs in the launcher: the ranks are its children
        (rank0,) = [p for p in ranks if "RANK=0" in Path(f"/proc/{p}/environ").read_bytes().decode().split("\0")]
        os.kill(rank0, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    assert out.count("stopped by SIGINT after step") == 1 and "error:" not in err, out + err


def test_a_clean_stop_is_exit_0_even_when_a_slower_rank_had_the_agents_sigterm():
    from colo_rl.launch import StopForwarder

    stop = StopForwarder()
    stop.received = [signal.SIGINT]
    assert stop.exit_code({0: _failure(130), 1: _failure(-15)}) == 0
    assert stop.exit_code({0: _failure(130), 1: _failure(130)}) == 0
    assert stop.exit_code({0: _failure(1), 1: _failure(-15)}) == 130  # no rank stopped cleanly
    stop.received = [signal.SIGINT, signal.SIGINT]
    assert stop.exit_code({0: _failure(130), 1: _failure(-9)}) == 130  # stopped now


def test_the_launcher_takes_sigint_and_sigterm_off_torchruns_signal_list():
    from torch.distributed.run import get_args_parser

    from colo_rl.launch import StopForwarder

    args = get_args_parser().parse_args(["--nproc_per_node=2", "x.py"])
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopForwarder()
        stop.install(args)
        assert args.signals_to_handle == "SIGHUP,SIGQUIT"
        assert signal.getsignal(signal.SIGINT) is stop and signal.getsignal(signal.SIGTERM) is stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
