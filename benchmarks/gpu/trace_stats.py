"""What a torch.profiler run of one update says: the fraction of its wall time a category of events
(GPU kernels) covers, from the exported chrome trace, and the profiler's largest entries.
`benchmarks/gpu/update_mfu.py` reports both."""

from __future__ import annotations


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def busy_fraction(trace: dict, category: str) -> dict:
    """From a chrome trace (torch.profiler export): the union of `category` events ("kernel" on a
    GPU) over the span of the "update" record_function range."""
    events = trace.get("traceEvents", [])
    spans = [e for e in events if e.get("name") == "update" and e.get("ph") == "X"]
    if not spans:
        raise ValueError("no 'update' range in the trace")
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    inside = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t1)) for e in events
              if e.get("cat") == category and e.get("ph") == "X" and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    busy = union_seconds(inside)
    return {"category": category, "events": len(inside), "busy_us": busy, "wall_us": t1 - t0,
            "busy_fraction": busy / max(t1 - t0, 1e-9)}


def busy_of_timed(busy: dict, update_seconds: float) -> float:
    """The category's busy time in the profiled update over an unprofiled update's wall time: the
    profiler slows the host (the profiled update ran 20-33 % longer on an H100), not the kernels, so
    `busy_fraction` of the profiled span understates how busy the device is in a timed update."""
    return busy["busy_us"] / 1e6 / max(update_seconds, 1e-9)


def top_ops(averages, key: str, n: int = 12) -> list[dict]:
    """The profiler's `n` largest entries by `key` (self_cpu_time_total / self_device_time_total,
    microseconds), as {name, calls, self_ms}."""
    rows = sorted(averages, key=lambda e: getattr(e, key, 0.0), reverse=True)[:n]
    return [{"name": e.key, "calls": e.count, "self_ms": getattr(e, key, 0.0) / 1e3} for e in rows
            if getattr(e, key, 0.0) > 0]
