"""The rollout engine protocol shared by the in-process HF engine and SGLang."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

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
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    # log softmax(logits / temperature)[token] over the full vocabulary, as the engine sampled it.
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS), "length", or "stop_string" (SamplingParams.stop)


@dataclass
class HandoffStats:
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    # What travelled: "full" (every weight), "merged" (LoRA merged into the base), "base+adapters"
    # (a LoRA engine's first handoff), "adapters" (a LoRA engine's later ones).
    content: str = "full"
    zero_copy: bool = False  # the engine read the trainer's own flat weight buffer (no gather, no copy)


class RolloutEngine(Protocol):
    """What the colocated loop asks of an engine (HFEngine, SGLangEngine, TPGroupEngine; each is
    checked against this in tests/test_engine_protocol.py).

    Optional, found by feature where used:
    - `supports_adapters() -> bool` + `load_adapter(named_tensors)`: LoRA adapters applied unmerged,
      every adapter tensor (adapter-file names) at once (colocate/handoff.py choose_lora_handoff);
    - `rng_state()` / `set_rng_state(state)`: the sampling RNG, saved in checkpoints (checkpoint/compat.py);
    - `lockstep_generate = True`: `generate` is a collective every rank of a group calls the same
      number of times (rollout/multiturn.py);
    - `inner`: the engine a wrapper drives (TPGroupEngine; None on the ranks that do not own it),
      where a checkpoint looks for the sampling RNG."""

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
