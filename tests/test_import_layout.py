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


def test_every_source_file_compiles_without_a_syntax_warning():
    """An invalid escape in a plain string ('\\s' in a docstring) is a SyntaxWarning the GPU image's
    Python 3.12 prints at every import (a DeprecationWarning in 3.11; a SyntaxError in a later Python)."""
    import warnings

    files = [p for d in ("colo_rl", "recipes", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
    noisy = []
    for path in files:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SyntaxWarning)
            warnings.simplefilter("error", DeprecationWarning)  # what Python 3.11 raises for it
            try:
                compile(path.read_text(), str(path), "exec")
            except SyntaxError as err:  # a SyntaxWarning raised as an error arrives as one
                noisy.append(f"{path.relative_to(ROOT)}:{err.lineno}: {err.msg}")
    assert not noisy, noisy
