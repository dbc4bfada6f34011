"""Phase-switch benchmark: what one colocated GRPO step pays to switch the GPU between phases.

Runs N GRPO-like steps (generate a small batch, take one optimizer step) through the real pieces,
`build_colocated` -> MemoryManager -> ledger, on a random-weight Llama, and reports for each
transition type the seconds it takes and the memory it frees:

    python benchmarks/phase_switch.py                      # GPU: 0.5B-class model, HF engine
    python benchmarks/phase_switch.py --engine sglang      # GPU: the SGLang engine
    python benchmarks/phase_switch.py --small --steps 2    # CPU-sized model (what the tests run)

Writes benchmarks/results/phase_switch-<device>-<date>.json (summary + raw ledger records) and a
.md table next to it. After the timed steps an itemised pass releases the engine's memory one tag at
a time (KV cache, CUDA graphs, weights) and pages the trainer's states one kind at a time (Adam
moments, master weights, weight partitions, gradients, gradient bucket), each measured alone. "GiB moved" is what the ledger says left the device (trainer states paged
to host, engine memory released); "device used" is measured before/after each transition (CUDA:
device-wide used memory; CPU: this process's RSS). On CPU nothing pages, so the trainer moves
are no-ops (moved=false) and only the protocol's overhead is measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402

GIB = 1 << 30
# 0.5B class: ~0.46B parameters with a 32k vocabulary (tied embeddings, GQA 4:1).
GPU_MODEL = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=4096, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000)
SMALL_MODEL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=256, num_attention_heads=1,
                   num_key_value_heads=1, vocab_size=512)
# The embedded default's shape (SmolLM2-135M-Instruct), random weights.
SMOLLM2_MODEL = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)
MODELS = {"0.5b": GPU_MODEL, "smollm2-135m": SMOLLM2_MODEL, "small": SMALL_MODEL}
EOS, PAD = 2, 0


def write_random_llama(directory: Path, **dims) -> Path:
    """An HF model directory with only a Llama config: weights are random (model.random_init)
    and SGLang loads dummy ones, so none are written."""
    from transformers import LlamaConfig

    # `architectures` is how SGLang picks its model class.
    LlamaConfig(**dims, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=EOS, pad_token_id=PAD, architectures=["LlamaForCausalLM"]).save_pretrained(directory)
    return directory


def bench_config(model_dir: Path, engine: str, dtype_name: str, steps: int, seqs: int):
    from colo_rl.config import ModelConfig, RunConfig

    cfg = RunConfig()
    cfg.model = ModelConfig(path=str(model_dir), dtype=dtype_name, random_init=True)
    cfg.rollout.engine = engine
    cfg.trainer.total_steps = steps
    cfg.trainer.micro_batch_size = seqs
    cfg.trainer.zero_stage = 3
    cfg.trainer.lr = 1e-5
    return cfg


def grpo_like_update(actor, completions) -> float:
    """One optimizer step on the generated batch (a policy-gradient-shaped loss, random signs)."""
    from colo_rl.train.batch import build_batch

    batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], PAD)
    signs = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(batch))])
    logp, _ = actor.response_logprobs(batch, grad=True)
    mask = batch.response_mask.to(logp.device)
    loss = -(logp * mask * signs.to(logp.device)[:, None]).sum() / mask.sum().clamp(min=1)
    actor.backward(loss, last_micro_batch=True)
    actor.step()
    return float(loss.detach())


device_slug = common.device_slug


def summarise(records: list[dict]) -> dict:
    """Per transition type: seconds and memory, and per move inside it."""
    out: dict = {}
    for name in sorted({r["transition"] for r in records}):
        recs = [r for r in records if r["transition"] == name]
        secs = [r["seconds"] for r in recs]
        steady = secs[1:] or secs  # the first of each kind includes one-time warm-up
        moved = [sum(m["bytes"] for m in r["moves"] if m["from"] == "device" and m["moved"]) / GIB for r in recs]
        key = "used_gib" if recs[0]["memory_before"]["device"] == "cuda" else "rss_gib"
        used_before = [r["memory_before"][key] for r in recs]
        used_after = [r["memory_after"][key] for r in recs]
        moves: dict = {}
        for what in dict.fromkeys(m["what"] for r in recs for m in r["moves"]):
            ms = [m for r in recs for m in r["moves"] if m["what"] == what]
            moves[what] = {"seconds_mean": statistics.fmean(m["seconds"] for m in ms),
                           "gib_mean": statistics.fmean(m["bytes"] for m in ms) / GIB,
                           "moved": any(m["moved"] for m in ms)}
        out[name] = {
            "count": len(recs), "seconds_mean": statistics.fmean(secs), "seconds_median": statistics.median(secs),
            "seconds_max": max(secs), "steady_seconds_mean": statistics.fmean(steady),
            "gib_moved_off_device_mean": statistics.fmean(moved), "memory_key": key,
            "used_before_gib_mean": statistics.fmean(used_before), "used_after_gib_mean": statistics.fmean(used_after),
            "freed_gib_mean": statistics.fmean(b - a for b, a in zip(used_before, used_after)),
            "moves": moves,
        }
    return out


def handoff_summary(records: list[dict]) -> dict:
    """The weight handoffs of the run (steady state: the first one carries one-time warm-up)."""
    moves = [m for r in records if r["transition"] == "update->generation" for m in r["moves"]
             if m["what"] == "weights handoff"]
    if not moves:
        return {}
    steady = moves[1:] or moves
    secs = [m["seconds"] for m in steady]
    nbytes = steady[0]["bytes"]
    med = statistics.median(secs)
    return {"count": len(moves), "bytes": nbytes, "seconds_median": med, "seconds_min": min(secs),
            "seconds_all": [m["seconds"] for m in moves], "bytes_per_s": nbytes / med if med > 0 else None}


def device_copy_seconds(nbytes: int, repeats: int = 10) -> Optional[float]:
    """Best time of a device-to-device copy of `nbytes` (benchmarks/handoff.py's memcpy), CUDA only:
    the floor the handoff is compared against (it moves the same bytes, plus gathers, flattening and IPC)."""
    if not torch.cuda.is_available() or nbytes <= 0:
        return None
    from benchmarks.handoff import memcpy_bandwidth

    seconds = nbytes / memcpy_bandwidth(nbytes, repeats, torch.device("cuda"))
    torch.cuda.empty_cache()
    return seconds


# DeepSpeed's paged trainer states (OffloadStateTypeEnum), in the order the itemised pass pages them.
TRAINER_STATES = {"optim_states": "Adam moments (fp32)", "hp_params": "master weights (fp32)",
                  "lp_params": "weight partitions (bf16)", "lp_grads": "gradient partitions",
                  "contiguous_grad_buffer": "ZeRO gradient bucket"}


def measured_frees(actions: list[tuple[str, Callable[[], object]]], free_bytes: Callable[[], Optional[int]]) -> list[dict]:
    """Run `actions` in turn; for each, the device memory it freed (free after - free before; None
    where `free_bytes` measures nothing) and its seconds."""
    out = []
    for what, act in actions:
        before, t0 = free_bytes(), time.perf_counter()
        act()
        seconds, after = time.perf_counter() - t0, free_bytes()
        out.append({"what": what, "seconds": seconds,
                    "freed_bytes": None if before is None or after is None else after - before})
    return out


def itemised_release(colo, step: int) -> dict:
    """After the timed steps: the engine's release and the trainer's page-out one kind at a time,
    each measured on its own (the transitions move them together, and a transition's before/after
    nets the trainer's page-out against the engine's wake). Against what each side held: the
    engine's allocations on waking (ledger), the trainer's allocated bytes before its page-out."""
    from colo_rl import dist
    from colo_rl.rollout.base import CUDA_GRAPH, KV_CACHE, WEIGHTS

    colo.switch.begin_step(step)
    with colo.switch.generation():  # the trainer pages out, the engine wakes and takes the weights
        wake = {m["what"]: m["bytes"] for m in colo.ledger.records[-1]["moves"]}
        engine = measured_frees([(tag, functools.partial(colo.engine.sleep, [tag]))
                                 for tag in (KV_CACHE, CUDA_GRAPH, WEIGHTS)], dist.device_free_bytes)
    with colo.switch.update():  # the engine is already released: only the trainer reloads
        allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
        trainer = []
        if colo.actor.pages:
            from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

            ds = colo.actor.engine
            page = [(kind, functools.partial(ds.offload_states, include=[OffloadStateTypeEnum(kind)],
                                             device=OffloadDeviceEnum.cpu, pin_memory=colo.actor.pin_memory))
                    for kind in TRAINER_STATES]
            trainer = measured_frees([("partition cache", ds.empty_partition_cache), *page], dist.device_free_bytes)
            colo.actor.reload_states()
    return {"engine": {"held_bytes": {"weights": wake.get("engine weights (allocate)", 0),
                                      "kv_cache + cuda_graph": wake.get("engine KV cache (allocate)", 0)},
                       "released": engine},
            "trainer": {"allocated_bytes_before": allocated, "state_bytes": colo.actor.state_bytes(),
                        "paged": trainer}}


def markdown(result: dict) -> str:
    m = result["model"]
    lines = [f"# Phase switch: {result['device']}, {result['date']}", "",
             f"{m['parameters'] / 1e6:.1f}M-parameter random Llama ({m['hidden_size']}x{m['num_hidden_layers']}), "
             f"{result['dtype']}, engine `{result['engine']}`, ZeRO-3 on {result['world_size']} rank(s), "
             f"{result['steps']} steps of {result['sequences']} sequences.", "",
             "| transition | count | s mean | s median | s max | s mean (steady) | GiB moved off device | "
             "device used before -> after (GiB) | freed (GiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, t in result["transitions"].items():
        lines.append(f"| {name} | {t['count']} | {t['seconds_mean']:.3f} | {t['seconds_median']:.3f} | "
                     f"{t['seconds_max']:.3f} | {t['steady_seconds_mean']:.3f} | {t['gib_moved_off_device_mean']:.2f} | "
                     f"{t['used_before_gib_mean']:.2f} -> {t['used_after_gib_mean']:.2f} ({t['memory_key']}) | "
                     f"{t['freed_gib_mean']:.2f} |")
    h = result.get("handoff") or {}
    if h:
        d2d = h.get("device_copy_seconds")
        lines += ["", f"Weight handoff (steady state, {h['count'] - 1 if h['count'] > 1 else h['count']} of {h['count']}): "
                  f"{h['bytes'] / GIB:.3f} GiB in **{1000 * h['seconds_median']:.1f} ms** median "
                  f"({h['bytes_per_s'] / 1e9:.1f} GB/s)" +
                  (f"; a device-to-device copy of the same bytes in the same run: {1000 * d2d:.2f} ms "
                   f"({h['bytes'] / d2d / 1e9:.0f} GB/s), so the handoff takes **{h['seconds_median'] / d2d:.1f}x** "
                   "the copy." if d2d else ".")]
    item = result.get("itemised") or {}
    if item.get("error"):
        lines += ["", f"Itemised release failed: {item['error']}"]
    elif item:
        gib = lambda b: "" if b is None else f"{b / GIB:.3f}"  # noqa: E731
        held = item["engine"]["held_bytes"]
        lines += ["", "One kind at a time, after the timed steps (device memory freed by each, measured alone):", "",
                  "| side | what | freed (GiB) | s |", "|---|---|---|---|"]
        lines += [f"| engine | release {r['what']} | {gib(r['freed_bytes'])} | {r['seconds']:.3f} |"
                  for r in item["engine"]["released"]]
        lines += [f"| trainer | page out {TRAINER_STATES.get(r['what'], r['what'])} | {gib(r['freed_bytes'])} | "
                  f"{r['seconds']:.3f} |" for r in item["trainer"]["paged"]]
        tr = item["trainer"]
        lines += ["", f"The engine held {gib(held['weights'])} GiB of weights and {gib(held['kv_cache + cuda_graph'])} "
                  f"GiB of KV cache + CUDA graphs on waking; the trainer had {gib(tr['allocated_bytes_before'])} GiB "
                  f"allocated before its page-out (paged states by formula: {gib(tr['state_bytes'])} GiB)."]
    lines += ["", "| transition | move | s mean | GiB mean | moved |", "|---|---|---|---|---|"]
    for name, t in result["transitions"].items():
        for what, mv in t["moves"].items():
            lines.append(f"| {name} | {what} | {mv['seconds_mean']:.3f} | {mv['gib_mean']:.2f} | {mv['moved']} |")
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    from colo_rl import console, dist
    from colo_rl.colocate.setup import build_colocated
    from colo_rl.models import resolve_dtype
    from colo_rl.rollout.base import SamplingParams

    dist.init()
    console.setup_logging()
    dims = MODELS["small" if args.small else args.model]
    dtype = resolve_dtype(args.dtype)
    work = Path(tempfile.mkdtemp(prefix="colo_rl-phase-switch-"))
    model_dir = write_random_llama(work / "model", **dims)
    seqs = args.prompts * args.n
    cfg = bench_config(model_dir, args.engine, args.dtype, args.steps, seqs)
    cfg.colocate.paging = args.paging
    if args.sglang_kwargs:
        cfg.rollout.sglang_kwargs = json.loads(args.sglang_kwargs)
    tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)  # random token ids: no text involved
    colo = build_colocated(cfg, tokenizer, dtype, run_dir=work, total_steps=args.steps, grad_accum=1)
    generator = torch.Generator().manual_seed(1234 + dist.rank())
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.n)
    t0 = time.perf_counter()
    for step in range(args.steps):
        colo.switch.begin_step(step)
        prompts = torch.randint(3, dims["vocab_size"], (args.prompts, args.prompt_len), generator=generator).tolist()
        with colo.switch.generation():
            completions = colo.engine.generate(prompts, sampling)
        with colo.switch.update():
            grpo_like_update(colo.actor, completions)
    total = time.perf_counter() - t0
    records = list(colo.ledger.records)  # the timed steps' (the itemised pass adds its own)
    try:
        itemised = itemised_release(colo, args.steps) if args.itemise else {}
    except Exception as e:  # noqa: BLE001 - the timed figures above are still worth publishing
        itemised = {"error": f"{type(e).__name__}: {e}"}
    result = {
        "device": device_slug(), "date": common.today(), "engine": args.engine,
        "dtype": str(dtype).replace("torch.", ""), "world_size": dist.world_size(), "steps": args.steps,
        "sequences": seqs, "total_seconds": total,
        "model": {**dims, "parameters": sum(n for _, n in colo.actor.named_parameter_sizes()) //
                  torch.empty((), dtype=dtype).element_size()},
        "transitions": summarise(records), "records": records, "itemised": itemised,
    }
    result["handoff"] = handoff_summary(records)
    if result["handoff"]:
        d2d = result["handoff"]["device_copy_seconds"] = device_copy_seconds(result["handoff"]["bytes"])
        result["handoff"]["ratio_to_device_copy"] = result["handoff"]["seconds_median"] / d2d if d2d else None
    if colo.engine is not None:
        colo.engine.shutdown()
    dist.cleanup()
    shutil.rmtree(work, ignore_errors=True)  # the random model and run dir: every figure is in `result`
    return result


# ----------------------------------------------------------------------------- the fixed cost
def zero_byte_page_outs(actor, repeats: int) -> list[float]:
    """Seconds of `repeats` page-outs that move nothing (every state already on the host): what
    DeepSpeed's offload_states costs beyond its bytes (its gc.collect() and empty_cache())."""
    actor.offload_states()  # the states leave once; later calls find every kind already paged
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        actor.offload_states()
        out.append(time.perf_counter() - t0)
    actor.reload_states()
    return out


def fixed_cost(args) -> dict:
    """A 0-byte page-out before and after `freeze_collector` in a process holding what a colocated
    run imports (torch, transformers, DeepSpeed, SGLang's engine where installed), with a real
    ZeRO-3 actor (world of one, paging forced) after one optimizer step."""
    import gc
    import importlib

    from colo_rl import dist
    from colo_rl.colocate.memory import freeze_collector
    from colo_rl.models import resolve_dtype
    from colo_rl.phase import Phase, PhaseGuard
    from colo_rl.train.actor import DeepSpeedActor

    imported = []
    for module in ("transformers", "deepspeed", "sglang.srt.entrypoints.engine"):
        try:
            importlib.import_module(module)
            imported.append(module)
        except Exception:  # noqa: BLE001 - SGLang may be missing or need its CPU shims: say what was loaded
            pass
    dist.init()
    dtype = resolve_dtype(args.dtype)
    work = Path(tempfile.mkdtemp(prefix="colo_rl-phase-switch-"))
    cfg = bench_config(write_random_llama(work / "model", **SMALL_MODEL), "hf", args.dtype, 2, 4)
    cfg.colocate.paging = "on"
    guard = PhaseGuard()
    guard.phase = Phase.UPDATE  # no switcher here: the actor trains, then pages as it would between phases
    actor = DeepSpeedActor(cfg, dtype, total_steps=2, guard=guard)
    from colo_rl.rollout.base import Completion

    completions = [Completion([5, 6, 7], [8, 9, 10, 11], [0.0] * 4, "length") for _ in range(4)]
    grpo_like_update(actor, completions)  # every state exists (the gradient bucket after a backward)
    result = {"device": device_slug(), "date": common.today(), "dtype": str(dtype).replace("torch.", ""),
              "imported": imported, "repeats": args.repeats}
    result["before"] = {"tracked_objects": len(gc.get_objects()),
                        "seconds": zero_byte_page_outs(actor, args.repeats)}
    frozen = freeze_collector()
    result["freeze"] = frozen
    result["after"] = {"tracked_objects": len(gc.get_objects()),
                       "seconds": zero_byte_page_outs(actor, args.repeats)}
    for key in ("before", "after"):
        result[key]["median_s"] = statistics.median(result[key]["seconds"])
    result["plans"] = sample_plans()
    shutil.rmtree(work, ignore_errors=True)
    dist.cleanup()
    return result


# The sample cases for colocate.paging=auto (per device; prompt ~150 tokens).
def sample_plans() -> dict:
    from colo_rl.colocate.paging_plan import full_finetune_needs, plan_paging

    h100 = 80 * 10**9
    llama7b = dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=11008, num_attention_heads=32,
                   num_key_value_heads=32, vocab_size=32000)
    cases = {
        "SmolLM2-135M, 1 x 80 GB, 64 x (150 + 64) tokens": full_finetune_needs(
            134_515_008, 1, SMOLLM2_MODEL, 64, 214, 16384, h100),
        "0.5B, 1 x 80 GB, 128 x (150 + 768) tokens": full_finetune_needs(
            458_500_000, 1, GPU_MODEL, 128, 918, 16384, h100),
        "7B, 8 x 80 GB ZeRO-3, 32 per engine x (512 + 1024), gradient checkpointing": full_finetune_needs(
            6_740_000_000, 8, llama7b, 32, 1536, 8192, h100, gradient_checkpointing=True),
        "7B, 1 x 80 GB (does not fit)": full_finetune_needs(6_740_000_000, 1, llama7b, 64, 1024, 4096, h100),
        "3B, 1 x 80 GB, 64 x 3072 tokens (some paging)": full_finetune_needs(
            3_200_000_000, 1, dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=8192,
                                   num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
            64, 3072, 4096, h100, gradient_checkpointing=True),
    }
    return {name: plan_paging(needs).record() for name, needs in cases.items()}


def fixed_cost_markdown(result: dict) -> str:
    b, a = result["before"], result["after"]
    lines = [f"# A page-out that moves 0 bytes: {result['device']}, {result['date']}", "",
             f"DeepSpeed ZeRO-3 actor (world of one, paging forced, {result['dtype']}) after one optimizer step, "
             f"every state already on the host; the process imported {', '.join(result['imported'])}. "
             f"{result['repeats']} page-outs each.", "",
             "| collector | tracked objects | median ms | max ms |", "|---|---|---|---|",
             f"| as today | {b['tracked_objects']} | {1000 * b['median_s']:.1f} | {1000 * max(b['seconds']):.1f} |",
             f"| frozen after set-up (`freeze_collector`, {result['freeze']['seconds']:.2f} s once) | "
             f"{a['tracked_objects']} | {1000 * a['median_s']:.1f} | {1000 * max(a['seconds']):.1f} |", "",
             "colocate.paging=auto on the sample cases (per device):", "",
             "| case | paged | fits | generation GiB | update GiB | device GiB | why |", "|---|---|---|---|---|---|---|"]
    for name, p in result["plans"].items():
        lines.append(f"| {name} | {', '.join(p['paged']) or 'nothing'} | {p['fits']} | {p['generation_gib']:.1f} | "
                     f"{p['update_gib']:.1f} | {p['device_gib']:.1f} | {p['reason']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="GRPO-like steps (two transitions each)")
    p.add_argument("--engine", choices=["hf", "sglang"], default="hf")
    p.add_argument("--small", action="store_true", help="CPU-sized model instead of the 0.5B-class one")
    p.add_argument("--model", choices=list(MODELS), default="0.5b", help="random-weight model shape")
    p.add_argument("--name", default="phase_switch", help="results file name (<name>-<device>-<date>)")
    p.add_argument("--sglang-kwargs", default="", help='rollout.sglang_kwargs as JSON, e.g. \'{"attention_backend": "triton"}\'')
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--no-itemise", dest="itemise", action="store_false",
                   help="skip the pass that releases / pages one kind at a time after the timed steps")
    p.add_argument("--paging", choices=["auto", "on", "off"], default="auto",
                   help="colocate.paging (on: page host to host on CPU too, to run the GPU's paging code)")
    p.add_argument("--fixed-cost", action="store_true",
                   help="CPU: time page-outs that move 0 bytes before / after freezing the collector, and "
                        "print colocate.paging=auto's decisions on the sample cases")
    p.add_argument("--repeats", type=int, default=10, help="page-outs per --fixed-cost measurement")
    args = p.parse_args(argv)
    if args.fixed_cost:
        result = fixed_cost(args)
        common.publish(args.name + "_fixed_cost", result, fixed_cost_markdown(result), args.out, readme=False)
        return 0
    if not args.small and args.model != "small" and not torch.cuda.is_available():
        p.error(f"the {args.model} model needs a GPU; pass --small on CPU")
    result = run(args)
    from colo_rl import dist

    if dist.is_rank0():
        common.publish(args.name, result, markdown(result), args.out, readme=False)
    return 0


if __name__ == "__main__":
    from colo_rl import process_exit

    process_exit.run_and_exit(main)
