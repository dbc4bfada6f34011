"""LoRA adapters (PEFT) on a causal LM: wrapping, the names they travel under, merging, and the
fingerprint of the frozen base that a LoRA checkpoint keeps instead of the base itself (and its check
on resume).

Three namings meet here:
- PEFT's module names (what the trainer's and the HF engine's wrapped models hold):
  `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`, `....q_proj.lora_A.default.weight`;
- HF names of the base model (what SGLang and an HF model directory hold): `model.layers.0.self_attn.q_proj.weight`;
- PEFT's adapter-file names (adapter_model.safetensors, SGLang's load_lora_adapter_from_tensors):
  `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.
The handoff sends base weights under HF names and adapters under adapter-file names; each engine
maps them to its own (`external_name`).
"""

from __future__ import annotations

import torch

from colo_rl import dist
from colo_rl.errors import CheckpointError, ConfigError

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # PEFT's adapter name when none is given
_BASE_LAYER = ".base_layer."
_LORA_PARTS = (".lora_A.", ".lora_B.")


def lora_enabled(model_cfg) -> bool:
    return model_cfg.lora.rank > 0


def peft_config(lora_cfg):
    """PEFT's LoraConfig for model.lora (plain LoRA: no bias, no rsLoRA, no DoRA)."""
    from peft import LoraConfig  # PEFT is only needed with model.lora.rank > 0

    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                      target_modules=list(lora_cfg.target_modules), bias="none", task_type="CAUSAL_LM")


def adapter_config_dict(lora_cfg, base_model: str = "") -> dict:
    """adapter_config.json's content (what SGLang's load_lora_adapter_from_tensors takes)."""
    cfg = peft_config(lora_cfg)
    cfg.base_model_name_or_path = base_model
    out = cfg.to_dict()
    out["target_modules"] = sorted(out["target_modules"])  # a set in PEFT: JSON needs a list
    out["peft_type"] = "LORA"
    out["task_type"] = "CAUSAL_LM"
    return out


def apply_lora(model, lora_cfg, seed: int):
    """Wrap `model` with LoRA adapters (base frozen, adapters trainable). lora_A's random init is
    drawn from `seed` without touching the global RNG, so every rank and every rerun start alike;
    lora_B starts at zero (the wrapped model equals the base)."""
    from peft import get_peft_model

    check_target_modules(model, lora_cfg.target_modules)  # before PEFT, which raises its own when none matches
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(lora_cfg))


def linear_modules(model) -> list[str]:
    """Full names of the layers LoRA can adapt (torch Linear, or transformers' Conv1D as in GPT-2)."""
    kinds = [torch.nn.Linear]
    try:
        from transformers.pytorch_utils import Conv1D

        kinds.append(Conv1D)
    except ImportError:
        pass
    return [name for name, m in model.named_modules() if isinstance(m, tuple(kinds))]


def check_target_modules(model, targets) -> None:
    """Every model.lora.target_modules entry names a linear layer of the (unwrapped) model as PEFT
    matches it (the module's name, or its dotted tail); ConfigError listing the model's own linear
    layer names otherwise (one typo among good names included). At start-up on the model's skeleton
    (models.model_skeleton), and again in apply_lora."""
    full = linear_modules(model)
    matches = lambda name, target: name == target or name.endswith(f".{target}")  # noqa: E731
    missing = [t for t in targets if not any(matches(n, t) for n in full)]
    if missing:
        names = sorted({n.rsplit(".", 1)[-1] for n in full})
        raise ConfigError(f"model.lora.target_modules: {missing} match no linear layer of this model; its linear "
                          f"layers are {names}")
    # a layer sharing its weight with the input embedding (tie_word_embeddings: the LM head) is listed
    # once, as the embedding, so its adapter could not be merged into the engine's or exported weights
    embedding, modules = model.get_input_embeddings().weight, dict(model.named_modules())
    tied = sorted({t for t in targets for n in full if matches(n, t) and modules[n].weight is embedding})
    if tied:
        raise ConfigError(f"model.lora.target_modules: {tied} share their weight with the input "
                          f"embedding (tie_word_embeddings), so an adapter on them cannot be merged; remove them")


def is_adapter(name: str) -> bool:
    return any(part in name for part in _LORA_PARTS)


def external_name(peft_name: str) -> str:
    """The name a wrapped model's parameter travels under: adapter-file name for adapters, HF name
    for base weights."""
    if is_adapter(peft_name):
        return peft_name.replace(f".{ADAPTER}.", ".")
    name = peft_name[len(PEFT_PREFIX):] if peft_name.startswith(PEFT_PREFIX) else peft_name
    return name.replace(_BASE_LAYER, ".")


def module_of(peft_name: str) -> str:
    """`...q_proj.base_layer.weight` / `...q_proj.lora_A.default.weight` -> `...q_proj` (the wrapped
    Linear a merge combines); other names are their own unit."""
    for part in (_BASE_LAYER, *_LORA_PARTS):
        if part in peft_name:
            return peft_name.split(part)[0]
    return peft_name


def merge_units(names: list[str]) -> list[list[str]]:
    """Parameter names grouped by what one merge needs (a wrapped Linear's base weight, bias and
    both adapter matrices together), in order."""
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(module_of(name), []).append(name)
    return list(units.values())


def transposed_modules(model) -> frozenset[str]:
    """The wrapped layers that store their weight [in, out] (transformers' Conv1D, GPT-2's: PEFT's
    fan_in_fan_out), by the module names `module_of` gives."""
    return frozenset(name for name, m in model.named_modules() if getattr(m, "fan_in_fan_out", False))


def merged_tensors(named: list[tuple[str, torch.Tensor]], scaling: float,
                   transposed: frozenset[str] = frozenset()) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of the merged model for whole merge units: W + scaling * B @ A (in fp32,
    then the base weight's dtype; (B @ A)^T for a layer in `transposed`, `transposed_modules`);
    unadapted tensors pass through (not copied)."""
    by_name = dict(named)
    out = []
    for name, tensor in named:
        if is_adapter(name):
            continue
        if name.endswith(f"{_BASE_LAYER}weight"):
            module = module_of(name)
            a = by_name[f"{module}.lora_A.{ADAPTER}.weight"].float()
            b = by_name[f"{module}.lora_B.{ADAPTER}.weight"].float()
            delta = b @ a
            tensor = (tensor.float() + scaling * (delta.T if module in transposed else delta)).to(tensor.dtype)
        out.append((external_name(name), tensor))
    return out


def lora_scaling(lora_cfg) -> float:
    return float(lora_cfg.alpha) / float(lora_cfg.rank)


FROZEN_BASE_KEY = "colo_rl_frozen_base"  # client_state key of a LoRA checkpoint's base fingerprint


def tensor_fingerprint(t: torch.Tensor, chunk: int = 1 << 22) -> tuple[int, int]:
    """Two int64 sums over a tensor's bit patterns: plain and position-weighted (weights 1..65521),
    wrapping modulo 2^64, so the result does not depend on the device or the reduction order: a
    changed element always changes it, values moved between positions almost always. Cheap on any
    device (no host copy of the tensor)."""
    flat = t.detach().reshape(-1)
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[flat.element_size()]
    flat = flat.view(bits)
    plain = weighted = 0
    for start in range(0, flat.numel(), chunk):
        x = flat[start:start + chunk].to(torch.int64)
        w = torch.arange(start, start + x.numel(), device=x.device, dtype=torch.int64) % 65521 + 1
        plain += int(x.sum())
        weighted += int((x * w).sum())
    wrap = lambda v: (v + 2**63) % 2**64 - 2**63  # noqa: E731  (the Python sums of chunks, back to int64)
    return wrap(plain), wrap(weighted)


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter: its ZeRO-3 shard (`ds_tensor`) without the padding
    DeepSpeed leaves uninitialised at the end of the last rank's shard (partition_parameters.py:
    torch.empty, then only the real elements copied), or the whole tensor without ZeRO-3."""
    shard = getattr(p, "ds_tensor", None)
    if shard is None:
        return p.data
    import torch.distributed as tdist

    group = getattr(p, "ds_process_group", None)
    start = (tdist.get_rank(group=group) if tdist.is_initialized() else 0) * shard.numel()
    return shard.reshape(-1)[:max(0, min(shard.numel(), p.ds_numel - start))]


def frozen_fingerprint(named_parameters) -> dict[str, tuple[int, int]]:
    """{name: tensor_fingerprint} of this rank's part of every frozen parameter."""
    return {n: tensor_fingerprint(local_part(p)) for n, p in named_parameters if not p.requires_grad}


def partition_bounds(numel: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s elements of a flattened parameter under ZeRO-3 over `world`
    ranks: the tensor padded to a multiple of `world`, cut in equal shards (partition_parameters.py
    _partition_param); padding is no element, so the last shards may be short or empty."""
    size = -(-numel // world)
    start = min(numel, rank * size)
    return start, min(numel, start + size)


def rank_fingerprint(named_parameters, rank: int, world: int, partitioned: bool) -> dict[str, tuple[int, int]]:
    """frozen_fingerprint as rank `rank` of `world` computed it in a run, from whole tensors (one
    process, no DeepSpeed): its ZeRO-3 part of each when `partitioned`, else the whole tensor."""
    out = {}
    for n, p in named_parameters:
        if not p.requires_grad:
            flat = p.detach().reshape(-1)
            out[n] = tensor_fingerprint(flat[slice(*partition_bounds(flat.numel(), rank, world))] if partitioned
                                        else flat)
    return out


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """Names whose fingerprints differ, or that only one side has (sorted)."""
    saved = {n: tuple(v) for n, v in saved.items()}
    return sorted(n for n in set(saved) | set(current) if saved.get(n) != current.get(n))


def check_frozen_base(saved: dict | None, named_parameters, model_cfg, directory: str) -> None:
    """A LoRA checkpoint's base fingerprint `saved` against this rank's frozen parameters: every rank
    compares its shards, one all-reduce makes every rank raise together (CheckpointError). A
    checkpoint without a fingerprint (written before LoRA checkpoints left the base out) holds the
    base itself: nothing to check."""
    if saved is None:
        return
    current = frozen_fingerprint(named_parameters)
    differing = fingerprint_differences(saved, current)
    if dist.all_reduce_max([float(bool(differing))])[0] == 0:
        return
    where = (f"on rank {dist.rank()}: {len(differing)} of {len(current)} frozen tensors differ, the first "
             f"{differing[0]}") if differing else "on another rank"
    base = ("the seeded random base (model.random_init)" if model_cfg.random_init
            else f"the base this run rebuilt from model.path={model_cfg.path!r}")
    raise CheckpointError(
        f"cannot resume from {directory}: a LoRA checkpoint holds the adapters, not the frozen base, and "
        f"{base} is not the one the adapters were trained on ({where}). Point model.path at the weights the "
        f"run started from (with the same model.dtype), or start a new run (resume=null).")
