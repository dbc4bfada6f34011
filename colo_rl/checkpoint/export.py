"""HF model directories from a live trainer (export_hf) or from a saved checkpoint
(`python -m colo_rl.checkpoint <checkpoint or run dir> <out_dir>`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from colo_rl import dist
from colo_rl.checkpoint.manager import CHECKPOINTS, COMPLETE, DS_TAG, is_complete, newest_checkpoint
from colo_rl.config import RunConfig
from colo_rl.errors import CheckpointError
from colo_rl.lora import (FROZEN_BASE_KEY, apply_lora, fingerprint_differences, is_adapter, lora_enabled,
                          rank_fingerprint)
from colo_rl.models import base_generation_config, load_model, load_tokenizer, model_config
from colo_rl.train.adapters import adapter_state_dict_on_rank0, merged_state_dict_on_rank0

log = logging.getLogger("colo_rl")


ADAPTER_DIR = "adapter"  # a LoRA run's PEFT adapter, inside the exported (merged) model directory


def export_hf(actor, tokenizer, out_dir: Path) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer) that
    `AutoModelForCausalLM.from_pretrained` and SGLang load. Every rank must call it (ZeRO-3
    gathers are collectives); rank 0 writes, atomically via a temporary directory.
    LoRA: the model is the merged one, and `<out_dir>/adapter/` holds the PEFT adapter
    (`PeftModel.from_pretrained(base, <out_dir>/adapter)`)."""
    out_dir = Path(out_dir)
    lora = getattr(actor, "lora", False)
    state = merged_state_dict_on_rank0(actor) if lora else actor.full_state_dict_on_rank0()
    adapter = adapter_state_dict_on_rank0(actor) if lora else None
    if dist.is_rank0():
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model = actor.module.get_base_model() if lora else actor.module  # the HF model (LoRA: its config, names)
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if lora:
            actor.module.save_pretrained(tmp / ADAPTER_DIR, state_dict=adapter, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        log.info("HF model written to %s", out_dir)
    dist.barrier()
    return out_dir


def check_out_dir(checkpoint: Path, out_dir: Path) -> None:
    """The export replaces `out_dir` whole: refuse one that holds the checkpoint (a run directory)
    or anything but an earlier export (an HF model directory: config.json)."""
    out, ckpt = out_dir.resolve(), checkpoint.resolve()
    if out == ckpt or out in ckpt.parents:
        raise CheckpointError(f"export: {out_dir} holds the checkpoint {checkpoint} (the export replaces its "
                              f"out_dir whole); pass a new directory, e.g. {out_dir / 'exported'}")
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file()):
        raise CheckpointError(f"export: {out_dir} exists and is not an HF model directory (the export replaces "
                              f"its out_dir whole, and would delete what is there); pass a new or empty directory")


def export_checkpoint_to_hf(checkpoint: Path, out_dir: Path, base: Optional[str] = None) -> Path:
    """Export a saved checkpoint (any rank count, any ZeRO stage) to an HF model directory, in one
    process without torchrun: DeepSpeed consolidates the fp32 master weights from the shards.
    `base`: a LoRA run's base model directory, when it has moved since the run (default: the run's
    model.path); checked against the checkpoint's fingerprint of the base either way."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM


    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_complete(checkpoint):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {COMPLETE} marker)")
    check_out_dir(checkpoint, out_dir)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                              OmegaConf.load(checkpoint / "config.yaml")))
    if base is not None:
        if not lora_enabled(cfg.model):
            raise CheckpointError(f"export: --base is for a LoRA checkpoint (whose base it does not hold); "
                                  f"{checkpoint} holds the whole model (model.lora.rank=0)")
        if cfg.model.random_init:
            raise CheckpointError(f"export: {checkpoint}'s run started from a seeded random base "
                                  f"(model.random_init=true), which the export rebuilds; drop --base")
        cfg.model.path = base
    state = json.loads((checkpoint / "state.json").read_text())
    dtype = getattr(torch, state.get("dtype", "float32"))
    weights = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)
    if lora_enabled(cfg.model):
        return _export_lora_checkpoint(checkpoint, cfg, weights, dtype, out_dir)
    model = AutoModelForCausalLM.from_config(model_config(cfg.model), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())  # a dict {tied: source} or a list
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint}: its weights do not match the model its config describes "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model.tie_weights()
    if (generation := base_generation_config(cfg.model)) is not None:  # the base's EOS ids, as the run exported
        model.generation_config = generation
    model = model.to(dtype)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(cfg.model.path).save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log.info("HF model from %s written to %s", checkpoint, out_dir)
    return out_dir


def _export_lora_checkpoint(checkpoint: Path, cfg, weights: dict, dtype: torch.dtype, out_dir: Path) -> Path:
    """A LoRA checkpoint holds the adapters (its base is frozen: model.path's weights, or the seeded
    random ones): the base is rebuilt as the run built it, the adapters loaded, and both the PEFT
    adapter (<out_dir>/adapter/) and the merged model written."""
    # the base as the run built it: in the run's dtype, so its bits are the fingerprinted ones
    model = apply_lora(load_model(cfg.model, dtype, seed=cfg.trainer.seed), cfg.model.lora, seed=cfg.trainer.seed)
    check_saved_base(checkpoint, cfg.model, model)
    adapters = {k: v for k, v in weights.items() if is_adapter(k)}
    missing = [k for k, _ in model.named_parameters() if is_adapter(k) and k not in adapters]
    if not adapters or missing:
        raise CheckpointError(f"{checkpoint}: its config has model.lora.rank={cfg.model.lora.rank} but the "
                              f"checkpoint lacks adapter weights {missing[:3]}")
    model.load_state_dict(adapters, strict=False)
    model = model.to(dtype)  # the run's weights: base and adapters in its dtype
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / ADAPTER_DIR, safe_serialization=True)
    # merged in fp32 and rounded once, as the run merges (lora.merged_tensors): PEFT merging in bf16
    # would round the update, then the sum
    model.float().merge_and_unload().to(dtype).save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(cfg.model.path).save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    log.info("HF model (merged LoRA) and PEFT adapter from %s written to %s", checkpoint, out_dir)
    return out_dir


def saved_base_fingerprints(checkpoint: Path) -> tuple[list[Optional[dict]], bool]:
    """Each rank's fingerprint of the frozen base (lora.FROZEN_BASE_KEY in its DeepSpeed client
    state, None in a checkpoint written before there was one), rank order, and whether the ranks
    held ZeRO-3 parts (one model-states file per rank) or the whole base (one file)."""
    tag_dir = checkpoint / DS_TAG
    per_rank = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"),
                      key=lambda f: int(f.name.split("_")[3]))
    files = per_rank or [tag_dir / "mp_rank_00_model_states.pt"]
    # DeepSpeed's own files, loaded as DeepSpeed loads them (they pickle its config objects)
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    return [s.get(FROZEN_BASE_KEY) for s in states], bool(per_rank)


def check_saved_base(checkpoint: Path, model_cfg, model) -> None:
    """The base this export rebuilt against the one the run trained its adapters on (each rank's
    fingerprint of its part): CheckpointError naming the first differing tensor."""
    saved, partitioned = saved_base_fingerprints(checkpoint)
    for rank, fingerprint in enumerate(saved):
        if fingerprint is None:  # an older checkpoint: nothing to check against
            continue
        current = rank_fingerprint(model.named_parameters(), rank, len(saved), partitioned)
        differing = fingerprint_differences(fingerprint, current)
        if differing:
            base = ("the seeded random base (model.random_init)" if model_cfg.random_init
                    else f"the base rebuilt from model.path={model_cfg.path!r}")
            raise CheckpointError(
                f"export: {checkpoint} holds LoRA adapters, not their frozen base, and {base} is not the one they "
                f"were trained on (rank {rank}'s part: {len(differing)} of {len(current)} frozen tensors differ, the "
                f"first {differing[0]}). Pass the base the run started from with --base <HF model directory>.")


def checkpoint_to_export(path: Path) -> Path:
    """The checkpoint `path` names for export: a complete checkpoint directory, or a run / checkpoints
    directory (its newest complete checkpoint)."""
    if is_complete(path):
        return path
    if not path.exists():
        raise CheckpointError(f"export: {path} does not exist; pass <run_dir>/{CHECKPOINTS}/step-NNNNNN or a run "
                              f"directory")
    if path.name.startswith("step-"):
        raise CheckpointError(f"export: {path} is not a complete checkpoint (no {COMPLETE} marker: its save was "
                              f"interrupted); pass a complete one, e.g. the newest in {path.parent}")
    for root in (path / CHECKPOINTS, path):
        newest = newest_checkpoint(root)
        if newest is not None:
            return newest
    raise CheckpointError(f"export: no complete checkpoint in {path} or {path / CHECKPOINTS}; a run writes them "
                          f"every trainer.save_every steps and at the end")


FINAL_EXPORT = "checkpoint-final"  # the HF model directory a finished run leaves in its run directory


def hf_model_dir(path: str) -> str:
    """The HF model directory `model.path` names for evaluation: `embedded`, an HF model directory,
    or a run directory (its checkpoint-final/). A run directory without one (the run stopped early)
    is refused with the command that exports its newest checkpoint; anything else is returned as
    it is, for the usual model.path check to name."""
    p = Path(path).expanduser()
    if path == "embedded" or (p / "config.json").exists() or not p.is_dir():
        return path
    if (p / FINAL_EXPORT / "config.json").exists():
        return str(p / FINAL_EXPORT)
    try:
        checkpoint = checkpoint_to_export(p)
    except CheckpointError:
        return path
    if checkpoint == p:  # a training checkpoint (DeepSpeed's state), not an HF model directory
        run_dir = p.parent.parent if p.parent.name == CHECKPOINTS else p.parent
        target = run_dir / f"export-{p.name}"
        raise CheckpointError(f"model.path={path!r} is a training checkpoint (DeepSpeed's state), not an HF model "
                              f"directory: export it first with `python -m colo_rl.checkpoint {p} {target}`, then "
                              f"evaluate model.path={target}")
    raise CheckpointError(f"model.path={path!r} is a run directory without {FINAL_EXPORT}/ (the run stopped before "
                          f"its end): export its newest checkpoint ({checkpoint.name}) first with "
                          f"`python -m colo_rl.checkpoint {p} {p / FINAL_EXPORT}`, then evaluate")


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m colo_rl.checkpoint",
                                     description="Export a colo_rl checkpoint to an HF model directory.")
    parser.add_argument("checkpoint", help="<run_dir>/checkpoints/step-NNNNNN, or a run dir (its newest)")
    parser.add_argument("out_dir")
    parser.add_argument("--base", help="a LoRA run's base model directory, when it has moved since the run "
                                       "(default: the run's model.path; checked against the checkpoint)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export_checkpoint_to_hf(checkpoint_to_export(Path(args.checkpoint)), Path(args.out_dir), base=args.base)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
