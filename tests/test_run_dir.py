"""One run per run directory (an OS lock that dies with its holder), and a refused start-up leaves
no stub directory behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time


from conftest import ROOT, child_env, child_python_path, wait_for_line

# runtime.start as a recipe calls it, then the run "trains" until it is killed
HOLD = """
import sys, time
from hydra import compose, initialize_config_dir
from colo_rl import runtime
from colo_rl.config import register_configs
register_configs()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[3:])
ctx = runtime.start(cfg, "grpo", overrides=[])
print("started", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _start(run_dir, *args, hold_s=0):
    """runtime.start in a process of its own, which then holds the run for `hold_s` seconds."""
    return subprocess.Popen([sys.executable, "-c", HOLD, str(ROOT / "conf"), str(hold_s), f"run_dir={run_dir}", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1"))


def _recipe(*args, timeout=120):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "recipes/grpo.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=child_env(OMP_NUM_THREADS="1"))
    return proc, time.perf_counter() - t0


def test_a_second_run_in_a_held_run_dir_is_refused_naming_the_holder_and_a_killed_one_is_not(tmp_path):
    holder = _start(tmp_path, hold_s=600)
    try:
        wait_for_line(holder, "started")
        rows = json.dumps({"step": 1}) + "\n"
        (tmp_path / "metrics.jsonl").write_text(rows)  # the holder's first row
        config = (tmp_path / "config.yaml").read_text()
        proc, seconds = _recipe(f"run_dir={tmp_path}", "trainer.seed=7")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in out, out
        assert f"error: run dir {tmp_path} is in use by another run (pid {holder.pid} on host " \
               f"{socket.gethostname()}, since " in out, out
        # refused before touching anything: the holder's metrics are not set aside, its config stays
        assert (tmp_path / "metrics.jsonl").read_text() == rows
        assert (tmp_path / "config.yaml").read_text() == config
        assert not list(tmp_path.glob("metrics.previous-*"))
        print(f"second run refused in {seconds:.1f}s")
    finally:
        holder.kill()  # kill -9: the lock dies with it
        holder.wait(timeout=30)
    again = _start(tmp_path, "trainer.seed=7")
    out, err = again.communicate(timeout=120)  # started, then held 0 s
    assert again.returncode == 0 and "started" in out, out + err


def test_a_refused_start_up_removes_the_run_dir_it_made(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(9))
                    + json.dumps({"prompt": "q9"}) + "\n")
    # refused by the checkpoint manager in runtime.start, and by the recipe's set-up (its data)
    for args, message in ([f"resume={tmp_path}/nowhere"], "no such directory"), \
                         ([f"data.path={data}", "data.eval_size=2"], "bad.jsonl:10: needs one of the keys"):
        run_dir = tmp_path / "new" / "run"
        proc, seconds = _recipe(f"run_dir={run_dir}", *args)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and message in out, out
        assert not run_dir.exists(), list(run_dir.iterdir())
        print(f"{args}: refused in {seconds:.1f}s")
    # a directory the user made stays (only its lock file is new)
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    proc, _ = _recipe(f"run_dir={run_dir}", f"data.path={data}", "data.eval_size=2")
    assert proc.returncode == 2 and run_dir.is_dir()
