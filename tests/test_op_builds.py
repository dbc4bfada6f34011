"""A JIT build killed mid-way leaves torch's lock file, and every later run would wait on it forever:
colo_rl stops with the path to delete instead (colo_rl/op_builds.py)."""

import os
import subprocess
import sys
import time

import pytest

from colo_rl.errors import BuildLockError
from colo_rl.op_builds import STALE_AFTER_S, check_no_interrupted_build, interrupted_builds
from tests.conftest import ROOT, child_env, child_python_path


def _lock(root, op, age_s):
    (root / op).mkdir(parents=True, exist_ok=True)
    lock = root / op / "lock"
    lock.write_text("")
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_an_old_lock_nobody_builds_under_is_named_with_what_to_do(tmp_path):
    old = _lock(tmp_path, "fused_adam", STALE_AFTER_S + 5)
    _lock(tmp_path, "deepspeed_shm_comm", 1)  # young: a build may be about to start ninja
    (tmp_path / "cpu_adam").mkdir()  # built, no lock
    assert interrupted_builds(tmp_path) == [old]
    with pytest.raises(BuildLockError) as e:
        check_no_interrupted_build(str(tmp_path))
    assert "fused_adam" in str(e.value) and f"rm {old}" in str(e.value) and "deepspeed_shm_comm" not in str(e.value)
    old.unlink()
    check_no_interrupted_build(str(tmp_path))  # nothing left: passes


def test_a_lock_with_a_process_working_in_its_directory_is_a_live_build(tmp_path):
    lock = _lock(tmp_path, "fused_adam", STALE_AFTER_S + 5)
    ninja = subprocess.Popen(["sleep", "30"], cwd=lock.parent)  # stands where ninja runs: the build directory
    try:
        assert interrupted_builds(tmp_path) == []
        check_no_interrupted_build(str(tmp_path))
    finally:
        ninja.kill()
        ninja.wait()
    assert interrupted_builds(tmp_path) == [lock]


def test_the_recipe_refuses_in_one_line_instead_of_hanging(tmp_path):
    """The real command line with a stale lock in its extensions directory: before this check it
    waited forever in torch's FileBaton when DeepSpeed loaded its CPU collective op."""
    lock = _lock(tmp_path / "ext", "deepspeed_shm_comm", STALE_AFTER_S + 5)
    proc = subprocess.run([sys.executable, "recipes/grpo.py", "model=tiny", f"output_root={tmp_path}/out"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=child_env(PYTHONPATH=child_python_path(), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"rm {lock}" in proc.stderr and "Traceback" not in proc.stderr
