"""Token batches: the padded layout and GRPO group packing give the same log-probs and gradients."""

import pytest
import torch

from colo_rl.algos import entropy_from_logits, logprobs_from_logits
from colo_rl.config import ModelConfig
from colo_rl.models import load_model
from colo_rl.train.batch import build_batch, micro_batches, response_logprobs
from colo_rl.train.packing import pack_groups

TINY = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")


def padded_logprobs(model, batch):
    """The reference: the textbook padded forward pass and log-softmax."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   logits_to_keep=batch.response_len + 1).logits[:, :-1]
    return logprobs_from_logits(logits, batch.response_ids)


def packed(prompts, groups):
    """Each (prompt, responses) group through the padded layout, then packed into one micro-batch."""
    parts = []
    for prompt, responses in zip(prompts, groups):
        rows = build_batch([prompt] * len(responses), responses, pad_id=0)
        parts.append((prompt, responses, rows.select(list(range(len(responses))))))
    return pack_groups(parts, torch.float32)


def test_build_batch_layout():
    b = build_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0, per_token={"x": [[0.5, 0.5], [1, 2, 3]]},
                    per_row={"adv": [1.0, -1.0]})
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 6, 0], [0, 0, 4, 7, 8, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids[1].tolist()[2:] == [0, 1, 2, 3]
    assert b.response_ids.tolist() == [[5, 6, 0], [7, 8, 9]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    sub = b.select([0])
    assert sub.input_ids.tolist() == [[1, 2, 3, 5, 6]] and sub.extras["x"].tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("kwargs,message", [
    # an engine's log-probs one short: the last token's rollout log-prob would silently be 0
    ({"per_token": {"rollout_logp": [[-0.1, -0.2], [-0.3, -0.4]]}},
     r"rollout_logp is not aligned with the response tokens \(sequence 1: 2 values for 3 response tokens\)"),
    ({"response_masks": [[1, 1], [1, 0]]}, r"response_masks .*sequence 1: 2 values for 3"),
    ({"response_masks": [[1, 1]]}, r"response_masks .*1 rows for 2 sequences"),
])
def test_build_batch_refuses_per_token_values_not_aligned_with_the_responses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0, **kwargs)


def test_group_packing_matches_padded_logprobs_entropy_and_gradients():
    """Three groups of different prompt and response lengths in one packed micro-batch give the
    padded layout's log-probs, entropies and gradients; padding stays 0."""
    torch.manual_seed(0)
    model = load_model(TINY, torch.float32, seed=3)
    prompts = [[5, 17, 99, 3, 250], [7, 8], [60, 61, 62]]
    groups = [[[11, 12, 13], [21], [31, 32, 33, 34, 35], [41, 42]],
              [[50, 51, 52, 53, 54, 55, 56], [57, 58]],
              [[70], [71], [72, 73]]]
    batch = build_batch([p for p, g in zip(prompts, groups) for _ in g], [r for g in groups for r in g], pad_id=0)
    mb = packed(prompts, groups)
    assert mb.input_ids.shape == (3, 5 + 11)  # one row per group, each prompt once
    assert mb.response_ids.shape == batch.response_ids.shape

    ref = padded_logprobs(model, batch)
    ref_grad = torch.autograd.grad((ref * batch.response_mask).sum(), list(model.parameters()))
    got, entropy = response_logprobs(model, mb, with_entropy=True)
    got_grad = torch.autograd.grad((got * mb.response_mask).sum(), list(model.parameters()))
    m = batch.response_mask.bool()
    assert torch.equal(mb.response_mask, batch.response_mask)
    assert got.shape == ref.shape and bool((got[~m] == 0).all())
    assert torch.allclose(got[m], ref[m], atol=1e-5), (got[m] - ref[m]).abs().max()
    for a, b in zip(got_grad, ref_grad):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       logits_to_keep=batch.response_len + 1).logits[:, :-1]
        assert torch.allclose(entropy[m], entropy_from_logits(logits)[m], atol=1e-5)


def test_padded_layout_through_the_shared_forward():
    model = load_model(TINY, torch.float32, seed=3)
    batch = build_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    got, _ = response_logprobs(model, batch, temperature=0.7)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   logits_to_keep=batch.response_len + 1).logits[:, :-1]
    assert torch.allclose(got, logprobs_from_logits(logits, batch.response_ids, 0.7), atol=1e-6)


def test_micro_batches_fill_whole_units_up_to_the_token_budget_shortest_first():
    costs = [5, 1, 4, 2, 3]
    assert micro_batches(costs, budget=0, max_units=2) == [[1, 3], [4, 2], [0]]  # a unit cap alone
    assert micro_batches(costs, budget=6, max_units=0) == [[1, 3, 4], [2], [0]]  # 1+2+3 <= 6; 4 then 5 alone
    assert micro_batches([9, 2], budget=4) == [[1], [0]]  # a unit over the budget gets one of its own
    # the order may differ from the cost (GRPO: groups ordered by trained tokens, filled by row length)
    assert micro_batches([3, 3, 3, 3], budget=6, order=[4, 3, 2, 1]) == [[3, 2], [1, 0]]
    # one GRPO group per micro-batch when two never fit (the CPU demo), in ascending order
    assert micro_batches([260, 300, 250, 280], budget=256) == [[2], [0], [3], [1]]


def test_packing_isolates_responses():
    """Changing one response must not change another's log-probs (no cross-attention), within a
    group and across the groups of one micro-batch."""
    model = load_model(TINY, torch.float32, seed=3)
    prompts = [[5, 17, 99], [8, 9]]
    a = [[[11, 12, 13], [21, 22]], [[30, 31]]]
    b = [[[11, 12, 13], [77, 78]], [[30, 31]]]
    lp_a, _ = response_logprobs(model, packed(prompts, a))
    lp_b, _ = response_logprobs(model, packed(prompts, b))
    assert torch.allclose(lp_a[0], lp_b[0], atol=1e-6)
    assert torch.allclose(lp_a[2], lp_b[2], atol=1e-6)
    assert not torch.allclose(lp_a[1], lp_b[1])


def _flex_groups():
    """Two groups of four, prompt and response lengths drawn, for the FlexAttention checks."""
    g = torch.Generator().manual_seed(0)
    prompts, groups = [], []
    for _ in range(2):
        prompts.append(torch.randint(5, 400, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist())
        groups.append([torch.randint(5, 400, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
                       for _ in range(4)])
    return prompts, groups


def test_group_attention_block_mask_allows_what_the_dense_mask_allows():
    """The FlexAttention rule, evaluated at every (q, k), is the dense mask's 0 / -inf pattern."""
    from torch.nn.attention.flex_attention import create_mask

    from colo_rl.train.packing import group_attention

    mb = packed(*_flex_groups())
    dense = group_attention(mb.segments, mb.prompt_end, torch.float32) == 0
    block = group_attention(mb.segments, mb.prompt_end, torch.float32, flex=True)
    B, L = mb.segments.shape
    assert torch.equal(create_mask(block.mask_mod, B, 1, L, L, device="cpu"), dense)


def test_group_block_mask_is_torchs_block_mask_built_a_band_at_a_time(monkeypatch):
    """The BlockMask is torch's `create_block_mask`'s, field for field (partial and full blocks, both
    orders), for rows of any length (padded to the 128-block), padding segments and band sizes; but
    no allocation the size of the [L, L] rule (create_block_mask's eager path evaluates every pair
    at once: 0.8 GiB for one 8k-token row)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.profiler import ProfilerActivity, profile

    from colo_rl.train import packing

    g = torch.Generator().manual_seed(1)
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
              "full_q_num_blocks", "full_q_indices")
    for _ in range(12):
        B, L = int(torch.randint(1, 3, (1,), generator=g)), int(torch.randint(2, 700, (1,), generator=g))
        prompt_end = int(torch.randint(1, max(2, L // 3), (1,), generator=g))
        seg = torch.zeros(B, L, dtype=torch.long)
        for b in range(B):
            pos, i = prompt_end, 1
            while pos < L:
                n = int(torch.randint(1, 200, (1,), generator=g))
                seg[b, pos:pos + n], pos, i = i, pos + n, i + 1
            pad = int(torch.randint(0, 50, (1,), generator=g))
            if pad:
                seg[b, L - pad:] = -torch.arange(1, pad + 1)
        monkeypatch.setattr(packing, "BAND_ELEMENTS", int(torch.randint(1, 1 << 20, (1,), generator=g)))
        got = packing.group_attention(seg, prompt_end, torch.float32, flex=True)
        want = create_block_mask(got.mask_mod, B, None, L, L, device="cpu")
        assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
        for name in fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), name

    monkeypatch.setattr(packing, "BAND_ELEMENTS", 1 << 22)
    L = 4096
    seg = torch.zeros(1, L, dtype=torch.long)
    seg[0, 256:] = torch.arange(L - 256) // 480 + 1
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        packing.group_attention(seg, 256, torch.float32, flex=True)
    assert max(e.self_cpu_memory_usage for e in prof.events()) < L * L // 2  # the rule's bool pairs: L^2 bytes


@pytest.mark.slow  # torch.compile of FlexAttention: ~10 s
def test_flex_attention_logprobs_equal_the_dense_masks():
    """model.attn_implementation=flex_attention: the packed rows' log-probs equal SDPA's with the dense
    mask (forward only: FlexAttention has no backward on the CPU; the gradients: test below, GPU)."""
    sdpa = load_model(TINY, torch.float32, seed=3)
    flex = load_model(ModelConfig(**{**TINY.__dict__, "attn_implementation": "flex_attention"}), torch.float32, seed=3)
    mb = packed(*_flex_groups())
    with torch.no_grad():
        ref, _ = response_logprobs(sdpa, mb)
        got, _ = response_logprobs(flex, mb)
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


def _other_lengths(groups, extra):
    """`groups` with `extra` tokens added to (or, negative, taken from) every response."""
    return [[r + [7] * extra if extra >= 0 else r[:max(1, len(r) + extra)] for r in g] for g in groups]


def _compiled_flex_model(backend: str, device: str = "cpu"):
    from colo_rl.train.compiled_layers import compile_decoder_layers

    cfg = {**TINY.__dict__, "attn_implementation": "flex_attention"}
    flex = load_model(ModelConfig(**cfg), torch.float32, seed=3).to(device)
    assert compile_decoder_layers(flex, announce=False, backend=backend) == TINY.num_layers
    return flex


def _assert_same_logprobs_and_grads(model, reference, mb, atol: float, rtol: float, what=None) -> None:
    """`model`'s response log-probs and their gradients (a log-prob sum) equal `reference`'s on `mb`."""
    ref, _ = response_logprobs(reference, mb)
    got, _ = response_logprobs(model, mb)
    assert torch.allclose(got, ref, atol=atol), (what, (got - ref).abs().max())
    g_ref = torch.autograd.grad((ref * mb.response_mask).sum(), list(reference.parameters()))
    g_got = torch.autograd.grad((got * mb.response_mask).sum(), list(model.parameters()))
    for a, b in zip(g_got, g_ref):
        assert torch.allclose(a, b, atol=atol, rtol=rtol), (what, (a - b).abs().max())


@pytest.mark.slow  # dynamo traces the layers: ~8 s
def test_compiled_flex_layers_trace_as_one_graph(monkeypatch):
    """model.compile with FlexAttention, as far as the CPU can take it: dynamo and AOT autograd (the
    aot_eager backend: no inductor kernels, which the CPU cannot build for FlexAttention) trace the
    decoder layer, the BlockMask an input, as one graph without a break, for every length, with and
    without gradients; log-probs and gradients equal SDPA's with the dense mask. The CPU's only
    barrier to the backward is FlexAttention's device check, lifted here (the math backward runs)."""
    import torch.nn.attention.flex_attention as flex_module
    from torch._dynamo.utils import counters

    counters.clear()
    sdpa = load_model(TINY, torch.float32, seed=3)
    flex = _compiled_flex_model("aot_eager")
    prompts, groups = _flex_groups()
    with torch.no_grad():
        for extra in (0, 3, -20):
            mb = packed(prompts, _other_lengths(groups, extra))
            ref, _ = response_logprobs(sdpa, mb)
            got, _ = response_logprobs(flex, mb)
            assert torch.allclose(got, ref, atol=1e-5), (extra, (got - ref).abs().max())
    assert dict(counters["frames"]) == {"total": 1, "ok": 1} and not counters["graph_break"], dict(counters)

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    for extra in (0, 5):
        _assert_same_logprobs_and_grads(flex, sdpa, packed(prompts, _other_lengths(groups, extra)), 1e-5, 1e-4, extra)
    # the graph with gradients is the second and last: the new length compiled nothing
    assert dict(counters["frames"]) == {"total": 2, "ok": 2} and not counters["graph_break"], dict(counters)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_flex_layers_on_gpu():
    """model.compile with FlexAttention through inductor's triton kernels: log-probs and gradients
    equal SDPA's with the dense mask, for two lengths, without a graph break."""
    from torch._dynamo.utils import counters

    counters.clear()
    sdpa = load_model(ModelConfig(**{**TINY.__dict__, "dtype": "fp32"}), torch.float32, seed=3).cuda()
    flex = _compiled_flex_model("inductor", "cuda")
    prompts, groups = _flex_groups()
    for extra in (0, 5):
        mb = packed(prompts, _other_lengths(groups, extra)).to("cuda")
        _assert_same_logprobs_and_grads(flex, sdpa, mb, 1e-4, 1e-3, extra)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_attention_logprobs_and_gradients_on_gpu():
    cfg = {**TINY.__dict__, "dtype": "fp32"}
    sdpa = load_model(ModelConfig(**cfg), torch.float32, seed=3).cuda()
    flex = load_model(ModelConfig(**{**cfg, "attn_implementation": "flex_attention"}), torch.float32, seed=3).cuda()
    _assert_same_logprobs_and_grads(flex, sdpa, packed(*_flex_groups()).to("cuda"), 1e-4, 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_group_block_mask_on_gpu_is_torchs():
    """The band-by-band classification's CUDA reductions (bool any / all over views) give torch's
    create_block_mask's BlockMask, field for field, for rows with padding and a partial last block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from colo_rl.train.packing import group_attention

    B, L, prompt_end = 2, 1000, 200
    seg = torch.zeros(B, L, dtype=torch.long, device="cuda")
    seg[:, prompt_end:] = torch.arange(L - prompt_end, device="cuda") // 150 + 1
    seg[1, 950:] = -torch.arange(1, 51, device="cuda")
    got = group_attention(seg, prompt_end, torch.bfloat16, flex=True)
    want = create_block_mask(got.mask_mod, B, None, L, L, device="cuda")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
