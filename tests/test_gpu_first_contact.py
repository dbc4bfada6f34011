"""What would break on the first GPU run with SGLang 0.5.17, decided on CPU (audit B2-B5, B7, B10).

Fakes stand for SGLang's objects only, written from the 0.5.17 sources: the engine installs
`custom_sigquit_handler` with signal.signal while it starts (engine.py `_set_envs_and_config`), its
tokenizer manager adds asyncio SIGQUIT and SIGTERM handlers that kill the process tree on its first
request (tokenizer_manager.py `auto_create_handle_loop`; SGLang runs uvloop), and a failing scheduler
sends SIGQUIT to the parent (scheduler.py).
"""

from __future__ import annotations

import asyncio
import json
import dataclasses
import importlib.abc
import multiprocessing
import os
import signal
import sys
import time
import types
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
from conftest import ROOT, hydra_dict
from hydra import compose, initialize_config_dir

from colo_rl.colocate import memory
from colo_rl.config import ConfigError, LoraConfig, register_configs, to_object
from colo_rl.rollout import sglang as sg
from colo_rl.rollout.sglang import engine as sg_engine
from colo_rl.rollout.sglang import env as sg_env
from colo_rl.rollout.sglang import failure as sg_failure
from colo_rl.rollout.base import CUDA_GRAPH, KV_CACHE, WEIGHTS
from colo_rl.train import ds_config
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.host_paging import HostPager

register_configs()

PIP_CUDART = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib"
MAPS = f"""\
5581a2c00000-5581a2c01000 r--p 00000000 08:01 131 /usr/bin/python3.12
7f1c2a000000-7f1c2a0a0000 r--p 00000000 08:01 912 {PIP_CUDART}/libcudart.so.13
7f1c2a0a0000-7f1c2a200000 r-xp 000a0000 08:01 912 {PIP_CUDART}/libcudart.so.13
7f1c2b000000-7f1c2b100000 r-xp 00000000 08:01 913 /venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so
7f1c2c000000-7f1c2c100000 r-xp 00000000 08:01 914 /opt/old/libcudart.so.12.4.127 (deleted)
7f1c2d000000-7f1c2d021000 rw-p 00000000 00:00 0
7ffd1a000000-7ffd1a021000 rw-p 00000000 00:00 0                          [stack]
"""


# ============================================================================ B2: libcudart for the preload hook
def test_cuda_runtime_dirs_parsed_from_proc_maps():
    assert sg.cuda_runtime_dirs(MAPS) == [PIP_CUDART]  # once, deleted mappings and non-cudart libs skipped
    assert sg.cuda_runtime_dirs("7f00-7f01 r-xp 0 08:01 1 /usr/local/cuda/lib64/libcudart.so.13.0.48\n") == \
        ["/usr/local/cuda/lib64"]
    assert sg.cuda_runtime_dirs("") == []


def test_engine_env_puts_the_loaded_cuda_runtime_first_on_ld_library_path():
    changes = sg.engine_env_overrides({"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}, maps_text=MAPS, site_dirs=[])
    assert changes["LD_LIBRARY_PATH"] == f"{PIP_CUDART}:/usr/local/nvidia/lib64"
    assert sg.engine_env_overrides({}, maps_text=MAPS, site_dirs=[])["LD_LIBRARY_PATH"] == PIP_CUDART
    # already there: left alone
    assert "LD_LIBRARY_PATH" not in sg.engine_env_overrides({"LD_LIBRARY_PATH": f"/x:{PIP_CUDART}"},
                                                            maps_text=MAPS, site_dirs=[])
    # no CUDA runtime anywhere (CPU): nothing to add
    assert "LD_LIBRARY_PATH" not in sg.engine_env_overrides({}, maps_text="", site_dirs=[])


def test_pip_cuda_runtime_is_the_fallback_when_none_is_mapped(tmp_path):
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_bytes(b"")
    (tmp_path / "nvidia" / "cuda_runtime" / "lib").mkdir(parents=True)  # empty: not a runtime
    changes = sg.engine_env_overrides({"LD_LIBRARY_PATH": "/a"}, maps_text="", site_dirs=[str(tmp_path)])
    assert changes["LD_LIBRARY_PATH"] == f"{lib}:/a"
    # the mapped runtime wins over site-packages (it is the one torch uses)
    changes = sg.engine_env_overrides({}, maps_text=MAPS, site_dirs=[str(tmp_path)])
    assert changes["LD_LIBRARY_PATH"] == PIP_CUDART


def test_engine_environment_restores_ld_library_path_after_start():
    env = {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        with sg.engine_environment(env, maps_text=MAPS, site_dirs=[]):
            assert env["LD_LIBRARY_PATH"].split(":") == [PIP_CUDART, "/usr/local/nvidia/lib64"]
        assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
        env = {}
        with sg.engine_environment(env, maps_text=MAPS, site_dirs=[]):
            assert env["LD_LIBRARY_PATH"] == PIP_CUDART
        assert "LD_LIBRARY_PATH" not in env
    finally:
        multiprocessing.set_start_method(method, force=True)


# ============================================================================ B3: rollout.sglang_kwargs
@dataclasses.dataclass
class FakeServerArgs:  # the ServerArgs fields colo_rl sets, plus a few a user would
    model_path: str = ""
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: Optional[float] = None
    enable_memory_saver: bool = False
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    random_seed: Optional[int] = None
    port: int = 30000
    nccl_port: Optional[int] = None
    log_level: str = "info"
    custom_sigquit_handler: Optional[Callable] = None
    attention_backend: Optional[str] = None
    sampling_backend: Optional[str] = None
    disable_cuda_graph: bool = False
    disable_prefill_cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None


def _compose(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_object(compose(config_name="config", overrides=overrides))


def test_sglang_kwargs_overrides_compose():
    assert _compose([]).rollout.sglang_kwargs == {}
    cfg = _compose(["rollout.sglang_kwargs={attention_backend:triton,cuda_graph_max_bs:16}",
                    "+rollout.sglang_kwargs.disable_cuda_graph=true"])
    assert cfg.rollout.sglang_kwargs == {"attention_backend": "triton", "cuda_graph_max_bs": 16,
                                         "disable_cuda_graph": True}
    assert _compose(["rollout.sglang_kwargs.sampling_backend=pytorch"]).rollout.sglang_kwargs == \
        {"sampling_backend": "pytorch"}
    # The tests' formatter (the GPU tests pass make gpu-check's JSON kwargs through it) round-trips.
    kwargs = {"attention_backend": "triton", "sampling_backend": "pytorch", "disable_cuda_graph": True,
              "cuda_graph_max_bs": 16, "mem_fraction_static": 0.5}
    assert _compose([f"rollout.sglang_kwargs={hydra_dict(kwargs)}"]).rollout.sglang_kwargs == kwargs


def test_sglang_kwargs_checked_against_server_args():
    extra = {"attention_backend": "triton", "disable_cuda_graph": True}
    assert sg.validate_sglang_kwargs(extra, FakeServerArgs) == extra
    with pytest.raises(ConfigError, match=r"rollout\.sglang_kwargs\.attention_backnd .*did you mean attention_backend"):
        sg.validate_sglang_kwargs({"attention_backnd": "triton"}, FakeServerArgs)
    with pytest.raises(ConfigError, match=r"rollout\.sglang_kwargs\.mem_fraction_static .*colocate\.mem_fraction_static"):
        sg.validate_sglang_kwargs({"mem_fraction_static": 0.5}, FakeServerArgs)
    with pytest.raises(ConfigError, match=r"rollout\.sglang_kwargs\.tp_size .*rollout\.tp_size"):
        sg.validate_sglang_kwargs({"tp_size": 2}, FakeServerArgs)
    with pytest.raises(ConfigError, match=r"rollout\.sglang_kwargs\.enable_memory_saver"):
        sg.validate_sglang_kwargs({"enable_memory_saver": False}, None)  # owned even when ServerArgs is unknown


# ============================================================================ B4: SIGQUIT from a failed child
def _deliver_sigquit():
    os.kill(os.getpid(), signal.SIGQUIT)
    for _ in range(200):  # Python runs the handler in the main thread at the next bytecode
        time.sleep(0.005)


@pytest.fixture
def sigquit_state():
    before, term_before = signal.getsignal(signal.SIGQUIT), signal.getsignal(signal.SIGTERM)
    saved = sg_failure._CHILD_FAILURE
    sg_failure._CHILD_FAILURE = None
    try:
        yield before
    finally:
        signal.signal(signal.SIGQUIT, before)
        signal.signal(signal.SIGTERM, term_before)
        sg_failure._CHILD_FAILURE = saved


def test_sigquit_from_a_child_raises_engine_error_and_restores(sigquit_state):
    handler = sg.watch_child_failures()
    with pytest.raises(sg.SGLangEngineError, match=r"SGLang scheduler process failed \(SIGQUIT from a child\)"):
        _deliver_sigquit()
    with pytest.raises(sg.SGLangEngineError, match="earlier"):  # a dead scheduler never answers: refuse
        handler.check()
    handler.restore()
    assert signal.getsignal(signal.SIGQUIT) == sigquit_state


def _asyncio_loop():
    return asyncio.new_event_loop()


def _uvloop():
    return pytest.importorskip("uvloop", reason="SGLang's event loop (uvloop) is not installed").new_event_loop()


@pytest.mark.parametrize("new_loop", [_asyncio_loop, _uvloop], ids=["asyncio", "uvloop"])
def test_sigquit_inside_the_engine_loop_stops_it_instead_of_raising_into_sglangs_task(sigquit_state, new_loop):
    """A scheduler fails while the engine's loop runs SGLang's own task (handle_loop): an error raised
    there would reach SGLang's print_exception_wrapper, which kills the process tree. The handler
    stops the loop instead; the pending call ends, and SGLangEngine._call raises colo_rl's error."""
    handler = sg.watch_child_failures()
    loop = new_loop()
    asyncio.set_event_loop(loop)
    seen = []

    async def sglang_task():  # print_exception_wrapper(handle_loop), in short
        try:
            os.kill(os.getpid(), signal.SIGQUIT)
            sum(range(10 ** 6))  # Python code of the task runs when the signal lands
            await asyncio.sleep(5)
        except Exception as e:  # noqa: BLE001
            seen.append(e)  # SGLang: kill_process_tree(include_parent=True)

    try:
        with pytest.raises(RuntimeError, match="stopped before"):
            loop.run_until_complete(sglang_task())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    assert handler.failed and seen == []


class FakeTokenizerManager:
    """SGLang 0.5.17's: the first request creates the handle loop on the running loop and adds the
    running-phase SIGQUIT handler and the SIGTERM one, both ending in a kill of the process tree."""

    def __init__(self, loop):
        self.loop = loop
        self.event_loop = None
        self.killed_tree = []

    def auto_create_handle_loop(self):
        if self.event_loop is not None:
            return
        self.event_loop = asyncio.get_running_loop()
        for sig in (signal.SIGQUIT, signal.SIGTERM):
            self.event_loop.add_signal_handler(sig, lambda s=sig: self.killed_tree.append(signal.Signals(s).name))


class FakeEngine:
    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.ld_library_path = os.environ.get("LD_LIBRARY_PATH")
        handler = kwargs.get("custom_sigquit_handler")
        # _set_envs_and_config: the custom handler, else one that kills the tree
        signal.signal(signal.SIGQUIT, handler if handler is not None else (lambda *a: self.killed.append(True)))
        self.killed = []
        self.loop = FakeEngine.new_loop()
        self.tokenizer_manager = FakeTokenizerManager(self.loop)
        self.shut = False
        FakeEngine.instances.append(self)

    def shutdown(self):
        self.shut = True


@pytest.mark.parametrize("new_loop", [_asyncio_loop, _uvloop], ids=["asyncio", "uvloop"])
def test_create_merges_kwargs_sets_cudart_and_keeps_sigquit(monkeypatch, sigquit_state, new_loop, tmp_path):
    api = SimpleNamespace(server_args_cls=FakeServerArgs, memory_tags=["kv_cache", "weights", "cuda_graph"],
                          begin_req=None, end_req=None)
    monkeypatch.setattr(sg_engine, "sglang_api", lambda: api)
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine, __version__="0.5.17"))
    # model=tiny's shape: 2 x 2 layers x 1 KV head x 64 x 2 bytes = 512 bytes of KV cache a token
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 1,
                                                      "hidden_size": 64}))
    monkeypatch.setattr(sg_engine, "engine_model_dir", lambda model_cfg: str(tmp_path))
    monkeypatch.setattr(sg_env, "_own_maps", lambda: MAPS)
    monkeypatch.setattr(sg_engine, "eos_token_ids", lambda tok, d: [2])
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/lib/site")
    rollout = SimpleNamespace(tp_size=1, seed=3,
                              sglang_kwargs={"attention_backend": "triton", "disable_cuda_graph": True})
    colocate = SimpleNamespace(memory_margin_gib=2.0, mem_fraction_static=None)
    cfg = SimpleNamespace(rollout=rollout, colocate=colocate, model=SimpleNamespace(lora=LoraConfig()))
    method = multiprocessing.get_start_method(allow_none=True)
    FakeEngine.instances.clear()
    monkeypatch.setattr(FakeEngine, "new_loop", staticmethod(new_loop), raising=False)
    stops = []
    signal.signal(signal.SIGTERM, lambda *a: stops.append(True))  # the trainer's StopSignal
    try:
        engine = sg.SGLangEngine.create(cfg, tokenizer=None, dtype=torch.bfloat16, free_bytes=40 << 30)
    finally:
        multiprocessing.set_start_method(method, force=True)
    fake = FakeEngine.instances[0]
    try:
        assert fake.kwargs["attention_backend"] == "triton" and fake.kwargs["disable_cuda_graph"] is True
        assert fake.kwargs["load_format"] == "dummy" and fake.kwargs["enable_memory_saver"] is True
        # SGLang's default (breakable) prefill graph refuses the memory saver: no prefill graph with it
        assert fake.kwargs["disable_prefill_cuda_graph"] is True
        # A toy model's pool (79M tokens of 512 bytes in 38 GiB) is bounded to 2^24 tokens, and the 48 bytes
        # a token SGLang sizes to the pool come out of the 38 of 40 GiB
        assert fake.kwargs["max_total_tokens"] == 1 << 24
        assert fake.kwargs["mem_fraction_static"] == pytest.approx((38 - (48 << 24) / (1 << 30)) / 40, abs=1e-4)
        assert fake.kwargs["custom_sigquit_handler"] is sg_failure._sigquit_from_child
        assert fake.ld_library_path == f"{PIP_CUDART}:/usr/lib/site"  # what the schedulers inherit
        assert os.environ["LD_LIBRARY_PATH"] == "/usr/lib/site"  # the trainer's own, restored
        # torchrun's SIGTERM after the tokenizer manager's loop exists: the trainer's handler, not SGLang's
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stops == [True]
        # A scheduler fails: ours, not SGLang's, runs.
        with pytest.raises(sg.SGLangEngineError, match="SIGQUIT from a child"):
            _deliver_sigquit()
        fake.loop.run_until_complete(asyncio.sleep(0.05))  # an asyncio handler would run now (uvloop re-arms them)
        assert fake.tokenizer_manager.killed_tree == [] and fake.killed == []
        _deliver_sigquit()  # a second rank's SIGQUIT: recorded, not raised again in the middle of cleanup
        with pytest.raises(sg.SGLangEngineError, match="earlier"):
            engine.sleep([WEIGHTS])
        engine.shutdown()
        assert fake.shut and signal.getsignal(signal.SIGQUIT) == sigquit_state
    finally:
        fake.loop.close()

    cfg.rollout.sglang_kwargs = {"attention_backnd": "triton"}
    with pytest.raises(ConfigError, match="attention_backend"):
        sg.SGLangEngine.create(cfg, tokenizer=None, dtype=torch.bfloat16, free_bytes=40 << 30)


# ============================================================================ B5: empty the cache before the KV cache
class RecordingActor:
    paged_kinds = ("optim_states", "lp_params")

    def __init__(self, calls):
        self.calls = calls

    def paged_bytes(self, kinds=None):
        return 1000

    def offload_states(self, kinds=None):
        self.calls.append(("offload", tuple(kinds)) if kinds is not None else "offload")
        return True

    def handoff_h2d_bytes(self, names=None):
        return 42


class RecordingEngine:
    def __init__(self, calls):
        self.calls = calls

    def wake(self, tags):
        self.calls.append(("wake", tuple(tags)))
        return 7


class RecordingHandoff:
    feeds_engine = True
    keeps_engine_weights = False
    gathered_names: list = []

    def __init__(self, calls):
        self.calls = calls

    def push(self):
        self.calls.append("push")
        return SimpleNamespace(bytes=10, buckets=1, content="full", zero_copy=False)


def test_trainer_cache_emptied_between_handoff_and_kv_resume(monkeypatch):
    calls: list = []

    def release():
        calls.append("empty_cache")
        return 512 << 20

    monkeypatch.setattr(memory, "release_cached_memory", release)
    manager = memory.MemoryManager(RecordingActor(calls), RecordingEngine(calls), RecordingHandoff(calls),
                                   memory.Ledger(None))
    record = manager.to_generation(step=0)
    assert calls == [("offload", ("optim_states", "lp_params")), "empty_cache", ("wake", (WEIGHTS,)), "push",
                     "empty_cache", ("wake", (KV_CACHE, CUDA_GRAPH))]
    handoff = next(m for m in record["moves"] if m["what"] == "weights handoff")
    assert handoff["cache_released_bytes"] == 512 << 20
    assert handoff["h2d_bytes"] == 42  # the gathers copy the paged lp partitions back


def test_with_room_the_handoff_runs_before_the_weight_partitions_leave(monkeypatch):
    """The paging plan's handoff_first: everything but lp_params pages, the engine takes the weights
    from the resident partitions (no host-to-device copy), then lp_params page, then the KV cache."""
    calls: list = []
    monkeypatch.setattr(memory, "release_cached_memory", lambda: calls.append("empty_cache") or 0)
    manager = memory.MemoryManager(RecordingActor(calls), RecordingEngine(calls), RecordingHandoff(calls),
                                   memory.Ledger(None), handoff_first=True)
    record = manager.to_generation(step=0)
    assert calls == [("offload", ("optim_states",)), "empty_cache", ("wake", (WEIGHTS,)), "push", "empty_cache",
                     ("offload", ("lp_params",)), ("wake", (KV_CACHE, CUDA_GRAPH))]
    moves = {m["what"]: m for m in record["moves"]}
    assert moves["weights handoff"]["h2d_bytes"] == 0  # nothing to copy back: the partitions were there
    assert moves["trainer states"]["kinds"] == ["optim_states"]
    assert moves["trainer weight partitions"]["moved"] is True


def test_release_cached_memory_is_a_noop_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert memory.release_cached_memory() == 0


# ============================================================================ B7: no model_runner in the trainer
class ImportRecorder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.seen = []

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sglang.srt.model_executor"):
            self.seen.append(fullname)
        return None


def _module(name, package=False, **attrs):
    mod = types.ModuleType(name)
    if package:
        mod.__path__ = []
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


def test_sglang_api_does_not_import_model_runner_when_the_bucket_resolves(monkeypatch):
    class Bucket:
        supports_multi_dtypes = True

    fakes = {
        "sglang": _module("sglang", package=True, __version__="0.5.17"),
        "sglang.srt": _module("sglang.srt", package=True),
        "sglang.srt.utils": _module("sglang.srt.utils", package=True, MultiprocessingSerializer=object),
        "sglang.srt.utils.patch_torch": _module("sglang.srt.utils.patch_torch",
                                                monkey_patch_torch_reductions=lambda: None),
        "sglang.srt.weight_sync": _module("sglang.srt.weight_sync", package=True),
        "sglang.srt.weight_sync.tensor_bucket": _module("sglang.srt.weight_sync.tensor_bucket",
                                                        FlattenedTensorBucket=Bucket),
    }
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in fakes.items():
        monkeypatch.setitem(sys.modules, name, mod)
    recorder = ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    sg.sglang_api.cache_clear()
    try:
        api = sg.sglang_api()
        assert api.bucket_cls is Bucket and api.lst_cls is None
        assert recorder.seen == []  # model_runner (and its whole stack) never imported

        # No FlattenedTensorBucket: LocalSerializedTensor from weight_updater, before model_runner's.
        class LST:
            pass

        monkeypatch.delitem(sys.modules, "sglang.srt.weight_sync.tensor_bucket")
        monkeypatch.setitem(sys.modules, "sglang.srt.model_executor", _module("sglang.srt.model_executor", True))
        monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.model_runner_components",
                            _module("sglang.srt.model_executor.model_runner_components", True))
        monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.model_runner_components.weight_updater",
                            _module("sglang.srt.model_executor.model_runner_components.weight_updater",
                                    LocalSerializedTensor=LST))
        monkeypatch.setitem(sys.modules, "sglang.srt.model_executor.model_runner",
                            _module("sglang.srt.model_executor.model_runner", LocalSerializedTensor=object))
        sg.sglang_api.cache_clear()
        api = sg.sglang_api()
        assert api.bucket_cls is None and api.lst_cls is LST
    finally:
        sg.sglang_api.cache_clear()


# ============================================================================ B10: paged bytes
def test_paged_state_bytes_uses_the_gradient_dtype():
    n = 1000
    # bf16 model, bf16 gradient accumulation (DeepSpeed's default: the model dtype)
    assert ds_config.paged_state_bytes(n, torch.bfloat16, torch.bfloat16, include_lp_params=True) == n * (12 + 2 + 2)
    assert ds_config.paged_state_bytes(n, torch.bfloat16, torch.float32, include_lp_params=True) == n * (12 + 2 + 4)
    assert ds_config.paged_state_bytes(n, torch.bfloat16, torch.bfloat16, include_lp_params=False) == n * (12 + 2)
    # fp32: the params are the master weights, no second copy
    assert ds_config.paged_state_bytes(n, torch.float32, torch.float32, include_lp_params=True) == n * (12 + 4)


def _param(numel, dtype=torch.bfloat16, persist=False, trained=True):
    return SimpleNamespace(ds_tensor=torch.zeros(numel, dtype=dtype), requires_grad=trained, ds_persist=persist)


def _fake_actor(params, bucket_numel):
    zero = SimpleNamespace(contiguous_gradients=True, reduce_bucket_size=bucket_numel, ipg_buckets={torch.bfloat16: None})
    actor = SimpleNamespace(with_optimizer=True, zero_stage=3, dtype=torch.bfloat16,
                            module=SimpleNamespace(parameters=lambda: iter(params),
                                                   named_parameters=lambda: iter(zip("abcd", params))),
                            engine=SimpleNamespace(get_data_types=lambda: (torch.bfloat16, torch.bfloat16), optimizer=zero),
                            frozen_pager=HostPager([p.ds_tensor for p in params if not p.requires_grad], False))
    actor.grad_dtype = types.MethodType(DeepSpeedActor.grad_dtype, actor)
    return actor


def test_actor_state_bytes_and_handoff_h2d_bytes():
    """(tests/test_paging.py checks state_bytes against the tensors DeepSpeed really moves.)"""
    actor = _fake_actor([_param(100), _param(50), _param(10, persist=True)], bucket_numel=160)
    # not 18 B/param: gradients are bf16; plus ZeRO's bf16 gradient bucket
    assert DeepSpeedActor.state_bytes(actor) == 160 * 16 + 160 * 2
    # persistent params too: offload_states released them, the handoff gathers them from the host
    assert DeepSpeedActor.handoff_h2d_bytes(actor) == (100 + 50 + 10) * 2
    assert DeepSpeedActor.handoff_h2d_bytes(actor, ["b", "c"]) == (50 + 10) * 2  # a LoRA handoff gathers some only


def test_actor_state_bytes_with_a_frozen_base():
    """LoRA: the adapters' bf16 partitions stay on the device; the base's are paged by colo_rl."""
    actor = _fake_actor([_param(1000, trained=False), _param(8), _param(500, trained=False), _param(8)],
                        bucket_numel=16)
    assert DeepSpeedActor.state_bytes(actor) == 16 * (12 + 2) + 16 * 2 + 1500 * 2
    assert DeepSpeedActor.handoff_h2d_bytes(actor) == 1500 * 2  # the adapters' partitions never left
