"""The embedded model's tokenizer agrees with its model config on the special tokens, whatever
transformers version converted the GGUF (5.12, the GPU carry's, reads EOS as <|im_start|>)."""

from __future__ import annotations

import json

import pytest
import torch

from colo_rl import models
from colo_rl.models import (align_special_tokens, describe_dtype, embedded_model_dir, eos_token_ids, load_model,
                            load_tokenizer, model_config, weight_bytes)
from colo_rl.config import ModelConfig


def test_the_embedded_tokenizer_has_the_model_configs_special_tokens():
    tok = load_tokenizer("embedded")
    config = model_config(ModelConfig())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (config.bos_token_id, config.eos_token_id,
                                                                      config.pad_token_id) == (1, 2, 2)
    assert eos_token_ids(tok, embedded_model_dir()) == [2]  # stops at <|im_end|> only
    saved = json.loads((embedded_model_dir() / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == "<|im_end|>"  # what an exported checkpoint carries


def test_a_tokenizer_read_as_transformers_5_12_reads_it_is_aligned_to_the_config():
    tok = load_tokenizer("embedded")
    config = model_config(ModelConfig())
    tok.eos_token = tok.pad_token = "<|im_start|>"  # transformers 5.12's reading of the GGUF
    changed = align_special_tokens(tok, config)
    assert changed == ["eos_token 1 -> 2 (<|im_end|>), as the model config says",
                       "pad_token 1 -> 2 (<|im_end|>), as the model config says"]
    assert (tok.eos_token_id, tok.pad_token_id) == (2, 2)
    assert align_special_tokens(tok, config) == []


def test_a_hub_id_as_model_path_says_how_to_download_it(tmp_path):
    from colo_rl.models import resolve_model_path

    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    assert "model.path='Qwen/Qwen2.5-0.5B-Instruct' does not exist. It looks like a Hugging Face hub id: colo_rl " \
           "never downloads models. Download it first, e.g. `huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct " \
           "--local-dir models/Qwen2.5-0.5B-Instruct`" in str(e.value)
    for path in (str(tmp_path / "nope"), "../models/x", "nope"):  # paths, not hub ids: no download hint
        with pytest.raises(FileNotFoundError) as e:
            resolve_model_path(path)
        assert "hub id" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_from_the_structure_equal_the_loaded_models(dtype):
    """What a split generator's GPU holds back for its weight receiver (colocate/setup.py): the
    tiny model's tied embedding counted once, as the loaded model holds it."""
    cfg = ModelConfig(random_init=True, hidden_size=64, num_layers=2)
    model = load_model(cfg, dtype)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(cfg, dtype) == held > 0


def test_the_base_generation_config_is_what_from_pretrained_reads(tmp_path):
    """What the checkpoint export gives its model from_config (a run's model came from_pretrained):
    the base's generation_config.json, e.g. an instruct model's two EOS ids; none for a random model."""
    import shutil

    from colo_rl.models import base_generation_config, resolve_model_path

    base = tmp_path / "base"
    shutil.copytree(resolve_model_path("embedded"), base, ignore=shutil.ignore_patterns("*.safetensors"))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.7,
                                                             "do_sample": True}))
    gen = base_generation_config(ModelConfig(path=str(base)))
    assert (gen.eos_token_id, gen.temperature, gen.do_sample) == ([2, 7], 0.7, True)
    assert base_generation_config(ModelConfig(path=str(base), random_init=True)) is None
    (base / "generation_config.json").unlink()
    assert base_generation_config(ModelConfig(path=str(base))) is None


@pytest.mark.parametrize("cuda,native_bf16,expected", [
    (False, False, "float32 (model.dtype=auto on a CPU without native bf16 math)"),
    (False, True, "bfloat16 (model.dtype=auto on a CPU with native bf16 math)"),
    (True, False, "bfloat16 (model.dtype=auto on a GPU)"),
])
def test_the_start_up_line_says_why_auto_chose_its_dtype(monkeypatch, cuda, native_bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(models, "cpu_supports_bf16", lambda: native_bf16)
    assert describe_dtype("auto") == expected
    assert describe_dtype("fp32") == "float32" and describe_dtype("bf16") == "bfloat16"  # asked for: no reason
