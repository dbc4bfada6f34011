"""colo_rl/host_malloc.py: on a CPU run, dist.init tells glibc to serve large blocks from its heap,
which keeps freed ones for reuse, instead of mapping each anew (fresh pages, faulted in and zeroed)."""

import json
import platform
import subprocess
import sys

import pytest

from colo_rl.host_malloc import KEEP_HOST_MEMORY_ENV, keep_host_memory_wanted
from conftest import child_env, child_python_path

# After dist.init (a world of one, gloo): whether a 256 MiB tensor's memory lies in the heap
# (glibc's [heap] mapping, which keeps freed blocks for reuse) or in a mapping of its own (unmapped
# when it is freed, and faulted in anew by the next one).
PROBE = """
import json, torch
from colo_rl import dist
dist.init()
x = torch.empty(256 << 18)
spans = [[int(v, 16) for v in line.split()[0].split("-")] for line in open("/proc/self/maps")
         if line.rstrip().endswith("[heap]")]  # one or more: the kernel may split it
print(json.dumps(any(lo <= x.data_ptr() < hi for lo, hi in spans)))
"""


def in_heap(keep: str) -> bool:
    env = child_env(PYTHONPATH=child_python_path(), CUDA_VISIBLE_DEVICES="", **{KEEP_HOST_MEMORY_ENV: keep})
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_dist_init_serves_large_host_tensors_from_the_heap():
    """Unset on a CPU run: a large tensor comes from the heap; 0: from a mapping of its own, as
    glibc does by default. (What it saves: benchmarks/update_overhead.py, docs/update_overhead.md.)"""
    assert in_heap("") is True
    assert in_heap("0") is False


def test_the_setting_follows_the_device_unless_forced(monkeypatch):
    monkeypatch.delenv(KEEP_HOST_MEMORY_ENV, raising=False)
    assert keep_host_memory_wanted(on_gpu=False) and not keep_host_memory_wanted(on_gpu=True)
    monkeypatch.setenv(KEEP_HOST_MEMORY_ENV, "1")
    assert keep_host_memory_wanted(on_gpu=True)
    monkeypatch.setenv(KEEP_HOST_MEMORY_ENV, "0")
    assert not keep_host_memory_wanted(on_gpu=False)
    monkeypatch.setenv(KEEP_HOST_MEMORY_ENV, "yes")
    with pytest.raises(ValueError, match="COLO_RL_KEEP_HOST_MEMORY='yes': use 1"):
        keep_host_memory_wanted(on_gpu=False)
