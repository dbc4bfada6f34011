"""The update's host-side costs (issue 37): ZeRO-3 hooks per decoder layer with unchanged weights,
and no device read per micro-batch. The figures: benchmarks/update_overhead.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import WORKERS, read_json, run_torchrun

from colo_rl import dist
from colo_rl.models import load_model
from colo_rl.config import ModelConfig
from colo_rl.train.ds_config import decoder_layer_classes, set_zero3_leaf_modules


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("update_overhead")
    run_torchrun(WORKERS / "update_overhead_worker.py", [str(d / "rep")], timeout=600)
    return [read_json(d / f"rep.rank{r}.json") for r in range(2)]


def test_leaf_modules_name_the_decoder_layer_and_keep_deepspeeds_defaults():
    model = load_model(ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"), torch.float32)
    assert decoder_layer_classes(model) == ["LlamaDecoderLayer"]
    cfg = {"zero_optimization": {"stage": 3}}
    assert set_zero3_leaf_modules(cfg, model) == ["LlamaDecoderLayer"]
    classes = cfg["zero_optimization"]["leaf_module"]["classes"]
    assert classes[-1] == "LlamaDecoderLayer" and any("Moe" in c for c in classes)
    other = {"zero_optimization": {"stage": 2}}
    assert set_zero3_leaf_modules(other, model) == [] and "leaf_module" not in other["zero_optimization"]


@pytest.mark.slow
def test_leaf_modules_train_the_same_weights_paged_or_not(reports):
    leaf = reports[0]["leaf"]
    assert leaf["leaf_modules_off"] == 0 and leaf["leaf_modules_on"] == leaf["layers"]
    assert leaf["names_equal"] and leaf["max_change_from_init"] > 1e-3  # the steps moved the weights
    # the same gradients to float rounding (DeepSpeed's own linear backward vs autograd's inside a leaf)
    assert leaf["grad_max_diff"] <= 1e-5 * leaf["grad_max_abs"], leaf
    # Adam's first steps move every weight by ~lr whatever its gradient's size, so rounding-level
    # gradient differences on near-zero gradients show as up to ~1 % of the change, not more
    assert leaf["max_diff_leaf_vs_off"] <= 1e-2 * leaf["max_change_from_init"], leaf
    assert leaf["max_diff_paged_vs_leaf"] == 0.0, leaf


@pytest.mark.slow
def test_chunked_lm_head_gives_the_whole_logits_results_under_zero3(reports):
    """2 ranks, ZeRO-3 partitioning the tied LM head / embedding: the LM head's chunked log-softmax
    (train/lm_head.py) and the whole-logits path give the same log-probs, entropies, gradients (a
    log-prob loss and an entropy bonus) and weights after a step, to float32 rounding."""
    for rep in reports:
        head = rep["fused_head"]
        assert head["logp_max_diff"] <= 1e-5 and head["entropy_max_diff"] <= 1e-5, head
        assert head["embedding_grad_abs"] > 0 and head["grad_max_diff"] <= 1e-5 * head["grad_max_abs"], head
    # lr 1e-2: a wrong gradient moves weights by ~1e-2; Adam turns rounding-level differences into far less
    assert reports[0]["fused_head"]["weights_max_diff"] <= 2e-3, reports[0]["fused_head"]


@pytest.mark.slow
def test_update_reads_the_device_a_fixed_number_of_times_whatever_the_split(reports):
    """One optimizer step: the non-finite flag, the statistics and the log-prob check travel once
    each (the engine-vs-trainer mismatch sums travel with the statistics), for 2 or 4 micro-batches of
    whole groups (before: ~8 reads per micro-batch)."""
    for rep in reports:
        runs = rep["reads"]
        assert sorted(r["micro_batches"] for r in runs.values()) == [2, 2, 4, 4, 4]
        counts = {name: len(r["reads"]) for name, r in runs.items()}
        assert len(set(counts.values())) == 1 and counts["padded_mbs8"] <= 3, runs
        # the same statistics however the step is split (float tolerance)
        for key in ("loss", "entropy", "logprob_diff"):
            values = [r[key] for r in runs.values()]
            assert max(values) - min(values) <= 1e-5 * max(1.0, abs(values[0])), (key, values)


def test_host_floats_reads_every_tensor_at_once():
    values = {"a": torch.tensor(1.5), "b": 2.0, "c": torch.tensor([3.0])}
    assert dist.host_floats(values) == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert list(dist.host_floats(values)) == ["a", "b", "c"]


def test_benchmark_runs_the_new_options_only_on_roots_that_know_them(tmp_path):
    from benchmarks.update_overhead import summarise, variants

    runs = variants([("old", tmp_path), ("new", tmp_path)], {"old": False, "new": True}, demo_steps=2)
    old = [r for r in runs if r["root"] == "old"]
    assert not any(k in o for k in ("zero_leaf_modules", "log_entropy", "micro_batch_tokens")
                   for r in old for o in r["overrides"])
    assert [r["variant"] for r in runs if r["root"] == "new" and r["work"] == "deep_narrow"] == [
        "default", "one micro-batch", "leaf modules off", "entropy not logged", "ZeRO-0 (reference)"]
    assert [r["root"] for r in runs if r["work"] == "demo"] == ["old", "new"]
    rows = [{"time/update": t, "time/step": 2 * t} for t in (9.0, 1.0, 3.0, 2.0)]
    # the first step is dropped; micro-batches from c28839b's rule when not logged: 8 groups of 8, 2 per batch
    got = summarise(rows, 1, ["trainer.micro_batch_size=16"])
    assert got["update_s_median"] == 2.0 and got["micro_batches"] == 4 and got["ms_per_micro_batch"] == 500.0
    assert summarise([{**r, "train/micro_batches": 1.0} for r in rows], 1, [])["micro_batches"] == 1.0
