"""The rollout engine protocol shared by the in-process HF engine and SGLang, and the engine registry:
`@ENGINES.register("name")` on an `Engine` subclass makes `rollout.engine=name` a choice; the class carries
the engine's rules (how it is built, where it runs, its context length, what it can do)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Optional, Protocol

import torch

from colo_rl.errors import ConfigError
from colo_rl.registry import Registry
from colo_rl.samples import Completion  # noqa: F401  (engines return it; defined at the bottom of the house)

# What `sleep` / `wake` take: SGLang's memory-occupation tags.
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
ALL_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1  # completions per prompt, returned contiguously (a GRPO group)
    greedy: bool = False
    # Generation may also end after the token that completes one of these strings (finish_reason
    # "stop_string"; the token is kept whole). A saving, not a contract: the HF engine honours it, and
    # SGLang when started with its tokenizer (multi-turn runs; otherwise it runs with
    # skip_tokenizer_init and cannot match text), so a caller still cuts what follows a stop string
    # itself (rollout/multiturn.py).
    stop: tuple[str, ...] = ()


@dataclass
class HandoffStats:
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    # What travelled: "full" (every weight), "merged" (LoRA merged into the base), "base+adapters"
    # (a LoRA engine's first handoff), "adapters" (a LoRA engine's later ones).
    content: str = "full"
    zero_copy: bool = False  # the engine read the trainer's own flat weight buffer (no gather, no copy)


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do beyond the protocol, declared on its class (`capabilities = Capabilities(...)`)
    and read where used through `capabilities_of(engine)`; an engine declares only what it has."""

    # rollout.tp_size > 1 splits one engine over that many GPUs of a node
    tensor_parallel: bool = False
    # honours SamplingParams.stop when `create(stop_strings=True)` asked for it; without, a tool turn
    # samples on to EOS and rollout/multiturn.py cuts it after the call (the same tokens, more sampling)
    stop_strings: bool = False
    # `supports_adapters() -> bool` (this instance, as started) + `load_adapter(named_tensors)`: LoRA
    # adapters applied unmerged, every adapter tensor (adapter-file names) at once (colocate/handoff.py)
    adapters: bool = False
    # `rng_state()` / `set_rng_state(state)`: the sampling RNG, saved in checkpoints (checkpoint/compat.py)
    sampling_rng: bool = False
    # `generate` is a collective every rank of a group calls the same number of times (rollout/multiturn.py)
    lockstep_generate: bool = False
    # `inner`: the engine a wrapper drives (TPGroupEngine; None on the ranks that do not own it), where a
    # checkpoint looks for the sampling RNG
    wraps_engine: bool = False


NO_CAPABILITIES = Capabilities()


def capabilities_of(engine: Any) -> Capabilities:
    """The engine's declared capabilities (none for None or an engine that declares none)."""
    declared = getattr(engine, "capabilities", NO_CAPABILITIES)
    return declared if isinstance(declared, Capabilities) else NO_CAPABILITIES


def sampling_seed(seed: int, rank: int) -> int:
    """Each rank's engine sampling seed: its own stream, and a prime stride so that a sweep's
    neighbouring rollout.seed values share no stream (seed s on rank 1 is not seed s+1 on rank 0)."""
    return seed + 7919 * rank


class RolloutEngine(Protocol):
    """What the colocated loop asks of an engine (HFEngine, SGLangEngine, TPGroupEngine; each is
    checked against this in tests/test_engine_protocol.py). What an engine can do beyond it is
    declared in its `capabilities` (`Capabilities`), not found by probing."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions for each prompt's token ids, `params.n` per prompt, contiguous."""

    def sleep(self, tags: Iterable[str] = ALL_TAGS) -> int:
        """Release the memory behind `tags`; returns bytes released (0 where nothing is held)."""

    def wake(self, tags: Iterable[str] = ALL_TAGS) -> int:
        """Re-acquire memory for `tags`; resumed weights are garbage until `load_weights`."""

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Take one bucket of full (unsharded) HF-named tensors from the trainer."""

    def finish_weight_update(self) -> None:
        """Called after the last bucket (flush caches, close an update session)."""

    def shutdown(self) -> None:
        """Stop the engine and release everything it holds."""


class Engine:
    """A registered engine's rules, read before it starts (classmethods: no engine is built). A new
    engine subclasses this, registers under its `rollout.engine` name, and overrides what differs;
    colo_rl then compares no engine names anywhere else.

        @ENGINES.register("vllm")
        class VLLMEngine(Engine):
            title = "vLLM"
            capabilities = Capabilities(tensor_parallel=True)
            @classmethod
            def create(cls, cfg, tokenizer, dtype, guard, stop_strings): ...
    """

    title: ClassVar[str] = "this engine"  # its name in messages
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES
    # It sizes its memory from what is free when it starts: the trainer is paged out around `create`.
    sizes_memory_at_start: ClassVar[bool] = False
    # What it runs where it takes no tensor parallelism (the tp_size refusal says it).
    without_tp: ClassVar[str] = "runs a whole model on every rank"
    # With tensor parallelism: (named_tensors) -> (payload, keepalive), each TP rank's share of a weight
    # update, gathered by TPGroupEngine on the engine's rank (rollout/tp_group.py).
    tp_rank_payload: ClassVar[Optional[Callable[[list], tuple[Any, Any]]]] = None

    @classmethod
    def create(cls, cfg: Any, tokenizer: Any, dtype: torch.dtype, guard: Any, stop_strings: bool) -> "RolloutEngine":
        """The engine for this rank, its weights released (they come from the trainer's handoff).
        `stop_strings`: the run's turns end at strings (SamplingParams.stop must be honoured)."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """The run's config against what this engine can do (part of config.validate)."""
        tp = cfg.rollout.tp_size
        if tp > 1 and not cls.capabilities.tensor_parallel:
            splitters = [n for n in ENGINES if ENGINES.get(n).capabilities.tensor_parallel]
            titles = " or ".join(f"{ENGINES.get(n).title}'s" for n in splitters)
            raise ConfigError(f"rollout.tp_size={tp} splits {titles} engine over GPUs; rollout.engine="
                              f"{cfg.rollout.engine} {cls.without_tp} and would ignore it: use "
                              f"{' or '.join(f'rollout={n}' for n in splitters)} (on GPUs) or leave rollout.tp_size=1")

    @classmethod
    def check_runs_here(cls, cfg: Any) -> None:
        """What it needs is installed and its device is here (at start-up, in seconds)."""

    @classmethod
    def engine_kwargs(cls, cfg: Any) -> dict:
        """The user's own arguments for this engine (e.g. rollout.sglang_kwargs): the memory plan reads
        the KV cache's dtype there."""
        return {}

    @classmethod
    def cuda_graphs(cls, cfg: Any) -> bool:
        """Whether it captures CUDA graphs on a GPU (the memory plan keeps room for them)."""
        return False

    @classmethod
    def context_length(cls, cfg: Any, model_length: Optional[int]) -> tuple[Optional[int], str]:
        """The longest sequence it takes for this run (None: unknown), and where that figure comes from;
        `model_length`: the model's own (config.json)."""
        return model_length, "config.json"


# rollout.engine's choices: every Engine subclass registered here (colo_rl/rollout/__init__.py imports them all).
ENGINES: Registry[type[Engine]] = Registry("rollout.engine")
