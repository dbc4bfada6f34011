"""model.compile: each decoder layer's `forward` through torch.compile (regional compilation).

Why `forward` and not the module: ZeRO-3 fetches and releases a layer's weights in hooks that
nn.Module.__call__ runs around `self.forward`. Compiling `forward` keeps those hooks outside the
graph: the compiled code sees the gathered weights, and DeepSpeed's hooks run eagerly as before.
With the decoder layer as ZeRO-3's leaf module (trainer.zero_leaf_modules) no hook sits inside the
layer. Without leaf modules every linear's hook would split the graph, so `check_compile` refuses
that combination.

One compilation serves every layer: the layers share their code, and dynamo guards on the module's
type, not on which layer it is (torch's inline_inbuilt_nn_modules). Packed rows change length
from one micro-batch to the next, so the activations' sizes are symbolic from the start
(dynamic=True): with automatic dynamic shapes the first new length, at any later step, would
compile again. The hidden size does not stay symbolic: it meets the weights, whose shapes are
static (dynamo's force_parameter_static_shapes), and specialises.

What it buys: the element-wise work of a layer (RMSNorm, rotary embedding, SwiGLU) fused into a
few kernels, forward and backward, and far fewer operator dispatches on the host. What it costs:
the compilation at the first micro-batches (tens of seconds; inductor's cache on disk shortens the
next process's). The figures: docs/update_overhead.md.
"""

from __future__ import annotations

import logging

import torch

from colo_rl.errors import ConfigError
from colo_rl.lora import lora_enabled
from colo_rl.train.ds_config import decoder_layer_classes

log = logging.getLogger("colo_rl")


def check_compile(model_cfg, trainer_cfg) -> None:
    """Raise ConfigError when model.compile=true meets a configuration whose hooks would split
    every compiled layer into pieces (ZeRO-3 without leaf modules; LoRA turns them off), or
    FlexAttention on a CPU."""
    if not model_cfg.compile:
        return
    if model_cfg.attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError("model.compile=true with model.attn_implementation=flex_attention needs a GPU: inductor's "
                          "CPU FlexAttention kernel fails to build for symbolic lengths (torch 2.13). Use "
                          "model.attn_implementation=sdpa on the CPU, or model.compile=false.")
    if trainer_cfg.zero_stage != 3:
        return
    if not trainer_cfg.zero_leaf_modules:
        raise ConfigError("model.compile=true with trainer.zero_stage=3 needs trainer.zero_leaf_modules=true: "
                          "without leaf modules ZeRO-3 hooks every linear inside a decoder layer, and each hook "
                          "would split the compiled layer. Set trainer.zero_leaf_modules=true or model.compile=false.")
    if lora_enabled(model_cfg):
        raise ConfigError(f"model.compile=true with LoRA adapters (model.lora.rank={model_cfg.lora.rank}) under "
                          "ZeRO-3: leaf modules are off with adapters (colo_rl/train/ds_config.py set_zero3_hooks), "
                          "so ZeRO-3's hooks would split every compiled layer. Set model.compile=false.")


def compile_decoder_layers(model: torch.nn.Module, announce: bool, backend: str = "inductor") -> int:
    """Replace the `forward` of every decoder layer (`ds_config.decoder_layer_classes`) by its
    torch.compile'd self; `announce`: log how many (rank 0 of a trained model); `backend`: torch's
    (tests trace FlexAttention layers on the CPU with "aot_eager"). Returns how many."""
    class_names = decoder_layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in class_names]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    if announce:
        log.info("model.compile: %d decoder layers, compiled at their first forward with and without gradients "
                 "(one compilation each serves every layer and length)", len(layers))
    return len(layers)
