"""What a torch.profiler run of one update says: the fraction of its wall time a category of events
(GPU kernels) covers, from the exported chrome trace. `benchmarks/gpu/update_mfu.py` reports it
beside the profiler's largest entries (`colo_rl.profiling.trace_ops`)."""

from __future__ import annotations

from colo_rl.profiling import busy_within


def busy_fraction(trace: dict, category: str) -> dict:
    """From a chrome trace (torch.profiler export): the union of `category` events ("kernel" on a
    GPU) over the span of the "update" record_function range."""
    events = trace.get("traceEvents", [])
    spans = [e for e in events if e.get("name") == "update" and e.get("ph") == "X"]
    if not spans:
        raise ValueError("no 'update' range in the trace")
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    busy, count = busy_within(events, t0, t1, category)
    return {"category": category, "events": count, "busy_us": busy, "wall_us": t1 - t0,
            "busy_fraction": busy / max(t1 - t0, 1e-9)}


def busy_of_timed(busy: dict, update_seconds: float) -> float:
    """The category's busy time in the profiled update over an unprofiled update's wall time: the
    profiler slows the host (the profiled update ran 20-33 % longer on an H100), not the kernels, so
    `busy_fraction` of the profiled span understates how busy the device is in a timed update."""
    return busy["busy_us"] / 1e6 / max(update_seconds, 1e-9)
