"""The phase-switch benchmark runs on CPU too (small model), so its GPU runs use tested code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_phase_switch_benchmark_reports_every_transition(tmp_path):
    env = child_env(OMP_NUM_THREADS="1")  # its own world of one
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


@pytest.mark.slow
@pytest.mark.e2e
def test_itemised_pass_releases_and_pages_one_kind_at_a_time_with_the_real_paging_code(tmp_path):
    """colocate.paging=on runs DeepSpeed's real per-kind offload_states on CPU (host to host): the
    sequence the GPU run measures, each kind alone, then a reload. Freed bytes are CUDA-only."""
    env = child_env(OMP_NUM_THREADS="1")  # its own world of one
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phase_switch.py"), "--small", "--steps", "1",
                           "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--paging", "on",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("phase_switch-cpu-*.json")
    result = json.loads(json_path.read_text())
    item = result["itemised"]
    assert "error" not in item, item
    assert [r["what"] for r in item["engine"]["released"]] == ["kv_cache", "cuda_graph", "weights"]
    assert [r["what"] for r in item["trainer"]["paged"]] == [
        "partition cache", "optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer"]
    assert all(r["freed_bytes"] is None and r["seconds"] >= 0 for r in item["trainer"]["paged"])
    assert item["engine"]["held_bytes"]["weights"] > 0 and item["trainer"]["state_bytes"] > 0
    assert len(result["records"]) == 2  # the timed step's transitions; the itemised pass is reported apart
    assert result["transitions"]["update->generation"]["moves"]["trainer states"]["moved"] is True
    # the gradient bucket is freed and allocated again, not copied: out of the bytes a GB/s divides
    (out,) = [m for m in result["records"][0]["moves"] if m["what"] == "trainer states"]
    assert 0 < out["copied_bytes"] < out["bytes"]
    table = json_path.with_suffix(".md").read_text()
    assert "| trainer | page out Adam moments (fp32) |" in table and "| engine | release kv_cache |" in table


@pytest.mark.slow
@pytest.mark.e2e
def test_fixed_cost_mode_times_zero_byte_page_outs_and_plans_the_sample_cases(tmp_path):
    """`--fixed-cost`: a real ZeRO-3 actor's page-outs that move nothing, before and after the
    collector freeze, and colocate.paging=auto's decisions on the issue's sample cases."""
    env = child_env(OMP_NUM_THREADS="1")  # its own world of one
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "phase_switch.py"), "--fixed-cost",
                           "--repeats", "3", "--dtype", "fp32", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("phase_switch_fixed_cost-cpu-*.json")
    result = json.loads(json_path.read_text())
    before, after = result["before"], result["after"]
    assert len(before["seconds"]) == len(after["seconds"]) == 3
    assert after["tracked_objects"] < before["tracked_objects"] // 2  # the set-up's objects are frozen
    assert after["median_s"] < before["median_s"]  # gc.collect() no longer scans them
    plans = result["plans"]
    resident = [name for name in plans if name.startswith(("SmolLM2", "0.5B", "7B, 8"))]
    assert len(resident) == 3 and all(plans[n]["paged"] == [] and plans[n]["fits"] for n in resident)
    assert plans["7B, 1 x 80 GB (does not fit)"]["fits"] is False
    some = plans["3B, 1 x 80 GB, 64 x 3072 tokens (some paging)"]
    assert some["fits"] and some["paged"] and "lp_params" not in some["paged"]
    assert "| as today |" in json_path.with_suffix(".md").read_text()


@pytest.mark.slow
@pytest.mark.e2e
def test_switch_perf_stage_rehearses_on_cpu_with_tiny_shapes(tmp_path):
    """benchmarks/switch_perf.py (a `make gpu-perf` stage): paging forced on and auto, the figures
    read back from the ledgers. On CPU `on` pages host to host; `auto` pages nothing."""
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "switch_perf.py"), "--small", "--engine", "hf",
                           "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("switch_perf-cpu-*.json")
    result = json.loads(json_path.read_text())
    runs = {r["paging"]: r["figures"] for r in result["runs"]}
    assert set(runs) == {"auto", "on"} and result["failed"] == []
    assert runs["auto"]["paging_plan"]["paged"] == [] and runs["auto"]["page_out"]["bytes"] == 0
    assert runs["on"]["paging_plan"]["paged"] and runs["on"]["page_out"]["bytes"] > 0
    assert runs["on"]["page_in"]["bytes"] == runs["on"]["page_out"]["bytes"]  # what left comes back
    for figures in runs.values():
        assert figures["switch_excl_handoff_s"] > 0 and figures["handoff"]["ms"] > 0
    assert "| small | on |" in json_path.with_suffix(".md").read_text()
