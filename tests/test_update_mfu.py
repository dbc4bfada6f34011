"""benchmarks/gpu/update_mfu.py's arithmetic: the busy fraction from a trace (trace_stats.py) and the
FLOP count (the GPU run itself: `python benchmarks/gpu/update_mfu.py`; its CPU rehearsal: --dry-run)."""

import pytest

from benchmarks.gpu.trace_stats import busy_fraction, busy_of_timed
from benchmarks.gpu.update_mfu import MODEL_05B, update_flops


def test_busy_fraction_is_kernel_time_inside_the_update_range():
    trace = {"traceEvents": [
        {"name": "update", "ph": "X", "ts": 100, "dur": 100, "cat": "user_annotation"},
        {"name": "k1", "ph": "X", "ts": 90, "dur": 30, "cat": "kernel"},    # 20 inside
        {"name": "k2", "ph": "X", "ts": 150, "dur": 20, "cat": "kernel"},
        {"name": "k3", "ph": "X", "ts": 160, "dur": 20, "cat": "kernel"},   # overlaps k2: +10
        {"name": "op", "ph": "X", "ts": 100, "dur": 100, "cat": "cpu_op"},  # another category
        {"name": "k4", "ph": "X", "ts": 300, "dur": 5, "cat": "kernel"}]}   # after the range
    got = busy_fraction(trace, "kernel")
    assert got["busy_us"] == 50 and got["wall_us"] == 100 and got["busy_fraction"] == pytest.approx(0.5)
    # the profiler slows the host: over an unprofiled update of 62.5 us the same kernels are 80 % of it
    assert busy_of_timed(got, 62.5e-6) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no 'update' range"):
        busy_fraction({"traceEvents": []}, "kernel")


def test_flops_follow_six_n_per_token_when_context_is_short():
    """With a 1-token context, attention is negligible: 6 x (layer params) per token + the head."""
    dims = dict(MODEL_05B)
    h, V = dims["hidden_size"], dims["vocab_size"]
    flops = update_flops(dims, prompt_len=1, response_len=1, group_size=1, groups=1000)
    kv = h * dims["num_key_value_heads"] // dims["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * dims["intermediate_size"]
    no_attention = 6 * (dims["num_hidden_layers"] * per_layer * 2 + h * V) * 1000
    assert flops == pytest.approx(no_attention, rel=1e-3)


def test_micro_batches_are_planned_as_a_grpo_step_plans_them():
    """`--groups-per-micro-batch auto` (the default): whole rows up to the trainer's token budget,
    by the recipe's own planner; a count: that many rows each; anything else is refused."""
    import argparse

    from benchmarks.gpu.mfu_work import micro_batch_plan
    from benchmarks.gpu.update_mfu import rows_per_micro_batch

    class Budget:  # the one thing the plan reads from the actor
        def micro_batch_tokens(self) -> int:
            return 2500

    rows = [150 + 8 * 96] * 16  # 918 tokens a row: two fit in 2,500, three do not
    auto = micro_batch_plan("auto", rows, Budget())
    assert [len(b) for b in auto] == [2] * 8 and sorted(i for b in auto for i in b) == list(range(16))
    assert micro_batch_plan(3, rows, Budget()) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15]]
    assert rows_per_micro_batch("auto") == "auto" and rows_per_micro_batch("4") == 4
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="--groups-per-micro-batch"):
            rows_per_micro_batch(bad)


def test_memory_figures_compare_the_micro_batch_with_the_budget_estimate():
    """What the timed updates allocated above the states, per token of the largest micro-batch and
    against the estimate the token budget is sized by (GPU runs only; the arithmetic here)."""
    from benchmarks.gpu.mfu_memory import memory_figures, memory_text

    gib = 1 << 30
    m = memory_figures(base=10 * gib, peak=40 * gib, reserved=48 * gib, total=80 * gib, tokens=15_000,
                       estimate=20 * gib)
    assert m["over_states_gib"] == 30 and m["measured_over_estimate"] == pytest.approx(1.5)
    assert m["mb_per_token"] == pytest.approx(30 * gib / 15_000 / 1e6)
    text = memory_text(m)
    assert "peak allocated 40.0 GiB (30.0 above the states: 2.15 MB per token" in text and "estimate 1.50" in text
    assert memory_text(None) == ""

