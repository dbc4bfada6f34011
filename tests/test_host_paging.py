"""HostPager (colo_rl/train/host_paging.py): a frozen model's partitions paged to host buffers that
are views into a few slabs, not one (power-of-two rounded, when pinned) allocation per tensor."""

from __future__ import annotations

import random

import pytest
import torch

from colo_rl.train.host_paging import ALIGN_BYTES, HostPager, slab_plan


def test_slab_plan_places_every_tensor_once_aligned_and_within_its_slab():
    rng = random.Random(0)
    for _ in range(500):
        slab = rng.choice([256, 1024, 4096])
        sizes = [rng.choice([0, 1, 7, 64, 100, 300, 5000]) for _ in range(rng.randint(0, 30))]
        slabs, where = slab_plan(sizes, slab)
        assert len(where) == len(sizes)
        spans: dict[int, list[tuple[int, int]]] = {}
        for n, (k, offset) in zip(sizes, where):
            assert offset % ALIGN_BYTES == 0 and offset + n <= slabs[k]
            assert slabs[k] <= slab or (offset == 0 and slabs[k] == n)  # over a slab only alone
            spans.setdefault(k, []).append((offset, offset + n))
        for ranges in spans.values():  # no two tensors overlap
            ranges.sort()
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
        # in order, each slab as full as the next tensor allowed: no slab but the last is nearly empty
        assert len(slabs) <= 1 + sum(sizes) // (slab // 2) + sum(n > slab // 2 for n in sizes)


def test_host_buffers_are_views_into_few_slabs_and_round_trip_exactly():
    torch.manual_seed(0)
    tensors = [torch.randn(n) for n in (1000, 3, 0, 250_000, 17)] + [torch.randn(4, 5).to(torch.bfloat16)]
    want = [t.clone() for t in tensors]
    pager = HostPager(tensors, pin_memory=False)
    pager.page_out()
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    assert len(storages) == len(pager.slab_bytes) == 1  # one slab, not six allocations
    assert sum(pager.slab_bytes) < pager.nbytes() + len(tensors) * ALIGN_BYTES
    assert all(torch.equal(t, w) and t.dtype == w.dtype for t, w in zip(tensors, want))
    held = list(pager._host)
    pager.page_in("cpu")
    tensors[0].data.mul_(2)  # trained between phases: the next page-out carries the new values
    pager.page_out()
    assert all(a is b for a, b in zip(pager._host, held))  # same shapes: the buffers are reused
    assert torch.equal(tensors[0], 2 * want[0]) and torch.equal(tensors[3], want[3])


def test_a_tensor_whose_shape_changes_gets_new_buffers():
    """ZeRO-3's persistent parameters hold no data (shape [0]) until their first forward."""
    t = torch.empty(0)
    other = torch.arange(6.0)
    pager = HostPager([t, other], pin_memory=False)
    pager.page_out()
    pager.page_in("cpu")
    t.data = torch.arange(10.0)
    pager.page_out()
    assert torch.equal(t, torch.arange(10.0)) and torch.equal(other, torch.arange(6.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_slabs_round_trip_on_gpu():
    """Pinned: the partitions go to views of one pinned slab and come back to the device unchanged."""
    tensors = [torch.randn(n, device="cuda") for n in (1000, 3, 0, 250_000)]
    tensors.append(torch.randn(4, 5, device="cuda").bfloat16())
    want = [t.clone() for t in tensors]
    pager = HostPager(tensors, pin_memory=True)
    pager.page_out()
    assert len(pager.slab_bytes) == 1
    assert all(t.device.type == "cpu" and t.untyped_storage().is_pinned() for t in tensors if t.numel())
    pager.page_in("cuda")
    assert all(t.device.type == "cuda" and torch.equal(t, w) for t, w in zip(tensors, want))
