"""The CPU branches of colo_rl's SGLang engine and the first-contact fixes the real CPU engine found
(tests/test_sglang_cpu*.py run them against SGLang itself); plain functions, no SGLang needed."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from colo_rl import stop_signal
from colo_rl.config import ConfigError
from colo_rl.rollout import sglang as sg


def test_the_engine_device_decides_the_memory_saver_and_the_gpu_id():
    assert sg.engine_device({}) == "cuda" and sg.engine_device({"device": "cpu"}) == "cpu"
    assert sg.memory_saver_for("cuda") is True and sg.memory_saver_for("cpu") is False  # CUDA-only in SGLang
    assert sg.memory_saver_kwargs("cpu") == {"enable_memory_saver": False}  # CPU: no CUDA graphs to keep apart
    assert sg.engine_base_gpu_id("cuda", 3) == 3 and sg.engine_base_gpu_id("cpu", 3) == 0  # NUMA node 0


def test_cpu_tensors_travel_without_sglangs_cuda_reduction_patch():
    assert not sg.payload_is_cuda_ipc([("w", torch.zeros(2))])
    calls = []

    class Bucket:
        supports_multi_dtypes = True

        def __init__(self, named_tensors):
            self.named = named_tensors

        def get_flattened_tensor(self):
            return torch.cat([t.flatten() for _, t in self.named])

        def get_metadata(self):
            out, start = [], 0
            for name, t in self.named:
                out.append(type("M", (), dict(name=name, shape=t.shape, dtype=t.dtype, start_idx=start,
                                              end_idx=start + t.numel(), numel=t.numel()))())
                start += t.numel()
            return out

    api = type("Api", (), dict(bucket_cls=Bucket, patch_reductions=lambda: calls.append("patched"),
                               serializer=type("S", (), dict(serialize=staticmethod(lambda d, output_str: "x")))))()
    payload, keep = sg.prepare_rank_payload([("a", torch.ones(2, 2)), ("b", torch.zeros(3))], api)
    assert payload == {"format": "flattened_bucket", "items": ["x"]} and calls == []


def test_a_cpu_engine_needs_a_bounded_kv_cache_and_sglangs_cpu_switch(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    sg.check_cpu_engine_kwargs({"device": "cpu", "max_total_tokens": 2048})
    with pytest.raises(ConfigError, match="max_total_tokens"):
        sg.check_cpu_engine_kwargs({"device": "cpu"})
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    with pytest.raises(ConfigError, match="SGLANG_USE_CPU_ENGINE=1"):
        sg.check_cpu_engine_kwargs({"device": "cpu", "max_total_tokens": 2048})
    assert sg.engine_free_bytes("cpu") > 0  # available RAM, what SGLang measures on CPU


def test_flush_is_retried_until_the_scheduler_is_idle():
    answers = iter([(False, "pending requests"), {"success": False}, (True, "")])
    calls = []

    def flush():
        calls.append(1)
        return next(answers)

    assert sg.flush_until_idle(flush, timeout_s=5, poll_s=0) == (True, "")
    assert len(calls) == 3
    assert sg.flush_until_idle(lambda: (False, "busy"), timeout_s=0, poll_s=0) == (False, "busy")  # gives up
    assert sg.flush_until_idle(lambda: True, timeout_s=1) == (True, "")


def test_the_handle_loop_is_created_inside_the_engines_loop():
    """SGLang 0.5.21 puts the tokenizer manager's handle loop on the running loop, or on a new one
    when none runs (where no call ever gets an answer)."""
    loop = asyncio.new_event_loop()
    try:
        seen = []

        def get_or_create():
            try:
                seen.append(asyncio.get_running_loop())
            except RuntimeError:
                seen.append("a new loop")

        sg.run_in_engine_loop(type("E", (), {"loop": loop})(), get_or_create)
        assert seen == [loop]
    finally:
        loop.close()


def test_torchruns_agent_store_switch_is_hidden_from_the_engine_and_restored():
    environ = {"TORCHELASTIC_USE_AGENT_STORE": "True", "LD_LIBRARY_PATH": "/x"}
    with sg.engine_environment(environ, maps_text="", site_dirs=[]):
        assert "TORCHELASTIC_USE_AGENT_STORE" not in environ  # SGLang's scheduler hosts its own store
    assert environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_a_child_failure_inside_the_engines_loop_stops_the_loop():
    """uvloop runs a signal handler as a loop callback and only logs what it raises: the failure must
    also stop the loop so the pending engine call returns (and becomes SGLangEngineError)."""
    failure = sg.ChildFailure()
    loop = asyncio.new_event_loop()
    try:
        async def waits_forever():
            loop.call_soon(lambda: pytest.raises(sg.SGLangEngineError, failure))
            await asyncio.sleep(3600)

        with pytest.raises(RuntimeError, match="Event loop stopped"):
            loop.run_until_complete(waits_forever())
        assert failure.failed
    finally:
        loop.close()


def test_a_child_failure_after_a_stop_signal_says_the_stop_ended_it(monkeypatch):
    """A time limit or Ctrl-C signals the whole process group: SGLang's children end with the trainer's
    SIGTERM and SIGQUIT it. The error must not send the user hunting for an out-of-memory."""
    monkeypatch.setattr(stop_signal, "_RECEIVED", None)
    with pytest.raises(sg.SGLangEngineError, match="common causes: CUDA out of memory") as plain:
        sg.ChildFailure()()  # outside the engine's loop it raises at once
    assert "got SIGTERM" not in str(plain.value)
    monkeypatch.setattr(stop_signal, "_RECEIVED", signal.SIGTERM)
    with pytest.raises(sg.SGLangEngineError, match="ended after this rank got SIGTERM") as stopped:
        sg.ChildFailure()()
    assert "resume=auto" in str(stopped.value)
