"""The SGLang engine's pure logic, on CPU, without SGLang.

Fakes stand only for SGLang's objects (its Engine, serializer and FlattenedTensorBucket), written
from SGLang's documented behaviour: a release >= 0.5.21 refuses updates outside a weight-update
session with (False, message); resuming a tag that is not released raises; releasing twice is
fatal. Everything colo_rl decides is real.
"""

from __future__ import annotations

import base64
import dataclasses
import multiprocessing
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colo_rl.colocate.handoff import HandoffError, LogprobAgreement
from colo_rl.phase import Phase, PhaseError, PhaseGuard
from colo_rl.rollout import sglang as sg
from colo_rl.rollout.base import ALL_TAGS, CUDA_GRAPH, KV_CACHE, WEIGHTS, SamplingParams
from colo_rl.train.actor import plan_buckets


# ============================================================================ fakes for SGLang
@dataclasses.dataclass
class FakeMeta:  # SGLang's FlattenedTensorMetadata
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FakeBucket:
    """SGLang's FlattenedTensorBucket before multi-dtype support: element offsets, one dtype."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            if len({t.dtype for _, t in named_tensors}) != 1:
                raise AssertionError("this bucket concatenates: one dtype per bucket")
            self.metadata, start = [], 0
            for name, t in named_tensors:
                self.metadata.append(FakeMeta(name, t.shape, t.dtype, start, start + t.numel(), t.numel()))
                start += t.numel()
            self.flattened_tensor = torch.cat([t.flatten() for _, t in named_tensors])
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].reshape(m.shape)) for m in self.metadata]


class FakeMultiDtypeBucket(FakeBucket):
    """A newer bucket: byte offsets over a uint8 view, any mix of dtypes."""

    supports_multi_dtypes = True

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is None:
            super().__init__(flattened_tensor=flattened_tensor, metadata=metadata)
            return
        self.metadata, parts, start = [], [], 0
        for name, t in named_tensors:
            flat = t.contiguous().flatten().view(torch.uint8)
            self.metadata.append(FakeMeta(name, t.shape, t.dtype, start, start + flat.numel(), flat.numel()))
            parts.append(flat)
            start += flat.numel()
        self.flattened_tensor = torch.cat(parts)

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]


class FakeSerializer:  # SGLang's MultiprocessingSerializer, by value (CPU: no IPC handles)
    output_str_calls: list = []

    @staticmethod
    def serialize(obj, output_str=False):
        FakeSerializer.output_str_calls.append(output_str)
        data = pickle.dumps(obj)
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data):
        return pickle.loads(base64.b64decode(data) if isinstance(data, str) else data)


@dataclasses.dataclass
class FakeLST:  # SGLang's LocalSerializedTensor
    values: list

    def get(self, rank):
        return FakeSerializer.deserialize(self.values[rank])


def fake_api(bucket_cls=FakeBucket, memory_tags=("kv_cache", "weights", "weights_drafter", "cuda_graph")):
    return SimpleNamespace(serializer=FakeSerializer, bucket_cls=bucket_cls, lst_cls=FakeLST,
                           patch_reductions=lambda: None, begin_req=None, end_req=None,
                           memory_tags=list(memory_tags), server_args_cls=None)


OUTSIDE_SESSION = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"


class FakeOldSGLang:
    """An SGLang Engine before 0.5.21: no weight-update session."""

    requires_session = False

    def __init__(self, tp_size=1, bucket_cls=FakeBucket):
        self.tp_size = tp_size
        self.bucket_cls = bucket_cls
        self.calls: list = []
        self.offloaded: set = set()
        self.in_session = False
        self.loaded: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(tp_size)}
        self.outputs = None
        self.update_answer = None  # force an answer, e.g. (False, "...")

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", list(tags)))
        for t in tags:
            assert t not in self.offloaded, f"double release of {t}: torch_memory_saver would abort"
            self.offloaded.add(t)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", list(tags)))
        for t in tags:
            self.offloaded.remove(t)  # KeyError, like SGLang, for a tag that is not released

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", load_format, flush_cache))
        if self.update_answer is not None:
            return self.update_answer
        if self.requires_session and not self.in_session:
            return False, OUTSIDE_SESSION
        for rank in range(self.tp_size):  # each TP rank reads only its own entry
            if load_format == "flattened_bucket":
                data = FakeSerializer.deserialize(named_tensors[rank])
                tensors = self.bucket_cls(flattened_tensor=data["flattened_tensor"],
                                          metadata=data["metadata"]).reconstruct_tensors()
            else:
                tensors = [(n, lst.get(rank)) for n, lst in named_tensors]
            self.loaded[rank].update({n: t.clone() for n, t in tensors})
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush",))
        return None

    def generate(self, input_ids, sampling_params, return_logprob, logprob_start_len):
        self.calls.append(("generate", len(input_ids), sampling_params, return_logprob, logprob_start_len))
        return self.outputs(input_ids) if callable(self.outputs) else self.outputs

    def shutdown(self):
        self.calls.append(("shutdown",))


class FakeNewSGLang(FakeOldSGLang):
    """SGLang >= 0.5.21: updates only inside begin_weight_update() / end_weight_update()."""

    requires_session = True

    def begin_weight_update(self):
        self.calls.append(("begin",))
        assert not self.in_session, "begin_weight_update called while a session is open"
        self.in_session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        assert self.in_session, "end_weight_update called without begin_weight_update"
        self.in_session = False
        return True, "Success"


def make_engine(fake, tp_size=1, api=None, guard=None):
    api = api or fake_api(fake.bucket_cls)
    return sg.SGLangEngine(fake, tp_size, eos_token_ids=[2, 7], guard=guard,
                           supported_tags=sg.supported_memory_tags(api.memory_tags), api=api)


def bucket_of(rank=0):
    return [("model.embed.weight", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + rank),
            ("model.norm.weight", torch.full((3,), 0.5 + rank, dtype=torch.float32)),
            ("model.out.weight", torch.ones(2, 2, dtype=torch.bfloat16) * (rank + 1))]


def handoff(engine, bucket):
    """What the memory manager does around the weight handoff."""
    engine.wake([WEIGHTS])
    engine.load_weights(bucket)
    engine.finish_weight_update()
    engine.wake([KV_CACHE, CUDA_GRAPH])


def names(calls):
    return [c[0] for c in calls]


# ============================================================================ sampling and outputs
def test_sampling_params_translate_to_sglang_dict():
    d = sg.sglang_sampling_params(SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, n=8), [2, 7])
    assert d == {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "n": 1,
                 "stop_token_ids": [2, 7], "no_stop_trim": True}
    greedy = sg.sglang_sampling_params(SamplingParams(temperature=0.3, greedy=True), [2])
    assert (greedy["temperature"], greedy["top_k"], greedy["top_p"]) == (0.0, 1, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        sg.sglang_sampling_params(SamplingParams(temperature=0.0), [2])
    with pytest.raises(ValueError, match="top_p"):
        sg.sglang_sampling_params(SamplingParams(top_p=0.0), [2])
    # stop strings reach only an engine started with its tokenizer (SGLang matches them on text)
    tagged = SamplingParams(stop=("</calculator>",))
    assert "stop" not in sg.sglang_sampling_params(tagged, [2])
    assert sg.sglang_sampling_params(tagged, [2], stop_strings=True)["stop"] == ["</calculator>"]
    assert "stop" not in sg.sglang_sampling_params(SamplingParams(), [2], stop_strings=True)


def test_prompts_expand_into_contiguous_groups():
    assert sg.expand_prompts([[1], [2, 3]], 3) == [[1], [1], [1], [2, 3], [2, 3], [2, 3]]
    with pytest.raises(ValueError):
        sg.expand_prompts([[1]], 0)


def out(tokens, logps, reason, **extra):
    return {"meta_info": {"output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, logps)],
                          "finish_reason": reason}, **extra}


def test_meta_info_parsing():
    c = sg.parse_completion([5, 6], out([11, 2], [-0.1, -0.2], {"type": "stop", "matched": 2},
                                        output_ids=[11, 2]))
    assert (c.prompt_ids, c.token_ids, c.logprobs, c.finish_reason) == ([5, 6], [11, 2], [-0.1, -0.2], "stop")
    c = sg.parse_completion([5], out([11, 12], [-1.0, -2.0], {"type": "length", "length": 2}, token_ids=[11, 12]))
    assert c.finish_reason == "length" and c.token_ids == [11, 12]
    c = sg.parse_completion([5], out([11, 12], [-1.0, -2.0], {"type": "stop", "matched": "</calculator>"}))
    assert c.finish_reason == "stop_string" and c.token_ids == [11, 12]
    # Output ids trimmed by the stop token (no_stop_trim ignored) are accepted; the log-prob ids win.
    assert sg.parse_completion([5], out([11, 2], [-0.1, -0.2], {"type": "stop"}, output_ids=[11])).token_ids == [11, 2]
    with pytest.raises(sg.SGLangEngineError, match="disagree"):
        sg.parse_completion([5], out([11, 2], [-0.1, -0.2], {"type": "stop"}, output_ids=[11, 3]))
    with pytest.raises(sg.SGLangEngineError, match="context length"):
        sg.parse_completion([5], out([], [], {"type": "abort", "message": "input too long"}))
    with pytest.raises(sg.SGLangEngineError, match="return_logprob"):
        sg.parse_completion([5], {"meta_info": {"finish_reason": {"type": "stop"}}})
    with pytest.raises(sg.SGLangEngineError, match="unfinished"):
        sg.parse_completion([5], out([1], [-1.0], None))
    with pytest.raises(sg.SGLangEngineError, match="2 outputs for 3"):
        sg.parse_outputs([[1], [1], [1]], [out([1], [-1.0], "stop")] * 2)


def test_an_eos_at_the_length_cap_finishes_by_eos():
    # SGLang 0.5.17 checks the length cap before EOS: an EOS as the last allowed token comes back as
    # "length". It finished by EOS (stop_rate, and a multi-turn context must not add a second one).
    capped = out([11, 2], [-0.1, -0.2], {"type": "length", "length": 2}, output_ids=[11, 2])
    assert sg.parse_completion([5], capped).finish_reason == "length"  # without the EOS ids: SGLang's word
    assert sg.parse_completion([5], capped, eos_token_ids=[2]).finish_reason == "stop"
    assert sg.parse_outputs([[5]], [capped], eos_token_ids=[2])[0].finish_reason == "stop"
    not_eos = out([11, 12], [-0.1, -0.2], {"type": "length", "length": 2})
    assert sg.parse_completion([5], not_eos, eos_token_ids=[2]).finish_reason == "length"


def test_the_engine_never_returns_log_probs_before_temperature():
    changes = sg.engine_env_overrides({"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, maps_text="", site_dirs=[])
    assert changes["SGLANG_RETURN_ORIGINAL_LOGPROB"] is None  # unset for the engine's children
    from colo_rl.rollout.sglang.env import RESTORED_AFTER_START
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in RESTORED_AFTER_START  # the user's value, back after the start
    assert len(sg.parse_outputs([[1]], out([1], [-1.0], "stop"))) == 1  # a batch of one, unwrapped


def test_aborts_generate_raises_itself_become_engine_errors_with_the_causes():
    """0.5.17 / 0.5.21 raise status-400 aborts as ValueError and 500 / 503 ones as fastapi's
    HTTPException from generate (tokenizer_manager.py _handle_abort_finish_reason); other errors pass."""
    from colo_rl.rollout.sglang.io import raised_abort

    too_long = raised_abort(ValueError("The input (4096 tokens) is longer than the model's context length"))
    assert "aborted a request: The input (4096 tokens)" in str(too_long) and "mem_fraction_static" in str(too_long)
    http = type("HTTPException", (Exception,), {})()
    http.status_code, http.detail = 503, "the scheduler is overloaded"
    assert "aborted a request: the scheduler is overloaded" in str(raised_abort(http))
    assert raised_abort(RuntimeError("a bug")) is None
    bad_top_p = raised_abort(ValueError("top_p must be in (0, 1], got 2.0."))  # no context hint where it misleads
    assert str(bad_top_p) == "SGLang refused a request: top_p must be in (0, 1], got 2.0."


# ============================================================================ results and sessions
def test_update_results_are_checked():
    assert sg.update_result((True, "Success"), "update") == "Success"
    assert sg.update_result({"success": True, "message": "ok"}, "update") == "ok"
    assert sg.update_result(SimpleNamespace(success=True, message="m"), "update") == "m"
    assert sg.update_result(None, "begin_weight_update", allow_none=True) == ""
    with pytest.raises(HandoffError, match="not in a session"):
        sg.update_result((False, "not in a session"), "update_weights_from_tensor")
    with pytest.raises(HandoffError, match="nope"):
        sg.update_result({"success": False, "message": "nope"}, "update")
    with pytest.raises(HandoffError, match="returned nothing"):
        sg.update_result(None, "update_weights_from_tensor")
    with pytest.raises(HandoffError, match="expected"):
        sg.update_result("yes", "update")
    # LoRA load / unload answer LoRAUpdateOutput(success, error_message) (io_struct.py, 0.5.17 and 0.5.21)
    with pytest.raises(HandoffError, match="rank 32 > max_lora_rank 16"):
        sg.update_result(SimpleNamespace(success=False, error_message="rank 32 > max_lora_rank 16",
                                         loaded_adapters=None), "load_lora_adapter_from_tensors")


def test_session_api_detected_by_feature():
    assert sg.weight_session_api(FakeOldSGLang()) is None
    new = FakeNewSGLang()
    session = sg.weight_session_api(new)
    assert session.via == "engine"
    session.begin()
    session.end()
    assert names(new.calls) == ["begin", "end"]

    # The engine lacks the methods but its tokenizer manager has them (with SGLang's request types).
    seen = []

    class TM:
        async def begin_weight_update(self, obj, request):
            seen.append(("begin", type(obj).__name__, request))
            return True, "ok"

        async def end_weight_update(self, obj, request):
            seen.append(("end", type(obj).__name__, request))
            return True, "ok"

    import asyncio

    loop = asyncio.new_event_loop()
    engine = SimpleNamespace(tokenizer_manager=TM(), loop=loop)
    begin_req, end_req = type("BeginWeightUpdateReqInput", (), {}), type("EndWeightUpdateReqInput", (), {})
    session = sg.weight_session_api(engine, begin_req, end_req)
    assert session.via == "tokenizer_manager"
    assert session.begin() == (True, "ok") and session.end() == (True, "ok")
    assert seen == [("begin", "BeginWeightUpdateReqInput", None), ("end", "EndWeightUpdateReqInput", None)]
    assert sg.weight_session_api(engine) is None  # no request types importable: treated as no session
    loop.close()


def test_new_release_updates_inside_one_session_and_flushes_after_kv_resumes():
    fake = FakeNewSGLang()
    engine = make_engine(fake)
    engine.sleep(ALL_TAGS)
    handoff(engine, bucket_of())
    # a flush first: SGLang releases only from an idle scheduler, and a flush succeeds only once it is idle
    assert names(fake.calls) == ["flush", "release", "resume", "begin", "update", "update", "end", "resume", "flush"]
    updates = [c for c in fake.calls if c[0] == "update"]
    assert all(c[1:] == ("flattened_bucket", False) for c in updates)  # one per dtype group, no flush each
    for name, tensor in bucket_of():
        assert torch.equal(fake.loaded[0][name], tensor)


def test_old_release_updates_without_a_session():
    fake = FakeOldSGLang()
    engine = make_engine(fake)
    engine.sleep(ALL_TAGS)
    handoff(engine, bucket_of())
    assert "begin" not in names(fake.calls) and names(fake.calls).count("update") == 2
    assert set(fake.loaded[0]) == {n for n, _ in bucket_of()}


def test_update_refused_by_the_engine_raises_with_its_message():
    # A >= 0.5.21 engine whose session API colo_rl could not find refuses the update.
    fake = FakeOldSGLang()
    fake.requires_session = True
    engine = make_engine(fake)
    engine.sleep(ALL_TAGS)
    engine.wake([WEIGHTS])
    with pytest.raises(HandoffError, match="must run between begin_weight_update"):
        engine.load_weights(bucket_of())
    fake.update_answer = (False, "Failed to update parameter online: shape mismatch")
    fake.requires_session = False
    with pytest.raises(HandoffError, match="shape mismatch"):
        engine.load_weights(bucket_of())


def test_whole_handoff_round_trip_through_planned_buckets():
    """Buckets planned like the handoff does, each flattened per dtype, reach the engine intact."""
    torch.manual_seed(0)
    weights = {f"layers.{i}.w": torch.randn(4, 4, dtype=torch.bfloat16) for i in range(5)}
    weights["norm"] = torch.randn(4)
    fake = FakeNewSGLang()
    engine = make_engine(fake)
    engine.sleep(ALL_TAGS)
    engine.wake([WEIGHTS])
    sizes = [(n, t.numel() * t.element_size()) for n, t in weights.items()]
    buckets = plan_buckets(sizes, bucket_bytes=80)
    assert len(buckets) > 1
    for names_ in buckets:
        engine.load_weights([(n, weights[n]) for n in names_])
    engine.finish_weight_update()
    assert names(fake.calls).count("begin") == 1 and names(fake.calls).count("end") == 1
    assert fake.loaded[0].keys() == weights.keys()
    assert all(torch.equal(fake.loaded[0][n], t) for n, t in weights.items())


# ============================================================================ payload layout
def test_payload_per_tp_rank_layout_flattened():
    api = fake_api()
    payloads = [sg.prepare_rank_payload(bucket_of(r), api)[0] for r in range(2)]
    assert all(p["format"] == "flattened_bucket" and len(p["items"]) == 2 for p in payloads)  # bf16, fp32
    calls = sg.payload_calls(payloads)
    assert len(calls) == 2 and all(c.load_format == "flattened_bucket" for c in calls)
    for i, call in enumerate(calls):  # call i carries dtype group i of rank 0, then of rank 1
        assert call.named_tensors == [payloads[0]["items"][i], payloads[1]["items"][i]]
    # The engine's TP rank r reads entry r: memory prepared by trainer rank r.
    fake = FakeOldSGLang(tp_size=2)
    for call in calls:
        fake.update_weights_from_tensor(call.named_tensors, call.load_format)
    for r in range(2):
        for name, tensor in bucket_of(r):
            assert torch.equal(fake.loaded[r][name], tensor)


def test_payload_per_tp_rank_layout_per_tensor():
    api = fake_api(bucket_cls=None)
    payloads = [sg.prepare_rank_payload(bucket_of(r), api)[0] for r in range(3)]
    (call,) = sg.payload_calls(payloads, FakeLST)
    assert call.load_format is None
    assert [n for n, _ in call.named_tensors] == [n for n, _ in bucket_of()]
    for j, (_, lst) in enumerate(call.named_tensors):
        assert lst.values == [payloads[r]["items"][j][1] for r in range(3)]
        assert torch.equal(lst.get(2), bucket_of(2)[j][1])


def test_payloads_that_disagree_across_ranks_are_refused():
    api = fake_api()
    flat = sg.prepare_rank_payload(bucket_of(), api)[0]
    short = sg.prepare_rank_payload(bucket_of()[:1], api)[0]
    per_tensor = sg.prepare_rank_payload(bucket_of(), fake_api(bucket_cls=None))[0]
    with pytest.raises(HandoffError, match="numbers of payload items"):
        sg.payload_calls([flat, short])
    with pytest.raises(HandoffError, match="formats"):
        sg.payload_calls([flat, per_tensor])
    renamed = {"format": "tensors", "items": [("other", b"x")] + per_tensor["items"][1:]}
    with pytest.raises(HandoffError, match="disagree on tensor 0"):
        sg.payload_calls([per_tensor, renamed], FakeLST)
    with pytest.raises(ValueError):
        sg.payload_calls([])


def test_bucket_flattening_by_dtype_and_keepalive():
    FakeSerializer.output_str_calls.clear()
    bucket = bucket_of()
    payload, keepalive = sg.prepare_rank_payload(bucket, fake_api())
    assert [[n for n, _ in g] for g in sg.group_by_dtype(bucket)] == [
        ["model.embed.weight", "model.out.weight"], ["model.norm.weight"]]
    assert len(keepalive) == 2 and all("flattened_tensor" in k for k in keepalive)
    assert FakeSerializer.output_str_calls == [True, True]  # str payloads: what every release accepts
    payload, keepalive = sg.prepare_rank_payload(bucket, fake_api(FakeMultiDtypeBucket))
    assert len(payload["items"]) == 1  # a multi-dtype bucket needs no split
    data = FakeSerializer.deserialize(payload["items"][0])
    rebuilt = FakeMultiDtypeBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(rebuilt.reconstruct_tensors(), bucket))


def test_bucket_metadata_must_match_the_tensors():
    bucket = bucket_of()[:1] + bucket_of()[2:]  # one dtype
    good = FakeBucket(named_tensors=bucket).get_metadata()
    sg.check_bucket_metadata(good, bucket)
    sg.check_bucket_metadata(FakeMultiDtypeBucket(named_tensors=bucket).get_metadata(), bucket)  # byte offsets
    shifted = [dataclasses.replace(good[0]), dataclasses.replace(good[1], start_idx=7, end_idx=11)]
    with pytest.raises(HandoffError, match="offset 6"):
        sg.check_bucket_metadata(shifted, bucket)
    with pytest.raises(HandoffError, match="model.out.weight"):
        sg.check_bucket_metadata([good[0], dataclasses.replace(good[1], shape=torch.Size([4]))], bucket)
    with pytest.raises(HandoffError, match="describes 1 tensors"):
        sg.check_bucket_metadata(good[:1], bucket)

    class ScrambledBucket(FakeBucket):
        def get_metadata(self):
            return list(reversed(self.metadata))

    with pytest.raises(HandoffError, match="does not match"):
        sg.prepare_rank_payload(bucket, fake_api(ScrambledBucket))


@pytest.mark.parametrize("bucket_cls", [FakeBucket, None], ids=["flattened", "per-tensor"])
def test_one_rank_loads_every_tp_rank_of_its_engine(bucket_cls):
    """A split run's generator alone receives the weights: load_weights hands every TP rank the same
    tensors, each rank's entry serialized on its own (a CPU handle is fetched once), the bucket
    flattened once."""
    flattened = []

    class CountedBucket(FakeBucket):  # records each flattening (a producer-side copy of the bucket)
        def __init__(self, named_tensors=None, **kwargs):
            super().__init__(named_tensors=named_tensors, **kwargs)
            if named_tensors is not None:
                flattened.append([n for n, _ in named_tensors])

    fake = FakeNewSGLang(tp_size=2, bucket_cls=FakeBucket)
    api = fake_api(bucket_cls and CountedBucket)
    engine = make_engine(fake, tp_size=2, api=api)
    FakeSerializer.output_str_calls.clear()
    engine.load_weights(bucket_of())
    assert len(flattened) == (2 if bucket_cls else 0)  # one per dtype group, not one per TP rank
    engine.finish_weight_update()
    for r in range(2):
        assert fake.loaded[r].keys() == {n for n, _ in bucket_of()}
        assert all(torch.equal(fake.loaded[r][n], t) for n, t in bucket_of())
    per_rank = 2 if bucket_cls else 3  # dtype groups (bf16, fp32) or tensors, once per TP rank
    assert len(FakeSerializer.output_str_calls) == 2 * per_rank
    with pytest.raises(HandoffError, match="1 payloads for an engine with tp_size=2"):
        engine.load_rank_payloads([sg.prepare_rank_payload(bucket_of(), fake_api())[0]])
    assert not engine.load_flat_weights(torch.zeros(4), [])  # the zero-copy path is one TP rank's


# ============================================================================ memory tags
def test_tag_bookkeeping_never_releases_twice_nor_resumes_what_is_held():
    fake = FakeNewSGLang()
    engine = make_engine(fake)
    engine.sleep([KV_CACHE])
    engine.sleep(ALL_TAGS)  # kv_cache already released: only the rest goes to SGLang
    assert [c for c in fake.calls if c[0] == "release"] == [("release", [KV_CACHE]), ("release", [WEIGHTS, CUDA_GRAPH])]
    engine.wake([WEIGHTS])
    engine.wake([WEIGHTS])  # already resident: nothing sent
    assert [c for c in fake.calls if c[0] == "resume"] == [("resume", [WEIGHTS])]
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.sleep(["kv"])
    state = sg.EngineMemoryState()
    state.mark_released([KV_CACHE])
    with pytest.raises(sg.EngineStateError, match="releasing twice"):
        state.mark_released([KV_CACHE])
    with pytest.raises(sg.EngineStateError, match="not released"):
        state.mark_resumed([WEIGHTS])


def test_tags_a_release_does_not_know_are_not_sent():
    api = fake_api(memory_tags=("kv_cache", "weights"))  # before cuda_graph was a tag
    assert sg.supported_memory_tags(api.memory_tags) == (WEIGHTS, KV_CACHE)
    assert sg.supported_memory_tags(None) == (WEIGHTS, KV_CACHE)
    fake = FakeOldSGLang()
    engine = make_engine(fake, api=api)
    engine.sleep(ALL_TAGS)
    engine.wake([KV_CACHE, CUDA_GRAPH])
    assert names(fake.calls) == ["flush", "release", "resume"]
    assert fake.calls[1:] == [("release", [WEIGHTS, KV_CACHE]), ("resume", [KV_CACHE])]


def test_state_errors_say_what_to_do():
    fake = FakeNewSGLang()
    engine = make_engine(fake)
    params = SamplingParams(n=2)
    with pytest.raises(sg.EngineStateError, match="run the handoff"):
        engine.generate([[1]], params)  # dummy weights: never written by a weight update
    engine.sleep(ALL_TAGS)
    with pytest.raises(sg.EngineStateError, match="wake"):
        engine.generate([[1]], params)
    with pytest.raises(sg.EngineStateError, match="wake\\(\\['weights'\\]\\)"):
        engine.load_weights(bucket_of())
    engine.wake([WEIGHTS])
    engine.load_weights(bucket_of())
    with pytest.raises(sg.EngineStateError, match="finish_weight_update"):
        engine.sleep([WEIGHTS])  # releasing mid-update
    engine.finish_weight_update()
    engine.wake([KV_CACHE, CUDA_GRAPH])
    engine.sleep(ALL_TAGS)
    engine.wake(ALL_TAGS)  # resumed weights are garbage again
    with pytest.raises(sg.EngineStateError, match="run the handoff"):
        engine.generate([[1]], params)


def test_flush_waits_for_the_kv_cache_or_runs_at_once():
    fake = FakeNewSGLang()
    engine = make_engine(fake)
    engine.sleep(ALL_TAGS)
    fake.calls.clear()
    engine.wake([WEIGHTS])
    engine.load_weights(bucket_of())
    engine.finish_weight_update()
    assert "flush" not in names(fake.calls)  # KV cache still released
    engine.wake([KV_CACHE])
    assert names(fake.calls)[-2:] == ["resume", "flush"]
    fake.calls.clear()
    engine.load_weights(bucket_of())  # KV resident: the flush runs at finish
    engine.finish_weight_update()
    assert names(fake.calls) == ["begin", "update", "update", "end", "flush"]


def test_generate_sends_expanded_prompts_and_parses_groups():
    guard = PhaseGuard()
    fake = FakeNewSGLang()
    engine = make_engine(fake, guard=guard)
    engine.sleep(ALL_TAGS)
    handoff(engine, bucket_of())
    fake.outputs = lambda ids: [out([p[0], 2], [-0.5, -0.25], {"type": "stop", "matched": 2}) for p in ids]
    with pytest.raises(PhaseError):
        engine.generate([[10], [20]], SamplingParams(n=3))
    guard.phase = Phase.GENERATION
    completions = engine.generate([[10], [20]], SamplingParams(n=3, max_new_tokens=5))
    assert [c.prompt_ids for c in completions] == [[10]] * 3 + [[20]] * 3
    assert [c.token_ids for c in completions] == [[10, 2]] * 3 + [[20, 2]] * 3
    (_, n_requests, sampling, return_logprob, start), = [c for c in fake.calls if c[0] == "generate"]
    assert n_requests == 6 and sampling["n"] == 1 and sampling["stop_token_ids"] == [2, 7]
    assert return_logprob is True and start == -1
    assert engine.generate([], SamplingParams()) == []


# ============================================================================ environment and args
def test_expandable_segments_are_stripped_for_the_engine():
    assert sg.without_expandable_segments("expandable_segments:True") is None
    assert sg.without_expandable_segments("max_split_size_mb:128,expandable_segments:True") == "max_split_size_mb:128"
    assert sg.without_expandable_segments(None) is None
    assert sg.expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert not sg.expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    changes = sg.engine_env_overrides({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert changes["PYTORCH_CUDA_ALLOC_CONF"] is None
    assert changes["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "0"
    assert changes["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
    assert changes["NCCL_GRAPH_REGISTER"] == "0"  # graph-captured NCCL buffers are paused and resumed
    assert "NCCL_GRAPH_REGISTER" not in sg.engine_env_overrides({"NCCL_GRAPH_REGISTER": "1"})  # the user's wins


def test_engine_environment_applies_then_restores():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:64", "NCCL_DEBUG": "WARN"}
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        with sg.engine_environment(env):
            assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
            assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1" and env["NCCL_GRAPH_REGISTER"] == "0"
            assert multiprocessing.get_start_method() == "spawn"
            env["NCCL_CUMEM_ENABLE"] = "0"  # what SGLang does when it starts
            env["NCCL_DEBUG"] = "INFO"
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
        assert env["NCCL_DEBUG"] == "WARN" and "NCCL_CUMEM_ENABLE" not in env and "NCCL_GRAPH_REGISTER" not in env
        assert env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] == "0"  # the engine's children read it later too
    finally:
        multiprocessing.set_start_method(method, force=True)


def test_trainer_logging_comes_out_of_the_engine_start_as_it_went_in(capsys):
    """What sglang.Engine() does to the trainer's logging (configure_logger: basicConfig(force=True) at
    its log level; its ERROR about our SIGQUIT handler), undone: same handlers, none closed, same level."""
    import logging

    class Kept(logging.StreamHandler):
        closed = False

        def close(self):
            self.closed = True
            super().close()

    root, mine = logging.getLogger(), Kept()
    before_handlers, before_level = list(root.handlers), root.level
    root.addHandler(mine)
    root.setLevel(logging.INFO)
    try:
        with sg.trainer_logging_kept({}):
            logging.basicConfig(level=logging.ERROR, format="[%(asctime)s] %(message)s", force=True)  # SGLang's
            sglang_handler = root.handlers[-1]
            logging.getLogger("sglang.srt.entrypoints.engine").error("Using custom SIGQUIT handler: <function>")
            logging.getLogger("sglang.srt.entrypoints.engine").error("a real engine error")
        assert root.handlers == before_handlers + [mine] and not mine.closed and root.level == logging.INFO
        assert sglang_handler not in root.handlers
        err = capsys.readouterr().err
        assert "a real engine error" in err and "SIGQUIT" not in err
        with sg.trainer_logging_kept({"SGLANG_LOGGING_CONFIG_PATH": "/my/logging.json"}):  # the user's config stands
            logging.basicConfig(level=logging.ERROR, force=True)
        assert mine not in root.handlers and mine.closed
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in before_handlers:
            root.addHandler(handler)
        root.setLevel(before_level)


def test_server_kwargs_filtered_by_feature():
    @dataclasses.dataclass
    class ServerArgs:
        model_path: str = ""
        tp_size: int = 1
        base_gpu_id: int = 0
        mem_fraction_static: float = 0.8
        enable_memory_saver: bool = False
        load_format: str = "auto"
        skip_tokenizer_init: bool = False

    kwargs = dict(model_path="m", tp_size=2, base_gpu_id=2, mem_fraction_static=0.5, enable_memory_saver=True,
                  load_format="dummy", skip_tokenizer_init=True, nccl_port=1234)
    kept = sg.known_server_kwargs(kwargs, ServerArgs, sg.REQUIRED_SERVER_ARGS)
    assert "nccl_port" not in kept and kept["tp_size"] == 2
    old_server_args = dataclasses.make_dataclass("OldServerArgs", ["model_path", "tp_size"])
    with pytest.raises(ImportError, match="enable_memory_saver"):
        sg.known_server_kwargs(kwargs, old_server_args, sg.REQUIRED_SERVER_ARGS)
    assert sg.sglang_dtype(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError):
        sg.sglang_dtype(torch.int8)


def test_memory_plan_for_the_engine():
    gib = 1 << 30
    assert sg.plan_mem_fraction_static(40 * gib, 2 * gib) == pytest.approx(0.95)
    assert sg.plan_mem_fraction_static(40 * gib, 2 * gib, override=0.6) == 0.6
    # The buffers SGLang sizes to the KV pool's token count come out of the margin's side too:
    # what a toy model's pool (512 bytes a token) holds, what a 135M model's (23 KB) does.
    from colo_rl.rollout.sglang.compat import ENGINE_BYTES_PER_KV_TOKEN, kv_bytes_per_token

    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(smollm2, 2) == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 1, "hidden_size": 64}, 2) == 512
    assert kv_bytes_per_token({"num_hidden_layers": 4, "head_dim": 128, "num_attention_heads": 8,
                               "num_key_value_heads": 2, "hidden_size": 512}, 1) == 2 * 4 * 2 * 128
    assert kv_bytes_per_token({"model_type": "mamba"}, 2) is None
    assert kv_bytes_per_token(smollm2, 2, tp_size=2) == 2 * 30 * 1 * 64 * 2  # 3 KV heads: one a TP rank
    assert kv_bytes_per_token(smollm2, 2, tp_size=4) == 2 * 30 * 1 * 64 * 2  # at least one a rank
    from colo_rl.rollout.sglang.compat import kv_cache_bytes

    assert kv_cache_bytes({}, torch.bfloat16) == 2 and kv_cache_bytes({}, torch.float32) == 4
    assert kv_cache_bytes({"kv_cache_dtype": "fp8_e4m3"}, torch.bfloat16) == 1
    assert kv_cache_bytes({"kv_cache_dtype": "bf16"}, torch.float32) == 2
    for kv in (512, 23040):
        f = sg.plan_mem_fraction_static(80 * gib, 2 * gib, kv_token_bytes=kv)
        tokens = f * 80 * gib / kv  # at most: the static pool holds the weights too
        assert 80 * gib - f * 80 * gib >= 2 * gib + tokens * ENGINE_BYTES_PER_KV_TOKEN - 1e6  # margin kept
    assert sg.plan_mem_fraction_static(80 * gib, 2 * gib, kv_token_bytes=23040) > 0.97  # barely moved
    with pytest.raises(MemoryError, match="memory_margin_gib"):
        sg.plan_mem_fraction_static(gib, 2 * gib)


def test_a_toy_models_kv_pool_is_bounded_and_real_models_are_not():
    # The first H100 run: model=tiny (512 bytes of KV a token) with 77.6 GiB free sized a 145M-token
    # pool, and its scheduler ran out of memory right after start; real models hold a few M tokens.
    from colo_rl.rollout.sglang.compat import MAX_POOL_TOKENS, bounded_pool_tokens

    gib = 1 << 30
    assert bounded_pool_tokens(int(77.6 * gib), 2 * gib, 512) == MAX_POOL_TOKENS == 1 << 24
    assert bounded_pool_tokens(80 * gib, 2 * gib, 23040) is None  # SmolLM2-135M: 3.6M tokens
    assert bounded_pool_tokens(141 * gib, 2 * gib, 2 * 24 * 2 * 64 * 2) is None  # a 0.5B Qwen on an H200: 12M
    assert bounded_pool_tokens(80 * gib, 2 * gib, None) is None  # KV bytes unknown (a non-attention model)
    assert bounded_pool_tokens(gib, 2 * gib, 512) is None  # no room at all: the memory plan says so
    # the plan: bounded, the pool's per-token buffers are a fixed amount out of the fraction; a user's fraction stands
    assert sg.plan_engine_memory(40 * gib, 2 * gib, None, 512) == (
        sg.plan_mem_fraction_static(40 * gib, 2 * gib + (48 << 24)), 1 << 24)
    assert sg.plan_engine_memory(40 * gib, 2 * gib, 0.6, 512) == (0.6, None)
    assert sg.plan_engine_memory(80 * gib, 2 * gib, None, 23040) == (
        sg.plan_mem_fraction_static(80 * gib, 2 * gib, kv_token_bytes=23040), None)


def test_sglang_import_error_says_what_to_do(monkeypatch):
    sg.sglang_api.cache_clear()
    monkeypatch.setitem(sys.modules, "sglang", None)  # not installed (an installed one: tests/test_sglang_cpu*.py)
    try:
        with pytest.raises(ImportError, match="rollout.engine=hf"):
            sg.sglang_api()
    finally:
        sg.sglang_api.cache_clear()


# ============================================================================ the handoff check
def test_logprob_agreement_raises_when_engine_and_trainer_disagree():
    mask = torch.tensor([[1, 1, 1, 0]])
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -9.0]])
    ok = LogprobAgreement()
    ok.add(trainer + 0.01, trainer, mask)
    metrics = ok.check(0.2)
    assert metrics["handoff/logprob_diff_mean"] == pytest.approx(0.01, abs=1e-6)
    stale = LogprobAgreement()  # an engine still on old (or garbage) weights
    stale.add(trainer + torch.tensor([[1.5, -0.8, 2.0, 0.0]]), trainer, mask)
    with pytest.raises(HandoffError, match="not on the trainer's weights"):
        stale.check(0.2)
    nan = LogprobAgreement()
    nan.add(torch.full_like(trainer, float("nan")), trainer, mask)
    with pytest.raises(HandoffError):
        nan.check(0.2)


def test_shutdown_removes_the_config_dir_written_for_a_random_model(tmp_path):
    """A shrunk random model's config is written to a temporary directory for SGLang to read at
    start-up; the engine removes it at shutdown (every test run used to leave one under /tmp)."""
    from colo_rl.config import ModelConfig
    from colo_rl.rollout.sglang.engine import engine_model_dir

    cfg = ModelConfig(random_init=True, hidden_size=64, num_layers=2)
    written = Path(engine_model_dir(cfg))
    assert (written / "config.json").exists()
    engine = make_engine(FakeNewSGLang())
    engine.temp_dir = str(written)
    engine.shutdown()
    assert not written.exists() and engine.engine is None
    assert engine_model_dir(ModelConfig(path="embedded")) != str(written)  # a real model is read in place
