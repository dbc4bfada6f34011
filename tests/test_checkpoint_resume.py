"""Kill and resume with the real trainer: recipes/grpo.py under torchrun (2 gloo ranks, ZeRO-3,
tiny model, a reference model for the KL term).

Run A goes through 4 steps uninterrupted. Run B is the same config checkpointing every step; once
checkpoint 2 is complete, torchrun and both ranks get SIGKILL at once (the machine going away:
nothing runs after it, possibly in the middle of step 3 or of its save). Run B is then started
again with resume=auto. Its metrics from the step after the checkpoint it resumed from must equal
run A's, and so must the final weights. Run B pages its trainer between phases as on a GPU
(`colocate.paging=on`: DeepSpeed's offload_states, host to host here), so the same checks also say
that paging changes nothing and that its checkpoints resume.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from colo_rl.checkpoint import is_complete, newest_checkpoint
from conftest import ROOT, WORKERS, child_env, child_python_path, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

WORKER = WORKERS / "grpo_resume_worker.py"
STEPS, KILL_AFTER = 4, 2
OVERRIDES = ["model=tiny", f"trainer.total_steps={STEPS}", "trainer.eval_every=2", "trainer.lr=1e-3",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
             "rollout.eval_max_new_tokens=4", "data.train_size=64", "data.eval_size=4", "algo.kl_coef=0.01",
             "reward.functions=[letter_share]", "reward.format_weight=0", "logger=[jsonl]", "plots=false"]
PAGED = ["colocate.paging=on"]  # run B only
COMPARED = ["reward/mean", "reward/std", "response/len_mean", "response/stop_rate", "train/loss", "train/kl",
            "train/entropy", "train/clip_frac", "train/grad_norm", "train/lr", "handoff/logprob_diff_mean",
            "eval/accuracy", "eval/format_rate"]


# Run A's steps 1-4 on this machine's CPU (fp32, 2 gloo ranks): the resumed run B equals run A
# step for step (below), so these are also the golden values after a resume.
GOLDEN = {"train/loss": [-8.754432201385498e-08, 7.068771083140746e-05, 0.00010744977407739498, 0.0001448958064429462],
          "train/grad_norm": [1.0769044915880421, 0.9903616193500923, 0.9680424184124837, 0.9634683050918107],
          "reward/mean": [0.8801694810390472, 0.8901298642158508, 0.8817603290081024, 0.8773542940616608]}


def torchrun_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), *args]


def kill_all(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGKILL torchrun and every process under it at once (torchrun starts each rank in its own
    session, so its process group alone would miss them)."""
    root = psutil.Process(proc.pid)
    procs = [root] + root.children(recursive=True)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    a_dir, b_dir = base / "uninterrupted", base / "killed"
    timings = {}
    t0 = time.perf_counter()
    run_torchrun(WORKER, OVERRIDES + [f"run_dir={a_dir}"])
    timings["uninterrupted"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    env = child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1")
    with open(base / "killed.log", "w") as out:
        proc = subprocess.Popen(torchrun_cmd(OVERRIDES + PAGED + [f"run_dir={b_dir}", "trainer.save_every=1"]), cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 900  # generous: a loaded 2-core CI machine
            while not is_complete(b_dir / "checkpoints" / f"step-{KILL_AFTER:06d}"):
                assert proc.poll() is None, (base / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "run B never wrote its checkpoint"
                time.sleep(0.05)
            killed = kill_all(proc)
            proc.wait(timeout=30)
        finally:
            proc.kill()
    _, alive = psutil.wait_procs(killed, timeout=10)
    killed_newest = newest_checkpoint(b_dir / "checkpoints").name
    timings["killed"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    resumed = run_torchrun(WORKER, OVERRIDES + PAGED + [f"run_dir={b_dir}", "trainer.save_every=1", "resume=auto"])
    timings["resumed"] = time.perf_counter() - t0
    print("timings (s):", {k: round(v, 1) for k, v in timings.items()})
    return {"a": a_dir, "b": b_dir, "resumed_log": resumed.stdout + resumed.stderr, "alive": alive,
            "killed": killed, "killed_newest": killed_newest, "timings": timings}


def tiny_partition_numel(ranks: int) -> int:
    """Elements of one rank's ZeRO-3 partitions of model=tiny (each parameter split in `ranks`, padded)."""
    from transformers import AutoModelForCausalLM

    from colo_rl.config import ModelConfig
    from colo_rl.models import model_config

    config = model_config(ModelConfig(path="embedded", random_init=True, hidden_size=64, num_layers=2))
    model = AutoModelForCausalLM.from_config(config)
    return sum(-(-p.numel() // ranks) for p in model.parameters())


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_kill_leaves_no_process_and_resume_picks_the_newest_complete_checkpoint(runs):
    assert len(runs["killed"]) >= 3 and runs["alive"] == []  # torchrun + 2 ranks (at least), all gone
    k = int(runs["killed_newest"].split("-")[1])
    assert k >= KILL_AFTER
    assert f"resumed from {runs['b'] / 'checkpoints' / runs['killed_newest']}: continuing after step {k}" \
        in runs["resumed_log"]
    # keep_last=2: only the two newest complete checkpoints remain, no debris of the kill
    assert sorted(p.name for p in (runs["b"] / "checkpoints").iterdir()) == [f"step-{STEPS - 1:06d}", f"step-{STEPS:06d}"]


def test_resumed_metrics_equal_the_uninterrupted_run_step_for_step(runs):
    a, b = rows(runs["a"]), rows(runs["b"])
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # each step once: rows after the checkpoint redone
    k = int(runs["killed_newest"].split("-")[1])
    for ra, rb in zip(a, b):
        assert ra["step"] == rb["step"]
        for key in COMPARED:
            if key in ra or key in rb:
                assert rb[key] == pytest.approx(ra[key], rel=1e-6, abs=1e-9), (rb["step"], key, ra[key], rb[key])
    assert k < STEPS and all("train/loss" in r for r in b[k + 1:])


def test_run_b_paged_its_trainer_and_checkpointed_without_deepspeeds_paging_buffers(runs):
    def moves(run_dir, what):
        records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
        return [m for r in records for m in r["moves"] if m["what"] == what]

    # The reference model (kl_coef > 0, full fine-tune) is paged with the trainer: its ZeRO-3
    # partitions, half of each fp32 weight (rounded up) on each of the 2 ranks.
    for what in ("trainer states", "reference model"):
        assert moves(runs["a"], what) and not any(m["moved"] for m in moves(runs["a"], what))
        assert moves(runs["b"], what) and all(m["moved"] and m["bytes"] > 0 for m in moves(runs["b"], what))
    assert {m["bytes"] for m in moves(runs["b"], "reference model")} == {4 * tiny_partition_numel(ranks=2)}
    optim = sorted((runs["b"] / "checkpoints").glob("step-*/**/*optim_states.pt"))
    assert len(optim) >= 2  # both ranks
    for f in optim:
        state = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]["optimizer_state_dict"]
        assert not [k for st in state["state"].values() for k in st if k.endswith("_offload_buffer")], f


def test_uninterrupted_run_matches_the_golden_values(runs):
    a = rows(runs["a"])[1:]
    actual = {k: [r[k] for r in a] for k in GOLDEN}
    for key, values in GOLDEN.items():
        assert actual[key] == pytest.approx(values, rel=1e-4, abs=1e-6), (key, actual[key])


def test_final_weights_equal_the_uninterrupted_run(runs):
    from safetensors.torch import load_file

    wa = load_file(runs["a"] / "checkpoint-final" / "model.safetensors")
    wb = load_file(runs["b"] / "checkpoint-final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    worst = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
    assert worst <= 1e-6, worst


def test_a_saved_checkpoint_exports_to_a_model_transformers_loads(runs, tmp_path):
    """`python -m colo_rl.checkpoint <run dir or checkpoint> <out>` (called in-process here): one
    process, no torchrun; the final step's checkpoint gives exactly the weights of the HF model the
    run exported itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colo_rl.checkpoint import main as export_main

    out = tmp_path / "hf"
    export_main([str(runs["b"]), str(out)])  # a run dir: its newest complete checkpoint
    model = AutoModelForCausalLM.from_pretrained(out)
    final = AutoModelForCausalLM.from_pretrained(runs["b"] / "checkpoint-final")
    assert model.state_dict().keys() == final.state_dict().keys()
    for (n, p), (_, q) in zip(model.state_dict().items(), final.state_dict().items()):
        assert torch.equal(p, q), n
    ids = AutoTokenizer.from_pretrained(out)("What is 2 + 3?", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


def test_resuming_with_a_config_that_changes_the_state_is_refused_by_key(runs):
    changed = [o for o in OVERRIDES if not o.startswith("rollout.group_size=")] + ["rollout.group_size=2",
                                                                                    "data.seed=8"]
    proc = subprocess.run(torchrun_cmd(changed + [f"run_dir={runs['b']}", "resume=auto", "trainer.save_every=1"]),
                          cwd=ROOT, env=child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "config key(s) data.seed, rollout.group_size differ" in out, out[-3000:]
    assert "rollout.group_size: checkpoint 4, now 2" in out and "data.seed: checkpoint 7, now 8" in out
