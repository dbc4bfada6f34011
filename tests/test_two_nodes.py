"""Two nodes: `torchrun --nnodes=2` works. Two torchrun agents on localhost (c10d rendezvous, gloo,
2 ranks each) run GRPO on the tiny model and reach the same metrics as one agent with the same 4
ranks; the run directory and the checkpoints are decided once (rank 0) and shared. Engine TP
groups are laid out by local rank and never span nodes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from colo_rl import runtime
from colo_rl.config import ConfigError
from colo_rl.rollout.tp_group import engine_rank_layout
from conftest import ROOT, WORKERS, child_env, child_python_path, run_torchrun

ARGS = ["model=tiny", "trainer.total_steps=2", "data.eval_size=4", "data.train_size=64", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.eval_max_new_tokens=4", "trainer.micro_batch_size=2",
        "trainer.lr=1e-3", "reward.functions=[letter_share]", "reward.format_weight=0", "trainer.save_every=1",
        "logger=[jsonl]", "plots=false"]
# Everything a step computes; times and throughputs differ from run to run.
COMPARED = ("reward/", "response/", "train/", "eval/", "handoff/logprob_diff")


def test_tp_groups_stay_inside_a_node():
    two_nodes = engine_rank_layout(world_size=8, tp_size=2, local_world_size=4)
    assert [(x["node"], x["local_rank"], x["owner"], x["owns_engine"]) for x in two_nodes] == [
        (0, 0, 0, True), (0, 1, 0, False), (0, 2, 2, True), (0, 3, 2, False),
        (1, 0, 4, True), (1, 1, 4, False), (1, 2, 6, True), (1, 3, 6, False)]
    assert {x["node"] for x in engine_rank_layout(8, 4, 4) if x["owner"] == 4} == {1}
    assert engine_rank_layout(4, 4)[3]["group_ranks"] == [0, 1, 2, 3]  # one node: the old layout
    with pytest.raises(ValueError, match=r"rollout.tp_size=4 must divide the ranks per node \(2\)"):
        engine_rank_layout(world_size=4, tp_size=4, local_world_size=2)  # it would span both nodes
    with pytest.raises(ValueError, match="same --nproc_per_node"):
        engine_rank_layout(world_size=6, tp_size=1, local_world_size=4)


def test_a_run_dir_some_node_cannot_see_is_refused(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text("recipe: grpo\n")
    runtime.check_run_dir_shared(tmp_path)  # one process: it sees what it wrote
    # what every rank reports on two nodes whose second node has no shared filesystem
    monkeypatch.setattr(runtime.dist, "all_gather_objects", lambda mine: [(0, True), (0, True), (1, False), (1, False)])
    with pytest.raises(ConfigError, match=r"not visible on node\(s\) \[1\]: .*filesystem every node mounts"):
        runtime.check_run_dir_shared(tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two 4-rank DeepSpeed runs on 2 CPU cores (about 2-3 minutes)
@pytest.mark.e2e  # in make test-e2e, not make test
def test_two_agents_reach_the_one_agent_metrics_and_share_one_run_dir(tmp_path):
    one = tmp_path / "one-agent"
    run_torchrun(WORKERS / "grpo_resume_worker.py", [*ARGS, f"run_dir={one}"], nproc=4, timeout=900)

    # No run_dir: rank 0 names it (a timestamp) and every rank of both agents must use that one.
    root, port = tmp_path / "two-agents", free_port()
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
         f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=colo-two-nodes", f"--node_rank={node}", "--max_restarts=0",
         str(WORKERS / "grpo_resume_worker.py"), *ARGS, f"output_root={root}"],
        cwd=ROOT, env=child_env(PYTHONPATH=child_python_path(), OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [a.communicate(timeout=900)[0] for a in agents]
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-6000:]

    (two,) = list(root.iterdir())  # one directory, decided once
    a, b = rows(one), rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        keys = sorted(k for k in ra if k.startswith(COMPARED))
        assert keys == sorted(k for k in rb if k.startswith(COMPARED))
        for k in keys:  # same seeds, same gloo reductions: the same figures
            assert rb[k] == pytest.approx(ra[k], rel=1e-6, abs=1e-9), (ra["step"], k, ra[k], rb[k])
    assert b[1]["reward/std"] > 0 and b[2]["train/grad_norm"] > 0  # the steps learned something to compare
    for step in ("step-000001", "step-000002"):  # every rank of both agents wrote into the shared checkpoint
        ckpt = two / "checkpoints" / step
        assert (ckpt / "COMPLETE").exists()
        assert sorted(p.name for p in ckpt.glob("rank*.pt")) == [f"rank{r:05d}.pt" for r in range(4)]
        assert json.loads((ckpt / "state.json").read_text())["world_size"] == 4
