"""Weight updates: the per-TP-rank payloads (CUDA IPC handles to flattened buckets; shared memory on
CPU), the weight-update session (SGLang >= 0.5.21), result checks."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Mapping, Optional

import torch

from colo_rl.errors import HandoffError
from colo_rl.rollout.sglang.compat import ensure_reductions_patched, sglang_api
from colo_rl.rollout.sglang.env import expandable_segments_enabled, ipc_producer_allocations


# ===================================================================== weight updates (pure)
def update_result(result, what: str, allow_none: bool = False) -> str:
    """Check an SGLang `(success, message)` answer (tuple, dict or object); raise HandoffError
    with the engine's message on failure. Returns the message."""
    if result is None:
        if allow_none:
            return ""
        raise HandoffError(f"SGLang's {what} returned nothing, so colo_rl cannot tell whether the engine "
                           "took the weights; this SGLang release is not supported for the handoff")
    # LoRA load / unload answer LoRAUpdateOutput(success, error_message), the rest (success, message)
    if isinstance(result, Mapping):
        success, message = result.get("success"), result.get("message") or result.get("error_message") or ""
    elif isinstance(result, (tuple, list)):
        success, message = (result[0], result[1] if len(result) > 1 else "")
    elif hasattr(result, "success"):
        success, message = result.success, getattr(result, "message", None) or getattr(result, "error_message", "")
    else:
        raise HandoffError(f"SGLang's {what} returned {result!r}; expected (success, message)")
    if success is not True:
        raise HandoffError(f"SGLang's {what} failed: {message!r}. The engine may not be sampling from the "
                           "trainer's weights; stopping rather than training on samples from the wrong policy")
    return str(message or "")


@dataclasses.dataclass
class WeightSession:
    """How to open/close SGLang's weight-update session (SGLang >= 0.5.21 refuses updates outside
    one). `via` is "engine" (Engine.begin/end_weight_update) or "tokenizer_manager"."""

    via: str
    begin: Any
    end: Any


def weight_session_api(engine, begin_req=None, end_req=None) -> Optional[WeightSession]:
    """Detect the session API by feature: the engine's own methods, else the tokenizer manager's
    coroutines with SGLang's request objects, else None (an older release: no session)."""
    begin, end = getattr(engine, "begin_weight_update", None), getattr(engine, "end_weight_update", None)
    if callable(begin) and callable(end):
        return WeightSession("engine", lambda: begin(), lambda: end())
    tm = getattr(engine, "tokenizer_manager", None)
    tm_begin, tm_end = getattr(tm, "begin_weight_update", None), getattr(tm, "end_weight_update", None)
    if callable(tm_begin) and callable(tm_end) and begin_req is not None and end_req is not None:
        def run(coro_fn, req_cls):
            return engine.loop.run_until_complete(coro_fn(req_cls(), None))

        return WeightSession("tokenizer_manager", lambda: run(tm_begin, begin_req), lambda: run(tm_end, end_req))
    return None


def group_by_dtype(named_tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Split a bucket by dtype, groups in order of first appearance (older FlattenedTensorBucket
    concatenates, which needs one dtype)."""
    groups: dict[torch.dtype, list] = {}
    for name, tensor in named_tensors:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def check_bucket_metadata(metadata, named_tensors) -> None:
    """The flattened bucket must describe exactly our tensors, in order, back to back. Checked
    because a layout change in SGLang would otherwise load scrambled weights silently."""
    if len(metadata) != len(named_tensors):
        raise HandoffError(f"SGLang's FlattenedTensorBucket describes {len(metadata)} tensors, the bucket has "
                           f"{len(named_tensors)}")
    end = 0
    for meta, (name, tensor) in zip(metadata, named_tensors):
        size = meta.end_idx - meta.start_idx
        ok = (meta.name == name and tuple(meta.shape) == tuple(tensor.shape) and meta.dtype == tensor.dtype
              and meta.start_idx == end and size == meta.numel
              and size in (tensor.numel(), tensor.numel() * tensor.element_size()))
        if not ok:
            raise HandoffError(f"SGLang's FlattenedTensorBucket entry {meta!r} does not match tensor {name!r} "
                               f"{tuple(tensor.shape)} {tensor.dtype} at offset {end}: this SGLang's bucket "
                               "layout is not the one colo_rl checks for")
        end = meta.end_idx


@dataclasses.dataclass
class UpdateCall:
    """One `update_weights_from_tensor(named_tensors=..., load_format=...)` call."""

    named_tensors: list
    load_format: Optional[str]


def payload_calls(rank_payloads: list[dict], lst_cls=None) -> list[UpdateCall]:
    """Engine calls for one bucket from the payloads of every TP rank (index = TP rank).

    Each TP rank of the engine deserialises only its own entry, a handle to memory on its own GPU:
    - "flattened_bucket": one call per dtype group, `named_tensors` = [payload of rank 0, 1, ...];
    - "tensors": one call, each tensor a LocalSerializedTensor whose values[i] is rank i's handle.
    """
    if not rank_payloads:
        raise ValueError("no payloads: the engine's TP group sent nothing")
    formats = {p["format"] for p in rank_payloads}
    if len(formats) != 1:
        raise HandoffError(f"TP ranks prepared different payload formats {sorted(formats)}: every rank of an "
                           "engine group must run the same SGLang")
    fmt = formats.pop()
    counts = {len(p["items"]) for p in rank_payloads}
    if len(counts) != 1:
        raise HandoffError(f"TP ranks prepared different numbers of payload items {sorted(counts)} for one bucket: "
                           "the ranks gathered different tensors (handoff buckets must be planned identically)")
    if fmt == "flattened_bucket":
        return [UpdateCall([p["items"][i] for p in rank_payloads], "flattened_bucket") for i in range(counts.pop())]
    if fmt == "tensors":
        if lst_cls is None:
            raise HandoffError("this SGLang has no LocalSerializedTensor for per-tensor handoff")
        named = []
        for j, (name, _) in enumerate(rank_payloads[0]["items"]):
            names = {p["items"][j][0] for p in rank_payloads}
            if names != {name}:
                raise HandoffError(f"TP ranks disagree on tensor {j} of the bucket: {sorted(names)}")
            named.append((name, lst_cls(values=[p["items"][j][1] for p in rank_payloads])))
        return [UpdateCall(named, None)] if named else []
    raise HandoffError(f"unknown payload format {fmt!r}")


def payload_is_cuda_ipc(named_tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """CPU branch of the handoff: CPU tensors travel as shared memory (torch's ForkingPickler moves
    their storage to shm and passes a file descriptor), and SGLang's reduction patch must stay off
    for them: it rewrites the device index of a CUDA reduce tuple (its 7th entry), which a CPU
    tensor's reduction does not have."""
    return any(t.is_cuda for _, t in named_tensors)


def prepare_rank_payload(named_tensors: list[tuple[str, torch.Tensor]], api=None) -> tuple[dict, list]:
    """This rank's share of an engine update: CUDA IPC handles to (a flattened copy of) the bucket
    (on CPU: shared-memory handles, see payload_is_cuda_ipc).

    Returns (payload, keepalive). The payload is small and picklable (it can travel to the rank
    that drives the engine); `keepalive` holds the producer tensors, which must outlive the
    engine's update call (the engine maps their memory)."""
    payloads, keepalive = prepare_payloads(named_tensors, 1, api)
    return payloads[0], keepalive


def prepare_payloads(named_tensors: list[tuple[str, torch.Tensor]], copies: int, api=None) -> tuple[list[dict], list]:
    """`copies` payloads of one bucket, all from this process's tensors: one per TP rank of an engine
    whose ranks all read from here (a split run's generator, the one rank of its TP group that
    receives the weights; SGLang's own Engine.update_weights_from_tensor does the same). The bucket
    is flattened once; each copy is serialized on its own, since a CPU handle (a file descriptor
    passed through multiprocessing's resource sharer) can be fetched only once. On a GPU every TP
    rank then copies its shard from this rank's device (peer to peer)."""
    api = api or sglang_api()
    if payload_is_cuda_ipc(named_tensors):
        ensure_reductions_patched(api)
    with ipc_producer_allocations():
        if api.bucket_cls is not None:
            one_call = getattr(api.bucket_cls, "supports_multi_dtypes", False)
            groups = [named_tensors] if one_call else group_by_dtype(named_tensors)
            keepalive = []
            for group in groups:
                if not group:
                    continue
                bucket = api.bucket_cls(named_tensors=[(n, t.detach()) for n, t in group])
                data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
                check_bucket_metadata(data["metadata"], group)
                keepalive.append(data)
            return [{"format": "flattened_bucket", "items": [api.serializer.serialize(data, output_str=True)
                                                             for data in keepalive]} for _ in range(copies)], keepalive
        return ([{"format": "tensors", "items": [(name, api.serializer.serialize(t.detach())) for name, t in named_tensors]}
                 for _ in range(copies)], [t for _, t in named_tensors])


# ===================================================================== zero-copy producer
def flat_metadata(buffer: torch.Tensor, named_views: list[tuple[str, torch.Tensor]], meta_cls,
                  byte_indexed: bool) -> tuple[torch.Tensor, list]:
    """(the flattened tensor to send, SGLang's metadata) for weights that are views of one 1-D
    `buffer`: each entry's start/end is its place in the buffer, in bytes over a uint8 view where
    the bucket class is multi-dtype (SGLang >= 0.5.21: `supports_multi_dtypes`), else in elements."""
    flat = buffer.view(torch.uint8) if byte_indexed else buffer
    unit, size = (buffer.element_size() if byte_indexed else 1), buffer.element_size()
    metadata = []
    for name, view in named_views:
        start = (view.data_ptr() - buffer.data_ptr()) // size * unit
        numel = view.numel() * unit
        metadata.append(meta_cls(name=name, shape=view.shape, dtype=view.dtype, start_idx=start,
                                 end_idx=start + numel, numel=numel))
    return flat, metadata


def reconstructs_views(bucket_cls, flat: torch.Tensor, metadata: list,
                       named_views: list[tuple[str, torch.Tensor]]) -> bool:
    """Does SGLang's own `reconstruct_tensors` give back exactly our views (name, shape, dtype,
    address)? Checked on every zero-copy handoff: it costs views only, and a layout change in SGLang
    would otherwise load scrambled weights silently."""
    out = bucket_cls(flattened_tensor=flat, metadata=metadata).reconstruct_tensors()
    return len(out) == len(named_views) and all(
        n == m and t.shape == v.shape and t.dtype == v.dtype and t.data_ptr() == v.data_ptr()
        for (n, t), (m, v) in zip(out, named_views))


def prepare_flat_payload(buffer: torch.Tensor, named_views: list[tuple[str, torch.Tensor]],
                         api=None) -> Optional[tuple[dict, list]]:
    """This rank's payload for weights that already lie in one flat buffer (DeepSpeed's, world size
    1): the buffer itself as the flattened tensor, no copy. None where this SGLang or this process
    cannot take it (no bucket class, a layout SGLang does not reconstruct to our views, a CUDA
    buffer under expandable segments, which CUDA IPC cannot export): the bucketed handoff runs."""
    api = api or sglang_api()
    meta_cls = getattr(sys.modules.get(getattr(api.bucket_cls, "__module__", ""), None), "FlattenedTensorMetadata",
                       None)
    if api.bucket_cls is None or meta_cls is None:
        return None
    if buffer.is_cuda and expandable_segments_enabled(os.environ):
        return None
    byte_indexed = bool(getattr(api.bucket_cls, "supports_multi_dtypes", False))
    if not byte_indexed and len({v.dtype for _, v in named_views}) > 1:
        return None
    flat, metadata = flat_metadata(buffer, named_views, meta_cls, byte_indexed)
    if not reconstructs_views(api.bucket_cls, flat, metadata, named_views):
        return None
    if buffer.is_cuda:
        ensure_reductions_patched(api)
    data = {"flattened_tensor": flat, "metadata": metadata}
    return {"format": "flattened_bucket", "items": [api.serializer.serialize(data, output_str=True)]}, [data]
