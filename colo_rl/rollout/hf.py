"""In-process HF rollout engine (CPU, or a GPU without SGLang).

Its weights are plain buffers that the trainer fills during the handoff (`load_weights` copies
each gathered tensor into the engine's own storage: no files, no pickling). `sleep("weights")`
frees those buffers and `wake("weights")` allocates fresh, uninitialised ones, so after a wake the
engine produces garbage until the handoff has run: the handoff is its only source of weights.

With LoRA the engine's model is PEFT-wrapped like the trainer's: it takes the base once and then
only the adapter tensors (`load_adapter`), applying them unmerged (base + scaling * B A x), so its
log-probs are the trainer's. Tensors arrive under the names they travel by (colo_rl/lora.py:
HF names for base weights, adapter-file names for adapters) and are mapped to the model's own.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from colo_rl import dist
from colo_rl.lora import apply_lora, external_name, is_adapter, lora_enabled
from colo_rl.models import eos_token_ids, load_model, resolve_model_path
from colo_rl.phase import Phase, PhaseGuard
from colo_rl.rollout.base import (ALL_TAGS, ENGINES, KV_CACHE, WEIGHTS, Capabilities, Completion, Engine,
                                  SamplingParams, sampling_seed)

log = logging.getLogger("colo_rl")


@ENGINES.register("hf")
class HFEngine(Engine):
    title = "the HF engine"
    # Stop strings: always honoured (it holds the tokenizer). Adapters: when built PEFT-wrapped.
    capabilities = Capabilities(stop_strings=True, adapters=True, sampling_rng=True)

    @classmethod
    def create(cls, cfg, tokenizer, dtype: torch.dtype, guard: Optional[PhaseGuard], stop_strings: bool) -> "HFEngine":
        model = load_model(cfg.model, dtype, seed=cfg.trainer.seed)
        if lora_enabled(cfg.model) and cfg.model.lora.handoff == "auto":  # adapters applied unmerged, as the trainer
            model = apply_lora(model, cfg.model.lora, seed=cfg.trainer.seed)
        model = model.to(dist.device())
        return cls(model, eos_token_ids(tokenizer, resolve_model_path(cfg.model.path)), tokenizer.pad_token_id,
                   guard=guard, max_batch=cfg.rollout.eval_batch_size,
                   seed=sampling_seed(cfg.rollout.seed, dist.rank()),
                   tokenizer=tokenizer)

    def __init__(self, model: torch.nn.Module, eos_token_ids: Iterable[int], pad_token_id: int,
                 guard: Optional[PhaseGuard] = None, max_batch: int = 64, seed: int = 0, tokenizer=None):
        self.model = model.eval()
        self.tokenizer = tokenizer  # only for SamplingParams.stop
        self.model.requires_grad_(False)
        self.device = next(model.parameters()).device
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        self.pad = pad_token_id
        self.guard = guard
        self.max_batch = max_batch
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # under the names the handoff sends (identity for a plain model); tied weights appear once
        self.params = {external_name(n): p for n, p in model.named_parameters()}
        self.shapes = {n: (p.shape, p.dtype) for n, p in self.params.items()}
        self.weights_resident = True

    # ---------------------------------------------------------------- memory protocol
    def weight_bytes(self) -> int:
        return sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in self.shapes.values())

    def sleep(self, tags: Iterable[str] = ALL_TAGS) -> int:
        released = 0
        if WEIGHTS in tags and self.weights_resident:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            self.weights_resident = False
            released += self.weight_bytes()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        # KV cache: allocated per generate() call and freed at its end; nothing held between calls.
        return released

    def wake(self, tags: Iterable[str] = ALL_TAGS) -> int:
        acquired = 0
        if WEIGHTS in tags and not self.weights_resident:
            for name, p in self.params.items():
                shape, dtype = self.shapes[name]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
            self.weights_resident = True
            acquired += self.weight_bytes()
        return acquired

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not self.weights_resident:
            raise RuntimeError("load_weights on a sleeping engine: wake('weights') first")
        for name, tensor in named_tensors:
            try:
                dst = self.params[name]
            except KeyError:
                raise KeyError(f"handoff sent {name!r}, which the engine's model does not have") from None
            if dst.shape != tensor.shape:
                raise ValueError(f"handoff tensor {name!r} has shape {tuple(tensor.shape)}, engine expects {tuple(dst.shape)}")
            dst.data.copy_(tensor, non_blocking=True)

    def supports_adapters(self) -> bool:
        """The model holds LoRA adapters (built PEFT-wrapped): the handoff can send only them."""
        return any(is_adapter(n) for n in self.params)

    def load_adapter(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Every adapter tensor at once; they are copied into the adapter layers, never merged."""
        base = [n for n, _ in named_tensors if not is_adapter(n)]
        if base:
            raise ValueError(f"load_adapter got base weights {base[:3]}: send them with load_weights")
        self.load_weights(named_tensors)

    def finish_weight_update(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        self.sleep([WEIGHTS, KV_CACHE])

    def rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self.guard is not None:
            self.guard.require(Phase.GENERATION, "engine.generate")
        if not self.weights_resident:
            raise RuntimeError("generate on a sleeping engine: wake it and hand off weights first")
        n = params.n
        results: list[Optional[Completion]] = [None] * (len(prompts) * n)
        # Whole groups per chunk, longest prompts first (little padding inside a chunk). Each prompt is
        # prefilled once and its KV cache copied to its n rows: the group shares the prompt.
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        if n <= self.max_batch:
            per_chunk = self.max_batch // n
            for start in range(0, len(order), per_chunk):
                idx = order[start:start + per_chunk]
                outs = self._generate_batch([prompts[i] for i in idx], n, params)
                for k, i in enumerate(idx):
                    results[i * n:(i + 1) * n] = outs[k * n:(k + 1) * n]
        else:  # a group larger than a chunk: its copies in chunks of max_batch
            for i in order:
                for c0 in range(0, n, self.max_batch):
                    copies = min(self.max_batch, n - c0)
                    results[i * n + c0:i * n + c0 + copies] = self._generate_batch([prompts[i]], copies, params)
        return results  # type: ignore[return-value]

    def _generate_batch(self, unique: list[list[int]], copies: int, params: SamplingParams) -> list[Completion]:
        """`copies` completions of each prompt in `unique`, grouped by prompt."""
        from transformers import DynamicCache

        dev = self.device
        P = max(len(p) for p in unique)
        ids = torch.full((len(unique), P), self.pad, dtype=torch.long, device=dev)
        mask = torch.zeros((len(unique), P), dtype=torch.long, device=dev)
        for i, p in enumerate(unique):  # left padding: every row's next token lands at column P
            ids[i, P - len(p):] = torch.tensor(p, device=dev)
            mask[i, P - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        # Prefill each distinct prompt once; only the last position's logits are needed.
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        next_pos = positions[:, -1] + 1
        if copies > 1:
            rep = torch.arange(len(unique), device=dev).repeat_interleave(copies)
            cache.batch_select_indices(rep)
            logits, mask, next_pos = logits[rep], mask[rep], next_pos[rep]
        prompts = [p for p in unique for _ in range(copies)]
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        finish = ["length"] * B
        alive = torch.arange(B, device=dev)  # original row of each live row
        for step in range(params.max_new_tokens):
            tok, logp = self._sample(logits, params)
            for row, t, lp in zip(alive.tolist(), tok.tolist(), logp.tolist()):
                tokens[row].append(t)
                logps[row].append(lp)
            done = torch.isin(tok, self.eos)
            for row in alive[done].tolist():
                finish[row] = "stop"
            if params.stop:
                done = self._mark_stop_strings(done, alive, tokens, finish, params.stop)
            if step == params.max_new_tokens - 1:
                break
            keep = (~done).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if keep.numel() < alive.numel():  # drop finished rows: no compute spent on padding
                cache.batch_select_indices(keep)
                mask, tok, next_pos, alive = mask[keep], tok[keep], next_pos[keep], alive[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        return [Completion(list(p), t, lp, f) for p, t, lp, f in zip(prompts, tokens, logps, finish)]

    def _mark_stop_strings(self, done: torch.Tensor, alive: torch.Tensor, tokens: list[list[int]],
                           finish: list[str], stops: tuple[str, ...]) -> torch.Tensor:
        """Rows whose newest token completes a stop string are done ("stop_string"). Only a tail
        is decoded: a string of c characters lies within its last c + 1 tokens (a token decodes to
        at least one character), and an earlier occurrence would have stopped the row already."""
        if self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs the engine's tokenizer: HFEngine(..., tokenizer=...)")
        window = max(len(s) for s in stops) + 1
        done = done.clone()
        for j, row in enumerate(alive.tolist()):
            if done[j]:
                continue
            tail = self.tokenizer.decode(tokens[row][-window:])
            if any(s in tail for s in stops):
                done[j] = True
                finish[row] = "stop_string"
        return done

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if params.greedy:
            tok = logits.argmax(-1)
            return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
        logprobs = torch.log_softmax(logits / params.temperature if params.temperature != 1.0 else logits, -1)
        probs = logprobs.exp()
        if params.top_p < 1.0:
            sorted_p, sorted_i = probs.sort(-1, descending=True)
            cut = sorted_p.cumsum(-1) - sorted_p > params.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(cut, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, sorted_i, sorted_p)
        tok = self._draw(probs)
        return tok, logprobs.gather(-1, tok[:, None]).squeeze(-1)

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row from (possibly unnormalised) probabilities [B, V], by inverting the CDF:
        one uniform number per row. (torch.multinomial draws an exponential per vocabulary entry:
        ~15 % of CPU decode time with a 49k vocabulary.) The CDF is summed in float64 so that tail
        tokens keep their probability."""
        cdf = probs.double().cumsum(-1)
        u = torch.rand((cdf.shape[0], 1), generator=self.generator, dtype=torch.float64, device=cdf.device)
        tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
        return tok.clamp_(max=probs.shape[-1] - 1)
