"""benchmarks/gpu/update_mfu.py's arithmetic: the busy fraction from a trace (trace_stats.py) and the
FLOP count (the GPU run itself: `python benchmarks/gpu/update_mfu.py`; its CPU rehearsal: --dry-run)."""

import pytest

from benchmarks.gpu.trace_stats import busy_fraction, union_seconds
from benchmarks.gpu.update_mfu import MODEL_05B, update_flops


def test_union_counts_overlaps_once():
    assert union_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert union_seconds([]) == 0.0


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
