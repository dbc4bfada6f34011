"""Token batches: the padded layout and GRPO group packing give the same log-probs and gradients."""

import torch

from colo_rl.algos import logprobs_from_logits
from colo_rl.config import ModelConfig
from colo_rl.models import load_model
from colo_rl.train.batch import build_batch, micro_batches, pack_group, unpack_group

TINY = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")


def padded_logprobs(model, batch):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   logits_to_keep=batch.response_len + 1).logits[:, :-1]
    return logprobs_from_logits(logits, batch.response_ids)


def packed_logprobs(model, packed):
    out = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask, position_ids=packed.position_ids,
                logits_to_keep=packed.logit_positions).logits[0]
    return logprobs_from_logits(unpack_group(out, packed.packed_lengths, packed.response_len), packed.response_ids)


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
    assert micro_batches(5, 2, lengths=[5, 1, 4, 2, 3]) == [[1, 3], [4, 2], [0]]


def test_group_packing_matches_padded_logprobs_and_gradients():
    torch.manual_seed(0)
    model = load_model(TINY, torch.float32, seed=3)
    prompt = [5, 17, 99, 3, 250]
    responses = [[11, 12, 13], [21], [31, 32, 33, 34, 35], [41, 42]]
    batch = build_batch([prompt] * 4, responses, pad_id=0)
    packed = pack_group(prompt, responses, batch, torch.float32)
    assert packed.input_ids.shape == (1, 5 + 11)  # the prompt once, no padding

    ref = padded_logprobs(model, batch)
    ref_grad = torch.autograd.grad((ref * batch.response_mask).sum(), list(model.parameters()))
    got = packed_logprobs(model, packed)
    got_grad = torch.autograd.grad((got * packed.response_mask).sum(), list(model.parameters()))
    m = batch.response_mask.bool()
    assert got.shape == ref.shape
    assert torch.allclose(got[m], ref[m], atol=1e-5), (got[m] - ref[m]).abs().max()
    for a, b in zip(got_grad, ref_grad):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_packing_isolates_responses():
    """Changing one response must not change another's log-probs (no cross-attention)."""
    model = load_model(TINY, torch.float32, seed=3)
    prompt = [5, 17, 99]
    a = [[11, 12, 13], [21, 22]]
    b = [[11, 12, 13], [77, 78]]
    lp_a = packed_logprobs(model, pack_group(prompt, a, build_batch([prompt] * 2, a, 0), torch.float32))
    lp_b = packed_logprobs(model, pack_group(prompt, b, build_batch([prompt] * 2, b, 0), torch.float32))
    assert torch.allclose(lp_a[0], lp_b[0], atol=1e-6)
    assert not torch.allclose(lp_a[1], lp_b[1])
