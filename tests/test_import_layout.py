"""The import layering of pyproject.toml's [tool.importlinter] contracts holds (recipes -> loop /
runtime -> colocate -> rollout, train -> base modules; rollout and train independent)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    proc = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in proc.stdout, proc.stdout[-2000:]
