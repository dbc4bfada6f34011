"""The zero-copy handoff's layout logic on CPU: DeepSpeed's flat buffer as named views
(train/flat_weights.py), SGLang's metadata over it (rollout/sglang/weights.py), the bucket size
from free memory (colocate/handoff.py). The real runtime takes this path in tests/test_sglang_cpu.py."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from colo_rl.colocate.handoff import MIN_BUCKET_BYTES, bucket_bytes_for
from colo_rl.rollout.sglang.weights import flat_metadata, prepare_flat_payload, reconstructs_views
from colo_rl.train.flat_weights import flat_weight_views

MIB, GIB = 1 << 20, 1 << 30


def deepspeed_like(dtype=torch.bfloat16):
    """A flat buffer with each parameter's partition a narrow view of it, as stage3.py's defragment
    leaves them at world size 1 (module order, back to back)."""
    shapes = {"embed.weight": (10, 4), "layer.q.weight": (4, 4), "norm.weight": (4,), "layer.mlp.weight": (6, 4)}
    total = sum(torch.Size(s).numel() for s in shapes.values())
    buffer = torch.arange(total, dtype=torch.float32).to(dtype)
    named, offset = [], 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        named.append((name, buffer.narrow(0, offset, n), torch.Size(shape)))
        offset += n
    return buffer, named


def test_each_weight_is_its_own_place_in_the_buffer():
    buffer, named = deepspeed_like()
    views = flat_weight_views(list(reversed(named)), buffer)  # order of the parameters, not of the buffer
    assert [n for n, _ in views] == [n for n, _, _ in reversed(named)]
    for (name, part, shape), (_, view) in zip(reversed(named), views):
        assert view.shape == shape and view.data_ptr() == part.data_ptr() and torch.equal(view.flatten(), part)
    buffer.zero_()  # views, not copies: the optimizer's in-place update is what the engine reads
    assert all(float(v.abs().sum()) == 0 for _, v in views)


@pytest.mark.parametrize("fault", ["sharded", "outside", "dtype", "strided"])
def test_anything_but_whole_contiguous_views_of_the_buffer_is_refused(fault):
    buffer, named = deepspeed_like()
    name, part, shape = named[1]
    if fault == "sharded":  # world size 2: a partition holds half of its weight
        named[1] = (name, part[: part.numel() // 2], shape)
    elif fault == "outside":
        named[1] = (name, part.clone(), shape)
    elif fault == "dtype":
        named[1] = (name, part.view(torch.float16), shape)
    else:
        named[1] = (name, buffer[::2][: part.numel()], shape)
    assert flat_weight_views(named, buffer) is None


def sglang_bucket():
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    from sglang.srt.weight_sync import tensor_bucket

    return tensor_bucket.FlattenedTensorBucket, tensor_bucket.FlattenedTensorMetadata


@pytest.mark.parametrize("byte_indexed", [True, False])
def test_sglangs_reconstruction_of_the_flat_buffer_gives_back_our_views(byte_indexed):
    bucket_cls, meta_cls = sglang_bucket()
    buffer, named = deepspeed_like()
    views = flat_weight_views(named, buffer)
    flat, metadata = flat_metadata(buffer, views, meta_cls, byte_indexed)
    assert flat.data_ptr() == buffer.data_ptr() and flat.numel() * flat.element_size() == buffer.numel() * 2
    assert [m.start_idx for m in metadata] == [(v.data_ptr() - buffer.data_ptr()) // (1 if byte_indexed else 2)
                                              for _, v in views]
    if byte_indexed:  # SGLang 0.5.21's reconstruction (uint8 + byte offsets)
        assert reconstructs_views(bucket_cls, flat, metadata, views)
        swapped = metadata[:]
        swapped[0], swapped[1] = swapped[1], swapped[0]
        assert not reconstructs_views(bucket_cls, flat, swapped, views)


def test_the_payload_is_the_buffer_itself_or_nothing():
    bucket_cls, _ = sglang_bucket()
    buffer, named = deepspeed_like()
    views = flat_weight_views(named, buffer)
    sent = []
    api = SimpleNamespace(bucket_cls=bucket_cls, serializer=SimpleNamespace(
        serialize=lambda data, output_str: sent.append(data) or "payload"))
    payload, keepalive = prepare_flat_payload(buffer, views, api)
    assert payload == {"format": "flattened_bucket", "items": ["payload"]}
    assert sent[0]["flattened_tensor"].data_ptr() == buffer.data_ptr()  # no copy
    assert keepalive[0] is sent[0]
    # a release whose bucket class reconstructs differently: refused, the bucketed handoff runs
    class Scrambling(bucket_cls):
        def reconstruct_tensors(self):
            return list(reversed(super().reconstruct_tensors()))

    assert prepare_flat_payload(buffer, views, SimpleNamespace(bucket_cls=Scrambling, serializer=api.serializer)) is None
    assert prepare_flat_payload(buffer, views, SimpleNamespace(bucket_cls=None, serializer=None)) is None


def test_bucket_size_follows_free_memory_up_to_the_cap():
    cap = 2048 * MIB
    assert bucket_bytes_for(40 * GIB, cap) == cap  # room: one call for a 0.5B model's 0.85 GiB
    assert bucket_bytes_for(3 * GIB, cap) == GIB  # two buckets live at once, 1 GiB left alone
    assert bucket_bytes_for(GIB, cap) == MIN_BUCKET_BYTES
    assert bucket_bytes_for(40 * GIB, MIB) == MIB  # the user's cap stands

