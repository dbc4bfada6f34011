"""Checkpoints: HF export (any rank count, any ZeRO stage)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from colo_rl import dist

log = logging.getLogger("colo_rl")


def export_hf(actor, tokenizer, out_dir: Path) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer) that
    `AutoModelForCausalLM.from_pretrained` and SGLang load. Every rank must call it (ZeRO-3
    gathers are collectives); rank 0 writes, atomically via a temporary directory."""
    out_dir = Path(out_dir)
    state = actor.full_state_dict_on_rank0()
    if dist.is_rank0():
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        actor.module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        log.info("HF model written to %s", out_dir)
    dist.barrier()
    return out_dir
