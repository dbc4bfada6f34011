"""LoRA with SGLang on a GPU: the GRPO recipe (1 rank, tiny model, rollout=sglang) with
model.lora.rank > 0. The pinned SGLang (0.5.17 / 0.5.21) has Engine.load_lora_adapter_from_tensors,
so the handoff must be adapter-only after the first step and the engine's log-probs must still be
the trainer's; model.lora.handoff=merged exercises the fallback. Skipped without CUDA and SGLang
(`make gpu-check` runs it, with the carry's engine arguments); the decisions behind it are
CPU-tested in tests/test_lora.py."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from conftest import GPU_STACK_REQUIRED, WORKERS, hydra_dict, run_torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None and not GPU_STACK_REQUIRED,
                                 reason="SGLang is not installed")]

OVERRIDES = ["model=tiny", "model.dtype=bf16", "rollout=sglang", "model.lora.rank=8", "trainer.lr=1e-3",
             "trainer.total_steps=3", "data.eval_size=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
             "rollout.max_new_tokens=16", "rollout.eval_max_new_tokens=4", "algo.kl_coef=0.05",
             "reward.functions=[letter_share]", "reward.format_weight=0", "logger=[jsonl]", "plots=false"]
# Extra engine arguments (JSON), as for tests/test_gpu.py: `make gpu-check` sets the slim carry's
# (Triton attention, PyTorch sampling: the carry has no FA3 library).
SGLANG_KWARGS = json.loads(os.environ.get("COLO_RL_SGLANG_KWARGS", "{}"))
if SGLANG_KWARGS:
    OVERRIDES.append(f"rollout.sglang_kwargs={hydra_dict(SGLANG_KWARGS)}")


@pytest.mark.parametrize("handoff,contents", [("auto", ["base+adapters", "adapters"]), ("merged", ["merged"])])
def test_sglang_lora_handoff_keeps_engine_and_trainer_in_agreement(tmp_path, handoff, contents):
    run_torchrun(WORKERS / "grpo_resume_worker.py", OVERRIDES + [f"model.lora.handoff={handoff}",
                                                                 f"run_dir={tmp_path}"], nproc=1, timeout=420)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 3 and all(r["handoff/logprob_diff_mean"] < 0.05 for r in rows)  # bf16 engine vs trainer
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    seen = [m["content"] for rec in ledger for m in rec["moves"] if m["what"] == "weights handoff"]
    assert seen[0] == contents[0] and set(seen[1:]) == set(contents[-1:])
