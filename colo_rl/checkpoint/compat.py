"""What a resumed run must share with its checkpoint: the config rules and the RNG states."""

from __future__ import annotations

import random

import numpy as np
import torch
from omegaconf import OmegaConf

from colo_rl.config import RunConfig
from colo_rl.loggers import flatten

# ---------------------------------------------------------------------------------------------
# Which config keys may differ between a checkpoint and the run resuming from it.
# REFUSED: the saved state means something else (or is silently overridden) under a new value.
# HARMLESS: how long / how often / where to log; changed silently.
# Anything else (loss coefficients, sampling temperature, ...) is allowed with a warning: the
# state is usable, but the resumed run no longer reproduces an uninterrupted one.
REFUSED: dict[str, str] = {
    "recipe": "a checkpoint of another recipe",
    "model.path": "the weights and optimizer state belong to another model",
    "model.random_init": "the weights and optimizer state belong to another model",
    "model.hidden_size": "the weights and optimizer state belong to another model",
    "model.num_layers": "the weights and optimizer state belong to another model",
    "model.dtype": "DeepSpeed's optimizer state differs between bf16 and fp32 training",
    "model.lora.rank": "the checkpoint holds adapters of another shape (or none)",
    "model.lora.target_modules": "the checkpoint holds adapters on other modules",
    "model.lora.alpha": "the saved adapters were trained under another scaling",
    "data.": "the saved data position indexes a different dataset / order",
    "trainer.zero_stage": "DeepSpeed's shards are laid out per ZeRO stage",
    "trainer.seed": "the saved per-rank RNG states were derived from the old seed",
    "trainer.lr": "the restored optimizer and scheduler state would silently keep the old value",
    "trainer.betas": "the restored optimizer state would silently keep the old value",
    "trainer.weight_decay": "the restored optimizer state would silently keep the old value",
    "trainer.batch_size": "the saved data position counts batches of the old size",
    "rollout.prompts_per_step": "the saved data position counts batches of the old size",
    "rollout.group_size": "a step's batch would no longer be the one the state was saved for",
    "rollout.seed": "the saved engine sampling state was derived from the old seed",
}
HARMLESS: tuple[str, ...] = (
    "trainer.total_steps", "trainer.save_every", "trainer.keep_last", "trainer.eval_every",
    "trainer.max_nonfinite_steps", "trainer.max_steps", "trainer.epochs",
    "trainer.eval_generate", "rollout.eval_max_new_tokens", "rollout.eval_batch_size",
    "colocate.", "model.lora.handoff", "reward.max_failure_rate", "output_root", "run_name", "run_dir",
    "resume", "debug", "logger", "tensorboard", "plots",  # tensorboard: logger's old form
)


def _matches(key: str, pattern: str) -> bool:
    return key.startswith(pattern) if pattern.endswith(".") else key == pattern


def config_container(cfg) -> dict:
    if isinstance(cfg, dict):
        return cfg
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def compare_configs(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(refusals, warnings): one line per differing key, naming it with both values."""
    old, new = flatten(saved), flatten(current)
    defaults = flatten(config_container(RunConfig()))
    refusals, warnings = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if a == b or any(_matches(key, p) for p in HARMLESS):
            continue
        if a == "<absent>" and key in defaults and b == defaults[key]:
            continue  # a key added since the checkpoint was written (model.lora.*), at its default: unchanged
        reason = next((why for p, why in REFUSED.items() if _matches(key, p)), None)
        line = f"{key}: checkpoint {a!r}, now {b!r}"
        if reason is not None:
            refusals.append(f"{line} ({reason})")
        else:
            warnings.append(line)
    return refusals, warnings


def _engine_with(engine, attr: str):
    """The engine, or the engine a wrapper (TPGroupEngine.inner) holds, if it has `attr`."""
    for candidate in (engine, getattr(engine, "inner", None)):
        if candidate is not None and callable(getattr(candidate, attr, None)):
            return candidate
    return None


def capture_rng(engine=None) -> dict:
    """This rank's RNG states; `engine_sampling` is None for engines without `rng_state()`."""
    owner = _engine_with(engine, "rng_state")
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "engine_sampling": owner.rng_state() if owner is not None else None,
    }


def restore_rng(state: dict, engine=None) -> list[str]:
    """Restore what `capture_rng` saved; returns notes on what could not be restored exactly."""
    notes = []
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            notes.append("CUDA RNG states not restored (different device count)")
    saved = state.get("engine_sampling")
    owner = _engine_with(engine, "set_rng_state")
    if saved is not None and owner is not None:
        owner.set_rng_state(saved)
    elif saved is not None and engine is not None:
        notes.append(f"{type(engine).__name__} has no set_rng_state(): its sampling RNG restarts from its seed")
    elif saved is None and owner is not None:
        notes.append("the checkpoint holds no engine sampling state: sampling restarts from the engine's seed")
    return notes
