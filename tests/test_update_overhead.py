"""The update's host-side costs (issue 37): ZeRO-3 hooks per decoder layer with unchanged weights,
and no device read per micro-batch. The figures: benchmarks/update_overhead.py."""

from __future__ import annotations

import math

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
@pytest.mark.e2e
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
@pytest.mark.e2e
def test_autograds_linear_trains_the_same_weights_and_keeps_what_it_says(reports):
    """trainer.zero_memory_efficient_linear: DeepSpeed's ZeRO-3 linear (on) and autograd's (off) give
    the same gradients and weights (2 ranks); off keeps the gathered linear weights for the
    backward, exactly the bytes `held_weight_bytes` charges it beyond each rank's partition; auto
    picks off for a model that small; off after on undoes DeepSpeed's process-wide F.linear."""
    for rep in reports:
        lin = rep["linear"]
        assert lin["settings"] == [True, False, False] and lin["deepspeed_linear"] == [True, False, False], lin
        assert lin["grad_max_diff"] <= 1e-5 * lin["grad_max_abs"], lin
        ws = lin["world_size"]
        gathered = lin["saved_bytes_off"] - lin["saved_bytes_on"]
        assert gathered == pytest.approx(lin["held_bytes"] * ws / (ws - 1), rel=0.02), lin
    assert reports[0]["linear"]["weights_max_diff"] <= 1e-5, reports[0]["linear"]
    assert reports[0]["linear"]["weights_auto_vs_off"] == 0.0, reports[0]["linear"]


def test_memory_efficient_linear_auto_follows_the_held_bytes():
    from colo_rl.train.ds_config import HELD_WEIGHTS_LIMIT, held_weight_bytes, set_zero3_linear

    model = load_model(ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"), torch.float32)
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
                  and m.weight is not model.get_input_embeddings().weight) + model.get_input_embeddings().weight.numel()
    assert held_weight_bytes(model, 1, 2) == 0  # world size 1: a gathered weight is its partition
    assert held_weight_bytes(model, 8, 2) == linears * 2 * 7 // 8  # the tied LM head counted once
    for mode, held, expected in [("auto", 0, False), ("auto", HELD_WEIGHTS_LIMIT, False),
                                 ("auto", HELD_WEIGHTS_LIMIT + 1, True), ("on", 0, True),
                                 ("off", 10 * HELD_WEIGHTS_LIMIT, False)]:
        cfg = {"zero_optimization": {"stage": 3}}
        assert set_zero3_linear(cfg, mode, held) is expected
        assert cfg["zero_optimization"]["memory_efficient_linear"] is expected
    other = {"zero_optimization": {"stage": 2}}
    assert set_zero3_linear(other, "off", 0) is None and "memory_efficient_linear" not in other["zero_optimization"]


@pytest.mark.slow
@pytest.mark.e2e
def test_gradient_checkpointing_trains_the_same_weights_under_zero3_leaf_modules(reports):
    """model.gradient_checkpointing (non-reentrant; each decoder layer, a ZeRO-3 leaf module, is
    fetched again for its recomputed forward inside the backward): the gradients and weights of two
    steps on 2 ranks equal those without it, to float32 rounding."""
    for rep in reports:
        ck = rep["checkpointing"]
        assert ck["on"] == [False, True] and ck["layer_forwards"] == [4, 8], ck  # 4 micro-batches, recomputed
        assert ck["grad_max_diff"] <= 1e-5 * ck["grad_max_abs"], ck
    assert reports[0]["checkpointing"]["weights_max_diff"] <= 1e-5, reports[0]["checkpointing"]


@pytest.mark.slow
@pytest.mark.e2e
def test_compiled_layers_train_the_same_weights_in_one_graph(reports):
    """model.compile: every decoder layer's forward is compiled, once for all layers and lengths,
    with no graph break from ZeRO-3's hooks; the gradients and weights are autograd's to float
    rounding (2 ranks: real gathers), with gradient checkpointing too."""
    for rep in reports:
        comp = rep["compile"]
        assert comp["compiled_forwards"] == [0, comp["layers"]], comp
        assert comp["eager_dynamo"]["frames"] == 0, comp
        # one graph with gradients for every layer (the one without was compiled before): not one per layer
        assert comp["steps_dynamo"]["frames"] == 1 and comp["steps_dynamo"]["breaks"] == 0, comp
        assert comp["other_length_dynamo"] == {"frames": 0, "graphs": 0, "breaks": 0}, comp  # lengths are symbolic
        assert comp["grad_max_diff"] <= 1e-5 * comp["grad_max_abs"], comp
        assert comp["no_grad_logp_max_diff"] <= 1e-5, comp
        assert comp["checkpointed_grad_max_diff"] <= 1e-5 * comp["grad_max_abs"], comp
        assert comp["checkpointed_breaks"] == 0, comp
    # Adam's first steps move a weight by ~lr whatever its gradient's size: a rounding-level gradient
    # difference on a near-zero gradient can show as a few % of the largest change, on few elements
    comp = reports[0]["compile"]  # rank 0 holds the gathered weights
    assert comp["max_change_from_init"] > 1e-3, comp  # the steps moved the weights
    assert comp["weights_max_diff"] <= 5e-2 * comp["max_change_from_init"], comp
    assert comp["weights_mean_diff"] <= 1e-4 * comp["mean_change_from_init"], comp
    assert comp["checkpointed_weights_max_diff"] <= 5e-2 * comp["max_change_from_init"], comp


def test_compile_refuses_zero3_hooks_inside_the_layer():
    from colo_rl.config import RunConfig, validate
    from colo_rl.errors import ConfigError

    cfg = RunConfig()
    cfg.model.compile = True
    validate(cfg, "grpo")  # the defaults: ZeRO-3 with leaf modules
    cfg.trainer.zero_leaf_modules = False
    with pytest.raises(ConfigError, match="trainer.zero_leaf_modules=true"):
        validate(cfg, "grpo")
    cfg.trainer.zero_stage = 0
    validate(cfg, "grpo")  # no ZeRO-3 hooks at all
    cfg.trainer.zero_stage, cfg.trainer.zero_leaf_modules, cfg.model.lora.rank = 3, True, 8
    with pytest.raises(ConfigError, match="model.compile=false"):
        validate(cfg, "grpo")
    cfg.model.lora.rank, cfg.model.attn_implementation = 0, "flex_attention"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a GPU"):
            validate(cfg, "grpo")


@pytest.mark.slow
@pytest.mark.e2e
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
@pytest.mark.e2e
def test_update_reads_the_device_a_fixed_number_of_times_whatever_the_split(reports):
    """One optimizer step: the non-finite flag, the statistics and the log-prob check travel once
    each (the engine-vs-trainer mismatch sums travel with the statistics), for 2 or 4 micro-batches of
    whole groups (before: ~8 reads per micro-batch)."""
    for rep in reports:
        runs = rep["reads"]
        assert sorted(r["micro_batches"] for r in runs.values()) == [2, 2, 4, 4, 4]
        counts = {name: len(r["reads"]) for name, r in runs.items()}
        assert len(set(counts.values())) == 1 and counts["padded_mbs8"] <= 3, runs
        assert all(not r["mixed"] for r in runs.values()), runs  # no host tensor meets a device one
        # two optimizer steps: the old log-probs' pass travels once too
        off = rep["off_policy_reads"]
        assert sorted(r["micro_batches"] for r in off.values()) == [2, 4], off
        assert len({len(r["reads"]) for r in off.values()}) == 1 and not any(r["mixed"] for r in off.values()), off
        # the same statistics however the step is split (float tolerance)
        for key in ("loss", "entropy", "logprob_diff"):
            values = [r[key] for r in runs.values()]
            assert max(values) - min(values) <= 1e-5 * max(1.0, abs(values[0])), (key, values)


@pytest.mark.slow
@pytest.mark.e2e
def test_sft_and_dpo_steps_read_the_device_a_fixed_number_of_times(reports):
    """One SFT or DPO optimizer step, packed or padded: the non-finite flag and the statistics
    travel once each, however many micro-batches (before: a read per micro-batch, six for DPO), and
    no host tensor meets a device one (DPO's padded layout masked device log-probs with the host
    batch's mask: a device mismatch on a GPU). DPO's pass of sequence log-probs reads once."""
    for rep in reports:
        runs = rep["offline_reads"]
        for kind in ("sft_packed", "sft_padded", "dpo_packed", "dpo_padded"):
            same = [r for name, r in runs.items() if name.startswith(kind + "_")]
            assert len({r["micro_batches"] for r in same}) == 3, (kind, same)  # three different splits
            assert {len(r["reads"]) for r in same} == {2}, (kind, same)
            assert all(not r["mixed"] for r in same), (kind, same)
            losses = [r["loss"] for r in same]
            assert max(losses) - min(losses) <= 1e-5 * max(1.0, abs(losses[0])), (kind, losses)
            if kind.startswith("dpo"):  # the reference log-probs' pass: one transfer
                assert all(r["logps_reads"] == ["cpu"] and not r["logps_mixed"] for r in same), (kind, same)


def test_host_floats_reads_every_tensor_at_once():
    values = {"a": torch.tensor(1.5), "b": 2.0, "c": torch.tensor([3.0])}
    assert dist.host_floats(values) == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert list(dist.host_floats(values)) == ["a", "b", "c"]


def test_step_sums_add_on_the_device_and_read_once():
    from workers.worker_support import DeviceTensor

    from colo_rl.metrics import StepSums

    DeviceTensor.reads.clear()
    DeviceTensor.mixed.clear()
    sums = StepSums(["loss", "unused"], maxima=["max"])
    for x in (1.0, 2.5, -0.5):
        t = torch.tensor(x, requires_grad=True).as_subclass(DeviceTensor)
        sums.add(loss=t * 2, tokens=3, max=t.abs())
        sums.add({"ratio": t}, prefix="m:")
    assert DeviceTensor.reads == []  # nothing read inside the loop
    assert not any(v.requires_grad for v in sums.values.values() if isinstance(v, torch.Tensor))
    totals = sums.totals()
    assert len(DeviceTensor.reads) <= 1 and DeviceTensor.mixed == []  # no host tensor met a device one
    assert totals == {"loss": 6.0, "unused": 0.0, "max": 2.5, "tokens": 9.0, "m:ratio": 3.0}
    # a NaN stays a NaN in a maximum (floats and tensors alike), so checks on it fail as they should
    for first, second in ((torch.tensor(float("nan")), torch.tensor(1.0)), (float("nan"), 1.0), (1.0, float("nan")),
                          (2.0, torch.tensor(float("nan")))):
        nan = StepSums(maxima=["max"])
        nan.add(max=first)
        nan.add(max=second)
        assert math.isnan(nan.totals()["max"]), (first, second)


def test_benchmark_runs_the_new_options_only_on_roots_that_know_them(tmp_path):
    from benchmarks.update_overhead import summarise, variants

    schema = tmp_path / "new" / "colo_rl" / "config" / "schema.py"
    schema.parent.mkdir(parents=True)
    schema.write_text("zero_leaf_modules log_entropy zero_memory_efficient_linear")
    (tmp_path / "new" / "colo_rl" / "host_malloc.py").write_text("")
    runs = variants([("old", tmp_path / "old"), ("new", tmp_path / "new")], {"old": False, "new": True}, demo_steps=2)
    old = [r for r in runs if r["root"] == "old"]
    assert not any(k in o for k in ("zero_leaf_modules", "log_entropy", "micro_batch_tokens", "memory_efficient_linear")
                   for r in old for o in r["overrides"])
    assert [r["variant"] for r in runs if r["root"] == "new" and r["work"] == "deep_narrow"] == [
        "default", "one micro-batch", "leaf modules off", "entropy not logged", "DeepSpeed's linear",
        "freed host memory returned", "ZeRO-0 (reference)"]
    assert [(r["root"], r["variant"]) for r in runs if r["work"] == "demo"] == [
        ("old", "default"), ("new", "default"), ("new", "freed host memory returned")]
    assert all(r.get("env") == {"COLO_RL_KEEP_HOST_MEMORY": "0"} for r in runs if r["variant"].startswith("freed"))
    assert not any("env" in r for r in old)
    (tmp_path / "new" / "colo_rl" / "solo_gathers.py").write_text("")  # a root with both host settings
    schema.write_text(schema.read_text() + " compile: bool")  # and model.compile
    both = variants([("new", tmp_path / "new")], {"new": True}, demo_steps=2)
    assert [r["overrides"] for r in both if r["variant"] == "decoder layers compiled"] == [["model.compile=true"]]
    assert [(r["work"], r["variant"], r.get("env")) for r in both if "env" in r] == [
        ("deep_narrow", "freed host memory returned", {"COLO_RL_KEEP_HOST_MEMORY": "0"}),
        ("deep_narrow", "gloo's gathers", {"COLO_RL_LOCAL_GATHERS": "0"}),
        ("demo", "freed host memory returned", {"COLO_RL_KEEP_HOST_MEMORY": "0"}),
        ("demo", "gloo's gathers", {"COLO_RL_LOCAL_GATHERS": "0"})]
    rows = [{"time/update": t, "time/step": 2 * t} for t in (9.0, 1.0, 3.0, 2.0)]
    # the first step is dropped; micro-batches from c28839b's rule when not logged: 8 groups of 8, 2 per batch
    got = summarise(rows, 1, ["trainer.micro_batch_size=16"])
    assert got["update_s_median"] == 2.0 and got["micro_batches"] == 4 and got["ms_per_micro_batch"] == 500.0
    assert summarise([{**r, "train/micro_batches": 1.0} for r in rows], 1, [])["micro_batches"] == 1.0


def test_host_overhead_benchmark_runs_each_variant_as_set(tmp_path):
    """benchmarks/host_overhead.py: one round, one update per variant; each process ran the linear its
    variant names, and the table has a row per variant."""
    from benchmarks import host_overhead

    assert host_overhead.main(["--rounds", "1", "--updates", "1", "--warmup", "1", "--out", str(tmp_path),
                               "--variants", "default,DeepSpeed's linear", "--no-readme"]) == 0
    result = read_json(next(tmp_path.glob("host_overhead-*.json")))
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["default"]["memory_efficient_linear"] is False  # auto at world size 1
    assert rows["DeepSpeed's linear"]["memory_efficient_linear"] is True
    assert all(r["micro_batches"] == 4 and r["ms_per_micro_batch"] > 0 for r in rows.values())
    md = next(tmp_path.glob("host_overhead-*.md")).read_text()
    assert "| DeepSpeed's linear | on |" in md and "| default | off |" in md
