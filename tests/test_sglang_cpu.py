"""SGLang's real engine (0.5.21, CPU, plain-torch kernels) driven by colo_rl's SGLangEngine, weight
handoff and memory manager, on a tiny random Llama: one engine for the module (start-up ~20-60 s).

What CPU changes (colo_rl/rollout/sglang/, named branches): the handoff passes shared-memory
handles instead of CUDA IPC handles, and the engine runs without SGLang's memory saver, so its
release / resume calls run for real but free nothing: these tests check the calls and the ledger,
not bytes. Test support: tests/sglang_cpu.py, tests/sglang_cpu_shims/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sglang_cpu

pytestmark = pytest.mark.slow

DIMS = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=512, initializer_range=0.1)
THRESHOLD = 1e-3  # engine-vs-trainer mean |log-prob| gap per token (the recipe's check); fp32 agrees to ~1e-6
RESULTS = Path(os.environ.get("COLO_RL_SGLANG_CPU_RESULTS", "")) if os.environ.get("COLO_RL_SGLANG_CPU_RESULTS") else None


def prompts(n: int, seed: int, length: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, DIMS["vocab_size"], (n, length), generator=g).tolist()


@pytest.fixture(scope="module")
def colo(tmp_path_factory):
    from benchmarks.phase_switch import EOS, PAD, bench_config, write_random_llama

    work = tmp_path_factory.mktemp("sglang_cpu")

    def make_cfg():
        cfg = bench_config(write_random_llama(work / "model", **DIMS), "sglang", "fp32", steps=8, seqs=8)
        cfg.trainer.lr = 1e-3  # weights move visibly in one step
        cfg.colocate.handoff_check_max_mean_abs = THRESHOLD
        return cfg

    with sglang_cpu.colocated(make_cfg, SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD), work) as built:
        yield built


class Spy:
    """Records the calls colo_rl's SGLangEngine makes into SGLang's Engine (and passes them through);
    the weight-update session's begin / end come through the session object colo_rl detected."""

    NAMES = ("release_memory_occupation", "resume_memory_occupation", "flush_cache", "update_weights_from_tensor",
             "generate")

    def __init__(self, wrapper):
        self.wrapper, self.engine, self.calls, self.saved = wrapper, wrapper.engine, [], {}

    def _wrap(self, name, original):
        def wrapped(*args, **kwargs):
            self.calls.append((name, tuple(kwargs.get("tags") or ())))
            return original(*args, **kwargs)

        return wrapped

    def __enter__(self):
        for name in self.NAMES:
            setattr(self.engine, name, self._wrap(name, getattr(self.engine, name)))
        session = self.wrapper.session
        if session is not None:  # SGLang < 0.5.21 has none
            self.saved_session = (session.begin, session.end)
            session.begin = self._wrap("begin_weight_update", session.begin)
            session.end = self._wrap("end_weight_update", session.end)
        return self

    def __exit__(self, *exc):
        for name in self.NAMES:
            delattr(self.engine, name)
        if self.wrapper.session is not None:
            self.wrapper.session.begin, self.wrapper.session.end = self.saved_session

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]


def agreement(colo, completions, threshold=None, temperature: float = 1.0) -> dict:
    """The recipe's per-step check: the engine's log-probs of its samples vs the trainer's."""
    from colo_rl.colocate.handoff import LogprobAgreement
    from colo_rl.train.batch import build_batch

    masks = [c.policy_mask for c in completions]  # episodes: the policy's tokens; None: every token
    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], colo.pad,
                        response_masks=masks, per_token={"rollout_logp": [c.logprobs for c in completions]})
    trainer, _ = colo.actor.response_logprobs(batch, temperature=temperature, grad=False)
    check = LogprobAgreement()
    check.add(batch.extras["rollout_logp"], trainer, batch.response_mask)
    return check.check(threshold)


def hf_engine_on_trainer_weights(colo):
    """colo_rl's HF engine on the trainer's current weights (handed off the same way)."""
    from colo_rl.models import load_model
    from colo_rl.rollout.hf import HFEngine

    engine = HFEngine(load_model(colo.cfg.model, torch.float32, seed=123), colo.engine.eos, colo.pad)
    for names in colo.switch.manager.handoff.buckets:
        with colo.actor.gathered(names) as tensors:
            engine.load_weights(tensors)
    return engine


def record(key: str, value) -> None:
    if RESULTS is not None:
        data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        data[key] = value
        RESULTS.write_text(json.dumps(data, indent=1))


# ------------------------------------------------------------------------------------------------ tests
def test_engine_starts_on_cpu_released_without_the_memory_saver(colo):
    engine = colo.engine
    assert engine.device == "cpu" and type(engine).__name__ == "SGLangEngine"
    if sglang_cpu.HAS_SESSION:
        assert engine.session is not None and engine.session.via == "engine"  # 0.5.21's begin/end_weight_update
    else:
        assert engine.session is None  # 0.5.17: updates apply without a session
    assert sorted(engine.state.released) == sorted(engine.state.supported)  # released right after start
    args = engine.engine.server_args
    assert args.device == "cpu" and args.enable_memory_saver is False and args.load_format == "dummy"
    assert args.attention_backend == "torch_native" and args.disable_cuda_graph


def test_sleep_and_wake_run_the_real_release_and_resume_calls_in_order(colo):
    from colo_rl.rollout.base import SamplingParams

    colo.switch.begin_step(0)
    with Spy(colo.engine) as spy:
        with colo.switch.generation():
            completions = colo.engine.generate(prompts(2, seed=0), SamplingParams(max_new_tokens=4, n=2))
        to_generation = spy.names()
        with colo.switch.update():
            pass
    assert len(completions) == 4
    # update -> generation: weights back, the handoff (inside 0.5.21's weight-update session), then the KV cache
    assert to_generation[0] == "resume_memory_occupation" and spy.calls[0][1] == ("weights",)
    if sglang_cpu.HAS_SESSION:
        i_begin, i_end = to_generation.index("begin_weight_update"), to_generation.index("end_weight_update")
        assert 0 < i_begin < i_end and set(to_generation[i_begin + 1:i_end]) == {"update_weights_from_tensor"}
    else:
        i_end = max(i for i, name in enumerate(to_generation) if name == "update_weights_from_tensor")
        assert set(to_generation[1:i_end + 1]) == {"update_weights_from_tensor"}
    i_kv = to_generation.index("resume_memory_occupation", i_end)
    assert set(spy.calls[i_kv][1]) == {"kv_cache", "cuda_graph"}
    assert to_generation[i_kv + 1:] == ["flush_cache", "generate"]  # old KV flushed before sampling
    # generation -> update: an idle scheduler (flushed) then every tag released at once
    back = spy.names()[len(to_generation):]
    assert back[-1] == "release_memory_occupation" and set(spy.calls[-1][1]) == {"weights", "kv_cache", "cuda_graph"}
    assert set(back[:-1]) == {"flush_cache"}
    # The ledger holds both transitions; on CPU SGLang frees nothing (no memory saver): 0 bytes, calls made.
    gen, upd = colo.ledger.records[-2:]
    assert (gen["transition"], upd["transition"]) == ("update->generation", "generation->update")
    moves = {m["what"]: m for m in gen["moves"] + upd["moves"]}
    assert moves["engine weights (allocate)"]["bytes"] == 0 and moves["engine KV cache (allocate)"]["bytes"] == 0
    assert moves["engine KV cache + weights (release)"]["bytes"] == 0
    expected = sum(n for _, n in colo.actor.named_parameter_sizes())
    assert moves["weights handoff"]["bytes"] == expected and moves["weights handoff"]["moved"] is True
    assert sorted(colo.engine.state.released) == sorted(colo.engine.state.supported)
    assert json.loads((colo.work / "ledger.jsonl").read_text().splitlines()[-1])["transition"] == "generation->update"


def test_greedy_generation_equals_the_hf_engine_on_the_same_weights(colo):
    from colo_rl.rollout.base import SamplingParams

    params = SamplingParams(max_new_tokens=8, greedy=True)
    batch = prompts(4, seed=1)
    colo.switch.begin_step(1)
    with colo.switch.generation():
        sgl = colo.engine.generate(batch, params)
    with colo.switch.update():
        hf = hf_engine_on_trainer_weights(colo).generate(batch, params)
    assert [c.token_ids for c in sgl] == [c.token_ids for c in hf]
    gap = max(abs(a - b) for s, h in zip(sgl, hf) for a, b in zip(s.logprobs, h.logprobs))
    assert gap < 1e-4, gap
    record("tiny_greedy_max_abs_logprob_gap_sglang_vs_hf", gap)


def test_sigterm_reaches_the_trainer_not_sglangs_exit_handler(colo):
    """SGLang's tokenizer manager adds (uvloop) SIGTERM / SIGQUIT handlers that end in a kill of the
    process tree; colo_rl drops them inside the running loop at start. A SIGTERM (torchrun, a
    scheduler's preemption) then reaches the trainer's StopSignal, and SGLang never starts draining
    to exit, even once its loop runs again for the next generate."""
    import signal
    import time

    from colo_rl.rollout.base import SamplingParams

    tm = colo.engine.engine.tokenizer_manager
    assert tm.event_loop is not None  # created at start, with its handlers dropped there
    stops, before = [], signal.signal(signal.SIGTERM, lambda *a: stops.append(True))
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # outside the loop: uvloop does not see it
        time.sleep(0.05)
        # inside the running loop (the engine's calls run it): where uvloop dispatches its own handlers
        colo.engine.engine.loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)
        colo.switch.begin_step(5)
        with colo.switch.generation():
            out = colo.engine.generate(prompts(2, seed=9), SamplingParams(max_new_tokens=4, greedy=True))
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stops == [True, True] and len(out) == 2
    assert not tm.gracefully_exit  # SGLang's sigterm_handler did not run


def test_a_prompt_over_the_context_length_is_an_engine_error_and_the_engine_goes_on(colo):
    """SGLang refuses it in generate itself (a ValueError, not an abort result): colo_rl's error
    gives SGLang's message and the usual causes, and the next request is served."""
    from colo_rl.rollout.base import SamplingParams
    from colo_rl.rollout.sglang import SGLangEngineError

    params = SamplingParams(max_new_tokens=4, greedy=True)
    colo.switch.begin_step(6)
    with colo.switch.generation():
        with pytest.raises(SGLangEngineError, match=r"aborted a request: The input \(\d+ tokens\) is longer"):
            colo.engine.generate([[5] * 4096], params)
        assert len(colo.engine.generate(prompts(2, seed=10), params)) == 2


def test_handoff_after_a_zero3_step_gives_the_engine_the_trainers_logprobs(colo):
    from benchmarks.phase_switch import grpo_like_update

    from colo_rl.rollout.base import SamplingParams

    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
    colo.switch.begin_step(2)
    with colo.switch.generation():
        before = colo.engine.generate(prompts(4, seed=2), params)
    with colo.switch.update():
        grpo_like_update(colo.actor, before)  # a real ZeRO-3 optimizer step
        hf = hf_engine_on_trainer_weights(colo)
        hf.generator.manual_seed(0)
        hf_samples = hf.generate(prompts(4, seed=3), params)
        hf_gap = agreement(colo, hf_samples)
    colo.switch.begin_step(3)
    with colo.switch.generation():
        after = colo.engine.generate(prompts(4, seed=3), params)
    with colo.switch.update():
        sgl_gap = agreement(colo, after, THRESHOLD)  # raises above the threshold
    assert sgl_gap["handoff/logprob_diff_mean"] < THRESHOLD
    # world size 1, weight partitions resident: SGLang read DeepSpeed's flat buffer in one call
    handoff = colo.switch.manager.last_handoff
    assert handoff.zero_copy is True and handoff.buckets == 1
    record("tiny_after_zero3_step", {"sglang_cpu": sgl_gap, "hf_engine": hf_gap})
    print(f"engine-vs-trainer log-prob gap after a ZeRO-3 step: SGLang CPU {sgl_gap}, HF engine {hf_gap}")


class CharTokenizer:
    """Text <-> ids for the tiny random Llama (vocabulary 512, no tokenizer of its own): one id per
    character. Only the multi-turn driver's text side needs it; the engine and trainer see ids."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + i % 95) for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) - 32) % 95 for c in text]}


class AnswerEveryTurn:
    """Answers every policy turn with an observation: episodes of env.max_turns turns (its own
    session: the character tokenizer has no chat template for colo_rl's conversation environments)."""

    def start(self, problem):
        return self

    def reward(self):
        return None, None

    def close(self):
        pass

    def parse(self, text):
        from colo_rl.envs.calls import ParsedTurn

        return ParsedTurn(error="always", end=None)

    def step(self, text, closed):
        from colo_rl.envs import Step

        return Step(observation=f"<obs {len(text)}>", error="always")


def test_multi_turn_episodes_agree_with_the_trainer_over_policy_tokens(colo):
    from colo_rl.rollout.base import Completion, SamplingParams
    from colo_rl.rollout.multiturn import MultiTurnRollout

    colo.switch.begin_step(4)
    rollout = MultiTurnRollout(AnswerEveryTurn(), CharTokenizer(), max_turns=3, max_total_tokens=60)
    with colo.switch.generation():
        episodes = rollout.generate(colo.engine, prompts(2, seed=4), SamplingParams(max_new_tokens=6, n=2))
    assert all(e.turns == 3 and 0 in e.policy_mask for e in episodes)
    with colo.switch.update():
        gap = agreement(colo, episodes, THRESHOLD)  # raises above the threshold
        # the observations' zeros are not the trainer's log-probs: counted, the check would fail
        unmasked = [Completion(e.prompt_ids, e.token_ids, e.logprobs, e.finish_reason) for e in episodes]
        assert agreement(colo, unmasked)["handoff/logprob_diff_mean"] > 10 * THRESHOLD
    record("tiny_multi_turn_episodes_sglang_cpu", gap)


@pytest.mark.parametrize("kind", ["skipped", "garbled", "unknown_names"])
def test_a_skipped_or_garbled_update_fails_the_handoff_check(colo, kind):
    from benchmarks.phase_switch import grpo_like_update

    from colo_rl.colocate.handoff import HandoffError
    from colo_rl.rollout.base import SamplingParams

    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
    colo.switch.begin_step(10)
    with colo.switch.generation():
        samples = colo.engine.generate(prompts(4, seed=4), params)
    with colo.switch.update():
        grpo_like_update(colo.actor, samples)  # the trainer moves on; the engine must follow
    original = colo.engine.load_weights

    def broken(named_tensors):
        if kind == "skipped":
            return None  # the bucket never reaches the engine
        if kind == "garbled":  # right names and shapes, wrong values: SGLang accepts them
            torch.manual_seed(0)
            return original([(n, t.flatten()[torch.randperm(t.numel())].view_as(t)) for n, t in named_tensors])
        # names the engine's model does not have: SGLang 0.5.21's Llama skips them and reports success
        return original([("model.renamed." + n, t) for n, t in named_tensors])

    original_flat = colo.engine.load_flat_weights

    def broken_flat(buffer, views):  # the same faults on the zero-copy path (world size 1 takes it)
        if kind == "skipped":
            return True  # claims to have sent the weights
        if kind == "garbled":
            torch.manual_seed(0)
            shuffled = buffer[torch.randperm(buffer.numel())]
            place = lambda v: (v.data_ptr() - buffer.data_ptr()) // buffer.element_size()  # noqa: E731
            return original_flat(shuffled, [(n, shuffled.narrow(0, place(v), v.numel()).view(v.shape))
                                            for n, v in views])
        return original_flat(buffer, [("model.renamed." + n, v) for n, v in views])

    colo.engine.load_weights, colo.engine.load_flat_weights = broken, broken_flat
    try:
        colo.switch.begin_step(11)
        with colo.switch.generation():
            samples = colo.engine.generate(prompts(4, seed=5), params)
    finally:
        colo.engine.load_weights, colo.engine.load_flat_weights = original, original_flat
    with colo.switch.update():
        with pytest.raises(HandoffError, match="not on the trainer's weights"):
            agreement(colo, samples, THRESHOLD)
    # The next (intact) handoff repairs the engine.
    colo.switch.begin_step(12)
    with colo.switch.generation():
        samples = colo.engine.generate(prompts(4, seed=6), params)
    with colo.switch.update():
        assert agreement(colo, samples, THRESHOLD)["handoff/logprob_diff_mean"] < THRESHOLD


def test_an_engine_error_surfaces_as_colo_rl_error_with_the_engines_message(colo):
    """A tensor of the wrong shape for a real weight: SGLang's weight loader refuses it. Last in the
    module: the engine may not be usable afterwards."""
    from colo_rl.colocate.handoff import HandoffError
    from colo_rl.rollout.base import KV_CACHE, WEIGHTS
    from colo_rl.rollout.sglang import SGLangEngineError

    engine = colo.engine
    name = "model.layers.0.self_attn.o_proj.weight"
    engine.wake([WEIGHTS])
    with pytest.raises((HandoffError, SGLangEngineError)) as err:
        engine.load_weights([(name, torch.zeros(3, 5))])
    message = str(err.value)
    assert "SGLang" in message
    if isinstance(err.value, HandoffError):  # the engine answered: its message is in ours
        assert "update_weights_from_tensor failed" in message and "shape" in message
    else:
        # 0.5.21: the weight loader's assertion ("param_data.shape=... loaded_weight.shape=...") kills
        # the scheduler, which logs it to its stderr and signals us (SIGQUIT): colo_rl's error names
        # the likely causes and points at that traceback, and this process lives on.
        assert "SIGQUIT from a child" in message and "weight name or shape" in message
        with pytest.raises(SGLangEngineError, match="cannot be used any more"):
            engine.wake([KV_CACHE])  # a dead scheduler is never called again (it would never answer)
    record("engine_error", {"type": type(err.value).__name__, "message": message[:2000]})

