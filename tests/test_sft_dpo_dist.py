"""SFT and DPO recipes under torchrun (2 gloo ranks, ZeRO-3, tiny model), and the SFT -> DPO ->
GRPO chain: each recipe's checkpoint-final is the next one's model.path."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_torchrun
from test_metrics_doc import undocumented

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

COMMON = ["model=tiny", "trainer.zero_stage=3", "data.train_size=24", "data.eval_size=8", "trainer.batch_size=8",
          "trainer.micro_batch_size=2", "trainer.max_steps=2", "trainer.lr=1e-3", "trainer.warmup_steps=0",
          "trainer.lr_schedule=constant", "rollout.eval_max_new_tokens=4"]


# Steps 1 and 2 on this machine's CPU (fp32, 2 gloo ranks, seed 42), in the manner of torchtune's
# recipe tests: a change to batching, packing, the losses or the update shows up here.
GOLDEN_SFT = {"train/loss": [10.804613590240479, 10.518816471099854],
              "train/grad_norm": [2.9192392273847148, 2.4095623079173514]}
GOLDEN_DPO = {"train/loss": [0.6931472718715668, 0.6795983612537384],
              "train/grad_norm": [0.6253872551730744, 0.49198549534030944],
              "rewards/margins": [-1.9073486612342094e-07, 0.02863273397088051]}


def _check_golden(rows, golden):
    actual = {k: [r[k] for r in rows[1:3]] for k in golden}
    for key, values in golden.items():
        assert actual[key] == pytest.approx(values, rel=1e-4, abs=1e-6), (key, actual[key])


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _outputs_exist(run_dir):
    for name in ["metrics.jsonl", "loss_curve.png", "summary.json", "config.yaml", "checkpoint-final/config.json",
                 "checkpoint-final/model.safetensors", "checkpoint-final/tokenizer_config.json"]:
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft") / "run"
    # packing on: micro-batch counts differ between ranks and are equalised (ZeRO-3 collectives)
    run_torchrun(ROOT / "recipes" / "sft.py", COMMON + ["trainer.packing=true", "trainer.eval_generate=true",
                                                        f"run_dir={d}"], timeout=600)
    return d


@pytest.fixture(scope="module")
def dpo_dirs(tmp_path_factory, sft_dir):
    out = {}
    for mode in ("frozen", "precomputed"):
        d = tmp_path_factory.mktemp(f"dpo-{mode}") / "run"
        run_torchrun(ROOT / "recipes" / "dpo.py",
                     COMMON + [f"model.path={sft_dir / 'checkpoint-final'}", "model.random_init=false",
                               f"algo.precompute_ref_logprobs={mode == 'precomputed'}", "trainer.eval_every=1",
                               f"run_dir={d}"], timeout=600)
        out[mode] = d
    return out


def test_sft_step_under_zero3(sft_dir):
    _outputs_exist(sft_dir)
    rows = _rows(sft_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/loss" in rows[0] and "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for r in rows[1:]:
        assert r["train/loss"] > 0 and torch.isfinite(torch.tensor(r["train/loss"]))
        assert r["train/grad_norm"] > 0 and r["train/lr"] == pytest.approx(1e-3)
    assert rows[-1]["train/loss"] < rows[1]["train/loss"]  # lr 1e-3 on a random model: the loss falls
    _check_golden(rows, GOLDEN_SFT)
    summary = json.loads((sft_dir / "summary.json").read_text())
    assert summary["overlong"]["dropped"] == 0 and summary["train_examples"] == 24


def test_dpo_step_under_zero3_from_the_sft_checkpoint(dpo_dirs):
    for d in dpo_dirs.values():
        _outputs_exist(d)
        rows = _rows(d)
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert rows[0]["eval/rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # policy == reference
        for r in rows[1:]:
            for k in ("train/loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy",
                      "eval/rewards/accuracy", "eval/rewards/margins", "train/grad_norm"):
                assert k in r and r[k] is not None, k
        assert rows[1]["train/loss"] == pytest.approx(0.6931, abs=1e-3)  # step 1 starts at the reference
    cfg = (dpo_dirs["frozen"] / "config.yaml").read_text()
    assert "checkpoint-final" in cfg and "random_init: false" in cfg
    cached = torch.load(dpo_dirs["precomputed"] / "ref_logprobs.pt")["train"]
    # the 2 steps of 8 pairs draw 16 of the 24: only those are computed (it was all 24)
    assert [int(torch.isfinite(cached[k]).sum()) for k in ("chosen", "rejected")] == [16, 16]
    assert _rows(dpo_dirs["precomputed"])[0]["time/ref_precompute"] > 0


def test_dpo_first_steps_match_the_golden_values(dpo_dirs):
    _check_golden(_rows(dpo_dirs["precomputed"]), GOLDEN_DPO)


def test_every_logged_key_is_documented(sft_dir, dpo_dirs):
    for run in (sft_dir, dpo_dirs["precomputed"], dpo_dirs["frozen"]):
        assert not undocumented(_rows(run)), (run.name, undocumented(_rows(run)))


def test_precomputed_reference_equals_frozen_reference_model(dpo_dirs):
    a, b = _rows(dpo_dirs["frozen"]), _rows(dpo_dirs["precomputed"])
    for ra, rb in zip(a[1:], b[1:]):
        for k in ("train/loss", "rewards/margins", "eval/rewards/margins", "eval/loss"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-3, abs=1e-4), k


def test_grpo_starts_from_the_dpo_checkpoint(dpo_dirs, tmp_path):
    d = tmp_path / "grpo"
    ckpt = dpo_dirs["precomputed"] / "checkpoint-final"
    # one step at a negligible learning rate: the result is the DPO checkpoint's weights only if
    # GRPO really started from them
    run_torchrun(ROOT / "recipes" / "grpo.py",
                 ["model=tiny", f"model.path={ckpt}", "model.random_init=false", "trainer.total_steps=1",
                  "trainer.lr=1e-12", "data.eval_size=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                  "rollout.max_new_tokens=4", "rollout.eval_max_new_tokens=4", "trainer.micro_batch_size=4",
                  f"run_dir={d}"], timeout=600)
    start = load_file(str(ckpt / "model.safetensors"))
    end = load_file(str(d / "checkpoint-final" / "model.safetensors"))
    assert start.keys() == end.keys()
    assert max(float((start[k] - end[k]).abs().max()) for k in start) < 1e-6
    assert _rows(d)[0]["step"] == 0 and "eval/accuracy" in _rows(d)[0]


def _continue_and_compare(script, args: list[str], stopped: Path, tmp_path):
    """Resume a copy of `stopped` (a 2-step run: its final checkpoint is step 2) to 4 steps; an
    uninterrupted 4-step run with the same arguments must log the same steps 3-4 and end with the
    same weights."""
    resumed, full = tmp_path / "resumed", tmp_path / "full"
    shutil.copytree(stopped, resumed)
    assert (resumed / "checkpoints" / "step-000002" / "COMPLETE").exists()
    # 24 examples in batches of 8: the second epoch starts at step 4 (the sampler's reshuffle resumes too)
    longer = [a for a in args if not a.startswith("trainer.max_steps=")] + ["trainer.max_steps=4", "trainer.epochs=2"]
    run_torchrun(script, longer + [f"run_dir={resumed}", "resume=auto"], timeout=900)
    run_torchrun(script, longer + [f"run_dir={full}"], timeout=900)
    a, b = _rows(full), _rows(resumed)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]  # nothing logged twice
    for ra, rb in zip(a[1:], b[1:]):
        for k in ("train/loss", "train/grad_norm", "train/lr"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-7), (ra["step"], k)
    for k in a[-1]:
        if k.startswith("eval/") and isinstance(a[-1][k], float):
            assert b[-1][k] == pytest.approx(a[-1][k], rel=1e-5, abs=1e-6), k
    assert json.loads((resumed / "summary.json").read_text())["resumed_at_step"] == 2
    wa = load_file(str(full / "checkpoint-final" / "model.safetensors"))
    wb = load_file(str(resumed / "checkpoint-final" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_sft_resumes_exactly(sft_dir, tmp_path):
    _continue_and_compare(ROOT / "recipes" / "sft.py", COMMON + ["trainer.packing=true", "trainer.eval_generate=true"],
                          sft_dir, tmp_path)


def test_dpo_resumes_exactly_with_the_reference_of_the_starting_weights(dpo_dirs, sft_dir, tmp_path):
    # the resumed run precomputes the reference from model.path before loading the step-2 weights
    _continue_and_compare(ROOT / "recipes" / "dpo.py",
                          COMMON + [f"model.path={sft_dir / 'checkpoint-final'}", "model.random_init=false",
                                    "algo.precompute_ref_logprobs=true", "trainer.eval_every=1"],
                          dpo_dirs["precomputed"], tmp_path)
