"""`.ci/check_disk.py`: an install that cannot fit is refused up front, naming the path and what to do."""

import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[1] / ".ci" / "check_disk.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True)


def test_refuses_when_the_filesystem_lacks_room(tmp_path):
    venv = tmp_path / "not" / "made" / "yet"  # the venv's folder does not exist before the install
    done = run("1e9", str(venv))
    assert done.returncode == 1
    assert str(venv) in done.stderr and "GiB free" in done.stderr and "VENV=" in done.stderr
    assert 1 <= done.stderr.count("error:") <= 2  # the venv's filesystem and TMPDIR's, each said once


def test_passes_when_there_is_room(tmp_path):
    done = run("0.001", str(tmp_path / "venv"))
    assert done.returncode == 0 and done.stderr == ""


def test_usage_without_arguments():
    assert run().returncode == 2
