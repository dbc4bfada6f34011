"""The reward model (`reward.model.path`): an HF *ForSequenceClassification model with one label,
frozen under DeepSpeed ZeRO-3 like the reference model, scoring prompt + completion in the update
phase. On GPU its parameter partitions are paged to host memory for the generation phase (the
memory manager does it, through colo_rl/train/host_paging.py's FrozenModelPaging, and records it in
the ledger), so it costs the engine no memory.

What it scores: the conversation as the reward model's own chat template writes it (the prompt's
messages, then the completion as the assistant's turn) when its tokenizer has one and
data.use_chat_template is on; otherwise the prompt text exactly as the policy saw it followed by the
completion. The score is the head's output at the last token of that text.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from colo_rl import dist
from colo_rl.errors import ConfigError
from colo_rl.models import load_tokenizer, resolve_model_path
from colo_rl.phase import Phase, PhaseGuard
from colo_rl.train.activation_memory import agreed_token_budget
from colo_rl.train.ds_config import build_ds_config

log = logging.getLogger("colo_rl")


def check_reward_model_config(path: str, config) -> None:
    """A scalar sequence-classification model, or a ConfigError saying what the directory holds."""
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"reward.model.path={path!r} holds {archs or 'no architectures'}, not a "
                          f"*ForSequenceClassification model: save a reward model with "
                          f"AutoModelForSequenceClassification (num_labels=1)")
    if config.num_labels != 1:
        raise ConfigError(f"reward.model.path={path!r} has num_labels={config.num_labels}: a reward model gives one "
                          f"score per sequence (num_labels=1)")


class RewardModel:
    """Frozen ZeRO-3 sequence-classification model; `score` runs in the update phase."""

    def __init__(self, cfg, dtype: torch.dtype, guard: Optional[PhaseGuard] = None):
        import deepspeed
        from transformers import AutoConfig, AutoModelForSequenceClassification

        path = resolve_model_path(cfg.reward.model.path)
        check_reward_model_config(cfg.reward.model.path, AutoConfig.from_pretrained(path))
        self.tokenizer = load_tokenizer(str(path))
        self.guard = guard
        # rows per forward: trainer.micro_batch_size where set, else as many as the trainer's token
        # budget holds at the step's longest text (`rows_per_forward`)
        self.micro_batch_size, self.tokens_setting, self.dtype = cfg.trainer.micro_batch_size, \
            cfg.trainer.micro_batch_tokens, dtype
        self._token_budget: Optional[int] = None
        self.use_chat_template = cfg.data.use_chat_template and bool(getattr(self.tokenizer, "chat_template", None))
        model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.model.attn_implementation)
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ConfigError(f"reward.model.path={cfg.reward.model.path!r}: {type(model).__name__} has no `score` "
                              f"head; colo_rl scores decoder models' *ForSequenceClassification (Llama, Qwen2, "
                              f"Mistral, Gemma, ...)")
        if model.config.pad_token_id is None:  # HF's own pooling refuses batches without one (we pool ourselves)
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_len = getattr(model.config, "max_position_embeddings", None)
        model.requires_grad_(False)
        self._head_out: list[torch.Tensor] = []
        head.register_forward_hook(lambda _m, _i, out: self._head_out.append(out))
        # mpu: a split run's trainer pool is DeepSpeed's whole world (None: the job's), as the actor's
        self.engine, *_ = deepspeed.initialize(model=model, config=build_ds_config(cfg.trainer, dtype, False),
                                               mpu=dist.deepspeed_mpu())
        self.engine.eval()
        self.module = self.engine.module

    # ------------------------------------------------------------------ scoring
    def texts(self, messages: list[list[dict]], prompt_texts: list[str], completions: list[str]) -> list[str]:
        """What the reward model reads for each sample (see the module docstring)."""
        if self.use_chat_template:
            return [self.tokenizer.apply_chat_template(m + [{"role": "assistant", "content": c}], tokenize=False)
                    for m, c in zip(messages, completions)]
        return [p + c for p, c in zip(prompt_texts, completions)]

    @torch.no_grad()
    def score(self, texts: list[str]) -> torch.Tensor:
        """One float32 score per text (CPU). Every rank calls it with as many texts (ZeRO-3's
        gathers are collectives: the micro-batch counts must match)."""
        if self.guard is not None:
            self.guard.require(Phase.UPDATE, "reward model forward")
        ids = [self.tokenizer(t, add_special_tokens=not self.use_chat_template)["input_ids"] for t in texts]
        if self.max_len:
            ids = [x[-self.max_len:] for x in ids]  # keep the end: the completion is what is judged
        out = torch.zeros(len(ids), dtype=torch.float32)
        pad = self.tokenizer.pad_token_id
        per_forward = self.rows_per_forward(ids)
        for start in range(0, len(ids), per_forward):
            rows = ids[start:start + per_forward]
            width = max(len(r) for r in rows)
            input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.engine.device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.engine.device)
            self._head_out.clear()
            self.engine(input_ids=input_ids, attention_mask=mask, use_cache=False)
            logits = self._head_out[-1]  # [b, T, 1]: the head at every position
            last = mask.sum(-1) - 1
            out[start:start + len(rows)] = logits[torch.arange(len(rows), device=logits.device), last, 0].float().cpu()
        return out

    def rows_per_forward(self, ids: list[list[int]]) -> int:
        """trainer.micro_batch_size, or (0: no cap) the trainer's token budget (trainer.micro_batch_tokens;
        auto: sized once from the memory free, as the actor's) over the longest text of any rank: the
        same on every rank, so the forwards' ZeRO-3 gathers line up. A no-grad forward needs less
        than the training pass the budget is sized for."""
        if self.micro_batch_size:
            return self.micro_batch_size
        if self._token_budget is None:
            self._token_budget, _ = agreed_token_budget(self.tokens_setting, self.module.config, self.dtype,
                                                        self.engine.device)
        (longest,) = dist.all_reduce_max([float(max((len(x) for x in ids), default=1))])
        return max(1, self._token_budget // int(longest))
