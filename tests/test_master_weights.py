"""A bf16 run's fp32 master weights start from the checkpoint's fp32 values, not from their bf16
rounding (colo_rl/train/optimizer_state.master_weights_from_checkpoint; why: docs/algorithms.md, issue #40)."""

import json
import sys

import torch

from tests.conftest import WORKERS, child_env, child_python_path


def test_bf16_masters_start_from_the_fp32_checkpoint(tmp_path):
    import subprocess

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=49152, max_position_embeddings=512, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(tmp_path / "model")  # fp32 values, off the bf16 grid
    from colo_rl.models import embedded_model_dir
    import shutil
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(embedded_model_dir() / f, tmp_path / "model" / f)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(WORKERS / "master_weights_worker.py"), str(tmp_path / "model"), str(out)],
                          env=child_env(PYTHONPATH=child_python_path()), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["checkpoint_off_grid_share"] > 0.9  # the check means something: most values lie between bf16 values
    assert r["master_equals_checkpoint"]  # not their bf16 rounding
    assert r["low_is_rounded_checkpoint"]  # the forward's bf16 weights are what was loaded
    assert r["master_moved"] > 0
