"""Peer race: colo_rl's GRPO step against TRL's GRPOTrainer on identical work, one process each.

Same model (SmolLM2-135M-Instruct, the embedded default), same prompts (colo_rl's arithmetic task
and chat prompts), same reward (colo_rl's RewardScorer: verifier + format bonus), 8 prompts x 8
completions per step, at most 64 new tokens, temperature 1.0, top-p 1, one optimizer step per batch,
no reference model (KL 0), token-mean loss with clip 0.2, Adam lr 1e-5 constant, grad clip 1.0,
bf16 where the CPU supports it (fp32 otherwise; --dtype picks one) for both. Each side runs in its own process, one
after the other; the score is the median seconds per step over steps skip+1..steps (3-8 by default)
and the ratio colo_rl / TRL (the target is 0.5 or lower). Reward per step is reported for both,
so speed is not bought with learning.

    python benchmarks/race_trl.py                         # 8 steps per side
    python benchmarks/race_trl.py --model tiny --steps 3  # quick check with a tiny random model

TRL is configured as its documentation recommends for speed on one CPU process: no vLLM (GPU only),
gradient checkpointing off (TRL's GRPOConfig turns it on by default, which costs a recomputation),
the whole batch generated at once (generation_batch_size = 64) and trained in micro-batches of 8 with
gradient accumulation up to one optimizer step per batch (steps_per_generation = gradient_accumulation_steps
= 8; one micro-batch of 64 needs several GiB for its logits and was killed for memory here), num_iterations =
1 (so TRL skips its old-log-prob pass), beta = 0 (no reference model), logging every step (to read the reward), no
checkpoints, no completion logging. colo_rl runs its recipe (recipes/grpo.py) with the same
settings and its defaults otherwise (group packing: each group one row, its prompt computed once), with
four groups per micro-batch (trainer.micro_batch_size=32). TRL's micro-batch was probed the same way
(4 steps, median of steps 2-4, same machine): 8 sequences 84.7 s/step, 16: 106.9, 32: 100.2, so it
keeps 8. By default the colo_rl side runs under benchmarks/step_breakdown.py, so the same run also
writes the step breakdown (time and memory per phase); its sampler thread costs well under 1 %.

Step time: colo_rl's time/step (prompt sampling to optimizer step, both phase switches and the
handoff included); TRL's from on_step_begin to on_step_end (generation, reward, loss, backward,
optimizer). Both leave out the per-step metric logging and the start-up. TRL's phases are timed
by wrapping its trainer's generation, reward and loss methods on the instance (not copied code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from colo_rl.child_env import child_python_path  # noqa: E402

LR = 1e-5
SEED = 42  # the default --seed: both sides' model init, sampling and prompt order


def median_step(seconds: list[float], skip: int) -> float:
    """Median of per-step seconds after dropping the first `skip` steps (steps 3-8 for skip=2)."""
    if not seconds:
        raise ValueError("no steps")
    return statistics.median(seconds[common.kept_steps(len(seconds), skip):])


def race_ratio(colo_seconds: list[float], trl_seconds: list[float], skip: int) -> float:
    return median_step(colo_seconds, skip) / median_step(trl_seconds, skip)


# ----------------------------------------------------------------------------- colo_rl side
def colo_overrides(args, run_dir: Path) -> list[str]:
    model = ["model=tiny"] if args.model == "tiny" else ["model=smollm2"]
    dtype = [] if args.dtype == "auto" else [f"model.dtype={args.dtype}"]
    return model + dtype + [
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"rollout.eval_batch_size={args.prompts * args.n}",  # the HF engine's batch: the whole step at once
        f"trainer.total_steps={args.steps}", "trainer.mini_batches_per_step=1", "algo.kl_coef=0.0",
        "algo.loss_agg=token-mean", "algo.clip_low=0.2", "algo.clip_high=0.2", f"trainer.lr={LR}",
        "trainer.lr_schedule=constant", "trainer.warmup_steps=0", "trainer.grad_clip=1.0", f"trainer.seed={args.seed}",
        f"trainer.micro_batch_size={args.colo_micro_batch}", "trainer.micro_batch_tokens=1000000",  # the count decides
        "data.train_size=512", "data.eval_size=8", "rollout.eval_max_new_tokens=16",
        "logger=[jsonl]", "plots=false", f"run_dir={run_dir}", *args.colo_override]


def colo_prompt_order(num_train: int, seed: int, steps: int, prompts: int) -> list[int]:
    """The training problems colo_rl's recipe draws, step after step (its EpochSampler with data.seed):
    TRL gets its dataset in this order, unshuffled, so step k of both sides trains on the same prompts
    and the per-step rewards compare the learners, not the draw of problems."""
    from colo_rl.data.sampler import EpochSampler

    sampler = EpochSampler(num_train, seed=seed)
    return [i for _ in range(steps) for i in sampler.next_global(prompts)]


def run_colo(args, work: Path) -> dict:
    run_dir = work / "colo_rl"
    if args.colo_runner == "breakdown":  # the recipe under the step-breakdown harness: one run, two results
        overrides = [o for o in colo_overrides(args, run_dir) if not o.startswith("run_dir=")]
        cmd = [sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), "--skip", str(args.skip),
               "--out", str(args.out), "--run-dir", str(run_dir), "--no-readme", *overrides]
    else:
        cmd = [sys.executable, str(ROOT / "recipes" / "grpo.py"), *colo_overrides(args, run_dir)]
    t0 = time.perf_counter()
    load0 = len(common.LOAD.samples)
    _run(cmd, work / "colo_rl.log")
    wall = time.perf_counter() - t0
    from colo_rl.loggers import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("time/step") is not None]
    phases = {k: [r.get(f"time/{k}", 0.0) for r in rows]
              for k in ("generation", "reward", "logprobs", "update", "handoff", "phase_switch")}
    return {"command": common.command(cmd), "wall_seconds": wall, "step_seconds": [r["time/step"] for r in rows],
            "reward": [r["reward/mean"] for r in rows], "accuracy": [r["reward/accuracy"] for r in rows],
            "completion_len": [r["response/len_mean"] for r in rows], "phases": phases,
            "load_avg_1m": _load_since(load0)}


# ----------------------------------------------------------------------------- TRL side
def run_trl(args, work: Path) -> dict:
    out = work / "trl.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "trl", "--worker-json", str(out),
           "--model", args.model, "--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n),
           "--max-new-tokens", str(args.max_new_tokens), "--trl-micro-batch", str(args.trl_micro_batch),
           "--seed", str(args.seed), "--dtype", args.dtype,
           *[a for o in args.colo_override for a in ("--colo-override", o)]]  # e.g. data.* for both sides
    t0 = time.perf_counter()
    load0 = len(common.LOAD.samples)
    _run(cmd, work / "trl.log")
    r = json.loads(out.read_text())
    r.update(command=common.command(cmd), wall_seconds=time.perf_counter() - t0, load_avg_1m=_load_since(load0))
    return r


def trl_worker(args) -> None:
    """Runs in its own process: TRL's GRPOTrainer on colo_rl's task, prompts, reward and model."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from colo_rl.config import ModelConfig, register_configs
    from colo_rl.data import PromptBuilder, load_problems
    from colo_rl.models import load_model, load_tokenizer, resolve_dtype
    from colo_rl.rewards import RewardScorer

    # The colo_rl side's config, composed from the same conf/ and overrides: the same problems,
    # prompts (instruction, chat template) and reward.
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=colo_overrides(args, Path(tempfile.gettempdir()))))
    tokenizer = load_tokenizer("embedded")
    train, _ = load_problems(cfg.data)
    builder = PromptBuilder(tokenizer, cfg.data)
    train = [p for p in train if builder.encode(p) is not None]  # what colo_rl's recipe keeps
    order = colo_prompt_order(len(train), cfg.data.seed, args.steps, args.prompts)
    dataset = Dataset.from_list([{"prompt": builder.messages(train[i]), "answer": train[i].answer} for i in order])
    scorer = RewardScorer(cfg.reward)
    accuracy: list[float] = []

    def arithmetic_reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        res = scorer.score(texts, list(answer))
        accuracy.append(sum(res.correct) / max(1, len(res.correct)))
        return res.rewards

    on_gpu = torch.cuda.is_available()
    bf16 = resolve_dtype(args.dtype) == torch.bfloat16  # as colo_rl's model.dtype resolves it
    if args.model == "tiny":
        model_cfg = ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32")
    else:
        model_cfg = ModelConfig()
    # fp32 weights; with bf16=True TRL trains under bf16 autocast (its standard mixed precision).
    model = load_model(model_cfg, torch.float32, seed=args.seed)
    batch = args.prompts * args.n
    micro = args.trl_micro_batch or batch
    config = GRPOConfig(
        output_dir=str(Path(args.worker_json).parent / "trl-out"),
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_generations=args.n, num_iterations=1,
        # sampling and optimizer settings from the colo_rl side's composed config (one source)
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=0, learning_rate=cfg.trainer.lr, lr_scheduler_type=cfg.trainer.lr_schedule,
        warmup_steps=cfg.trainer.warmup_steps, max_grad_norm=cfg.trainer.grad_clip,
        weight_decay=cfg.trainer.weight_decay, beta=cfg.algo.kl_coef, epsilon=cfg.algo.clip_low,
        epsilon_high=cfg.algo.clip_high, loss_type="dapo", scale_rewards="group",  # dapo = token-mean over the batch
        max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none", log_completions=False,
        bf16=bf16, fp16=False, gradient_checkpointing=False, use_vllm=False, use_cpu=not on_gpu,
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
        shuffle_dataset=False,  # the dataset is already in colo_rl's order (colo_prompt_order)
    )
    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)

    phase_s: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phase_s[name] = phase_s.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("rollout_total", trainer._generate_and_score_completions)
    trainer.compute_loss = timed("loss_forward", trainer.compute_loss)

    record = {"step_seconds": [], "reward": [], "completion_len": [], "phases": {}}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            phase_s.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            dt = time.perf_counter() - self.t0
            record["step_seconds"].append(dt)
            gen, rew, roll, loss = (phase_s.get(k, 0.0) for k in ("generation", "reward", "rollout_total",
                                                                     "loss_forward"))
            for k, v in {"generation": gen, "reward": rew, "scoring_other": roll - gen - rew,
                         "loss_forward": loss, "backward_optimizer": dt - roll - loss}.items():
                record["phases"].setdefault(k, []).append(v)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:
                record["reward"].append(logs["reward"])
                record["completion_len"].append(logs.get("completions/mean_length"))

    trainer.add_callback(StepTimer())
    trainer.train()
    record["accuracy"] = accuracy
    record["config"] = {k: getattr(config, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
        "num_generations", "num_iterations", "max_completion_length", "temperature", "top_p", "top_k",
        "learning_rate", "lr_scheduler_type", "beta", "epsilon", "loss_type", "scale_rewards", "bf16",
        "gradient_checkpointing", "use_vllm", "max_steps", "logging_steps")}
    record["torch_threads"] = torch.get_num_threads()
    Path(args.worker_json).write_text(json.dumps(record, indent=1) + "\n")


# ----------------------------------------------------------------------------- helpers, report
def _run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": child_python_path(),
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{common.command(cmd)} failed ({proc.returncode}); log {log}:\n{tail}")


def _load_since(index: int) -> dict:
    s = common.LOAD.samples[index:] + [os.getloadavg()[0]]
    return {"mean": round(statistics.fmean(s), 2), "max": round(max(s), 2)}


def summarise(side: dict, skip: int) -> dict:
    k = common.kept_steps(len(side["step_seconds"]), skip)
    out = {"median_step_seconds": median_step(side["step_seconds"], skip),
           "steps_kept": list(range(k + 1, len(side["step_seconds"]) + 1)),
           "reward_mean_all_steps": statistics.fmean(side["reward"]) if side["reward"] else None,
           "reward_last_step": side["reward"][-1] if side["reward"] else None,
           "reward_mean_last3": statistics.fmean(side["reward"][-3:]) if side["reward"] else None,
           "accuracy_mean_all_steps": statistics.fmean(side["accuracy"]) if side.get("accuracy") else None,
           "completion_len_mean": statistics.fmean(x for x in side["completion_len"] if x is not None)
           if side.get("completion_len") else None,
           "phases_median": {p: statistics.median(v[k:]) for p, v in side["phases"].items() if v[k:]}}
    return out


def markdown(result: dict) -> str:
    c, t = result["colo_rl"]["summary"], result["trl"]["summary"]
    w = result["work"]
    verdict = "meets" if result["ratio"] <= 0.5 else "misses"
    lines = [f"# Peer race vs TRL: {result['device']}, {result['date']}", "",
             f"{w['model']}, {w['dtype']}, {w['prompts']} prompts x {w['n']} completions, <= {w['max_new_tokens']} new "
             f"tokens, temperature 1.0, one optimizer step per batch, no reference model, {w['steps']} steps per side, "
             f"seed {w.get('seed', SEED)}, the same prompts at each step on both sides, "
             f"one process each (colo_rl first). Median over steps {c['steps_kept'][0]}-{c['steps_kept'][-1]}.", "",
             "| | colo_rl | TRL GRPOTrainer |", "|---|---|---|",
             f"| **median s / step** | **{c['median_step_seconds']:.2f}** | **{t['median_step_seconds']:.2f}** |",
             f"| reward/mean, all steps | {c['reward_mean_all_steps']:.3f} | {t['reward_mean_all_steps']:.3f} |",
             f"| reward/mean, last 3 steps | {c['reward_mean_last3']:.3f} | {t['reward_mean_last3']:.3f} |",
             f"| reward/mean, step {w['steps']} | {c['reward_last_step']:.3f} | {t['reward_last_step']:.3f} |",
             f"| accuracy, all steps | {_f(c['accuracy_mean_all_steps'])} | {_f(t['accuracy_mean_all_steps'])} |",
             f"| mean completion tokens | {_f(c['completion_len_mean'], 1)} | {_f(t['completion_len_mean'], 1)} |",
             f"| wall clock incl. start-up (s) | {result['colo_rl']['wall_seconds']:.0f} | "
             f"{result['trl']['wall_seconds']:.0f} |",
             f"| load avg 1m during (mean / max) | {result['colo_rl']['load_avg_1m']['mean']} / "
             f"{result['colo_rl']['load_avg_1m']['max']} | {result['trl']['load_avg_1m']['mean']} / "
             f"{result['trl']['load_avg_1m']['max']} |", "",
             f"**Ratio colo_rl / TRL = {result['ratio']:.2f}** ({verdict} the <= 0.5 target).", "",
             "Median seconds per phase (kept steps):", "",
             "| colo_rl phase | s | TRL phase | s |", "|---|---|---|---|"]
    cp = list(c["phases_median"].items())
    tp = list(t["phases_median"].items())
    for i in range(max(len(cp), len(tp))):
        a = cp[i] if i < len(cp) else ("", None)
        b = tp[i] if i < len(tp) else ("", None)
        lines.append(f"| {a[0]} | {_f(a[1])} | {b[0]} | {_f(b[1])} |")
    lines += ["", "Per step (s; reward):", "", "| step | colo_rl s | TRL s | colo_rl reward | TRL reward |",
              "|---|---|---|---|---|"]
    cs, ts = result["colo_rl"], result["trl"]
    for i in range(max(len(cs["step_seconds"]), len(ts["step_seconds"]))):
        def g(lst, j, d=2):
            return _f(lst[j], d) if j < len(lst) else ""
        lines.append(f"| {i + 1} | {g(cs['step_seconds'], i)} | {g(ts['step_seconds'], i)} | "
                     f"{g(cs['reward'], i, 3)} | {g(ts['reward'], i, 3)} |")
    if result.get("note"):
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


def _f(x, d: int = 3) -> str:
    return "" if x is None else f"{x:.{d}f}"


def chart(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from colo_rl.metrics import save_figure

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for side, label in (("colo_rl", "colo_rl"), ("trl", "TRL")):
        s = result[side]
        ax1.plot(range(1, len(s["step_seconds"]) + 1), s["step_seconds"], marker="o", label=label)
        ax2.plot(range(1, len(s["reward"]) + 1), s["reward"], marker="o", label=label)
    ax1.set_title(f"seconds per step (ratio {result['ratio']:.2f})")
    ax1.set_xlabel("step")
    ax1.set_ylim(bottom=0)
    ax2.set_title("reward/mean per step")
    ax2.set_xlabel("step")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=SEED, help="both sides' seed (model init, sampling, prompt order)")
    p.add_argument("--skip", type=int, default=2, help="leading steps left out of the median (default 2: steps 3-8)")
    p.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="both sides' precision: colo_rl's model.dtype; TRL's bf16 autocast over fp32 weights "
                        "(auto: bf16 on a GPU or a CPU with native bf16, fp32 otherwise)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--colo-micro-batch", type=int, default=32,
                   help="colo_rl trainer.micro_batch_size: 32 = four packed groups of 8 per forward/backward "
                        "(the fastest on the 2-core CPU: 1, 2, 4, 8 groups took 29.5, 25.7, 23.4, 24.6 s per update)")
    p.add_argument("--trl-micro-batch", type=int, default=8,
                   help="TRL per_device_train_batch_size; gradient accumulation makes up the batch (0 = the whole "
                        "batch in one micro-batch, which needs several GiB for the logits of 64 sequences)")
    p.add_argument("--colo-override", action="append", default=[], help="extra Hydra override for the colo_rl side")
    p.add_argument("--colo-runner", choices=["breakdown", "recipe"], default="breakdown",
                   help="breakdown (default): run the recipe under benchmarks/step_breakdown.py, which also writes "
                        "the step breakdown of this very run; recipe: plain recipes/grpo.py")
    p.add_argument("--sides", default="colo_rl,trl", help="which sides to run (both for a ratio)")
    p.add_argument("--note", default="", help="a sentence added under the table (e.g. why fewer steps)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--no-readme", action="store_true")
    p.add_argument("--worker", choices=["trl"], help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "trl":
        trl_worker(args)
        return 0
    import torch

    from colo_rl.models import resolve_dtype

    work = Path(tempfile.mkdtemp(prefix="colo_rl-race-", dir=ROOT / "outputs" if (ROOT / "outputs").exists() else None))
    sides = args.sides.split(",")
    result = {"work": {"model": "SmolLM2-135M-Instruct (embedded)" if args.model == "embedded" else "tiny random",
                       "dtype": str(resolve_dtype(args.dtype)).replace("torch.", ""), "prompts": args.prompts,
                       "n": args.n, "max_new_tokens": args.max_new_tokens, "steps": args.steps, "skip": args.skip,
                       "seed": args.seed, "same_prompts_per_step": True,
                       "colo_micro_batch": args.colo_micro_batch, "trl_micro_batch": args.trl_micro_batch or
                       args.prompts * args.n, "torch_threads": torch.get_num_threads()},
              "device": common.device_slug(), "date": common.today(), "note": args.note, "work_dir": str(work)}
    for side in sides:
        print(f"race: running {side} ({args.steps} steps) ...", flush=True)
        result[side] = run_colo(args, work) if side == "colo_rl" else run_trl(args, work)
        result[side]["summary"] = summarise(result[side], args.skip)
        print(f"race: {side} median {result[side]['summary']['median_step_seconds']:.2f} s/step", flush=True)
    if not {"colo_rl", "trl"} <= set(sides):
        print(json.dumps({s: result[s]["summary"] for s in sides}, indent=1))
        return 0
    result["ratio"] = race_ratio(result["colo_rl"]["step_seconds"], result["trl"]["step_seconds"], args.skip)
    common.publish("race_trl", result, markdown(result), args.out, chart, readme=not args.no_readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
