"""The SGLang-on-CPU test shim must not change what the rest of a test process computes.

Its pin_memory part replaces torch's tensor factories in every process of `make test`'s venv that
imports sglang.srt.lora (the venv's .pth puts tests/sglang_cpu_shims/ on sys.path, so Python runs
its sitecustomize.py everywhere). Once, that made every later `from_pretrained` in the process leave
the rotary `inv_freq` buffer uninitialised: the greedy answers of the next test module's HF engine
were EOS (the test-order dependency in docs/history.md). Checked in a fresh interpreter,
since the patch is process-wide and cannot be undone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SHIMS = Path(__file__).resolve().parent / "sglang_cpu_shims"

CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import colo_rl_sglang_cpu_shim as shim

assert shim.drop_pin_memory(), "the shim did not patch (a CUDA machine?)"
assert torch.empty(2, pin_memory=True).shape == (2,)  # what the shim is for
with torch.device("meta"):
    assert torch.empty(2).device.type == "meta" and torch.tensor([1.0]).device.type == "meta"

config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64)
AutoModelForCausalLM.from_config(config).save_pretrained(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
params = getattr(config, "rope_parameters", None) or {}
theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
dim = config.hidden_size // config.num_attention_heads
expected = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
got = model.model.rotary_emb.inv_freq
assert torch.allclose(got, expected), f"rotary inv_freq after from_pretrained: {got.tolist()} != {expected.tolist()}"
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the pin_memory shim patches only a torch without CUDA")
def test_patched_factories_keep_torch_device_contexts_and_from_pretrained_initialises_buffers(tmp_path):
    run = subprocess.run([sys.executable, "-c", CHECK, str(SHIMS), str(tmp_path / "model")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
