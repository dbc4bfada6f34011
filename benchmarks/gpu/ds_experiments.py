"""update_mfu.py's experiments on DeepSpeed's own knobs, beside colo_rl's configuration (benchmark
only): zero_optimization settings over colo_rl's (`--zero`), top-level config sections
(`--deepcompile`'s `compile`), and DeepCompile's `engine.compile()`."""

from __future__ import annotations

import argparse
import contextlib
from typing import Optional


def deepcompile(actor) -> None:
    """`engine.compile()` with DeepCompile on: the whole model through DeepSpeed's backend, compiled at
    its first forward. Its native op `dc` is loaded when prebuilt ($COLO_RL_PREBUILT_OPS, registered
    with FusedAdam when the actor was built), else JIT-built here as FusedAdam is: the CUDA toolkit
    found for it, and an architecture list DeepSpeed can parse."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    from colo_rl.cuda_toolkit import arch_list_for_deepspeed, prepare_jit_builds

    if "dc" not in OpBuilder._loaded_ops:
        prepare_jit_builds()
    with arch_list_for_deepspeed():
        actor.engine.compile()


def ds_overrides(args) -> dict:
    """Top-level DeepSpeed config sections over colo_rl's (`--deepcompile`: its `compile` section)."""
    return {"compile": {"deepcompile": True}} if args.deepcompile else {}


def zero_override(text: str) -> tuple[str, float]:
    """KEY=VALUE of `--zero`: a DeepSpeed zero_optimization key and its number."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--zero {text!r}: expected KEY=VALUE")
    try:
        return key, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--zero {text!r}: {value!r} is not a number") from None


@contextlib.contextmanager
def zero_settings(overrides: list[tuple[str, float]], sections: Optional[dict] = None):
    """The actor built inside takes `overrides` into its zero_optimization section and `sections`
    (`ds_overrides`) at the top level of its DeepSpeed config (benchmark only: an experiment on
    DeepSpeed's knobs, e.g. every parameter persistent at world size 1, where each fetch of a
    released layer ends in a stream synchronisation: NoGatherHandle.wait in 0.19.8)."""
    from colo_rl.train import actor as actor_module

    built = actor_module.build_ds_config

    def with_overrides(*args, **kwargs):
        config = built(*args, **kwargs)
        config["zero_optimization"].update(overrides)
        config.update(sections or {})
        return config

    actor_module.build_ds_config = with_overrides
    try:
        yield
    finally:
        actor_module.build_ds_config = built
