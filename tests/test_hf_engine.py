"""The in-process engine: sampling log-probs are right, memory protocol, phase guard."""

import pytest
import torch

from colo_rl.algos import logprobs_from_logits
from colo_rl.config import ModelConfig
from colo_rl.models import load_model, load_tokenizer
from colo_rl.phase import Phase, PhaseError, PhaseGuard
from colo_rl.rollout.base import SamplingParams
from colo_rl.rollout.hf import HFEngine
from colo_rl.train.batch import build_batch

TINY = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer("embedded")
    model = load_model(TINY, torch.float32, seed=1)
    guard = PhaseGuard()
    guard.phase = Phase.GENERATION
    return tok, model, HFEngine(model, [tok.eos_token_id], tok.pad_token_id, guard=guard, max_batch=3, seed=5), guard


def teacher_forced(model, prompts, responses, pad, temperature):
    batch = build_batch(prompts, responses, pad)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, -batch.response_len - 1:-1]
    return logprobs_from_logits(logits, batch.response_ids, temperature), batch.response_mask


def test_sampling_logprobs_equal_a_full_forward(setup):
    tok, model, engine, _ = setup
    prompts = [tok("What is 2 + 2?")["input_ids"], tok("Hi")["input_ids"], tok("A longer prompt here, yes")["input_ids"],
               tok("x")["input_ids"]]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.7, n=2))
    assert len(out) == 8 and [o.prompt_ids for o in out[:2]] == [prompts[0]] * 2  # groups contiguous
    ref, mask = teacher_forced(model, [o.prompt_ids for o in out], [o.token_ids for o in out], tok.pad_token_id, 0.7)
    got = build_batch([o.prompt_ids for o in out], [o.token_ids for o in out], tok.pad_token_id,
                      per_token={"lp": [o.logprobs for o in out]}).extras["lp"]
    assert torch.allclose(got * mask, ref * mask, atol=1e-4), (got - ref).abs().max()
    for o in out:
        assert o.finish_reason in ("stop", "length")
        assert (o.finish_reason == "stop") == (o.token_ids[-1] == tok.eos_token_id)
        assert len(o.token_ids) <= 12


def test_greedy_is_deterministic_and_batch_independent(setup):
    tok, _, engine, _ = setup
    prompts = [tok("What is 2 + 2?")["input_ids"], tok("Hello there")["input_ids"]]
    together = engine.generate(prompts, SamplingParams(max_new_tokens=8, greedy=True))
    alone = engine.generate(prompts[1:], SamplingParams(max_new_tokens=8, greedy=True))
    assert together[1].token_ids == alone[0].token_ids


def test_generation_ends_at_the_token_completing_a_stop_string(setup):
    """A stop string taken from a greedy run's own text: the stopped run is that run's prefix up to
    the token whose text completes the string (kept whole), finish_reason "stop_string"; other rows
    go on; without the tokenizer the engine says what it needs."""
    tok, model, engine, guard = setup
    prompts = [tok("What is 2 + 2?")["input_ids"], tok("Hello there")["input_ids"]]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))
    ids = free[0].token_ids
    stop = tok.decode(ids[3:6])[1:]  # starts inside token 3, ends with token 5
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    engine.tokenizer = tok
    try:
        stopped = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True, stop=(stop,)))
    finally:
        engine.tokenizer = None
    assert stopped[0].token_ids == ids[:k] and stopped[0].finish_reason == "stop_string"
    assert stopped[0].logprobs == pytest.approx(free[0].logprobs[:k], abs=1e-5)
    if stop not in tok.decode(free[1].token_ids):
        assert stopped[1].token_ids == free[1].token_ids and stopped[1].finish_reason == free[1].finish_reason
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, greedy=True, stop=("x",)))


def test_sleep_frees_weights_and_load_weights_restores_them(setup):
    tok, model, engine, _ = setup
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompt = [tok("What is 2 + 2?")["input_ids"]]
    before = engine.generate(prompt, SamplingParams(max_new_tokens=6, greedy=True))
    assert engine.sleep(["weights", "kv_cache"]) == sum(t.numel() * 4 for t in saved.values())
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match="sleeping engine"):
        engine.generate(prompt, SamplingParams(max_new_tokens=2))
    engine.wake(["weights"])
    engine.load_weights(list(saved.items()))
    assert engine.generate(prompt, SamplingParams(max_new_tokens=6, greedy=True))[0].token_ids == before[0].token_ids
    with pytest.raises(KeyError, match="does not have"):
        engine.load_weights([("not.a.param", torch.zeros(1))])


def test_generate_outside_the_generation_phase_is_refused(setup):
    tok, _, engine, guard = setup
    guard.phase = Phase.UPDATE
    try:
        with pytest.raises(PhaseError, match="switch.generation"):
            engine.generate([tok("x")["input_ids"]], SamplingParams(max_new_tokens=2))
    finally:
        guard.phase = Phase.GENERATION


def test_hf_engine_cdf_sampler_draws_from_the_distribution():
    """The HF engine's sampler (a CPU hot spot the race found: torch.multinomial draws an exponential per
    vocabulary entry) inverts the CDF instead; it must still sample each token with its probability,
    never a zero-probability one, and accept unnormalised rows (top-p leaves them so)."""
    engine = HFEngine.__new__(HFEngine)  # only the generator is needed
    engine.generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(100_000, 1)
    freq = torch.bincount(engine._draw(probs), minlength=5).double() / 100_000
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0], dtype=torch.float64), atol=0.006)
    assert freq[1] == 0 and freq[4] == 0
    assert set(engine._draw(torch.tensor([[0.0, 0.0, 2.5]]).repeat(1000, 1)).tolist()) == {2}
    first = torch.tensor([[1.0] + [0.0] * 9]).repeat(1000, 1)
    assert set(engine._draw(first).tolist()) == {0}


def test_each_rank_of_a_seed_sweep_samples_a_stream_of_its_own():
    """Both engines seed rank r with sampling_seed(rollout.seed, r): a sweep over neighbouring seeds
    on 8 ranks shares no stream (seed + rank would: seed 1 on rank 1 is seed 2 on rank 0)."""
    from colo_rl.rollout.base import sampling_seed

    streams = [sampling_seed(seed, rank) for seed in range(64) for rank in range(8)]
    assert len(set(streams)) == len(streams)
    assert sampling_seed(5, 0) == 5  # rank 0 samples with rollout.seed itself
