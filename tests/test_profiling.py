"""colo_rl/profiling.py: the trace arithmetic, the host's time by Python package (cProfile), and
`trainer.profile_steps`' profiler on a real torch workload (the recipe's own profiled step:
tests/test_grpo_recipe.py)."""

import gzip
import json

import pytest
import torch

from colo_rl.metrics import Timer
from colo_rl.profiling import (DEVICE_CATEGORIES, HOST_CATEGORIES, StepProfiler, host_text, profile_call,
                               section_figures, summarise, trace_ops, union_seconds)


def test_union_counts_overlaps_once():
    assert union_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert union_seconds([]) == 0.0


def test_sections_count_the_kernels_inside_each_range():
    trace = {"traceEvents": [
        {"name": "colo_rl/update", "ph": "X", "ts": 100, "dur": 100, "cat": "user_annotation"},
        {"name": "colo_rl/update", "ph": "X", "ts": 300, "dur": 50, "cat": "user_annotation"},  # a second pass
        {"name": "colo_rl/reward", "ph": "X", "ts": 200, "dur": 100, "cat": "user_annotation"},
        {"name": "update", "ph": "X", "ts": 0, "dur": 1000, "cat": "user_annotation"},  # not the recipe's
        {"name": "k1", "ph": "X", "ts": 90, "dur": 30, "cat": "kernel"},    # 20 inside the first update
        {"name": "k2", "ph": "X", "ts": 150, "dur": 20, "cat": "kernel"},
        {"name": "k3", "ph": "X", "ts": 160, "dur": 20, "cat": "kernel"},   # overlaps k2: +10
        {"name": "k4", "ph": "X", "ts": 340, "dur": 20, "cat": "kernel"}]}  # 10 inside the second
    got = section_figures(trace)
    assert set(got) == {"update", "reward"}
    assert got["update"]["count"] == 2 and got["update"]["wall_s"] == pytest.approx(150e-6)
    assert got["update"]["busy_s"] == pytest.approx(60e-6)
    assert got["reward"] == {"count": 1, "wall_s": pytest.approx(100e-6), "busy_s": 0.0}
    assert section_figures(trace, None)["update"] == {"count": 2, "wall_s": pytest.approx(150e-6), "busy_s": None}


def test_trace_ops_take_each_events_direct_children_off_per_thread():
    events = [
        {"name": "outer", "ph": "X", "ts": 0, "dur": 100, "cat": "user_annotation", "pid": 1, "tid": 1},
        {"name": "aten::mm", "ph": "X", "ts": 10, "dur": 30, "cat": "cpu_op", "pid": 1, "tid": 1},
        {"name": "aten::t", "ph": "X", "ts": 12, "dur": 5, "cat": "cpu_op", "pid": 1, "tid": 1},  # in mm
        {"name": "aten::mm", "ph": "X", "ts": 50, "dur": 20, "cat": "cpu_op", "pid": 1, "tid": 1},
        {"name": "aten::mm", "ph": "X", "ts": 5, "dur": 200, "cat": "cpu_op", "pid": 1, "tid": 2},  # another thread
        {"name": "k", "ph": "X", "ts": 20, "dur": 7, "cat": "kernel", "pid": 0, "tid": 7},
        {"name": "k", "ph": "X", "ts": 22, "dur": 3, "cat": "kernel", "pid": 0, "tid": 7},  # kernels: own time
        {"name": "update", "ph": "X", "ts": 0, "dur": 900, "cat": "gpu_user_annotation", "pid": 0, "tid": 7},
        {"name": "flow", "ph": "s", "ts": 10, "cat": "cpu_op", "pid": 1, "tid": 1}]
    host = {o["name"]: (o["calls"], o["self_ms"]) for o in trace_ops(events, HOST_CATEGORIES)}
    assert host == {"aten::mm": (3, pytest.approx(0.245)), "outer": (1, pytest.approx(0.05)),
                    "aten::t": (1, pytest.approx(0.005))}
    assert [o["name"] for o in trace_ops(events, HOST_CATEGORIES, n=1)] == ["aten::mm"]
    assert trace_ops(events, DEVICE_CATEGORIES) == [{"name": "k", "calls": 2, "self_ms": pytest.approx(0.01)}]


def test_trace_ops_agree_with_the_profilers_own_averages(tmp_path):
    """On a real torch workload (forward, backward, nested ranges), each operator's self time read
    from the exported trace equals torch.profiler's key_averages()."""
    w = torch.randn(32, 32, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("outer"):
            for _ in range(20):
                with torch.profiler.record_function("inner"):
                    y = (torch.relu(w @ w) * 2).mean()
                y.backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ours = {o["name"]: o for o in trace_ops(json.loads((tmp_path / "t.json").read_text())["traceEvents"],
                                            HOST_CATEGORIES, n=10_000)}
    theirs = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    assert len(theirs) > 15 and {"outer", "inner", "aten::mm", "MmBackward0"} <= set(ours)
    for e in theirs:
        assert ours[e.key]["self_ms"] == pytest.approx(e.self_cpu_time_total / 1e3, rel=1e-3, abs=2e-3), e.key
    assert ours["aten::mm"]["calls"] == 60 and ours["inner"]["calls"] == 20


def test_host_profile_counts_a_builtin_to_its_callers_packages():
    """cProfile's stats by package: a C built-in's self time goes to the packages of its callers, in
    proportion to what each caller's calls cost; the top list is by self time."""
    ds = ("/v/lib/python3.12/site-packages/deepspeed/runtime/zero/stage3.py", 10, "hook")
    actor = ("/home/u/colo_rl/colo_rl/train/actor.py", 5, "step")  # a checkout named colo_rl
    sync = ("~", 0, "<method 'synchronize' of 'torch._C._CudaStreamBase' objects>")
    stats = {ds: (1, 1, 0.2, 0.5, {}), actor: (1, 1, 0.1, 0.4, {}),
             sync: (3, 3, 0.3, 0.3, {ds: (2, 2, 0.25, 0.25), actor: (1, 1, 0.05, 0.05)})}
    got = summarise(stats, wall_s=0.7)
    assert got["by_package"] == pytest.approx({"deepspeed": 0.45, "colo_rl": 0.15})
    assert list(got["by_package"]) == ["deepspeed", "colo_rl"] and got["profiled_s"] == pytest.approx(0.6)
    assert [o["name"] for o in got["top_self"]] == [sync[2], "deepspeed/runtime/zero/stage3.py:10(hook)",
                                                    "colo_rl/train/actor.py:5(step)"]
    assert got["top_self"][0]["calls"] == 3 and got["top_self"][0]["self_ms"] == pytest.approx(300)


def test_host_profile_of_a_real_call_names_its_functions():
    intervals = [(i, i + 2) for i in range(200_000)]
    got = profile_call(lambda: union_seconds(intervals))
    name = f"colo_rl/profiling.py:{union_seconds.__code__.co_firstlineno}(union_seconds)"
    assert got["by_package"]["colo_rl"] > 0 and got["top_self"][0]["name"] == name
    assert 0 < got["profiled_s"] <= got["wall_s"]
    assert f"| `{name}` | 1 |" in host_text(got) and host_text(None) == ""
    assert host_text({"error": "ValueError: no"}) == "Under cProfile: not measured (ValueError: no)."


def test_only_the_named_steps_are_profiled_and_each_says_where_its_time_went(tmp_path):
    timer = Timer()
    profiler = StepProfiler([2], tmp_path, timer)
    w = torch.randn(256, 256, requires_grad=True)
    for row in (1, 2, 3):
        with profiler(row):
            with timer("update"):
                for _ in range(20):
                    (w @ w).sum().backward()
            with timer("reward"):
                torch.randn(64).sum()
    assert timer.pop()["time/profile_write"] > 0
    out = tmp_path / "profile"
    assert sorted(p.name for p in out.iterdir()) == ["step2-rank0.trace.json.gz", "step2.json", "step2.md"]
    trace = json.loads(gzip.open(out / "step2-rank0.trace.json.gz").read())
    assert any(e.get("name") == "colo_rl/update" for e in trace["traceEvents"])
    summary = json.loads((out / "step2.json").read_text())
    sections = summary["sections"]
    assert set(sections) == {"update", "reward"} and sections["update"]["count"] == 1
    assert summary["step_s"] == summary["wall_s"]  # no loop around it: no `step` section
    assert sections["update"]["wall_s"] > sections["reward"]["wall_s"] and sections["update"]["wall_s"] < summary["wall_s"]
    assert summary["host"]["by_package"]["torch"] > 0 and summary["device_category"] == "cpu_op"
    assert sections["update"]["busy_s"] is None and summary["busy_s"] is None  # no device on a CPU
    assert any(o["name"] == "aten::mm" for o in summary["host_ops"])
    md = (out / "step2.md").read_text()
    assert md.startswith("# Step 2, profiled") and "| update | 1 |" in md and "`step2-rank0.trace.json.gz`" not in md
    assert "profile/step2-rank0.trace.json.gz" in md


def test_steps_the_run_will_not_reach_are_named(tmp_path, caplog):
    StepProfiler([1, 4, 11], tmp_path, Timer()).check_reach(start=3, total=10)  # resumed after step 3 of 10
    assert "step(s) [1, 11] are outside this run's steps 4-10: not profiled" in caplog.text
    caplog.clear()
    StepProfiler([4, 10], tmp_path, Timer()).check_reach(start=3, total=10)
    assert caplog.text == ""


def test_a_profiler_that_cannot_start_leaves_the_step_unprofiled_and_says_so(tmp_path, monkeypatch, caplog):
    import cProfile

    def refuse(self):
        raise ValueError("Another profiling tool is already active")

    monkeypatch.setattr(cProfile.Profile, "enable", refuse)
    ran = []
    with StepProfiler([1], tmp_path, Timer())(1):
        ran.append(torch.ones(3).sum().item())
    assert ran == [3.0] and not (tmp_path / "profile").exists()
    assert "step 1 not profiled: cProfile did not start (ValueError: Another profiling tool" in caplog.text


def test_a_step_that_fails_writes_no_profile_and_its_error_goes_through(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with StepProfiler([1], tmp_path, Timer())(1):
            raise RuntimeError("boom")
    assert not (tmp_path / "profile").exists()
    with StepProfiler([2], tmp_path, Timer())(2):  # and the next profile starts cleanly
        torch.ones(3).sum()
    assert (tmp_path / "profile" / "step2.md").exists()
