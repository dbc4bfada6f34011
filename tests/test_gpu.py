"""GPU checks: real CUDA, real DeepSpeed, real SGLang where installed. Never faked.

Skipped without CUDA (tests/conftest.py); `make gpu-check` runs them on a GPU machine. One process,
world of one rank, tp_size 1 (the TP data path is tested on CPU in test_tp_group.py).
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.phase_switch import EOS, PAD, bench_config, grpo_like_update, write_random_llama  # noqa: E402

# conftest.py skips `gpu` tests without CUDA; the skipif keeps this module safe on its own too.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GIB = 1 << 30
TOKENIZER = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)  # random token ids: no text involved
# Peaked next-token distributions (initializer_range 0.1): an engine on other weights (SGLang's
# near-zero dummy weights, a perturbed copy) disagrees with the trainer by nats, not hundredths.
DIMS = dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1536, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=32000, initializer_range=0.1)
# Large enough that paging the trainer out frees a clearly measurable amount.
HF_DIMS = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=4096, num_attention_heads=16,
               num_key_value_heads=16, vocab_size=32000)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    from colo_rl import dist

    dist.init()
    yield
    dist.cleanup()


def random_prompts(n: int, length: int = 16, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, DIMS["vocab_size"], (n, length), generator=g).tolist()


def build(tmp_path, engine: str, dims: dict, **rollout):
    from colo_rl.colocate.setup import build_colocated

    model_dir = write_random_llama(tmp_path / f"model-{engine}", **dims)
    cfg = bench_config(model_dir, engine, "bf16", steps=8, seqs=8)
    cfg.trainer.lr = 1e-3  # weights move visibly between steps
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    colo = build_colocated(cfg, TOKENIZER, torch.bfloat16, run_dir=tmp_path, total_steps=8, grad_accum=1)
    return cfg, colo


def logprob_agreement(cfg, colo, completions) -> dict:
    """Engine vs trainer log-probs of what the engine sampled (the recipe's check)."""
    from colo_rl.colocate.handoff import LogprobAgreement
    from colo_rl.train.batch import build_batch

    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], PAD,
                        per_token={"rollout_logp": [c.logprobs for c in completions]})
    trainer_logp, _ = colo.actor.response_logprobs(batch, temperature=cfg.rollout.temperature, grad=False)
    agreement = LogprobAgreement()
    dev = trainer_logp.device
    agreement.add(batch.extras["rollout_logp"].to(dev), trainer_logp, batch.response_mask.to(dev))
    return agreement.check(cfg.rollout.handoff_check_max_mean_abs)


def release(colo) -> None:
    if colo.engine is not None:
        colo.engine.shutdown()
    del colo
    gc.collect()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- HF engine
def test_hf_engine_under_the_memory_manager_frees_device_memory(tmp_path):
    from colo_rl.rollout.base import SamplingParams

    cfg, colo = build(tmp_path, "hf", HF_DIMS)
    params = SamplingParams(max_new_tokens=8, n=2)
    for step in range(2):
        colo.switch.step = step
        with colo.switch.generation():
            completions = colo.engine.generate(random_prompts(4, seed=step), params)
        with colo.switch.update():
            grpo_like_update(colo.actor, completions)
    with colo.switch.generation():
        pass
    records = colo.ledger.records
    assert [r["transition"] for r in records] == ["update->generation", "generation->update"] * 2 + \
        ["update->generation"]
    on_ledger = [line for line in (tmp_path / "ledger.jsonl").read_text().splitlines() if line]
    assert len(on_ledger) == len(records)  # the ledger file holds what the run did

    state_gib = colo.actor.state_bytes() / GIB
    weight_gib = colo.engine.weight_bytes() / GIB
    assert state_gib > 1.0, "model too small to measure paging"
    evict = records[-1]  # after real optimizer steps: trainer states, gradients exist
    moves = {m["what"]: m for m in evict["moves"]}
    assert moves["trainer states"]["moved"] is True
    freed_alloc = evict["memory_before"]["allocated_gib"] - evict["memory_after"]["allocated_gib"]
    freed_used = evict["memory_before"]["used_gib"] - evict["memory_after"]["used_gib"]
    # Paging the states out frees them; the engine's weights come back in (HF: a full bf16 copy).
    assert freed_alloc > 0.6 * state_gib - weight_gib, (freed_alloc, state_gib, weight_gib)
    assert freed_used > 0.5 * state_gib - weight_gib, (freed_used, state_gib, weight_gib)  # back to the device
    back = records[-2]
    release_move = next(m for m in back["moves"] if m["what"].startswith("engine KV cache + weights"))
    assert release_move["bytes"] == colo.engine.weight_bytes()
    assert back["memory_after"]["allocated_gib"] > back["memory_before"]["allocated_gib"]  # states reloaded
    release(colo)


# ------------------------------------------------------------------------------------- SGLang
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="SGLang is not installed here (install it on the GPU machine; see colo_rl/colocate/NOTES.md)")


@pytest.fixture(scope="module")
def sglang_colo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang")
    cfg, colo = build(tmp, "sglang", DIMS, memory_margin_gib=8.0, temperature=1.0)
    yield cfg, colo
    release(colo)


@needs_sglang
def test_sglang_engine_starts_released_and_resumes(sglang_colo):
    _, colo = sglang_colo
    engine = colo.engine
    assert engine.state.released == set(engine.state.supported)  # released right after start
    taken = engine.wake([w for w in engine.state.supported])
    freed = engine.sleep(engine.state.supported)
    assert taken > 1 * GIB, f"resume took {taken / GIB:.2f} GiB"  # weights + a planned KV cache
    assert freed > 0.9 * taken, (freed / GIB, taken / GIB)
    assert engine.state.released == set(engine.state.supported)


@needs_sglang
def test_sglang_weights_via_ipc_agree_with_the_trainer_through_training(sglang_colo):
    from colo_rl.rollout.base import SamplingParams

    cfg, colo = sglang_colo
    params = SamplingParams(max_new_tokens=16, temperature=cfg.rollout.temperature, n=2)
    diffs = []
    for step in range(4):  # agreement before training and after each of 3 optimizer steps
        colo.switch.step = step
        with colo.switch.generation():
            completions = colo.engine.generate(random_prompts(4, seed=step), params)
        stats = colo.switch.manager.last_handoff
        assert stats.bytes == sum(n for _, n in colo.actor.named_parameter_sizes())
        with colo.switch.update():
            diffs.append(logprob_agreement(cfg, colo, completions)["handoff/logprob_diff_mean"])
            if step < 3:
                grpo_like_update(colo.actor, completions)
    assert max(diffs) <= cfg.rollout.handoff_check_max_mean_abs, diffs


@needs_sglang
def test_sglang_on_other_weights_fails_the_handoff_check(sglang_colo, monkeypatch):
    from colo_rl.colocate.handoff import HandoffError
    from colo_rl.rollout.base import SamplingParams

    cfg, colo = sglang_colo
    original = colo.engine.load_weights

    def perturbed(named_tensors):  # a handoff that "succeeds" with the wrong tensors: shuffled entries
        torch.manual_seed(0)
        original([(n, t.flatten()[torch.randperm(t.numel(), device=t.device)].view_as(t)) for n, t in named_tensors])

    monkeypatch.setattr(colo.engine, "load_weights", perturbed)
    colo.switch.step = 100
    with colo.switch.generation():
        completions = colo.engine.generate(random_prompts(4, seed=7), SamplingParams(max_new_tokens=16, n=2))
    with colo.switch.update():
        with pytest.raises(HandoffError, match="not on the trainer's weights"):
            logprob_agreement(cfg, colo, completions)
