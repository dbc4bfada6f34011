"""Log-probs and entropy straight from the last hidden states: the vocabulary projection, the
log-softmax and the entropy in chunks of positions, so the [positions, vocab] logits never exist
whole and each chunk is reduced while it is in cache.

The trainer needs, per response token t predicted at position u(t), only

    logp_t = z[u(t), y_t] - logZ_u,   H_u = logZ_u - sum_v softmax(z_u)_v z_uv,
    z_u = W h_u / T,  logZ_u = logsumexp_v z_uv,

so the LM head's output per position is two numbers, not a vocabulary-wide row.
`ChunkedHeadLogprobs` computes logZ, H and each token's z[u, y] chunk by chunk, all from the same
float32 logits, as the whole-logits path does.
Peers do the same: verl's fused linear-for-ppo, OpenRLHF / slime's chunked log-prob + entropy,
Liger's fused linear cross-entropy.

`fused_head_logprobs` runs an HF causal LM so: its `lm_head` module is called as always (ZeRO-3's
hooks gather its weight around that call and again for its backward) but computes the above instead
of logits for the duration of one forward.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from colo_rl.algos import entropy_from_logits

# Positions per chunk. CPU: 64 positions of a 49k vocabulary are 12 MiB of float32, resident in the
# last-level cache while the chunk is reduced; but every chunk reads the head's weight [V, h] again
# (three products) and adds to its gradient, so a chunk covers at least h positions (its logits at
# least as large as the weight). Elsewhere ~1 GiB of float32 per chunk: few launches, bounded memory
# (an 8k-token micro-batch of a 152k vocabulary would otherwise hold 5 GiB of logits).
CPU_CHUNK_POSITIONS = 64
DEVICE_CHUNK_BYTES = 1 << 30


WEIGHT_GRAD_BANDS = 8  # a bf16 weight gradient's chunk products, in this many bands of the vocabulary


def chunk_positions(device: torch.device, vocab: int, hidden_size: int) -> int:
    if device.type == "cpu":
        return max(CPU_CHUNK_POSITIONS, hidden_size)
    return max(64, DEVICE_CHUNK_BYTES // (4 * vocab))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = (h W^T) / T in float32; the product in the model's dtype, as the LM head computes it."""
    z = (hidden @ weight.t()).float()
    return z / temperature if temperature != 1.0 else z


def _in_chunk(at: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's row in the chunk [start, start + rows) (clamped into it) and whether it is there:
    a gather and a where, no boolean indexing (which would wait for the device)."""
    return (at - start).clamp_(0, rows - 1), (at >= start) & (at < start + rows)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden [N, h], weight [V, h], at [M], targets [M]) -> logp [M] and H [N] (zeros without
    `with_entropy`), float32: logp_t = z[u(t), y_t] - logZ_u(t), the picked logit taken from the same
    float32 chunk of z as logZ. (A separate bf16 dot product h . W_y rounds differently from the
    chunk's product: logp came out above 0, and a confident token's gradient g (1 - p_y) W_y became
    the difference of two bf16 numbers that cancel.)

    Backward, per chunk, with p = softmax(z), E[z] = sum_v p_v z_v and g_u = the sum of the g_t of
    the tokens predicted at u (recomputed from h and W: the chunk's z is not kept):

        dlogp_t / dz_uv = [v = y_t] - p_uv,     dH_u / dz_uv = -p_uv (z_uv - E[z_u])
        G_uv = (sum_{t: u(t)=u, y_t=v} g_t - g_u p_uv - g_H_u p_uv (z_uv - E[z_u])) / T
        dL/dh = G W,   dL/dW = G^T h

    G is formed in float32 and cast to the weight's dtype once (the whole-logits path's order).
    H gets a gradient only with `entropy_grad` (an entropy bonus); else it is a constant."""

    @staticmethod
    def forward(ctx, hidden, weight, at, targets, temperature: float, with_entropy: bool, entropy_grad: bool,
                chunk: int):
        n = hidden.shape[0]
        logz = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(at.shape, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):  # (no autograd graph inside a Function's forward)
            z = _chunk_logits(hidden[s:s + chunk], weight, temperature)
            logz[s:s + chunk] = torch.logsumexp(z, dim=-1)
            if with_entropy:
                entropy[s:s + chunk] = entropy_from_logits(z, logz[s:s + chunk])
            row, inside = _in_chunk(at, s, z.shape[0])
            picked = torch.where(inside, z[row, targets], picked)
        ctx.save_for_backward(hidden, weight, at, targets, logz, entropy)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return picked - logz[at], entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, at, targets, logz, entropy = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        use_entropy = ctx.entropy_grad and g_entropy is not None
        g_logp = torch.zeros_like(logz[at]) if g_logp is None else g_logp.float()
        g_pos = torch.zeros_like(logz).index_add_(0, at, g_logp)  # g_u: a prompt's end predicts several tokens
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            z = _chunk_logits(h, weight, T)
            p = (z - logz[s:s + chunk, None]).exp_()
            if use_entropy:  # E[z] = logZ - H
                centred = z.sub_((logz[s:s + chunk] - entropy[s:s + chunk])[:, None])
                grad = p.mul_(-(g_pos[s:s + chunk, None] + g_entropy[s:s + chunk, None] * centred))
            else:
                grad = p.mul_(-g_pos[s:s + chunk, None])
            row, inside = _in_chunk(at, s, z.shape[0])
            grad.index_put_((row, targets), torch.where(inside, g_logp, 0.0), accumulate=True)  # the one-hot term
            if T != 1.0:
                grad = grad.div_(T)
            grad = grad.to(weight.dtype)
            if g_hidden is not None:
                g_hidden[s:s + chunk] = grad @ weight
            if g_weight is None:
                continue
            if grad.dtype == torch.float32:
                g_weight.addmm_(grad.t(), h)  # accumulated inside the product: no [V, h] temporary
            else:  # bf16 / fp16 products, summed over chunks in float32, a band of the vocabulary at a
                # time: the whole [V, h] product and its float32 copy were 3x the weight's bytes on
                # top of g_weight (2x) at the head's backward, the step's memory peak
                band = -(-weight.shape[0] // WEIGHT_GRAD_BANDS)
                for v in range(0, weight.shape[0], band):
                    g_weight[v:v + band] += (grad[:, v:v + band].t() @ h).float()
        g_weight = None if g_weight is None else g_weight.to(weight.dtype)
        return g_hidden, g_weight, None, None, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, at: torch.Tensor, targets: torch.Tensor,
                  temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                  chunk: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(W h / T)[targets] per token and the entropy of each token's distribution, float32.

    hidden [N, h]: the positions' last hidden states; weight [V, h]: the LM head (no bias); at [...]:
    the position (row of `hidden`) predicting each token; targets [...]: the token ids. Returns
    (logp, entropy) shaped like `at` (entropy None without `with_entropy`)."""
    chunk = chunk or chunk_positions(hidden.device, weight.shape[0], weight.shape[1])
    logp, entropy = ChunkedHeadLogprobs.apply(hidden, weight, at.reshape(-1), targets.reshape(-1), temperature,
                                              with_entropy, entropy_grad, chunk)
    return logp.view(at.shape), entropy[at] if with_entropy else None


# On the CPU the whole-logits path is faster (2 cores, 2026-11-26: LM head + log-softmax + entropy,
# forward and backward, 512 positions x 49k vocabulary, h=64: 0.17 s whole vs 0.21 s in 64-position
# chunks; 4096 positions: 1.27 vs 1.65 s; h=576, 320 positions: 0.41 vs 0.45 s): the recomputed head
# product costs more than the memory traffic it saves there. So the chunked head runs off the CPU
# (where the [tokens, V] logits' memory is what limits a micro-batch); tests switch it on here.
FUSE_ON_CPU = False
# $COLO_RL_CHUNKED_LM_HEAD: 1 / 0 forces the chunked head on / off on every device (an A/B switch for
# a GPU run: its speed on a GPU is not measured yet); unset, it follows the device (off on the CPU).
CHUNKED_HEAD_ENV = "COLO_RL_CHUNKED_LM_HEAD"


def chunked_head_wanted(device_type: str) -> bool:
    """Whether the chunked head runs on `device_type`: $COLO_RL_CHUNKED_LM_HEAD, else not on the CPU
    (unless FUSE_ON_CPU) and on any other device."""
    forced = os.environ.get(CHUNKED_HEAD_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{CHUNKED_HEAD_ENV}={forced!r}: use 1 (chunked LM head), 0 (whole logits) or leave it unset")
    if forced:
        return forced == "1"
    return device_type != "cpu" or FUSE_ON_CPU


def fusable_head(model) -> Optional[torch.nn.Linear]:
    """The model's LM head when its output is the forward's logits unchanged (a bias-free Linear, no
    logit soft-capping or scaling after it) and the device wants it (`chunked_head_wanted`): then
    `fused_head_logprobs` may replace its logits."""
    core = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    head = getattr(core, "lm_head", None)
    config = getattr(core, "config", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or config is None:
        return None
    if not chunked_head_wanted(head.weight.device.type):
        return None
    if any(getattr(config, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                 "logits_scaling", "output_multiplier_scale")):
        return None
    return head


@contextlib.contextmanager
def _head_computes(head: torch.nn.Linear, fn):
    """`head`'s forward replaced by `fn(head, hidden)` for the duration (its hooks stay: ZeRO-3 still
    gathers the weight around the call and for its backward)."""
    own = head.__dict__.get("forward")  # an instance-level forward someone installed (hooks), kept
    head.forward = lambda hidden: fn(head, hidden)
    try:
        yield
    finally:
        if own is not None:
            head.forward = own
        else:
            del head.forward  # back to the class's forward


def fused_head_logprobs(model, head: torch.nn.Linear, inputs: dict, at: torch.Tensor, targets: torch.Tensor,
                        temperature: float, with_entropy: bool, entropy_grad: bool
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`model(**inputs)` with its LM head computing `head_logprobs` on the kept positions (flattened
    in order, [B * U]) instead of logits. Returns (logp, entropy) shaped like `at`."""
    produced = {}

    def compute(mod, hidden):
        logp, entropy = head_logprobs(hidden.reshape(-1, hidden.shape[-1]), mod.weight, at, targets, temperature,
                                      with_entropy, entropy_grad)
        out = torch.stack([logp, entropy if entropy is not None else torch.zeros_like(logp)], dim=-1)
        produced["out"] = out
        return out

    with _head_computes(head, compute):
        out = model(**inputs).logits
    made = produced.get("out")
    if made is None or out.shape != made.shape or out.data_ptr() != made.data_ptr():
        raise RuntimeError(f"{type(getattr(model, 'module', model)).__name__} changes its LM head's output before "
                           "returning it as logits; colo_rl's fused log-probs cannot be used with this model "
                           "(report it: fusable_head should have refused it)")
    return out[..., 0], (out[..., 1] if with_entropy else None)
