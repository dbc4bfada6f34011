"""recipes/grpo.py with rollout=sglang under torchrun (2 gloo ranks, tiny model): two real SGLang
engines on CPU (one per rank), the handoff every step and its log-prob check, as with the HF engine
(tests/test_grpo_recipe.py). Both runs page the trainer between phases as on a GPU
(colocate.paging=on: host to host here), the order the GPU's memory plan relies on included: the
trainer paged out while SGLang starts. Test support: tests/sglang_cpu.py, tests/sglang_cpu_shims/."""

import json
import re

import pytest

import sglang_cpu
from conftest import ROOT, WORKERS, hydra_dict, run_torchrun

from colo_rl.loggers import read_jsonl

# the longest end-to-end files: not in `make test`, in `make test-e2e` (CI runs both)
pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 3


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    sglang_cpu.require_sglang()
    d = tmp_path_factory.mktemp("grpo_sglang") / "run"
    proc = run_torchrun(ROOT / "recipes" / "grpo.py",
                 ["model=tiny", "rollout=sglang", f"trainer.total_steps={STEPS}", "data.eval_size=8",
                  "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                  "rollout.eval_max_new_tokens=8", "trainer.micro_batch_size=8", "trainer.lr=1e-3",
                  "colocate.handoff_check_max_mean_abs=0.001", "colocate.handoff_bucket_mb=1", "colocate.paging=on",
                  f"rollout.sglang_kwargs={sglang_cpu.hydra_kwargs()}", f"run_dir={d}"],
                 timeout=900, env=sglang_cpu.env())
    (d.parent / "console.txt").write_text(proc.stdout + proc.stderr)
    return d


def test_console_keeps_colo_rls_format_and_rank_0_only_after_sglang_starts(run_dir):
    """sglang.Engine() reconfigures the process's logging (basicConfig(force=True)) and logs an ERROR
    about our SIGQUIT handler on every rank: the trainer's lines must come out as before it started."""
    out = (run_dir.parent / "console.txt").read_text()
    assert "Using custom SIGQUIT handler" not in out and "server_args=" not in out, out
    colo_rl_line = re.compile(r"^\[\d\d:\d\d:\d\d\] ", re.M)  # colo_rl's format, not SGLang's [date time]
    assert len(re.findall(colo_rl_line.pattern + r"step \d+ \|", out, re.M)) == STEPS, out
    assert re.search(colo_rl_line.pattern + r"SGLang engine up in", out, re.M), out
    assert out.count("SGLang engine up in") == 1, out  # rank 0's line only


def test_every_step_has_metrics_and_passes_the_handoff_check(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for row in rows[1:]:
        for key in ["reward/mean", "train/grad_norm", "time/handoff", "handoff/logprob_diff_mean",
                    "throughput/gen_tokens_per_s"]:
            assert key in row, key
        assert row["handoff/logprob_diff_mean"] < 1e-3  # checked in the run too (it would have stopped)
    print("SGLang CPU engine-vs-trainer gap per step:", [r["handoff/logprob_diff_mean"] for r in rows[1:]])


def test_ledger_covers_every_transition(run_dir):
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    kinds = [r["transition"] for r in records]
    assert kinds[0] == "update->generation"
    assert kinds.count("generation->update") == STEPS + 1 and kinds.count("update->generation") == STEPS + 1
    for r in records:
        moves = {m["what"]: m for m in r["moves"]}
        if r["transition"] == "update->generation":
            assert moves["weights handoff"]["moved"] is True and moves["weights handoff"]["buckets"] >= 2
            assert moves["engine weights (allocate)"]["bytes"] == 0  # CPU: SGLang frees / takes nothing
        assert moves["trainer states"]["moved"] is True and moves["trainer states"]["bytes"] > 0  # paged


def test_the_engines_were_sglang_on_cpu(run_dir):
    config = (run_dir / "config.yaml").read_text()
    assert "engine: sglang" in config and "device: cpu" in config


def test_lora_adapters_reach_sglang_as_tensors_and_are_applied(tmp_path):
    """model.lora.rank > 0 on SGLang's real runtime (its torch_native LoRA backend on CPU; the GPU
    uses the Triton one, tests/test_lora_gpu.py): the base once, then only the adapters each step,
    and the engine's log-probs stay the trainer's while the policy moves away from the base (the KL
    to the base, i.e. what the adapters change, is far above the engine-vs-trainer gap)."""
    sglang_cpu.require_sglang()
    kwargs = {**sglang_cpu.SGLANG_KWARGS, "lora_backend": "torch_native"}
    run_torchrun(WORKERS / "grpo_resume_worker.py",
                 ["model=tiny", "rollout=sglang", "model.lora.rank=8", "trainer.lr=1e-3", f"trainer.total_steps={STEPS}",
                  "data.eval_size=4", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
                  "rollout.eval_max_new_tokens=4", "algo.kl_coef=0.05", "reward.functions=[letter_share]",
                  "reward.format_weight=0", "logger=[jsonl]", "plots=false", "colocate.handoff_check_max_mean_abs=0.001",
                  "colocate.paging=on", f"rollout.sglang_kwargs={hydra_dict(kwargs)}", f"run_dir={tmp_path}"],
                 nproc=1, timeout=900, env=sglang_cpu.env())
    rows, ledger = read_jsonl(tmp_path / "metrics.jsonl")[1:], read_jsonl(tmp_path / "ledger.jsonl")
    handoffs = [m for rec in ledger for m in rec["moves"] if m["what"] == "weights handoff"]
    assert [m["content"] for m in handoffs] == ["base+adapters"] + ["adapters"] * STEPS
    assert all(m["bytes"] < handoffs[0]["bytes"] / 50 for m in handoffs[1:])  # rank-8 adapters of a 13 MB model
    assert len(rows) == STEPS and all(r["handoff/logprob_diff_max"] < 1e-4 for r in rows)
    assert rows[-1]["train/kl"] > 1e-5 and rows[-1]["train/kl"] > 100 * rows[-1]["handoff/logprob_diff_mean"]
    print("SGLang LoRA on CPU: gap max per step", [r["handoff/logprob_diff_max"] for r in rows], "KL to the base",
          [r["train/kl"] for r in rows], "adapter bytes", handoffs[1]["bytes"], "base bytes", handoffs[0]["bytes"])


def test_tensor_parallel_engine_serves_both_ranks_with_the_weights_of_both(tmp_path):
    """rollout.tp_size=2 on SGLang's real runtime (2 gloo ranks, one engine with two scheduler
    processes, TP over gloo): rank 1 sends its prompts to the owner and gets exactly its
    completions back, and each rank's payload reaches its own TP rank. The engine-vs-trainer check
    pairs each rank's prompts with the completions it got, on weights that move every step.
    Before the group's ranks took the owner's authkey, rank 1's CPU payload failed in TP rank 1's
    scheduler (a file descriptor's hand-over authenticates with an authkey only the owner shares
    with SGLang's children)."""
    sglang_cpu.require_sglang()
    if not sglang_cpu.CPU_TENSOR_PARALLEL.get(sglang_cpu.SGLANG_VERSION, True):
        pytest.skip(f"SGLang {sglang_cpu.SGLANG_VERSION}'s CPU engine has no tp_size > 1 (make test runs 0.5.21)")
    rewards = tmp_path / "rewards.py"  # a reward a random tiny model's completions vary in
    rewards.write_text("def letter_share(completion, truth):\n"
                       "    return sum(c.isascii() and c.isalpha() for c in completion) / max(len(completion), 1)\n")
    proc = run_torchrun(ROOT / "recipes" / "grpo.py",
                        ["model=tiny", "rollout=sglang", "rollout.tp_size=2", f"trainer.total_steps={STEPS}",
                         "data.eval_size=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
                         "rollout.max_new_tokens=8", "trainer.lr=1e-3", f"reward.functions=[{rewards}:letter_share]",
                         "reward.format_weight=0", "logger=[jsonl]", "plots=false", "colocate.paging=on",
                         "colocate.handoff_check_max_mean_abs=0.001",
                         f"rollout.sglang_kwargs={sglang_cpu.hydra_kwargs()}", f"run_dir={tmp_path / 'run'}"],
                        timeout=900, env={**sglang_cpu.env(), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    out = proc.stdout + proc.stderr
    assert out.count("starting SGLang") == 1 and "(tp=2," in out  # one engine for the two ranks
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert len(rows) == STEPS
    assert all(r["train/grad_norm"] > 0 for r in rows)  # the weights handed off differ every step
    assert all(r["handoff/logprob_diff_max"] < 1e-4 for r in rows), [r["handoff/logprob_diff_max"] for r in rows]
    print("SGLang tp=2 on CPU: gap max per step", [r["handoff/logprob_diff_max"] for r in rows])


def test_split_placement_feeds_a_tensor_parallel_sglang_generation_pool_every_version(tmp_path):
    """placement.mode=split with SGLang's real runtime and a TP engine in the generation pool (ranks 0
    and 1: one engine with tp_size=2, driven by rank 0; rank 2 trains; gloo): the trainer's weights
    reach rank 0 bucket by bucket (`WeightReceiver.take` -> `SGLangEngine.load_weights`) between
    generate calls, and both TP ranks read them from rank 0. With k = 0 every step trains the
    rollout of the version just sent, and the engine's log-probs equal the trainer's on it (to
    float32 rounding: a TP rank left on an older shard would be off by what a step at lr 1e-3
    changed). Rank 1 only holds its GPU for the engine and ends with the run. An SGLang whose CPU
    engine has no TP (the GPU carry's 0.5.17) runs the same with 1 generation rank + 1 trainer."""
    sglang_cpu.require_sglang()
    tp = 2 if sglang_cpu.CPU_TENSOR_PARALLEL.get(sglang_cpu.SGLANG_VERSION, True) else 1
    proc = run_torchrun(WORKERS / "grpo_resume_worker.py",
                        ["model=tiny", "rollout=sglang", "placement.mode=split", f"placement.generation_ranks={tp}",
                         f"rollout.tp_size={tp}", "rollout.max_staleness=0", f"trainer.total_steps={STEPS}",
                         "data.eval_size=8", "rollout.prompts_per_step=4", "rollout.group_size=4",
                         "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=8", "trainer.lr=1e-3",
                         "reward.functions=[letter_share]", "reward.format_weight=0", "logger=[jsonl]", "plots=false",
                         "colocate.handoff_check_max_mean_abs=0.001",
                         f"rollout.sglang_kwargs={sglang_cpu.hydra_kwargs()}", f"run_dir={tmp_path}"],
                        nproc=tp + 1, timeout=900,
                        env={**sglang_cpu.env(), **({"SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {})})
    out = proc.stdout + proc.stderr
    assert out.count("starting SGLang") == 1 and f"(tp={tp}," in out, out  # one engine, on ranks [0, tp)
    if tp > 1:
        assert f"generation rank 1: held its GPU for rank 0's engine, {STEPS} slot(s)" in out, out
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert "engine: sglang" in (tmp_path / "config.yaml").read_text()
    assert rows[0]["eval/count"] == rows[-1]["eval/count"] == 8  # evaluated on the generation rank
    steps = rows[1:]
    assert [r["split/policy_version"] for r in steps] == list(range(STEPS))
    assert all(r["split/staleness_max"] == 0 and r["train/grad_norm"] > 0 for r in steps)
    assert all(r["handoff/logprob_diff_max"] < 1e-5 for r in steps), [r["handoff/logprob_diff_max"] for r in steps]
    assert all(r["split/weight_sync_bytes"] > 0 for r in steps)
    print("SGLang tp=2 generation pool: gap max per step", [r["handoff/logprob_diff_max"] for r in steps])

