"""glibc's allocator told to keep large freed blocks for reuse, on a run whose tensors live in host
memory (no GPU).

A CPU tensor's memory comes from glibc's malloc. A block over its mmap threshold (32 MiB at most)
is mapped from the kernel when it is allocated and unmapped when it is freed, so every such tensor
is fresh pages, which the kernel faults in and zeroes one by one on first touch. A training step
makes many: each micro-batch's [tokens, vocabulary] logits, and under ZeRO-3 (at any world size)
the gradient buckets that `reduce_scatter_coalesced` concatenates and the copies into the float32
gradient partitions. On a 2-core CPU that was ~20 % system time, and keeping the blocks made the
demo's update 0.69x as long (docs/update_overhead.md). With `M_MMAP_MAX=0` every block comes from
the heap, and a high `M_TRIM_THRESHOLD` keeps freed heap in the process, where the next
micro-batch reuses it without a fault.

The price: freed host memory stays in the process (its RSS is the high-water mark of its heap, not
of its live tensors; the CPU memory ledger's `rss_gib` reads so), and fragmentation adds to the
peak: torch asks for 64-byte-aligned blocks, which a freed block of the very same size does not
always fit (a small allocation right after it keeps it from merging), so the heap may grow a few
times before freed blocks serve every request. The recipe's peak RSS grew 5.09 -> 5.65 GiB for the
demo and 1.31 -> 2.02 GiB for the deep narrow model (docs/update_overhead.md). On a GPU the large
tensors are the device's, and pinned host buffers come from CUDA's allocator, so nothing is changed
there. `$COLO_RL_KEEP_HOST_MEMORY`: 1 / 0 forces it on / off; unset, it follows the device.
"""

from __future__ import annotations

import ctypes
import os
import platform

KEEP_HOST_MEMORY_ENV = "COLO_RL_KEEP_HOST_MEMORY"
# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: free heap is returned only past 2 GiB at its top


def keep_host_memory_wanted(on_gpu: bool) -> bool:
    """$COLO_RL_KEEP_HOST_MEMORY (1 / 0), else on exactly when the run computes on the CPU."""
    forced = os.environ.get(KEEP_HOST_MEMORY_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{KEEP_HOST_MEMORY_ENV}={forced!r}: use 1 (keep freed host memory for reuse), "
                         "0 (glibc's default) or leave it unset (kept on a CPU run)")
    return forced == "1" if forced else not on_gpu


def keep_freed_host_memory(on_gpu: bool) -> bool:
    """Apply the setting above to this process (where `keep_host_memory_wanted` and the C library
    is glibc). Returns whether it is in effect. Process-wide and irreversible: call it once, early."""
    if not keep_host_memory_wanted(on_gpu) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library already loaded (find_library would run ldconfig)
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False
