"""SGLangEngine: the colo_rl engine protocol on SGLang's offline Engine, with its memory-tag state
machine (see colo_rl/colocate/NOTES.md for the layout, the transition order and the traps)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from colo_rl import dist
from colo_rl.cuda_toolkit import prepare_jit_builds
from colo_rl.errors import ConfigError, HandoffError, SGLangEngineError
from colo_rl.models import eos_token_ids, model_config, resolve_model_path
from colo_rl.phase import Phase
from colo_rl.rollout.base import (ALL_TAGS, ENGINES, KV_CACHE, Capabilities, Completion, Engine, SamplingParams,
                                  sampling_seed)
from colo_rl.rollout.sglang.compat import (
    REQUIRED_SERVER_ARGS,
    SGLANG_DEFAULT_CONTEXT_LENGTH,
    SGLANG_LONGER_CONTEXT_VARIABLE,
    _plain_dict,
    check_cpu_engine_kwargs,
    check_engine_runs_here,
    engine_base_gpu_id,
    engine_device,
    engine_free_bytes,
    known_server_kwargs,
    kv_bytes_per_token,
    kv_cache_bytes,
    memory_saver_kwargs,
    plan_engine_memory,
    sglang_api,
    sglang_dtype,
    supported_memory_tags,
    validate_sglang_kwargs,
)
from colo_rl.rollout.sglang.env import engine_environment, trainer_logging_kept
from colo_rl.rollout.sglang.failure import (
    ChildFailure,
    _sigquit_from_child,
    child_failed_message,
    flush_until_idle,
    take_over_signals,
    watch_child_failures,
)
from colo_rl.rollout.sglang.io import expand_prompts, parse_outputs, raised_abort, sglang_sampling_params
from colo_rl.rollout.sglang.memory_state import EngineMemoryState
from colo_rl.rollout.sglang.lora import (ADAPTER_NAME, adapter_request, lora_engine_support, lora_server_kwargs,
                                         request_lora_paths)
from colo_rl.rollout.sglang.weights import (payload_calls, prepare_flat_payload, prepare_payloads, prepare_rank_payload,
                                            update_result, weight_session_api)

log = logging.getLogger("colo_rl")

GIB = 1 << 30
FLUSH_TIMEOUT_S = 60.0  # how long to wait for an idle scheduler before a flush / release


def engine_model_dir(model_cfg) -> str:
    """The directory SGLang reads the architecture from (weights are dummy: never read). A
    shrunk random model gets its config written to a temporary directory, removed at the engine's
    shutdown, or at exit where the engine is left to SGLang's own exit hook (the recipes)."""
    if not model_cfg.random_init:
        return str(resolve_model_path(model_cfg.path))
    out = tempfile.mkdtemp(prefix="colo_rl-sglang-config-")
    model_config(model_cfg).save_pretrained(out)
    _WRITTEN_MODEL_DIRS.add(out)
    atexit.register(shutil.rmtree, out, True)
    return out


_WRITTEN_MODEL_DIRS: set[str] = set()  # what engine_model_dir wrote: the only directories shutdown removes


@ENGINES.register("sglang")
class SGLangEngine(Engine):
    """The colo_rl engine protocol on SGLang's offline Engine (one per TP group, on its first rank).

    With tp_size > 1 in a colocated run, wrap it in colo_rl.rollout.tp_group.TPGroupEngine: every
    rank of the group holds the gathered weights on its own GPU and sends its TP rank a payload
    from there (`load_rank_payloads`). `load_weights` serves a rank that alone holds the weights
    (a split run's generator): every TP rank reads them from this rank.
    """

    title = "SGLang"
    # Stop strings: honoured when started with its tokenizer (create(stop_strings=True)). Adapters: when
    # this SGLang has load_lora_adapter_from_tensors and tp_size is 1 (supports_adapters()).
    capabilities = Capabilities(tensor_parallel=True, stop_strings=True, adapters=True)
    sizes_memory_at_start = True
    tp_rank_payload = staticmethod(prepare_rank_payload)

    @classmethod
    def check_runs_here(cls, cfg: Any) -> None:
        check_engine_runs_here(cfg.rollout.engine, cfg.rollout.sglang_kwargs)

    @classmethod
    def engine_kwargs(cls, cfg: Any) -> dict:
        return dict(cfg.rollout.sglang_kwargs or {})

    @classmethod
    def cuda_graphs(cls, cfg: Any) -> bool:
        return not cls.engine_kwargs(cfg).get("disable_cuda_graph")

    @classmethod
    def context_length(cls, cfg: Any, model_length: Optional[int]) -> tuple[Optional[int], str]:
        """rollout.sglang_kwargs.context_length when set (SGLang refuses to start when it is more than
        the model's, unless told otherwise), else the model's, else SGLang's default."""
        derived = (model_length, "config.json") if model_length is not None else (
            SGLANG_DEFAULT_CONTEXT_LENGTH, "SGLang's default: config.json names none")
        override = cfg.rollout.sglang_kwargs.get("context_length")
        if override is None:
            return derived
        allowed = os.environ.get(SGLANG_LONGER_CONTEXT_VARIABLE, "").lower() in ("1", "true", "yes", "y")
        if int(override) > derived[0] and not allowed:
            raise ConfigError(f"rollout.sglang_kwargs.context_length={override} is more than model.path="
                              f"{cfg.model.path!r} takes ({derived[0]}, {derived[1]}): SGLang would refuse to start. "
                              f"Lower it, or set {SGLANG_LONGER_CONTEXT_VARIABLE}=1 if the model does take longer "
                              f"inputs")
        return int(override), "rollout.sglang_kwargs.context_length"

    def __init__(self, engine, tp_size: int, eos_token_ids: list[int], guard=None,
                 supported_tags: Iterable[str] = ALL_TAGS, api=None, child_failure: Optional[ChildFailure] = None,
                 device: str = "cuda"):
        self.engine = engine
        self.device = device
        self.tp_size = tp_size
        self.eos = list(eos_token_ids)
        self.guard = guard
        self.api = api
        self.child_failure = child_failure
        self.temp_dir: Optional[str] = None
        self.state = EngineMemoryState(supported_tags)
        self.session = weight_session_api(engine, getattr(api, "begin_req", None), getattr(api, "end_req", None))
        self.model_cfg = None  # set when the engine was started with room for colo_rl's LoRA adapter
        self.stop_strings = False  # started with its tokenizer: SamplingParams.stop is passed on
        self.adapter_loaded = False

    @classmethod
    def create(cls, cfg, tokenizer, dtype: torch.dtype, guard=None, free_bytes: Optional[int] = None,
               stop_strings: bool = False):
        """Start the engine on this rank's GPU (and the next tp_size - 1), sized from the memory
        free now: call it while the trainer is paged out (see `trainer_paged_out`). `stop_strings`:
        start it with its tokenizer, so that SamplingParams.stop reaches SGLang (its scheduler
        matches stop strings on decoded text; without a tokenizer it cannot)."""
        api = sglang_api()
        import sglang

        rollout, colocate = cfg.rollout, cfg.colocate
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size()))
        if dist.local_rank() + rollout.tp_size > local_world:  # the placement's layouts keep TP groups in a node
            raise ValueError(f"rollout.tp_size={rollout.tp_size} from local rank {dist.local_rank()}: the engine's TP "
                             f"ranks need GPUs {dist.local_rank()}..{dist.local_rank() + rollout.tp_size - 1}, and this "
                             f"node has {local_world}")
        # Checked before the engine starts: a typo fails in seconds, not after a failed launch.
        extra = validate_sglang_kwargs(_plain_dict(getattr(rollout, "sglang_kwargs", None)), api.server_args_cls)
        device = engine_device(extra)
        if device == "cpu":
            check_cpu_engine_kwargs(extra)
        if free_bytes is None:
            free_bytes = engine_free_bytes(device)
        model_dir = engine_model_dir(cfg.model)
        # a pool bounded by max_total_tokens keeps its per-token buffers small whatever the model
        kv_token = None if extra.get("max_total_tokens") else kv_bytes_per_token(
            json.loads((Path(model_dir) / "config.json").read_text()), kv_cache_bytes(extra, dtype), rollout.tp_size)
        fraction, pool_cap = plan_engine_memory(free_bytes, int(colocate.memory_margin_gib * GIB),
                                                colocate.mem_fraction_static, kv_token)
        if pool_cap is not None:  # a toy model
            log.info("KV pool bounded to %d tokens (rollout.sglang_kwargs.max_total_tokens): this model's KV is "
                     "%.0f bytes a token, memory alone would size the pool past that", pool_cap, kv_token)
            extra["max_total_tokens"] = pool_cap
        child_failure = watch_child_failures()
        kwargs = known_server_kwargs(dict(
            model_path=model_dir, tp_size=rollout.tp_size, base_gpu_id=engine_base_gpu_id(device, dist.local_rank()),
            mem_fraction_static=fraction, **memory_saver_kwargs(device), load_format="dummy",
            skip_tokenizer_init=True, dtype=sglang_dtype(dtype),
            random_seed=sampling_seed(rollout.seed, dist.rank()),
            port=dist.free_port(), nccl_port=dist.free_port(), log_level="error",
            custom_sigquit_handler=_sigquit_from_child,
        ), api.server_args_cls, REQUIRED_SERVER_ARGS)
        if stop_strings:  # the tokenizer colo_rl uses (model.path's; a shrunk random model's config dir has none)
            kwargs.update(skip_tokenizer_init=False, tokenizer_path=str(resolve_model_path(cfg.model.path)))
        kwargs.update(extra)
        takes_adapters, why = lora_engine_support(cfg.model, sglang.Engine, rollout.tp_size)
        if takes_adapters:
            kwargs.update(lora_server_kwargs(cfg.model))
        if cfg.model.lora.rank > 0:
            log.info("SGLang LoRA adapters from tensors: %s (%s)", "yes" if takes_adapters else "no, merged handoff", why)
        log.info("starting SGLang %s (tp=%d, %s %d, mem_fraction_static=%.3f of %.1f GiB free%s)",
                 getattr(sglang, "__version__", "?"), rollout.tp_size, device, dist.local_rank(), fraction,
                 free_bytes / GIB,
                 f", {extra}" if extra else "")
        if device == "cuda":
            prepare_jit_builds()  # the schedulers JIT-build SGLang's kernels: CUDA_HOME, headers
        t0 = time.perf_counter()
        temp_dir = model_dir if model_dir in _WRITTEN_MODEL_DIRS else None
        try:
            with engine_environment(), trainer_logging_kept():
                engine = sglang.Engine(**kwargs)
            take_over_signals(engine, child_failure)
        except BaseException:
            child_failure.restore()
            if temp_dir is not None:
                shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        log.info("SGLang engine up in %.1fs", time.perf_counter() - t0)
        out = cls(engine, rollout.tp_size, eos_token_ids(tokenizer, model_dir), guard=guard,
                  supported_tags=supported_memory_tags(api.memory_tags), api=api, child_failure=child_failure,
                  device=device)
        out.model_cfg = cfg.model if takes_adapters else None
        out.stop_strings = stop_strings
        out.temp_dir = temp_dir
        return out

    def _alive(self) -> None:
        if self.child_failure is not None:
            self.child_failure.check()

    def _call(self, fn, *args, **kwargs):
        """One call into SGLang; when a child failed meanwhile (SIGQUIT stopped the engine's loop),
        whatever the interrupted call raised becomes SGLangEngineError."""
        self._alive()
        try:
            return fn(*args, **kwargs)
        except SGLangEngineError:
            raise
        except Exception as e:
            if self.child_failure is not None and self.child_failure.failed:
                raise SGLangEngineError(child_failed_message()) from e
            raise

    # ---------------------------------------------------------------- memory protocol
    def _free_bytes(self) -> int:
        if self.device == "cpu":  # CPU: SGLang's release frees nothing
            return 0
        return dist.device_free_bytes() or 0

    def sleep(self, tags: Iterable[str] = ALL_TAGS) -> int:
        """Release `tags`; returns the bytes freed on this rank's GPU."""
        todo = self.state.plan_release(tags)
        if not todo:
            return 0
        self._alive()
        if KV_CACHE not in self.state.released:
            # SGLang asserts an idle scheduler in release_memory_occupation (a failed assertion kills
            # the scheduler), and it may still be finishing the last batch: a flush succeeds only
            # once it is idle.
            self._flush()
        before = self._free_bytes()
        self._call(self.engine.release_memory_occupation, tags=todo)
        self.state.mark_released(todo)
        return max(0, self._free_bytes() - before)

    def wake(self, tags: Iterable[str] = ALL_TAGS) -> int:
        """Resume `tags`; returns the bytes taken on this rank's GPU. Resumed weights are garbage
        until the next weight update finishes."""
        todo = self.state.plan_resume(tags)
        if not todo:
            return 0
        self._alive()
        before = self._free_bytes()
        self._call(self.engine.resume_memory_occupation, tags=todo)
        self.state.mark_resumed(todo)
        if KV_CACHE in todo and self.state.flush_pending:
            self._flush()
        return max(0, before - self._free_bytes())

    def _flush(self) -> None:
        # The radix cache holds KV computed with the old weights. Flushing touches KV-cache
        # bookkeeping, so it runs only while the KV cache is resident.
        result = flush_until_idle(lambda: self._call(self.engine.flush_cache), FLUSH_TIMEOUT_S)
        update_result(result, "flush_cache", allow_none=True)
        self.state.flush_pending = False

    # ---------------------------------------------------------------- weights
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket from this rank's tensors, to every TP rank of the engine."""
        self._send_own_payloads(lambda: prepare_payloads(named_tensors, self.tp_size, self.api))

    def load_flat_weights(self, buffer: torch.Tensor, named_views: list[tuple[str, torch.Tensor]]) -> bool:
        """Every weight in one call from the trainer's own flat buffer (the views' places in it),
        without a copy (zero-copy producer); False, having sent nothing, where this SGLang or this
        process cannot take it that way (`prepare_flat_payload`): then hand off in buckets."""
        if self.tp_size > 1:
            return False
        prepared = prepare_flat_payload(buffer, named_views, self.api)
        if prepared is None:
            return False
        self._send_own_payloads(lambda: ([prepared[0]], prepared[1]))  # keepalive: the trainer's own buffer
        return True

    def _send_own_payloads(self, prepare) -> None:
        """Payloads made by this rank (`prepare()`: one per TP rank, keepalive); the producer tensors
        live until SGLang has copied them, then are dropped before the IPC blocks are collected."""
        payloads, keepalive = prepare()
        try:
            self.load_rank_payloads(payloads)
        finally:
            del keepalive
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()

    def load_rank_payloads(self, rank_payloads: list[dict]) -> None:
        """One bucket, as prepared by every TP rank (index = TP rank); producers stay alive until
        this returns."""
        self.state.require_weights_resident("load_weights")
        self._alive()
        if len(rank_payloads) != self.tp_size:
            raise HandoffError(f"{len(rank_payloads)} payloads for an engine with tp_size={self.tp_size}")
        if self.session is not None and not self.state.session_open:
            update_result(self._call(self.session.begin), "begin_weight_update", allow_none=True)
            self.state.session_open = True
        for call in payload_calls(rank_payloads, getattr(self.api, "lst_cls", None)):
            result = self._call(self.engine.update_weights_from_tensor, named_tensors=call.named_tensors,
                                load_format=call.load_format, flush_cache=False)
            update_result(result, "update_weights_from_tensor")

    def supports_adapters(self) -> bool:
        return self.model_cfg is not None

    def load_adapter(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """The policy's adapters, replacing the previous ones (SGLang keeps a loaded adapter
        immutable: unload, then load under the same name)."""
        self._alive()
        if self.adapter_loaded:
            update_result(self._call(self.engine.unload_lora_adapter, ADAPTER_NAME), "unload_lora_adapter")
            self.adapter_loaded = False
        request = adapter_request(named_tensors, self.model_cfg)
        update_result(self._call(self.engine.load_lora_adapter_from_tensors, **request),
                      "load_lora_adapter_from_tensors")
        self.adapter_loaded = True
        self.state.flush_pending = True  # cached prefixes were computed with the old adapter

    def finish_weight_update(self) -> None:
        if self.state.session_open:
            self.state.session_open = False  # closed or failed: never end a session twice
            update_result(self._call(self.session.end), "end_weight_update", allow_none=True)
        if self.state.finish_update():
            self._flush()

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.guard is not None:
            self.guard.require(Phase.GENERATION, "engine.generate")
        self.state.require_generate()
        self._alive()
        if self.state.flush_pending:
            self._flush()
        expanded = expand_prompts(prompts, params.n)
        if not expanded:
            return []
        sampling = sglang_sampling_params(params, self.eos, self.stop_strings)
        try:
            outputs = self._call(self.engine.generate, input_ids=expanded, sampling_params=sampling,
                                 return_logprob=True, logprob_start_len=-1, **self._lora_kwargs(len(expanded)))
        except Exception as e:
            abort = raised_abort(e)
            if abort is None:
                raise
            raise abort from e
        return parse_outputs(expanded, outputs, self.eos)

    def _lora_kwargs(self, n: int) -> dict:
        paths = request_lora_paths(self.adapter_loaded, n)
        return {"lora_path": paths} if paths is not None else {}

    def shutdown(self) -> None:
        # SGLang's shutdown kills every child process of this process, not only its own.
        try:
            if self.engine is not None:
                self.engine.shutdown()
                self.engine = None
        finally:
            if self.child_failure is not None:  # the handler that was there before the engine
                self.child_failure.restore()
            if self.temp_dir is not None:  # a random model's config, written for the engine alone
                shutil.rmtree(self.temp_dir, ignore_errors=True)
                _WRITTEN_MODEL_DIRS.discard(self.temp_dir)
                self.temp_dir = None
