"""The GRPO recipe with LoRA under torchrun (2 gloo ranks, tiny model, KL against the base with
adapters disabled): the engine keeps computing the trainer's log-probs through adapter-only
handoffs, and a resumed run equals the uninterrupted one (metrics and final adapters).

Run A: 3 steps. Run B: the same config stopped after 2 (its final checkpoint), then resumed with
trainer.total_steps=3 (a harmless change: the schedule is constant). Run B pages its trainer as on a
GPU (colocate.paging=on: the adapters' states through DeepSpeed, the frozen base's partitions through
colo_rl's pager), so its equality with run A also says paging a LoRA trainer changes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import WORKERS, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # three tiny GRPO runs, ~40 s each on 2 CPU cores

OVERRIDES = ["model=tiny", "model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=2e-2", "algo.kl_coef=0.05",
             "data.eval_size=4", "data.train_size=64", "rollout.prompts_per_step=4", "rollout.group_size=4",
             "rollout.max_new_tokens=8", "rollout.eval_max_new_tokens=4", "trainer.micro_batch_size=8",
             "reward.functions=[letter_share]", "reward.format_weight=0", "colocate.handoff_check_max_mean_abs=0.001",
             "logger=[jsonl]", "plots=false"]
COMPARED = ["reward/mean", "reward/std", "response/len_mean", "train/loss", "train/kl", "train/entropy",
            "train/grad_norm", "handoff/logprob_diff_mean"]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_grpo")
    a, b = root / "a", root / "b"
    run_torchrun(WORKERS / "grpo_resume_worker.py", OVERRIDES + ["trainer.total_steps=3", f"run_dir={a}"])
    paged = OVERRIDES + ["colocate.paging=on"]
    run_torchrun(WORKERS / "grpo_resume_worker.py", paged + ["trainer.total_steps=2", f"run_dir={b}"])
    run_torchrun(WORKERS / "grpo_resume_worker.py", paged + ["trainer.total_steps=3", f"run_dir={b}", "resume=auto"])
    return a, b


def test_adapter_handoff_keeps_engine_and_trainer_in_agreement(runs):
    a, _ = runs
    r = rows(a)[1:]
    assert len(r) == 3
    for row in r:
        assert row["handoff/logprob_diff_mean"] < 1e-3 and row["train/grad_norm"] > 0 and row["train/kl"] >= 0
    assert r[-1]["train/kl"] > 0  # the adapters moved the policy away from the base
    ledger = [json.loads(line) for line in (a / "ledger.jsonl").read_text().splitlines()]
    contents = [m["content"] for rec in ledger for m in rec["moves"] if m["what"] == "weights handoff"]
    assert contents[0] == "base+adapters" and set(contents[1:]) == {"adapters"}


def test_resumed_lora_run_equals_the_uninterrupted_one(runs):
    from safetensors.torch import load_file

    a, b = runs
    ra, rb = rows(a), rows(b)
    assert [x["step"] for x in rb] == [0, 1, 2, 3]
    for key in COMPARED:
        assert [x[key] for x in ra[1:]] == [x[key] for x in rb[1:]], key
    wa = load_file(str(a / "checkpoint-final" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(b / "checkpoint-final" / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ledger = [json.loads(line) for line in (b / "ledger.jsonl").read_text().splitlines()]
    trainer = [m for rec in ledger for m in rec["moves"] if m["what"] == "trainer states"]
    assert trainer and all(m["moved"] and m["bytes"] > 0 for m in trainer)  # run B really paged


def test_checkpoint_export_equals_the_live_export(runs, tmp_path):
    """`python -m colo_rl.checkpoint` on a LoRA checkpoint: the base rebuilt as the run built it, the
    adapters from the ZeRO shards; the same merged model and adapter as the run's own export."""
    from safetensors.torch import load_file

    from colo_rl.checkpoint import export_checkpoint_to_hf, newest_checkpoint

    a, _ = runs
    out = export_checkpoint_to_hf(newest_checkpoint(a / "checkpoints"), tmp_path / "exported")
    for rel in ("model.safetensors", "adapter/adapter_model.safetensors"):
        live, offline = load_file(str(a / "checkpoint-final" / rel)), load_file(str(out / rel))
        assert live.keys() == offline.keys(), rel
        for k in live:
            torch.testing.assert_close(offline[k], live[k], rtol=0, atol=1e-6)


def test_checkpoint_export_refuses_another_base(runs, tmp_path):
    """The export rebuilds the base the checkpoint left out; one rebuilt another way (here: another
    seed for the random base) is refused by the ranks' fingerprints of their ZeRO-3 parts, not merged."""
    import shutil

    from omegaconf import OmegaConf

    from colo_rl.checkpoint import CheckpointError, export_checkpoint_to_hf, newest_checkpoint
    from colo_rl.checkpoint.export import saved_base_fingerprints

    a, _ = runs
    source = newest_checkpoint(a / "checkpoints")
    ckpt = shutil.copytree(source, tmp_path / source.name)
    saved, partitioned = saved_base_fingerprints(ckpt)
    assert partitioned and len(saved) == 2 and all(saved)  # both ranks' parts
    cfg = OmegaConf.load(ckpt / "config.yaml")
    cfg.trainer.seed += 1
    OmegaConf.save(cfg, ckpt / "config.yaml")
    with pytest.raises(CheckpointError, match=r"rank 0's part: \d+ of \d+ frozen tensors differ.*--base"):
        export_checkpoint_to_hf(ckpt, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()
    with pytest.raises(CheckpointError, match="random base.*drop --base"):
        export_checkpoint_to_hf(ckpt, tmp_path / "exported", base=str(tmp_path))
