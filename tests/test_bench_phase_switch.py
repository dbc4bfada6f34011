"""The phase-switch benchmark runs on CPU too (small model), so its GPU runs use tested code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_phase_switch_benchmark_reports_every_transition(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phase_switch.py"), "--small", "--steps", "2",
                           "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("phase_switch-cpu-*.json")
    result = json.loads(json_path.read_text())
    assert set(result["transitions"]) == {"update->generation", "generation->update"}
    for name, t in result["transitions"].items():
        assert t["count"] == 2, name
        assert t["seconds_mean"] > 0 and t["seconds_max"] >= t["seconds_median"] > 0
        assert t["memory_key"] == "rss_gib" and t["used_before_gib_mean"] > 0
    moves = result["transitions"]["update->generation"]["moves"]
    assert list(moves) == ["trainer states", "engine weights (allocate)", "weights handoff",
                           "engine KV cache (allocate)"]
    assert moves["trainer states"]["moved"] is False  # CPU: nothing pages
    assert moves["engine weights (allocate)"]["gib_mean"] > 0  # the HF engine really re-allocates
    assert len(result["records"]) == 4 and result["model"]["parameters"] > 0
    table = json_path.with_suffix(".md").read_text()
    assert "| update->generation | 2 |" in table and "| generation->update | 2 |" in table
