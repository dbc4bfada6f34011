"""DeepSpeed's JIT ops are built by one ninja however a run starts (make, an activated venv, plain
python), and a rebuild is announced before it starts."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colo_rl.train.ds_config import announce_op_build
from conftest import ROOT, child_env

VENV_BIN = Path(sys.prefix) / "bin"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"  # what `make` and a shell without the venv activated have

pytestmark = pytest.mark.skipif(not (VENV_BIN / "ninja").is_file(), reason="no ninja in this environment's bin")


def test_importing_colo_rl_puts_the_venvs_ninja_first():
    proc = subprocess.run([sys.executable, "-c", "import colo_rl, shutil; print(shutil.which('ninja'))"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=child_env(PATH=SYSTEM_PATH))
    assert proc.stdout.strip() == str(VENV_BIN / "ninja"), proc.stdout + proc.stderr


def _make_probe(target: str, command: str) -> str:
    """What `command` prints inside the Makefile's `target` (its recipe replaced by the probe)."""
    proc = subprocess.run(["make", "-s", "-f", "Makefile", "-f", "-", f"VENV={sys.prefix}",
                           "-o", f"{sys.prefix}/.colo_rl-installed", target], input=f"{target}:\n\t@{command}\n",
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=child_env(PATH=SYSTEM_PATH))
    return proc.stdout.strip()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_the_makefile_builds_and_runs_with_the_venvs_ninja():
    for target in ("demo", "test", "sft"):
        assert _make_probe(target, "command -v ninja") == str(VENV_BIN / "ninja"), target
    # the GPU machine's targets keep the image's python3
    assert _make_probe("gpu-wheels", "command -v python3") != str(VENV_BIN / "python3")


def test_a_rebuild_that_ninja_would_do_is_announced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    op = tmp_path / "fused_adam"
    op.mkdir()
    (op / "src.cpp").write_text("1")
    (op / "build.ninja").write_text("rule cp\n  command = cp $in $out\nbuild fused_adam.so: cp src.cpp\n")
    subprocess.run([str(VENV_BIN / "ninja"), "-C", str(op)], check=True, capture_output=True)
    assert not announce_op_build("fused_adam", "the optimizer op")  # built, up to date: nothing to say
    time.sleep(1.1)
    (op / "src.cpp").write_text("2")  # out of date: ninja would rebuild it
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        assert announce_op_build("fused_adam", "the optimizer op")
    assert f"rebuilding the optimizer op into {op} (ninja finds it out of date" in caplog.text
