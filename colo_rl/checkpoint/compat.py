"""What a resumed run must share with its checkpoint: the config rules and the RNG states."""

from __future__ import annotations

import random

import numpy as np
import torch
from omegaconf import OmegaConf

from colo_rl.config import RunConfig, resume_rule
from colo_rl.loggers import flatten
from colo_rl.rollout.base import capabilities_of

# Which config keys may differ between a checkpoint and the run resuming from it: each option's
# `resume` rule, beside its field in colo_rl/config/schema.py (config/options.py: WARN, SILENT, refuse).
FORMER_KEYS = ("tensorboard",)  # the logger option's old form: changed silently


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
        rule = resume_rule(key)
        if a == b or rule.silent or key in FORMER_KEYS:
            continue
        if a == "<absent>" and key in defaults and b == defaults[key]:
            continue  # a key added since the checkpoint was written (model.lora.*), at its default: unchanged
        line = f"{key}: checkpoint {a!r}, now {b!r}"
        refused = rule.refused if old.get("placement.mode") != "split" else rule.refused or rule.refused_in_split
        if refused is not None:
            refusals.append(f"{line} ({refused})")
        else:
            warnings.append(line)
    return refusals, warnings


def _engine_with_rng(engine):
    """The engine, or the engine a wrapper (TPGroupEngine.inner) holds, if it declares a sampling RNG."""
    for candidate in (engine, engine.inner if capabilities_of(engine).wraps_engine else None):
        if candidate is not None and capabilities_of(candidate).sampling_rng:
            return candidate
    return None


def capture_rng(engine=None) -> dict:
    """This rank's RNG states; `engine_sampling` is None for engines without `rng_state()`."""
    owner = _engine_with_rng(engine)
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
    owner = _engine_with_rng(engine)
    if saved is not None and owner is not None:
        owner.set_rng_state(saved)
    elif saved is not None and engine is not None:
        notes.append(f"{type(engine).__name__} has no set_rng_state(): its sampling RNG restarts from its seed")
    elif saved is None and owner is not None:
        notes.append("the checkpoint holds no engine sampling state: sampling restarts from the engine's seed")
    elif engine is not None and owner is None:  # SGLang's: seeded at start-up, its state not readable
        notes.append(f"{type(engine).__name__} keeps no sampling RNG state a checkpoint can hold: its sampling "
                     f"restarts from its seed")
    return notes
