"""Checkpoints: atomic save, exact resume, HF export (manager.py, compat.py, export.py).

A recipe uses it in a few lines:

    ckpt = CheckpointManager(run_dir, cfg)                  # picks the checkpoint, checks the config
    start_step = ckpt.maybe_resume(actor, sampler, engine)  # 0 on a fresh run
    ...
    ckpt.save(step, actor, sampler, engine)                 # every rank calls it (collective)

On disk, one directory per checkpoint under <run_dir>/checkpoints/:

    step-000004/
      ds/                DeepSpeed's own checkpoint (engine.save_checkpoint): every rank writes its
                         ZeRO shards: model, optimizer, scheduler, DeepSpeed's step counters (with
                         LoRA: the adapters only, and a fingerprint of the rank's frozen base shards)
      rank00000.pt ...   per rank: Python / NumPy / torch (+ CUDA) RNG states, the rollout engine's
                         sampling RNG (each rank seeds differently)
      state.json         step, data-sampler position and shuffle epoch, trainer counters, world size
      config.yaml        the run's config (compared on resume)
      COMPLETE           written last, before the rename

Atomicity: everything is written into `step-000004.tmp/`; after a barrier (every rank finished),
rank 0 writes COMPLETE, fsyncs and renames the directory to `step-000004`. A kill at any point
before the rename leaves only a `.tmp` directory, which resume ignores (and the next run removes);
a directory counts as a checkpoint only with its final name *and* its COMPLETE marker.
Assumes the run directory is on one filesystem that every rank sees (one node, or a shared FS).
"""

from colo_rl.checkpoint.compat import capture_rng, compare_configs, config_container, restore_rng
from colo_rl.checkpoint.export import FINAL_EXPORT, export_checkpoint_to_hf, export_hf, hf_model_dir, main
from colo_rl.checkpoint.manager import (CHECKPOINTS, COMPLETE, DS_TAG, CheckpointManager, complete_checkpoints,
                                        is_complete, newest_checkpoint, resolve_resume, step_dir_name)
from colo_rl.errors import CheckpointError

__all__ = ["CHECKPOINTS", "COMPLETE", "DS_TAG", "FINAL_EXPORT", "hf_model_dir", "CheckpointError", "CheckpointManager",
           "capture_rng", "compare_configs", "complete_checkpoints", "config_container", "export_checkpoint_to_hf",
           "export_hf", "is_complete", "main", "newest_checkpoint", "resolve_resume", "restore_rng", "step_dir_name"]
