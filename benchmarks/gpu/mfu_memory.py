"""update_mfu.py's device memory (GPU runs): what the timed updates allocate above the trainer's
states, per token of the largest micro-batch, against the estimate `trainer.micro_batch_tokens=auto`
sizes its budget by (`colo_rl/train/activation_memory.py`, half the free memory today). The figure
that says how much larger a budget's share could be."""

from __future__ import annotations

from typing import Optional


def device_memory_start(on_gpu: bool) -> int:
    """Bytes allocated between updates (the trainer's states), the peak counters reset: the timed
    updates' peak above it is what the micro-batches cost."""
    if not on_gpu:
        return 0
    import torch

    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def device_memory(actor, mbs, base: int) -> dict:
    """The timed updates' memory against the estimate the token budget is sized by
    (`activation_bytes` of the largest micro-batch): how much of the free memory a budget may take."""
    import torch

    from colo_rl.train.activation_memory import activation_bytes

    tokens = max(int(mb.input_ids.numel()) for mb in mbs)
    estimate = activation_bytes(actor.config, tokens, torch.finfo(actor.dtype).bits // 8,
                                bool(actor.cfg.model.gradient_checkpointing), actor.chunked_lm_head)
    return memory_figures(base, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(),
                          torch.cuda.get_device_properties(0).total_memory, tokens, estimate)


def memory_figures(base: int, peak: int, reserved: int, total: int, tokens: int, estimate: int) -> dict:
    """GiB figures and the measured-over-estimate ratio of the largest micro-batch's `tokens`."""
    gib = 1 << 30
    over = peak - base
    return {"states_gib": base / gib, "peak_allocated_gib": peak / gib, "peak_reserved_gib": reserved / gib,
            "device_gib": total / gib, "largest_micro_batch_tokens": tokens, "estimate_gib": estimate / gib,
            "over_states_gib": over / gib, "measured_over_estimate": over / estimate if estimate else None,
            "mb_per_token": over / tokens / 1e6 if tokens else None}


def memory_text(mem: Optional[dict]) -> str:
    if not mem:
        return ""
    ratio = mem["measured_over_estimate"]
    return (f"Device memory: states {mem['states_gib']:.1f} GiB; peak allocated {mem['peak_allocated_gib']:.1f} GiB "
            f"({mem['over_states_gib']:.1f} above the states: {mem['mb_per_token']:.2f} MB per token of the largest "
            f"micro-batch, {mem['largest_micro_batch_tokens']:,} tokens), reserved {mem['peak_reserved_gib']:.1f} of "
            f"{mem['device_gib']:.1f} GiB; the budget's estimate for that micro-batch {mem['estimate_gib']:.1f} GiB"
            + (f" (measured / estimate {ratio:.2f})." if ratio is not None else "."))
