"""The LM head's log-probs and entropy in chunks of positions (train/lm_head.py) equal the
textbook log-softmax of the whole logits: values and gradients, in float32 at a tight tolerance."""

import pytest
import torch

from colo_rl.algos import entropy_from_logits
from colo_rl.config import ModelConfig
from colo_rl.models import load_model, model_config
from colo_rl.train import batch as batch_module
from colo_rl.train.batch import build_batch, response_logprobs
from colo_rl.train import lm_head
from colo_rl.train.lm_head import fusable_head, head_logprobs
from colo_rl.train.packing import pack_groups

TINY = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")


@pytest.fixture(autouse=True)
def fuse_on_cpu(monkeypatch):
    """The chunked head runs off the CPU by default (slower here); these tests check it on the CPU."""
    monkeypatch.setattr(lm_head, "FUSE_ON_CPU", True)


def textbook(hidden, weight, at, targets, temperature):
    z = (hidden @ weight.t()) / temperature
    logp = torch.log_softmax(z, -1)[at, targets]
    return logp, entropy_from_logits(z)[at]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_matches_whole_logits_values_and_gradients(temperature, entropy_grad):
    """13 positions in chunks of 5 (the last one short), one position predicting several tokens
    (a packed group's prompt end), a loss on log-probs and, with entropy_grad, an entropy bonus;
    against float64 arithmetic."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(300, 16, generator=g).mul(0.5).requires_grad_()
    at = torch.tensor([[0, 3, 4, 5], [0, 7, 8, 12], [0, 1, 2, 2]])
    targets = torch.randint(0, 300, at.shape, generator=g)
    coef = torch.randn(at.shape, generator=g)

    def loss(logp, entropy):
        return (coef * logp).sum() + (0.3 * entropy.sum() if entropy_grad else 0.0)

    exact = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()]  # float64
    ref_logp, ref_ent = textbook(*[t.double() for t in exact], at, targets, temperature)
    ref_grads = torch.autograd.grad(loss(ref_logp, ref_ent), exact)
    logp, ent = head_logprobs(hidden, weight, at, targets, temperature, with_entropy=True,
                              entropy_grad=entropy_grad, chunk=5)
    grads = torch.autograd.grad(loss(logp, ent), [hidden, weight])
    torch.testing.assert_close(logp, ref_logp.float(), rtol=0, atol=2e-6)
    torch.testing.assert_close(ent, ref_ent.detach().float(), rtol=0, atol=2e-6)
    assert ent.requires_grad == entropy_grad
    for got, ref in zip(grads, ref_grads):  # gradients of magnitude ~5: float32's rounding, ~3e-6 relative
        torch.testing.assert_close(got, ref.float(), rtol=0, atol=3e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_chunked_head_equals_the_whole_logits_path_on_confident_tokens(temperature):
    """In bf16 (a GPU's default) the picked logit comes from the chunk's float32 logits, as logZ does,
    and the one-hot term joins the gradient in float32 before the cast: log-probs and gradients equal
    the whole-logits path's (HF's bf16 logits, upcast). A separate bf16 dot product h . W_y had given
    log-probs up to +0.06 and a confident token's gradient all rounding (relative error 1.0)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 64, generator=g).div(8)
    targets = torch.randint(0, 512, (24,), generator=g)
    w_y = weight[targets]
    hidden = (torch.randn(24, 64, generator=g) + 16 * w_y / w_y.pow(2).sum(-1, keepdim=True)).bfloat16()
    weight, at = weight.bfloat16(), torch.arange(24)
    coef = torch.randn(24, generator=g)
    h_chunk, w_chunk = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = head_logprobs(h_chunk, w_chunk, at, targets, temperature, chunk=7)
    (coef * logp).sum().backward()
    h_whole, w_whole = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    z = (h_whole @ w_whole.t()).float() / temperature
    whole = torch.log_softmax(z, -1)[at, targets]
    (coef * whole).sum().backward()
    assert whole.exp().min() > 0.99  # confident tokens, as most of an RL rollout's
    assert logp.max() <= 0
    # 3e-6: the paths round differently (torch 2.13's CPU bf16 matmul differs by 1.1e-6); the bug was 0.06
    torch.testing.assert_close(logp, whole.detach(), rtol=0, atol=3e-6)
    torch.testing.assert_close(h_chunk.grad.float(), h_whole.grad.float(), rtol=0.02, atol=1e-4)
    torch.testing.assert_close(w_chunk.grad.float(), w_whole.grad.float(), rtol=0.02, atol=1e-4)


def test_bf16_weight_gradient_holds_no_whole_vocabulary_temporary():
    """The bf16 weight gradient summed each chunk's whole [V, h] product (1x the weight's bytes) and
    its float32 copy (2x) into the float32 accumulator (2x): 5x the weight at the backward's peak, on
    a GPU the update's. Now a band of the vocabulary at a time: the accumulator and the final cast
    are the only allocations of the weight's size, and the gradient is the same."""
    from torch.profiler import ProfilerActivity, profile

    V, h, N = 4096, 512, 256
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, h, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, h, generator=g) * 0.05).bfloat16().requires_grad_()
    at, targets = torch.arange(N), torch.randint(0, V, (N,), generator=g)
    logp, _ = head_logprobs(hidden, weight, at, targets, chunk=64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp.sum().backward()
    unit = V * h * 2  # the bf16 weight's bytes
    big = sorted(e.self_cpu_memory_usage // unit for e in prof.events() if e.self_cpu_memory_usage >= unit // 2)
    assert big == [1, 2]  # the float32 accumulator and its cast to bf16; no per-chunk products
    z = (hidden.detach().float() @ weight.detach().float().t())
    p = torch.softmax(z, -1)
    grad = -p
    grad[at, targets] += 1
    torch.testing.assert_close(weight.grad.float(), grad.t() @ hidden.detach().float(), rtol=0.02, atol=2e-2)


def test_head_without_entropy_returns_none_and_the_same_logprobs():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(50, 8, generator=g)
    at, targets = torch.arange(6).view(2, 3), torch.randint(0, 50, (2, 3), generator=g)
    logp, ent = head_logprobs(hidden, weight, at, targets, chunk=4)
    assert ent is None
    torch.testing.assert_close(logp, textbook(hidden, weight, at, targets, 1.0)[0], rtol=0, atol=1e-6)


def unfused(monkeypatch):
    """response_logprobs through the whole logits (the path for heads that cannot be fused)."""
    monkeypatch.setattr(batch_module, "fusable_head", lambda model: None)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_model_logprobs_entropy_and_gradients_equal_the_whole_logits_path(layout, monkeypatch):
    model = load_model(TINY, torch.float32, seed=3)
    assert fusable_head(model) is model.lm_head
    prompts = [[5, 17, 99, 3, 250], [7, 8]]
    groups = [[[11, 12, 13], [21], [31, 32, 33, 34, 35]], [[50, 51, 52, 53], [57, 58]]]
    rows = build_batch([p for p, g in zip(prompts, groups) for _ in g], [r for g in groups for r in g], pad_id=0)
    if layout == "packed":
        parts, k = [], 0
        for prompt, responses in zip(prompts, groups):
            parts.append((prompt, responses, rows.select(list(range(k, k + len(responses))))))
            k += len(responses)
        mb = pack_groups(parts, torch.float32)
    else:
        mb = rows
    params = list(model.parameters())

    def run():
        logp, ent = response_logprobs(model, mb, temperature=0.8, with_entropy=True, entropy_grad=True)
        return logp, ent, torch.autograd.grad((logp * mb.response_mask).sum() - 0.1 * ent.sum(), params)

    fused = run()
    unfused(monkeypatch)
    whole = run()
    torch.testing.assert_close(fused[0], whole[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused[1], whole[1], rtol=0, atol=1e-5)
    if layout == "packed":  # padding: exactly 0
        assert (fused[0][mb.logit_index < 0] == 0).all() and (fused[1][mb.logit_index < 0] == 0).all()
    for got, ref in zip(fused[2], whole[2]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_heads_with_changed_logits_are_not_fused():
    """Soft-capped (Gemma 2) or scaled logits are not the head's output: those models keep the whole-logits path."""
    model = load_model(TINY, torch.float32, seed=3)
    model.config.final_logit_softcapping = 30.0
    assert fusable_head(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
    assert fusable_head(model) is None
    assert model_config(TINY).tie_word_embeddings  # the tied head: the fused path also trains the embedding


def test_the_cpu_keeps_the_whole_logits_path_by_default(monkeypatch):
    monkeypatch.setattr(lm_head, "FUSE_ON_CPU", False)
    assert fusable_head(load_model(TINY, torch.float32, seed=3)) is None


def test_the_head_is_a_plain_linear_again_after_the_forward_even_when_it_fails():
    model = load_model(TINY, torch.float32, seed=3)
    mb = build_batch([[5, 6, 7]], [[8, 9]], pad_id=0)
    response_logprobs(model, mb, with_entropy=True)
    assert "forward" not in model.lm_head.__dict__
    assert model(input_ids=mb.input_ids).logits.shape[-1] == model.config.vocab_size
    with pytest.raises(IndexError):  # a target outside the vocabulary fails inside the head
        response_logprobs(model, build_batch([[5, 6, 7]], [[8, 10 ** 6]], pad_id=0))
    assert "forward" not in model.lm_head.__dict__


def test_the_environment_switch_forces_the_chunked_head_on_or_off(monkeypatch):
    """$COLO_RL_CHUNKED_LM_HEAD: the A/B switch for a GPU run; unset, the device decides."""
    monkeypatch.setattr(lm_head, "FUSE_ON_CPU", False)
    monkeypatch.delenv(lm_head.CHUNKED_HEAD_ENV, raising=False)
    assert (lm_head.chunked_head_wanted("cpu"), lm_head.chunked_head_wanted("cuda")) == (False, True)
    monkeypatch.setenv(lm_head.CHUNKED_HEAD_ENV, "1")
    assert lm_head.chunked_head_wanted("cpu") and lm_head.chunked_head_wanted("cuda")
    monkeypatch.setenv(lm_head.CHUNKED_HEAD_ENV, "0")
    assert not lm_head.chunked_head_wanted("cpu") and not lm_head.chunked_head_wanted("cuda")
    monkeypatch.setenv(lm_head.CHUNKED_HEAD_ENV, "yes")
    with pytest.raises(ValueError, match="COLO_RL_CHUNKED_LM_HEAD='yes'"):
        lm_head.chunked_head_wanted("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_weight_gradient_peak_memory_on_gpu():
    """On a GPU the head's backward held the float32 accumulator (2 units of the bf16 weight's bytes)
    plus a chunk's whole [V, h] product and its float32 copy (3 units): 5. In vocabulary bands the
    peak is the accumulator and its final cast, 3 units (and a chunk's working set, small here);
    the gradient equals the whole-logits path's."""
    V, h, N = 32768, 4096, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, h, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, h, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    at = torch.arange(N, device="cuda")
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    logp, _ = head_logprobs(hidden, weight, at, targets, chunk=128)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp.sum().backward()
    torch.cuda.synchronize()
    unit = V * h * 2
    peak = (torch.cuda.max_memory_allocated() - base) / unit
    assert peak < 3.6, peak
    chunked = weight.grad.float()
    weight.grad = None
    z = (hidden @ weight.t()).float()
    torch.log_softmax(z, -1)[at, targets].sum().backward()
    rel = (chunked - weight.grad.float()).norm() / weight.grad.float().norm()
    assert rel < 0.01, rel
