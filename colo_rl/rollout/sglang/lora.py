"""LoRA on SGLang, found by feature: the engine takes the trainer's adapters as tensors in memory.

SGLang 0.5.17 and 0.5.21 (both read) have `Engine.load_lora_adapter_from_tensors(lora_name,
tensors, config_dict, load_format=None)` (tensors: {adapter-file name: tensor}, serialized per TP
rank by SGLang itself, CUDA IPC handles on GPU) and `unload_lora_adapter(lora_name)`; the engine
must start with enable_lora / max_lora_rank / lora_target_modules, and a request names its adapter
with `lora_path=<lora_name>`. Each handoff unloads the previous adapter and loads the new one under
the same name. Without that API (or with tp_size > 1, where colo_rl's TP group sends per-rank
payloads) the trainer merges and hands off the whole model instead (colo_rl/colocate/handoff.py).
"""

from __future__ import annotations

from typing import Any, Optional

from colo_rl.lora import adapter_config_dict, lora_enabled

ADAPTER_NAME = "colo_rl_policy"


def lora_engine_support(model_cfg, engine_cls, tp_size: int) -> tuple[bool, str]:
    """Can this SGLang take colo_rl's adapters as tensors? (yes/no, why)."""
    if not lora_enabled(model_cfg):
        return False, "model.lora.rank=0"
    if model_cfg.lora.handoff != "auto":
        return False, f"model.lora.handoff={model_cfg.lora.handoff}"
    missing = [m for m in ("load_lora_adapter_from_tensors", "unload_lora_adapter")
               if not callable(getattr(engine_cls, m, None))]
    if missing:
        return False, f"this SGLang's Engine has no {missing}"
    if tp_size > 1:
        return False, f"rollout.tp_size={tp_size} (adapter tensors are sent by the engine's first rank only)"
    return True, "Engine.load_lora_adapter_from_tensors"


def lora_server_kwargs(model_cfg) -> dict[str, Any]:
    """Engine arguments that make room for one adapter of colo_rl's shape."""
    return {"enable_lora": True, "max_lora_rank": int(model_cfg.lora.rank),
            "lora_target_modules": list(model_cfg.lora.target_modules), "max_loras_per_batch": 1}


def adapter_request(named_tensors, model_cfg) -> dict[str, Any]:
    """load_lora_adapter_from_tensors's arguments for one handoff's adapters."""
    return {"lora_name": ADAPTER_NAME, "tensors": dict(named_tensors),
            "config_dict": adapter_config_dict(model_cfg.lora)}


def request_lora_paths(adapter_loaded: bool, n: int) -> Optional[list[str]]:
    """generate's lora_path: every request on the policy's adapter once one is loaded."""
    return [ADAPTER_NAME] * n if adapter_loaded else None
