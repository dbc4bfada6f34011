"""A generation rank's position in the data and its engine's sampling RNG: sent with every slot,
saved by the trainers for the last slot they used, restored on a resume (colo_rl/split/NOTES.md).
JSON, as a checkpoint's state.json holds it."""

from __future__ import annotations

import base64
import logging

import torch

from colo_rl import dist

log = logging.getLogger("colo_rl")


def generator_position(sampler, engine) -> dict:
    """The sampler's state and, for an engine with `rng_state()` (the HF engine), its sampling RNG."""
    rng = getattr(engine, "rng_state", None)
    return {"sampler": sampler.state_dict(),
            "engine_rng": base64.b64encode(rng().numpy().tobytes()).decode() if callable(rng) else None}


def restore_generator_position(position: dict, sampler, engine) -> None:
    sampler.load_state_dict(position["sampler"])
    if position.get("engine_rng") is not None and callable(getattr(engine, "set_rng_state", None)):
        engine.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(position["engine_rng"])), dtype=torch.uint8))
    log.info("generation rank %d: resumed at data position %s", dist.job_rank(), position["sampler"])
