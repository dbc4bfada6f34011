"""The update at the hardware's speed (issue 37, GPU half): one GRPO-shaped update of a 0.5B-class
random Llama through colo_rl's DeepSpeed actor, its model FLOPs utilisation, and the fraction of its
wall time the GPU is busy (a torch.profiler trace of one update). A stage of `make gpu-perf`.

    python benchmarks/gpu/update_mfu.py                           # GPU: 128 x 768, 0.5B-class, bf16
    python benchmarks/gpu/update_mfu.py --attn flex_attention     # FlexAttention block masks
    python benchmarks/gpu/update_mfu.py --deepcompile             # DeepSpeed's DeepCompile (GPU only)
    python benchmarks/gpu/update_mfu.py --packing false           # a row per sequence, SDPA's causal kernel
    python benchmarks/gpu/update_mfu.py --dry-run                 # CPU rehearsal: tiny shapes, fp32

Work: `--sequences` responses of `--response-len` tokens in groups of `--group-size` sharing a
`--prompt-len`-token prompt, packed one group per row (`pack_groups`; `--packing false`: a row per
sequence, its prompt computed once per sequence, as `trainer.packing=false` lays a GRPO step out:
SDPA's causal kernel with no [L, L] mask, since every row here is the same length), micro-batches
planned as a GRPO step plans them (`--groups-per-micro-batch auto`: whole rows up to the trainer's token budget,
`trainer.micro_batch_tokens=auto`, sized from the device memory free once the actor is built) or N
rows each, one optimizer step (ZeRO-3 as colo_rl configures it, leaf modules per `--leaf`).
`--warmup` updates (each timed and reported: the compilations land there), then `--repeats` timed
ones (cuda-synchronised); then one more under the profiler, and one under cProfile (the host's time
by Python function and package, `colo_rl/profiling.py`). FLOPs counted (per token, training =
3 x forward):
    6 N_layers-params + 6 h V (the LM head, on kept positions) + 12 n_layers h ctx (attention, ctx =
    the keys each query attends: the prompt's causal half, or the prompt + the response's own prefix)
FLOPs count the packed work (each prompt once per group) whatever the layout, so layouts compare on
the same work. MFU = FLOPs / seconds / peak (--peak-tflops, default by device: H100/H200 989 bf16 dense).
GPU busy = the union of the trace's kernel intervals over the update's wall time. On the CPU
(--dry-run) the trace has no kernels: the CPU ops' union is reported instead, as a rehearsal of
the parsing only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.ds_experiments import deepcompile, ds_overrides, zero_override, zero_settings  # noqa: E402
from benchmarks.gpu.mfu_memory import device_memory, device_memory_start, memory_text  # noqa: E402
from benchmarks.gpu.mfu_work import laid_out, random_groups  # noqa: E402
from benchmarks.gpu.trace_stats import busy_fraction, busy_of_timed  # noqa: E402
from colo_rl.profiling import DEVICE_CATEGORIES, HOST_CATEGORIES, host_text, profile_call, trace_ops  # noqa: E402

# 0.5B class: ~0.46B parameters, 32k vocabulary, tied embeddings, GQA 4:1 (benchmarks/phase_switch.py's).
MODEL_05B = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000)
MODEL_DRY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512)
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0}  # bf16 dense


def llama_params(config: dict) -> dict:
    """Parameters of a Llama-style config: the layers', the embedding's (tied: the LM head too)."""
    h, ffn, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config.get("head_dim", h // config["num_attention_heads"]) * config["num_key_value_heads"]
    q = config.get("head_dim", h // config["num_attention_heads"]) * config["num_attention_heads"]
    layers = n * (h * q + q * h + 2 * h * kv + 3 * h * ffn)
    return {"layers": layers, "embedding": h * config["vocab_size"]}


def update_flops(dims: dict, prompt_len: int, response_len: int, group_size: int, groups: int) -> float:
    """Model FLOPs of one update (forward + backward) of `groups` packed rows; see the module docstring."""
    h, n_layers, V = dims["hidden_size"], dims["num_hidden_layers"], dims["vocab_size"]
    layer_params = llama_params(dims)["layers"] // n_layers
    tokens = groups * (prompt_len + group_size * response_len)
    kept = groups * group_size * response_len  # positions whose logits are computed
    ctx = groups * (prompt_len * (prompt_len + 1) / 2
                    + group_size * (response_len * prompt_len + response_len * (response_len + 1) / 2))
    forward = 2 * n_layers * layer_params * tokens + 2 * h * V * kept + 4 * n_layers * h * ctx
    return 3 * forward


def build(args, dims: dict, model_dir: Path):
    import torch
    from transformers import LlamaConfig

    from colo_rl.config import ModelConfig, RunConfig
    from colo_rl.train.actor import DeepSpeedActor

    LlamaConfig(**dims, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, architectures=["LlamaForCausalLM"]).save_pretrained(model_dir)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cfg = RunConfig()
    cfg.model = ModelConfig(path=str(model_dir), dtype="fp32" if args.dry_run else "bf16", random_init=True,
                            attn_implementation=args.attn)
    cfg.trainer.zero_stage, cfg.trainer.zero_leaf_modules, cfg.trainer.lr = args.zero_stage, args.leaf, 1e-6
    cfg.trainer.zero_memory_efficient_linear = args.linear
    cfg.model.gradient_checkpointing = args.checkpointing
    cfg.model.compile = args.compile
    groups = args.sequences // args.group_size
    actor = DeepSpeedActor(cfg, dtype, total_steps=100, grad_accum=1)  # as GRPO's: boundaries set per micro-batch
    parts = random_groups(args, dims["vocab_size"])
    mbs = [actor.to_device(mb) for mb in laid_out(parts, args.packing, args.groups_per_micro_batch, actor, dtype)]
    return actor, mbs, groups


def true_or_false(text: str) -> bool:
    """A switch's value: true/false (also 1/0, yes/no)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")
    return value


def rows_per_micro_batch(text: str):
    """--groups-per-micro-batch: `auto` or a positive count."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--groups-per-micro-batch {text!r}: expected `auto` or a positive count")
    return int(text)


def warmup_updates(args) -> int:
    """Updates before the timed ones: `--warmup`, else 1 (DeepSpeed's buffers, autotuning, the
    compilation), and with --deepcompile one past DeepCompile's WARMUP step, from which it adds its
    ZeRO-3 prefetch and selective-gather passes and compiles again (5 in DeepSpeed 0.19.8)."""
    if args.warmup is not None:
        return args.warmup
    if not args.deepcompile:
        return 1
    from deepspeed.compile.init_z3 import WARMUP

    return WARMUP + 1


def check_args(args, on_gpu: bool) -> None:
    """Refuse combinations the run cannot measure, before the model is built."""
    if args.warmup is not None and args.warmup < 1:
        raise SystemExit(f"update_mfu: --warmup {args.warmup}: at least one update runs before the timed ones")
    if args.deepcompile:
        if not on_gpu or args.dry_run:
            raise SystemExit("update_mfu: --deepcompile needs a CUDA device (DeepSpeed's is_deepcompile_supported: "
                             "torch >= 2.6 and the cuda accelerator); it has no CPU rehearsal")
        if args.compile:
            raise SystemExit("update_mfu: --deepcompile compiles the whole model; drop --compile (the decoder layers)")
        if args.zero_stage == 0:
            raise SystemExit("update_mfu: --deepcompile needs --zero-stage 1, 2 or 3")


def compiled_vs_eager(actor, mb) -> dict:
    """--compile: the log-probs of micro-batch `mb` (no gradients, as the old and reference
    log-probs) from the compiled decoder layers and from the same layers run eagerly
    (torch.compiler.set_stance("force_eager")): the largest and the mean |difference| over response
    tokens. A check that the compiled kernels compute what eager does, on this device."""
    import torch

    with torch.no_grad():
        compiled, _ = actor.response_logprobs(mb, 1.0, grad=False)
        with torch.compiler.set_stance("force_eager"):
            eager, _ = actor.response_logprobs(mb, 1.0, grad=False)
    diff = (compiled - eager).abs() * mb.response_mask
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.sum() / mb.response_mask.sum())}


def agreement_text(agreement: Optional[dict]) -> str:
    if not agreement:
        return ""
    if "error" in agreement:
        return f" Compiled vs eager log-probs: not compared ({agreement['error']})."
    return (f" Compiled vs eager log-probs of the first micro-batch (no gradients): max |diff| "
            f"{agreement['max_abs']:.2e}, mean {agreement['mean_abs']:.2e}.")


def checked_agreement(actor, mb) -> dict:
    """`compiled_vs_eager`, or why it could not run: DeepCompile removes ZeRO-3's module hooks, and
    whether its eager fallback gathers every parameter of a forced-eager forward is for the GPU to
    show; the figures already written stay either way."""
    try:
        return compiled_vs_eager(actor, mb)
    except Exception as exc:  # reported in the results, not raised: the measurement is what the stage is for
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def one_update(actor, mbs, n_tok: float) -> None:
    for j, mb in enumerate(mbs):
        logp, _ = actor.response_logprobs(mb, 1.0)
        actor.backward(-(logp * mb.response_mask).sum() / n_tok, last_micro_batch=j == len(mbs) - 1)
    actor.step()


def profiled_host(actor, mbs, n_tok: float, sync) -> dict:
    """One more update under cProfile (`colo_rl.profiling`: where the host's time goes by Python
    function and package), with the compilations it triggered: any, and its figures include one. Or
    why it could not run (e.g. cProfile refused to start): the stage's other figures matter more."""
    import torch._dynamo.utils

    compiles = torch._dynamo.utils.counters["frames"]["total"]
    try:
        host = profile_call(lambda: (one_update(actor, mbs, n_tok), sync()))
    except Exception as exc:  # reported in the results, not raised
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    host["compilations"] = torch._dynamo.utils.counters["frames"]["total"] - compiles
    return host


def arg_parser() -> argparse.ArgumentParser:
    """The options (also what `build` reads: benchmarks/host_overhead.py parses its own runs here)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU rehearsal with tiny shapes (not a measurement)")
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--groups-per-micro-batch", type=rows_per_micro_batch, default="auto",
                   help="packed rows per forward/backward, or `auto` (default): as a GRPO step plans them, up to "
                        "the trainer's token budget (trainer.micro_batch_tokens=auto)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention", "eager"])
    p.add_argument("--packing", type=true_or_false, default=True,
                   help="trainer.packing (true/false): a row per group [prompt | r_1 | ... | r_G] (default), or a "
                        "row per sequence; --groups-per-micro-batch still counts groups")
    p.add_argument("--leaf", type=true_or_false, default=True, help="trainer.zero_leaf_modules (true/false)")
    p.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3], help="trainer.zero_stage")
    p.add_argument("--linear", default="auto", choices=["auto", "on", "off"],
                   help="trainer.zero_memory_efficient_linear (DeepSpeed's ZeRO-3 linear: on; autograd's: off)")
    p.add_argument("--checkpointing", action="store_true",
                   help="model.gradient_checkpointing: activations recomputed, so far larger micro-batches fit")
    p.add_argument("--compile", action="store_true",
                   help="model.compile: each decoder layer's forward through torch.compile")
    p.add_argument("--deepcompile", action="store_true",
                   help="DeepSpeed's DeepCompile: compile.deepcompile=true, then engine.compile(): the whole model "
                        "compiled with ZeRO-3's gathers and releases as graph operations instead of module hooks "
                        "(CUDA only)")
    p.add_argument("--warmup", type=int, default=None,
                   help="updates before the timed ones (default 1; with --deepcompile one past the step from which "
                        "DeepCompile adds its prefetch passes: 6 with DeepSpeed 0.19.8)")
    p.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE", type=zero_override,
                   help="a zero_optimization setting over colo_rl's (repeatable), e.g. "
                        "stage3_param_persistence_threshold=1e12: every parameter persistent")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: by device name)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-readme", action="store_true")
    p.add_argument("--name", default="update_mfu", help="results file name (<name>-<device>-<date>)")
    return p


def plan_text(m: dict) -> str:
    """How the micro-batches were cut, e.g. `3, 3, 2 rows (auto: up to 24,700 tokens each)`."""
    rows = ", ".join(map(str, m["rows_per_micro_batch"]))
    budget = m["micro_batch_tokens"]
    return f"{rows} rows" + (f" (auto: up to {budget:,} tokens each)" if budget is not None else "")


class StageClock:
    """Seconds of each part of the run (`mark` ends a part): where a stage's device time goes
    beside the updates it measures."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = round(now - self._last, 2)
        self._last = now


def write_results(args, m: dict, agreement: Optional[dict]) -> None:
    """The results (JSON + Markdown) of main's measurements `m`, with `compiled_vs_eager`'s
    figures when there are some."""
    import torch

    from benchmarks import common
    from colo_rl import dist

    dims, groups, n_micro, seconds = m["dims"], m["groups"], m["micro_batches"], m["seconds"]
    busy, host_top, device_top = m["busy"], m["host_top"], m["device_top"]
    linear_on, warmup_seconds, on_gpu = m["linear_on"], m["warmup_seconds"], m["on_gpu"]
    flops = update_flops(dims, args.prompt_len, args.response_len, args.group_size, groups)
    best = min(seconds)
    name = torch.cuda.get_device_name(0).lower() if on_gpu else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    result = {"dry_run": args.dry_run, "model": dims, "sequences": args.sequences, "group_size": args.group_size,
              "prompt_len": args.prompt_len, "response_len": args.response_len, "micro_batches": n_micro,
              "micro_batch_tokens": m["micro_batch_tokens"], "rows_per_micro_batch": m["rows_per_micro_batch"],
              "attn": args.attn, "packing": args.packing, "leaf_modules": args.leaf, "zero_overrides": dict(args.zero),
              "memory_efficient_linear": linear_on, "gradient_checkpointing": args.checkpointing,
              "compiled_layers": args.compile, "deepcompile": args.deepcompile, "chunked_lm_head": m["chunked_lm_head"],
              "update_seconds": seconds, "first_update_seconds": warmup_seconds[0],
              "warmup_update_seconds": warmup_seconds, "compiled_vs_eager": agreement, "memory": m["memory"],
              "stage_seconds": m["stage_seconds"],
              "flops": flops,
              "tflops_per_s": flops / best / 1e12, "peak_tflops": peak,
              "mfu": flops / best / 1e12 / peak if peak else None, "busy": busy,
              "host_top": host_top, "device_top": device_top, "host_python": m["host_python"]}
    mfu = f"{100 * result['mfu']:.1f} %" if result["mfu"] is not None else "n/a (no peak for this device)"
    table = "\n".join([
        f"{'DRY RUN (CPU, tiny shapes: not a measurement). ' if args.dry_run else ''}"
        f"{args.sequences} sequences x {args.response_len} response tokens (groups of {args.group_size}, "
        f"{args.prompt_len}-token prompt), {n_micro} micro-batches of {plan_text(m)}, "
        f"{'a row per group' if args.packing else 'a row per sequence (no packing)'}, attention {args.attn}, "
        f"leaf modules {'on' if args.leaf else 'off'}, DeepSpeed's memory-efficient linear "
        f"{'on' if linear_on else 'off'} (--linear {args.linear})"
        f"{', gradient checkpointing' if args.checkpointing else ''}"
        f"{', decoder layers compiled (model.compile)' if args.compile else ''}"
        f"{', DeepCompile (the whole model, ZeRO-3 in the graph)' if args.deepcompile else ''}"
        f", LM head {'chunked' if m['chunked_lm_head'] else 'over whole logits'}"
        f"{''.join(f', zero_optimization.{k}={v:g}' for k, v in args.zero)}.", "",
        "| update s (best) | TFLOP/s | MFU | busy: of the best update / of the profiled one | events |",
        "|---|---|---|---|---|",
        f"| {best:.3f} | {result['tflops_per_s']:.2f} | {mfu} | {100 * busy_of_timed(busy, best):.1f} % / "
        f"{100 * busy['busy_fraction']:.1f} % ({busy['category']}; profiled update {busy['wall_us'] / 1e6:.3f} s) "
        f"| {busy['events']} |", "",
        f"Warm-up updates{' (the compilations included)' if args.compile or args.deepcompile else ''}: "
        f"{', '.join(f'{w:.2f}' for w in warmup_seconds)} s." + agreement_text(agreement), "",
        *([memory_text(m["memory"]), ""] if m["memory"] else []),
        *([host_text(m["host_python"]), ""] if m["host_python"] else []),
        "Seconds of this run by part: " + ", ".join(f"{k} {v:.1f}" for k, v in m["stage_seconds"].items()) + ".", "",
        "Top host functions of the profiled update (self CPU time):", "",
        "| function | calls | self ms |", "|---|---|---|",
        *[f"| `{o['name'][:80]}` | {o['calls']} | {o['self_ms']:.1f} |" for o in host_top],
        *(["", "Top device kernels (self device time):", "", "| kernel | calls | ms |", "|---|---|---|",
           *[f"| `{o['name'][:80]}` | {o['calls']} | {o['self_ms']:.1f} |" for o in device_top]] if device_top else [])])
    stem = args.name + ("_dry_run" if args.dry_run else "")
    if dist.is_rank0():
        common.publish(stem, result, table, args.out or common.RESULTS, readme=not args.no_readme)


def main(argv=None) -> int:
    clock = StageClock()
    args = arg_parser().parse_args(argv)
    if args.dry_run:
        args.sequences, args.group_size, args.prompt_len, args.response_len = 4, 2, 6, 8
        args.repeats = 1
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from colo_rl import dist

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.dry_run:
        raise SystemExit("update_mfu: no CUDA device; --dry-run rehearses on the CPU with tiny shapes")
    check_args(args, on_gpu)
    dist.init()
    clock.mark("imports and process group")
    dims = MODEL_DRY if args.dry_run else MODEL_05B
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="update_mfu-") as tmp:
        with zero_settings(args.zero, ds_overrides(args)):
            actor, mbs, groups = build(args, dims, Path(tmp) / "model")
        if args.deepcompile:
            deepcompile(actor)
        clock.mark("model, actor and batches")
        linear_on = bool(actor.memory_efficient_linear)
        n_tok = float(sum(mb.response_mask.sum() for mb in mbs))

        def timed_update() -> float:
            t0 = time.perf_counter()
            one_update(actor, mbs, n_tok)
            sync()
            return time.perf_counter() - t0

        # DeepSpeed's buffers, kernels' autotuning, compilations
        warmup_seconds = [timed_update() for _ in range(warmup_updates(args))]
        clock.mark("warm-up updates")
        base = device_memory_start(on_gpu)
        seconds = [timed_update() for _ in range(args.repeats)]
        memory = device_memory(actor, mbs, base) if on_gpu else None
        clock.mark("timed updates")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            with record_function("update"):
                one_update(actor, mbs, n_tok)
                sync()
        clock.mark("profiled update")
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        busy = busy_fraction(trace, "kernel" if on_gpu else "cpu_op")
        host_top = trace_ops(trace["traceEvents"], HOST_CATEGORIES)
        device_top = trace_ops(trace["traceEvents"], DEVICE_CATEGORIES) if on_gpu else []
        clock.mark("trace analysis")
        host = profiled_host(actor, mbs, n_tok, sync)
        clock.mark("cProfile'd update")
    budget = actor.micro_batch_tokens() if args.groups_per_micro_batch == "auto" else None  # the plan's (cached)
    measured = {"dims": dims, "groups": groups, "micro_batches": len(mbs), "micro_batch_tokens": budget,
                "rows_per_micro_batch": [int(mb.input_ids.shape[0]) for mb in mbs],
                "linear_on": linear_on, "seconds": seconds,
                "warmup_seconds": warmup_seconds, "busy": busy, "host_top": host_top, "device_top": device_top,
                "on_gpu": on_gpu, "chunked_lm_head": actor.chunked_lm_head, "memory": memory, "host_python": host,
                "stage_seconds": clock.seconds}
    write_results(args, measured, None)
    if args.compile or args.deepcompile:  # after the figures are written: this compiles the graph without
        write_results(args, measured, checked_agreement(actor, mbs[0]))  # gradients (a budget may cut it)
    return 0


if __name__ == "__main__":
    from colo_rl import process_exit

    process_exit.run_and_exit(main)
