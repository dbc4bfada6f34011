"""The update's activation memory, estimated from the model's shape: one estimate for the token
budget of `trainer.micro_batch_tokens=auto` (sized in the update phase from the memory free then)
and for the paging plan (colo_rl/colocate/paging_plan.py, decided at start-up).

Per token of a micro-batch, for a Llama-style decoder (h hidden, f MLP, kv = key/value width),
kept for the backward, in the model's dtype:

    per layer   8h + 4kv + 4f   the two norms' inputs and outputs (4h), q, k, v and the rotated
                                q, k (2h + 4kv), the attention output and o_proj's input (2h), the
                                MLP's gate, up, act(gate) and their product (4f)
    checkpointed                 each layer's input (h), plus one layer recomputed in full

and the LM head. With the whole logits (`response_logprobs`' fallback): the logits in the model's
dtype, their float32 log-softmax and its gradient, V x (dtype + 8) bytes per token. With the
chunked head (`lm_head.fused_head_logprobs`, a GPU's default): the head's input row (h) and two
float32 numbers per token, plus one chunk's working set, independent of the micro-batch's size:

    3 x min(tokens, chunk positions) x V x 4 bytes   (the chunk's logits, their softmax, its gradient)
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from colo_rl import dist
from colo_rl.train.lm_head import chunk_positions

# trainer.micro_batch_tokens=auto on CPU: one group of the demo (~250 tokens) per micro-batch, the
# split the README's CPU figures were measured with (docs/micro_batches.md).
CPU_MICRO_BATCH_TOKENS = 256
AUTO_MIN_TOKENS, AUTO_MAX_TOKENS = 1024, 65536
HEAD_CHUNK_COPIES = 3  # a chunk's float32 logits, their softmax and the gradient G, at once in the backward


def _fields(config) -> Mapping:
    """config.json's fields from a dict or an HF config object."""
    return config if isinstance(config, Mapping) else config.to_dict()


def activation_terms(config, dtype_bytes: int, gradient_checkpointing: bool = False,
                     chunked_head: bool = False) -> tuple[int, int, int]:
    """(bytes per token, the head chunk's bytes per position, the chunk's positions): the estimate is
    tokens x per token + min(tokens, positions) x per position (see the module's docstring)."""
    c = _fields(config)
    h = int(c.get("hidden_size") or 0)
    layers = int(c.get("num_hidden_layers") or 0)
    f = int(c.get("intermediate_size") or 4 * h)
    heads = int(c.get("num_attention_heads") or 1)
    kv = int(c.get("num_key_value_heads") or heads) * int(c.get("head_dim") or h // max(1, heads))
    vocab = int(c.get("vocab_size") or 0)
    per_layer = (8 * h + 4 * kv + 4 * f) * dtype_bytes
    kept = (layers * h * dtype_bytes + per_layer) if gradient_checkpointing else layers * per_layer
    if not chunked_head or not vocab:
        return kept + vocab * (dtype_bytes + 8), 0, 0
    return kept + h * dtype_bytes + 8, HEAD_CHUNK_COPIES * 4 * vocab, chunk_positions(torch.device("cuda"), vocab, h)


def activation_bytes(config, tokens: int, dtype_bytes: int, gradient_checkpointing: bool = False,
                     chunked_head: bool = False) -> int:
    """Peak activations of one micro-batch of `tokens` tokens (an estimate; module docstring)."""
    per_token, per_position, positions = activation_terms(config, dtype_bytes, gradient_checkpointing, chunked_head)
    return int(tokens * per_token + min(tokens, positions) * per_position)


def micro_batch_token_budget(setting, model_config, dtype: torch.dtype, free_bytes: Optional[int],
                             share: float = 0.5, gradient_checkpointing: bool = False,
                             chunked_head: bool = False) -> int:
    """trainer.micro_batch_tokens as a number of tokens. An integer is taken as it is. `auto`: on a
    GPU (`free_bytes`: the device memory free in the update phase) the most tokens whose
    `activation_bytes` fit in `share` of it, within [AUTO_MIN_TOKENS, AUTO_MAX_TOKENS] (the rest is
    room for the allocator, the attention masks and what the estimate leaves out); on CPU
    (`free_bytes` None) CPU_MICRO_BATCH_TOKENS.

        budget = clamp(max t: activation_bytes(t) <= share * free_bytes, 1024, 65536)"""
    if str(setting) != "auto":
        return int(setting)
    if free_bytes is None:
        return CPU_MICRO_BATCH_TOKENS
    room = share * free_bytes
    per_token, per_position, positions = activation_terms(model_config, torch.finfo(dtype).bits // 8,
                                                          gradient_checkpointing, chunked_head)
    fit = int(room / (per_token + per_position))  # every token inside the head's chunk
    if fit > positions:  # the chunk is full: its working set is a fixed cost
        fit = int((room - positions * per_position) / per_token)
    return max(AUTO_MIN_TOKENS, min(AUTO_MAX_TOKENS, fit))


def agreed_token_budget(setting, model_config, dtype: torch.dtype, device: torch.device,
                        **estimate) -> tuple[int, Optional[int]]:
    """`micro_batch_token_budget` sized from the memory free on `device` now (None off a GPU), the
    smallest over ranks (a collective: every rank calls it); and the free bytes it was sized from.
    `estimate`: `activation_terms`' gradient_checkpointing / chunked_head."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    own = micro_batch_token_budget(setting, model_config, dtype, free, **estimate)
    return int(-dist.all_reduce_max([-float(own)])[0]), free

