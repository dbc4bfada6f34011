"""The rollout's type (colo_rl/samples.py), its micro-batches (train/packing.pack_rollout) and the
token-budget planner (train/batch.py): groups stay whole, rewards have one home, each micro-batch is
built once and carries its columns, and `auto` sizes the budget from the memory it is given."""

from __future__ import annotations

import pytest
import torch

from colo_rl.config import ModelConfig
from colo_rl.models import load_model
from colo_rl.samples import Completion, Rollout, groups_of
from colo_rl.train.activation_memory import (AUTO_MAX_TOKENS, AUTO_MIN_TOKENS, CPU_MICRO_BATCH_TOKENS, activation_bytes,
                                             micro_batch_token_budget)
from colo_rl.train.batch import agreed_mini_batches, micro_batches, response_logprobs, spread
from colo_rl.train.packing import pack_groups, pack_rollout


def rollout_of(prompts: list[list[int]], responses: list[list[list[int]]], rewards: list[float]) -> Rollout:
    completions = [Completion(p, r, [-0.1 * (k + 1)] * len(r), "stop")
                   for p, rs in zip(prompts, responses) for k, r in enumerate(rs)]
    G = len(responses[0])
    n = len(completions)
    out = Rollout(policy_version=5)
    out.keep(groups_of([f"problem {j}" for j in range(len(prompts))], G, {"verifier": rewards},
                       completions=completions, rewards=rewards, correct=[False] * n, lenient=[False] * n,
                       formatted=[True] * n, texts=["t"] * n))
    return out


def test_groups_keep_each_prompts_completions_together():
    r = rollout_of([[1, 2], [3]], [[[4], [5, 6]], [[7, 8, 9], [10]]], [1.0, 0.0, 0.5, 0.5])
    assert [g.problem for g in r.groups] == ["problem 0", "problem 1"]
    assert [g.prompt_ids for g in r.groups] == [[1, 2], [3]]
    assert [g.tokens for g in r.groups] == [2 + 1 + 2, 1 + 3 + 1]
    assert r.group_rows() == [[0, 1], [2, 3]] and len(r) == 4 and r.group_size == 2
    assert r.problems == ["problem 0", "problem 0", "problem 1", "problem 1"]
    assert r.groups[1].sources == {"verifier": [0.5, 0.5]}
    with pytest.raises(ValueError, match="rewards: 3 values for 2 groups of 2"):
        groups_of(["a", "b"], 2, {}, rewards=[1.0, 2.0, 3.0])


def test_a_later_source_joins_the_rewards_in_float32_and_shaping_only_the_total():
    base = [0.1, 0.7, 1.3, 0.2]
    r = rollout_of([[1], [2]], [[[4], [5]], [[6], [7]]], base)
    scores = torch.tensor([0.31, -0.2, 0.05, 1.7])
    r.add_source("model", scores, 0.3)
    # exactly what one float32 tensor sum gives (the recipe's golden values depend on it)
    assert torch.equal(r.rewards, torch.tensor(base) + 0.3 * scores)
    assert r.sources()["model"] == scores.tolist() and r.groups[1].sources["model"] == scores[2:].tolist()
    penalty = torch.tensor([0.0, -0.5, 0.0, -1.0])
    r.add_shaping("overlong", penalty)
    assert torch.equal(r.rewards, torch.tensor(base) + 0.3 * scores)  # the reported reward: no shaping
    assert torch.equal(r.total(), r.rewards + penalty)
    with pytest.raises(ValueError, match="3 scores for 4 completions"):
        r.add_source("x", [1.0, 2.0, 3.0])


def test_dynamic_sampling_keeps_informative_groups_then_fills_with_set_aside_ones():
    r = Rollout()
    first = rollout_of([[1], [2], [3]], [[[4], [5]]] * 3, [1, 0, 1, 1, 0, 0]).groups
    r.keep(first, [True, False, False])
    r.keep(rollout_of([[9]], [[[4], [5]]], [0, 1]).groups, [True])
    r.fill(3)
    assert [g.prompt_ids for g in r.groups] == [[1], [9], [2]] and r.filled == 1
    r.fill(1)
    assert [g.prompt_ids for g in r.groups] == [[1]]


def test_a_completion_or_rollout_that_does_not_fit_together_is_refused_where_it_is_made():
    """An engine's misaligned output fails at the engine, not as log-probs scored against the wrong
    tokens in the update; a rollout holds groups of one size (its rows are g*G .. g*G+G-1)."""
    assert Completion([1], [2, 3], [-0.1, -0.2], "stop", policy_mask=[1, 0]).trained_tokens == 1
    with pytest.raises(ValueError, match="2 tokens and 1 log-probs"):
        Completion([1], [2, 3], [-0.1], "stop")
    with pytest.raises(ValueError, match="policy_mask of 3"):
        Completion([1], [2, 3], [-0.1, -0.2], "stop", policy_mask=[1, 1, 0])
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        Completion([1], [2], [-0.1], "abort")
    r = rollout_of([[1]], [[[4], [5]]], [1.0, 0.0])
    r.keep(rollout_of([[2]], [[[6], [7]]], [0.0, 1.0]).groups, [False])
    with pytest.raises(ValueError, match=r"groups of \[2, 3\] completions"):
        r.keep(rollout_of([[3]], [[[8], [9], [10]]], [0.0, 1.0, 0.5]).groups)
    assert len(r.groups) == 1 and len(r.set_aside) == 1


def test_spread_reaches_the_agreed_count_by_halving_the_costliest_micro_batch():
    costs = [1, 2, 3, 4]
    bins = micro_batches(costs, budget=10)
    assert bins == [[0, 1, 2, 3]]
    assert spread(bins, 2, costs) == [[0, 1], [2, 3]]
    assert spread(bins, 3, costs) == [[0, 1], [2], [3]]  # the costlier half split again
    assert spread([[0], [1]], 4, costs) == [[0], [1], [], []]  # one unit each: empty passes after


def test_mini_batches_take_equal_shares_in_the_given_order_not_bands_of_length():
    """Mini-batch k is the k-th run of the units as given (a rollout's order): equal group counts,
    every length in each; inside one, micro-batches sort by length and fill the budget."""
    costs = [200, 5000, 210, 4000, 190, 220, 3000, 205]
    plans = agreed_mini_batches(costs, budget=4096, mini_batches=2)
    assert [sorted(i for mb in p for i in mb) for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plans == [[[0, 2], [3], [1]], [[4, 7, 5, 6]]]  # similar lengths together, up to the budget
    assert agreed_mini_batches(costs, budget=4096) == [micro_batches(costs, 4096)]  # one mini-batch: the whole plan
    with pytest.raises(ValueError, match="8 units do not split into 3 mini-batches"):
        agreed_mini_batches(costs, budget=4096, mini_batches=3)
    # seeded: a shuffle first (refill groups a rollout appends last spread), the same for the same seed
    shuffled = agreed_mini_batches(costs, budget=4096, mini_batches=2, seed=11)
    assert shuffled == agreed_mini_batches(costs, budget=4096, mini_batches=2, seed=11) != plans
    assert sorted(i for p in shuffled for mb in p for i in mb) == list(range(8))
    assert [sum(len(mb) for mb in p) for p in shuffled] == [4, 4]
    assert agreed_mini_batches(costs, budget=4096, seed=11) == [micro_batches(costs, 4096)]  # one: no shuffle


# A small Llama by hand: per layer and token (8h + 4kv + 4f) x 2 bytes = (512 + 128 + 1024) x 2 = 3328
SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)
# SmolLM2-135M's shape: (8 x 576 + 4 x 192 + 4 x 1536) x 2 = 23040 bytes per layer and token
SMOL = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152)


def test_activation_estimate_by_hand_whole_logits_chunked_head_and_checkpointing():
    assert activation_bytes(SMALL, 1, 2) == 2 * 3328 + 1000 * (2 + 8)  # logits bf16 + fp32 log-softmax + grad
    assert activation_bytes(SMALL, 10, 2) == 10 * (2 * 3328 + 10_000)
    assert activation_bytes(SMALL, 1, 2, gradient_checkpointing=True) == 2 * 64 * 2 + 3328 + 10_000
    # chunked head: the head's input row and two floats per token, then one chunk of 3 float32
    # vocabulary rows per position (a GPU's chunk: max(64, 1 GiB / (4 V)) = 268435 positions here)
    assert activation_bytes(SMALL, 10, 2, chunked_head=True) == 10 * (2 * 3328 + 64 * 2 + 8) + 10 * 3 * 4 * 1000
    per_token, fixed = 30 * 23040 + 576 * 2 + 8, (2**30 // (4 * 49152)) * 3 * 4 * 49152
    assert activation_bytes(SMOL, 8192, 2, chunked_head=True) == 8192 * per_token + fixed  # the chunk is full
    # an HF config object gives the same figure as its config.json fields
    cfg = load_model(ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"), torch.float32).config
    assert activation_bytes(cfg, 7, 4) == activation_bytes(cfg.to_dict(), 7, 4) > 0


def test_auto_budget_from_the_free_memory_it_is_given():
    per_token = 2 * 3328 + 10_000
    assert micro_batch_token_budget("auto", SMALL, torch.bfloat16, None) == CPU_MICRO_BATCH_TOKENS
    assert micro_batch_token_budget("4096", SMALL, torch.bfloat16, 10) == 4096  # a number is taken as it is
    assert micro_batch_token_budget("auto", SMALL, torch.bfloat16, 2000 * per_token) == AUTO_MIN_TOKENS  # 1000 < min
    assert micro_batch_token_budget("auto", SMALL, torch.bfloat16, 10_000 * per_token) == 5000
    assert micro_batch_token_budget("auto", SMALL, torch.bfloat16, 1 << 50) == AUTO_MAX_TOKENS
    chunked = 2 * 3328 + 64 * 2 + 8 + 3 * 4 * 1000  # every token inside the chunk
    assert micro_batch_token_budget("auto", SMALL, torch.bfloat16, 10_000 * chunked, chunked_head=True) == 5000
    # SmolLM2 on an H100 with 70 GiB free: the full chunk (3 GiB) is a fixed cost, then 692360 B a token
    per_token, fixed = 30 * 23040 + 576 * 2 + 8, (2**30 // (4 * 49152)) * 3 * 4 * 49152
    whole = micro_batch_token_budget("auto", SMOL, torch.bfloat16, 70 << 30)
    assert whole == int((70 << 29) / (30 * 23040 + 49152 * 10))
    chunked_budget = micro_batch_token_budget("auto", SMOL, torch.bfloat16, 70 << 30, chunked_head=True)
    assert chunked_budget == int(((70 << 29) - fixed) / per_token) > 1.5 * whole
    # checkpointing keeps each layer's input: 30 x 576 x 2 + 23040 B a token, plus the logits
    assert (micro_batch_token_budget("auto", SMOL, torch.bfloat16, 8 << 30, gradient_checkpointing=True)
            == int((8 << 29) / (30 * 576 * 2 + 23040 + 49152 * 10)))
    # the demo's 4 groups per rank (~4 x 400 tokens) fit in one micro-batch; at any free memory, even
    # at the floor, the demo's work takes at most 2 micro-batches per rank
    assert whole > 4 * 400
    for free in (0, 1 << 30, 70 << 30):
        for head in (False, True):
            budget = micro_batch_token_budget("auto", SMOL, torch.bfloat16, free, chunked_head=head)
            assert len(micro_batches([60 + 8 * 40] * 4, budget)) <= 2


def test_each_micro_batch_is_built_once_and_carries_its_columns():
    """pack_rollout's micro-batches equal the groups packed directly; attached columns land on the
    right rows; collect brings per-micro-batch values back in the rollout's order."""
    torch.manual_seed(0)
    r = rollout_of([[5, 6, 7], [8], [9, 10]], [[[11, 12], [13]], [[14], [15, 16, 17]], [[18, 19], [20]]],
                   [1.0, 0.0, 0.5, 0.2, 0.3, 0.9])
    packed = pack_rollout(r, [[[1]], [[0, 2], []]], pad_id=0, dtype=torch.float32)  # 2 mini-batches
    assert packed.rows == [[2, 3], [0, 1, 4, 5], []]
    assert packed.steps == [slice(0, 1), slice(1, 3)]
    direct = pack_groups([(g.prompt_ids, [c.token_ids for c in g.completions],
                           packed.table.select(rows)) for g, rows in ((r.groups[0], [0, 1]), (r.groups[2], [4, 5]))],
                         torch.float32)
    assert torch.equal(packed.micro[1].input_ids, direct.input_ids)
    assert torch.equal(packed.micro[1].extras["rollout_logp"], direct.extras["rollout_logp"])
    assert packed.micro[2].response_mask.sum() == 0  # the empty pass adds nothing
    packed.attach("advantages", torch.arange(6.0))
    assert packed.micro[1].extras["advantages"].tolist() == [0.0, 1.0, 4.0, 5.0]
    assert packed.micro[2].extras["advantages"].tolist() == [0.0]
    model = load_model(ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"), torch.float32)
    with torch.no_grad():
        per_micro = [response_logprobs(model, mb)[0] for mb in packed.micro]
        unpacked = response_logprobs(model, packed.table)[0] * packed.table.response_mask
    table = packed.collect(per_micro)
    assert torch.allclose(table, unpacked, atol=1e-5)
    packed.attach("old_logp", table)
    assert torch.allclose(packed.micro[0].extras["old_logp"], per_micro[0])
