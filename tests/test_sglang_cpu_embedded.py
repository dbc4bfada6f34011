"""SGLang's real engine on CPU with the embedded model (SmolLM2-135M-Instruct, fp32), driven by
colo_rl's SGLangEngine and handoff: one engine for the module. Real weights make the comparisons
meaningful on text: greedy decoding against colo_rl's HF engine, stop strings, and the
engine-vs-trainer log-prob gap after a ZeRO-3 step for both engines on the same step. The engine
starts as in a multi-turn run: with its tokenizer, so that it can match stop strings (the tiny-model
module, tests/test_sglang_cpu.py, covers the single-turn start without it).
Test support: tests/sglang_cpu.py, tests/sglang_cpu_shims/."""

from __future__ import annotations


import pytest
import torch

import sglang_cpu
from test_sglang_cpu import agreement, hf_engine_on_trainer_weights, record

# the longest end-to-end files: not in `make test`, in `make test-e2e` (CI runs both)
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

QUESTIONS = ["What is 7 + 5?", "Name a primary colour.", "Write the word cat backwards.", "What is 3 * 4?"]


@pytest.fixture(scope="module")
def colo(tmp_path_factory):
    from colo_rl.config import ModelConfig, RunConfig
    from colo_rl.models import load_tokenizer

    def make_cfg():
        cfg = RunConfig()
        cfg.model = ModelConfig(path="embedded", dtype="fp32", random_init=False)
        cfg.rollout.engine = "sglang"
        cfg.trainer.zero_stage = 3
        cfg.trainer.micro_batch_size = 8
        cfg.trainer.lr = 1e-5
        cfg.env.name = "calculator"  # the engine starts with its tokenizer, as in a multi-turn run
        return cfg

    tokenizer = load_tokenizer("embedded")
    with sglang_cpu.colocated(make_cfg, tokenizer, tmp_path_factory.mktemp("sglang_cpu_embedded"),
                              total_steps=4) as built:
        built.tokenizer = tokenizer
        yield built


def chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in QUESTIONS]


def test_greedy_answers_equal_the_hf_engine_on_the_embedded_model(colo):
    from colo_rl.rollout.base import SamplingParams

    params = SamplingParams(max_new_tokens=16, greedy=True)
    batch = chat_prompts(colo.tokenizer)
    with colo.switch.generation():
        sgl = colo.engine.generate(batch, params)
    with colo.switch.update():
        hf = hf_engine_on_trainer_weights(colo)
        hf_out = hf.generate(batch, params)
    texts = colo.tokenizer.batch_decode([c.token_ids for c in sgl], skip_special_tokens=True)
    print("SGLang CPU greedy answers:", texts)
    assert [c.token_ids for c in sgl] == [c.token_ids for c in hf_out]
    gap = max(abs(a - b) for s, h in zip(sgl, hf_out) for a, b in zip(s.logprobs, h.logprobs))
    record("embedded_greedy_max_abs_logprob_gap_sglang_vs_hf", gap)
    assert gap < 1e-3, gap


def test_a_stop_string_ends_the_answer_at_its_last_token_as_in_the_hf_engine(colo):
    """A stop string taken from each greedy answer's own text, starting inside one token: SGLang ends
    the answer at the token that completes it (kept whole, finish_reason "stop_string"), the same
    tokens the HF engine gives with the same stop."""
    from colo_rl.rollout.base import SamplingParams

    assert colo.engine.stop_strings
    tok, batch = colo.tokenizer, chat_prompts(colo.tokenizer)
    with colo.switch.generation():
        free = colo.engine.generate(batch, SamplingParams(max_new_tokens=16, greedy=True))
    stops, cut = [], []
    for c in free:
        stop = tok.decode(c.token_ids[2:5])[1:]
        stops.append(stop)
        cut.append(next(k for k in range(1, len(c.token_ids) + 1) if stop in tok.decode(c.token_ids[:k])))
    for i, stop in enumerate(stops):
        params = SamplingParams(max_new_tokens=16, greedy=True, stop=(stop,))
        with colo.switch.generation():
            (sgl,) = colo.engine.generate(batch[i:i + 1], params)
        with colo.switch.update():
            hf = hf_engine_on_trainer_weights(colo)
            hf.tokenizer = tok
            (hf_out,) = hf.generate(batch[i:i + 1], params)
        assert sgl.token_ids == free[i].token_ids[:cut[i]] == hf_out.token_ids, (stop, sgl.token_ids)
        assert sgl.finish_reason == hf_out.finish_reason == "stop_string"
    assert all(k < len(c.token_ids) for k, c in zip(cut, free))  # every answer ended early
    record("embedded_stop_strings", {"stops": stops, "tokens_kept": cut})


def test_logprob_gap_after_a_zero3_step_sglang_and_hf_on_the_same_step(colo):
    from colo_rl.rollout.base import SamplingParams
    from colo_rl.train.batch import build_batch

    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2)
    batch = chat_prompts(colo.tokenizer)
    with colo.switch.generation():
        samples = colo.engine.generate(batch, params)
    with colo.switch.update():  # one real ZeRO-3 step (a policy-gradient-shaped loss, alternating signs)
        tb = build_batch([c.prompt_ids for c in samples], [c.token_ids for c in samples], colo.pad)
        logp, _ = colo.actor.response_logprobs(tb, grad=True)
        signs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(tb))])[:, None]
        loss = -(logp * tb.response_mask * signs).sum() / tb.response_mask.sum()
        colo.actor.backward(loss, True)
        colo.actor.step()
        hf = hf_engine_on_trainer_weights(colo)
        hf.generator.manual_seed(0)
        hf_gap = agreement(colo, hf.generate(batch, params))
    with colo.switch.generation():
        after = colo.engine.generate(batch, params)
    with colo.switch.update():
        sgl_gap = agreement(colo, after, 1e-3)
    record("embedded_after_zero3_step", {"sglang_cpu": sgl_gap, "hf_engine": hf_gap})
    print(f"embedded model, gap after a ZeRO-3 step: SGLang CPU {sgl_gap}, HF engine {hf_gap}")
    assert sgl_gap["handoff/logprob_diff_mean"] < 1e-3 and hf_gap["handoff/logprob_diff_mean"] < 1e-3


def surprise_gap(colo, completions, temperature: float) -> tuple[float, float, int]:
    """Mean over the drawn tokens of (-log p(token) - H(p)) under the trainer's distribution at
    `temperature`, its standard error, and the token count. Each term has mean 0 given the tokens
    before it when the token was drawn from p, so the terms are uncorrelated and the usual standard
    error holds."""
    from colo_rl.train.batch import build_batch

    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], colo.pad)
    logp, entropy = colo.actor.response_logprobs(batch, temperature=temperature, with_entropy=True, grad=False)
    d = (-logp - entropy)[batch.response_mask.bool()].double()
    return float(d.mean()), float(d.std() / d.numel() ** 0.5), int(d.numel())


def test_both_engines_draw_from_the_distribution_the_trainer_computes(colo):
    """The per-step log-prob check compares what an engine reports for the tokens it drew; a sampler
    that draws from another distribution (a second temperature, a hidden top-k / top-p, bf16
    probabilities) passes it and still trains on other samples. For tokens drawn from p the mean of
    -log p(token) equals the mean entropy: at the demo's temperature both engines' gap is 0 within
    sampling noise (issue #40: SGLang learned less than the HF engine on 3 of 3 seeds)."""
    from colo_rl.rollout.base import SamplingParams

    params = SamplingParams(max_new_tokens=16, temperature=0.8, n=8)  # ~500 tokens an engine: s.e. ~0.06
    batch = chat_prompts(colo.tokenizer)
    with colo.switch.generation():
        sgl = colo.engine.generate(batch, params)
    with colo.switch.update():
        hf = hf_engine_on_trainer_weights(colo)
        hf.generator.manual_seed(0)
        hf_out = hf.generate(batch, params)
        gaps = {"sglang": surprise_gap(colo, sgl, 0.8), "hf": surprise_gap(colo, hf_out, 0.8)}
        # the test can fail: tokens drawn at temperature 1 are more surprising than p at 0.8 predicts
        hot = hf.generate(batch, SamplingParams(max_new_tokens=16, temperature=1.0, n=8))
        hot_gap = surprise_gap(colo, hot, 0.8)
    record("embedded_sampling_surprise_gap_t0.8", {**gaps, "hf_drawn_at_t1": hot_gap})
    print(f"mean (-log p - H) over drawn tokens, (gap, standard error, tokens): {gaps}; HF drawn at T=1: {hot_gap}")
    for name, (gap, se, n) in gaps.items():
        assert n > 300 and abs(gap) < 4 * se, (name, gap, se)
    assert hot_gap[0] > 4 * hot_gap[1], hot_gap
