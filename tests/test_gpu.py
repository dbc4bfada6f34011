"""GPU checks: real CUDA, real DeepSpeed, real SGLang where installed. Never faked.

Skipped without CUDA (tests/conftest.py); `make gpu-check` runs them on a GPU machine. One process,
world of one rank, tp_size 1 (the TP data path is tested on CPU in test_tp_group.py).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conftest import GPU_STACK_REQUIRED, child_env, child_python_path  # noqa: E402
from benchmarks.phase_switch import EOS, PAD, bench_config, grpo_like_update, write_random_llama  # noqa: E402

# conftest.py skips `gpu` tests without CUDA; the skipif keeps this module safe on its own too.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GIB = 1 << 30
TOKENIZER = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)  # random token ids: no text involved
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
    return torch.randint(3, HF_DIMS["vocab_size"], (n, length), generator=g).tolist()


def build(tmp_path, engine: str, dims: dict, kl_coef: float = 0.0, **rollout):
    from colo_rl.colocate.setup import build_colocated

    model_dir = write_random_llama(tmp_path / f"model-{engine}", **dims)
    cfg = bench_config(model_dir, engine, "bf16", steps=8, seqs=8)
    cfg.trainer.lr = 1e-3  # weights move visibly between steps
    cfg.algo.kl_coef = kl_coef  # > 0: a frozen reference model, paged with the trainer
    for key, value in rollout.items():
        setattr(cfg.rollout, key, value)
    colo = build_colocated(cfg, TOKENIZER, torch.bfloat16, run_dir=tmp_path, total_steps=8, grad_accum=1)
    return cfg, colo


@pytest.fixture(autouse=True)
def free_gpu_memory_after_each_test():
    """A test's colocated set (actor, engine) dies with its frame, after the test returns (its own
    release() call cannot drop the caller's reference): collect it, and give the cached blocks back,
    so the next test (the SGLang worker, another process) starts with the GPU free."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


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
        colo.switch.begin_step(step)
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


def test_reference_model_is_paged_with_the_trainer(tmp_path):
    """kl_coef > 0, full fine-tune: the frozen reference's partitions leave the GPU for the
    generation phase and come back unchanged (its log-probs are bit-equal)."""
    from colo_rl.train.batch import build_batch

    cfg, colo = build(tmp_path, "hf", HF_DIMS, kl_coef=0.05)
    prompts = random_prompts(4, seed=5)
    batch = build_batch(prompts, [p[:8] for p in prompts], PAD)
    with colo.switch.update():
        before, _ = colo.ref.response_logprobs(batch, grad=False)
    (paging,) = colo.switch.manager.frozen
    ref_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in colo.ref.module.parameters())
    with colo.switch.generation():
        on_host = all(t.device.type == "cpu" for t in paging.pager.tensors)
    with colo.switch.update():
        after, _ = colo.ref.response_logprobs(batch, grad=False)
    to_gen, to_train = colo.ledger.records[-2:]
    out = next(m for m in to_gen["moves"] if m["what"] == "reference model")
    back = next(m for m in to_train["moves"] if m["what"] == "reference model")
    assert paging.name == "reference model" and on_host
    assert out["moved"] and back["moved"] and out["bytes"] == back["bytes"] == ref_bytes
    assert torch.equal(before, after)
    release(colo)


def test_auto_micro_batch_tokens_come_from_the_update_phases_free_memory(tmp_path):
    """trainer.micro_batch_tokens=auto on a GPU: sized from the memory free once the engine has
    released it (the update phase), within its bounds; the demo's 4 groups per rank (each at most
    ~60 + 8 x 40 tokens) then take at most 2 micro-batches. The estimate knows the GPU runs the
    chunked LM head (no whole logits)."""
    from colo_rl.train.activation_memory import AUTO_MAX_TOKENS, AUTO_MIN_TOKENS, micro_batch_token_budget
    from colo_rl.train.batch import micro_batches

    cfg, colo = build(tmp_path, "hf", HF_DIMS)
    with colo.switch.update():
        free = torch.cuda.mem_get_info()[0]
        tokens = colo.actor.micro_batch_tokens()
    assert colo.actor.chunked_lm_head  # a GPU's default
    expect = micro_batch_token_budget("auto", colo.actor.config, colo.actor.dtype, free, chunked_head=True)
    assert AUTO_MIN_TOKENS <= tokens <= AUTO_MAX_TOKENS and abs(tokens - expect) <= 0.05 * expect
    assert len(micro_batches([380] * 4, tokens)) <= 2
    release(colo)


# ------------------------------------------------------------------------------------- SFT, DPO
def offline_step_losses(packing: bool) -> dict:
    """One SFT step, one DPO step (cached reference log-probs) and DPO's pass of sequence log-probs
    on the device, padded or packed: the losses (at the initial weights) and the log-probs."""
    from workers.worker_support import load_recipe_module, scripted_offline_data

    from colo_rl.config import ModelConfig, RunConfig
    from colo_rl.train.actor import DeepSpeedActor
    from colo_rl.train.offline import pair_logps, sft_micro_batches

    examples, pairs, cached = scripted_offline_data(3)
    out = {}
    for recipe in ("sft", "dpo"):
        cfg = RunConfig(model=ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"))
        cfg.trainer.packing, cfg.trainer.micro_batch_size, cfg.trainer.batch_size = packing, 2, 4
        actor = DeepSpeedActor(cfg, torch.float32, total_steps=2)
        module = load_recipe_module(recipe)
        if recipe == "sft":
            batches = sft_micro_batches(examples, 2, 0, packing, max_len=16, budget=actor.micro_batch_tokens())
            out["sft_loss"] = module.sft_step(actor, batches, 0, examples)["train/loss"]
        else:
            out["dpo_logps"] = pair_logps(actor, pairs, 2, 0, False, packing, budget=actor.micro_batch_tokens())
            out["dpo_loss"] = module.dpo_step(cfg, actor, None, pairs, list(range(4)), cached, 0, False,
                                              torch.float32)["train/loss"]
        del actor
        gc.collect()
    return out


def test_sft_and_dpo_steps_run_on_the_device_padded_or_packed():
    """The offline recipes' steps move each micro-batch to the device once and keep their statistics
    there (tests/test_update_overhead.py counts it on CPU); here they meet a real device. Padded and
    packed layouts give the same losses and sequence log-probs (fp32, the first step's weights)."""
    padded, packed = offline_step_losses(False), offline_step_losses(True)
    for key in ("sft_loss", "dpo_loss"):
        assert padded[key] == pytest.approx(packed[key], rel=1e-4, abs=1e-5), (key, padded[key], packed[key])
        assert padded[key] == padded[key] and padded[key] > 0.0  # finite, and a loss
    for a, b in zip(padded["dpo_logps"], packed["dpo_logps"]):
        assert a.device.type == "cpu" and torch.allclose(a, b, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------- SGLang
# The SGLang checks run in a worker process (tests/workers/sglang_gpu_worker.py): an SGLang scheduler
# failure signals its parent, and inside pytest that would end the whole suite.
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None and not GPU_STACK_REQUIRED,
                                  reason="SGLang is not installed here (make gpu-wheels here, make gpu-install "
                                         "on the GPU machine; see docs/history.md)")
# Extra engine arguments for the worker (rollout.sglang_kwargs), as JSON; `make gpu-check` sets them.
SGLANG_KWARGS = os.environ.get("COLO_RL_SGLANG_KWARGS", "{}")


@pytest.fixture(scope="module")
def sglang_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang")
    # Under `make gpu-check` the worker's output (written as it runs, so a hang that the device call's
    # budget cuts short still leaves it) and its report (the figures behind the asserts) go with the logs.
    keep = Path(os.environ.get("COLO_RL_GPU_LOG_DIR") or tmp)
    keep.mkdir(parents=True, exist_ok=True)
    out, log = keep / "sglang_gpu_report.json", keep / "sglang_gpu_worker.log"
    out.unlink(missing_ok=True)  # never a previous run's
    # A world of its own: not this process's rendezvous port (dist.init put it in the environment).
    env = child_env(PYTHONPATH=child_python_path())
    with open(log, "w") as fh:
        try:
            proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "sglang_gpu_worker.py"), str(out),
                                   str(tmp), SGLANG_KWARGS], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=420)  # inside a device call's 10 minutes, with the HF tests
            status = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            status = f"timed out after {e.timeout} s"
    report = json.loads(out.read_text()) if out.exists() else {}
    report["_output"] = f"{status} ({log})\n{log.read_text()[-12000:]}"
    return report


def part(report: dict, key: str) -> dict:
    if key not in report:
        pytest.fail(f"the SGLang worker did not reach {key!r}: {report.get('error', '')}\n{report['_output']}")
    return report[key]


@needs_sglang
def test_sglang_engine_starts_released_and_resumes(sglang_report):
    start = part(sglang_report, "start")
    assert start["released_at_start"] == sorted(start["supported"])  # released right after start
    assert start["taken_bytes"] > 1 * GIB, f"resume took {start['taken_bytes'] / GIB:.2f} GiB"  # weights + KV cache
    assert start["freed_bytes"] > 0.9 * start["taken_bytes"], (start["freed_bytes"] / GIB, start["taken_bytes"] / GIB)
    assert start["released_after"] == sorted(start["supported"])


@needs_sglang
def test_sglang_weights_via_ipc_agree_with_the_trainer_through_training(sglang_report):
    agreement = part(sglang_report, "agreement")
    steps = agreement["steps"]
    assert len(steps) == 4
    assert all(s["handoff_bytes"] == agreement["model_bytes"] for s in steps), steps
    assert all(s["tokens"] > 0 for s in steps)
    diffs = [s["handoff/logprob_diff_mean"] for s in steps]
    assert max(diffs) <= agreement["threshold"], diffs


@needs_sglang
def test_sglang_on_other_weights_fails_the_handoff_check(sglang_report):
    perturbed = part(sglang_report, "perturbed")
    assert perturbed["raised"], "a handoff of shuffled weights passed the engine-vs-trainer check"
    assert "not on the trainer's weights" in perturbed["message"]


@needs_sglang
def test_sglang_worker_finished_cleanly(sglang_report):
    assert sglang_report.get("done"), sglang_report.get("error") or sglang_report["_output"]
