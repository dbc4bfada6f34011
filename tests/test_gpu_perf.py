"""make gpu-perf's CPU parts: the summary's arithmetic (benchmarks/gpu/perf_summary.py), the random-weight
model directories (perf_models.py), and its stages end to end on CPU (GPU_DRY_RUN=1, slow)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.gpu.perf_models import MODEL_05B, derive, unpack
from benchmarks.gpu.perf_summary import RUNS, ledger_figures, llama_params
from colo_rl.train.activation_memory import CPU_MICRO_BATCH_TOKENS

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def test_llama_params_counts_gqa_projections_and_the_tied_embedding():
    # SmolLM2-135M: 30 layers of h=576, 9 heads / 3 KV heads of 64, FFN 1536, vocabulary 49152
    cfg = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152)
    p = llama_params(cfg)
    per_layer = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    assert p == {"layers": 30 * per_layer, "embedding": 576 * 49152}
    assert 134e6 < p["layers"] + p["embedding"] < 135e6  # the 134.5M the model card gives (norms aside)


def _record(step, transition, moves, plan=None):
    r = {"step": step, "transition": transition, "moves": moves, "seconds": sum(m["seconds"] for m in moves)}
    if plan:
        r["paging_plan"] = plan
    return r


def test_ledger_figures_rates_per_step_and_the_handoff_after_warm_up():
    plan = {"mode": "on", "paged": ["optim_states"], "fits": True}
    out = lambda s: {"what": "trainer states", "from": "device", "to": "host", "bytes": 2 * GIB, "moved": True, "seconds": s}  # noqa: E731
    back = lambda s: {"what": "trainer states", "from": "host", "to": "device", "bytes": 2 * GIB, "moved": True, "seconds": s}  # noqa: E731
    hand = lambda ms: {"what": "weights handoff", "from": "trainer", "to": "engine", "bytes": 10**9, "moved": True,  # noqa: E731
                       "seconds": ms / 1000, "zero_copy": True, "buckets": 1}
    records = [_record(0, "update->generation", [hand(500)], plan),  # set-up: no page-out, a slow first handoff
               _record(1, "generation->update", [back(9.0)]), _record(1, "update->generation", [out(9.0), hand(400)]),
               _record(2, "generation->update", [back(0.5)]), _record(2, "update->generation", [out(0.25), hand(10)]),
               _record(3, "generation->update", [back(0.5)]), _record(3, "update->generation", [out(0.25), hand(20)])]
    f = ledger_figures(records, skip=1)  # step 1 is warm-up
    assert f["paging_plan"] == plan
    assert f["page_out"]["gib_per_step"] == 2.0 and f["page_out"]["s_per_step"] == 0.25
    assert f["page_out"]["gb_per_s"] == pytest.approx(2 * GIB / 0.25 / 1e9)
    assert f["page_in"]["s_per_step"] == 0.5
    assert f["handoff"]["ms"] == pytest.approx(15.0)  # the median of 10 and 20 ms
    assert f["handoff"]["gb_per_s"] == pytest.approx(10**9 / 15e-3 / 1e9)
    assert f["handoff"]["zero_copy"] is True


def test_paging_bandwidth_divides_the_bytes_copied_not_the_gradient_bucket_freed():
    """ZeRO's gradient bucket is freed by the page-out and allocated again by the reload: the ledger
    counts it in the memory a move frees (`bytes`) but the GB/s figure divides `copied_bytes`."""
    out = {"what": "trainer states", "from": "device", "to": "host", "bytes": 3 * GIB, "copied_bytes": 2 * GIB,
           "moved": True, "seconds": 0.5}
    records = [_record(s, "update->generation", [dict(out)]) for s in (1, 2)]
    f = ledger_figures(records, skip=0)
    assert f["page_out"]["gib_per_step"] == 3.0  # what left the device
    assert f["page_out"]["gb_per_s"] == pytest.approx(2 * GIB / 0.5 / 1e9)  # 4.3, not 6.4


def test_the_05b_directory_is_the_toys_tokenizer_with_the_05b_shape(tmp_path):
    import lzma

    toy = tmp_path / "toy"
    toy.mkdir()
    (toy / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152}))
    (toy / "tokenizer.json.xz").write_bytes(lzma.compress(b'{"model": "bpe"}'))
    unpack(toy)
    assert (toy / "tokenizer.json").read_bytes() == b'{"model": "bpe"}'
    big = derive(toy, tmp_path / "0.5b", MODEL_05B)
    cfg = json.loads((big / "config.json").read_text())
    assert cfg["hidden_size"] == 1024 and cfg["num_hidden_layers"] == 28 and cfg["vocab_size"] == 49152
    assert (big / "tokenizer.json").read_bytes() == b'{"model": "bpe"}'


@pytest.mark.slow
@pytest.mark.e2e
def test_gpu_perf_dry_run_fills_the_summary_from_real_runs(tmp_path):
    """The same stages as on a GPU, tiny shapes on the HF engine: the summary's toy row and the
    update's row come from the runs' own files."""
    env = dict(os.environ, GPU_DRY_RUN="1", GPU_PY=str(Path(os.sys.executable)), GPU_SITE="/nonexistent",
               GPU_LOG_PREFIX="gpu_perf", GPU_CHECK_RESULTS=str(tmp_path / "res"), PERF_MODELS=str(tmp_path / "models"),
               COLO_RL_GPU_RUNS=str(tmp_path / "runs"), CHECK_BUDGET_S="800")
    proc = subprocess.run(["bash", "benchmarks/gpu/check.sh", "versions", "mfu", "toy", "summary"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary,) = (tmp_path / "res").glob("gpu_perf-cpu-*.json")
    result = json.loads(summary.read_text())
    toy = result["runs"]["perf_toy"]
    assert "missing" in result["runs"]["perf_big"]  # not run: listed as missing, never filled in
    assert toy["phases_s"]["update"] > 0 and toy["micro_batches"] >= 1
    assert toy["ledger"]["paging_plan"]["mode"] == "auto"
    mfu = result["mfu"]["update_mfu"]
    assert mfu["dry_run"] is True
    # planned as GRPO plans a step: the trainer's CPU budget, whole rows, every row once
    assert mfu["micro_batch_tokens"] == CPU_MICRO_BATCH_TOKENS and sum(mfu["rows_per_micro_batch"]) == 2
    # where the stage's time went, part by part, in the order the run takes them
    assert list(mfu["stage_seconds"]) == ["imports and process group", "model, actor and batches", "warm-up updates",
                                          "timed updates", "profiled update", "trace analysis",
                                          "cProfile'd update"]
    assert all(v >= 0 for v in mfu["stage_seconds"].values())
    # the host's time by Python package: ZeRO-3's hooks are DeepSpeed's, the layers' dispatch torch's
    host = mfu["host_python"]
    assert host["by_package"]["deepspeed"] > 0 and host["by_package"]["torch"] > 0 and host["compilations"] == 0
    assert any(o["name"].startswith("deepspeed/runtime/zero/") for o in host["top_self"])
    md = summary.with_suffix(".md").read_text()
    assert "| toy, new defaults |" in md and "| 0.5B, new defaults | not run |" in md
    # the toy's profiled step (trainer.profile_steps): its summary came back with the logs, and is left out
    (profile,) = toy["profiles"]
    assert profile["step"] == 3 and profile["host"]["by_package"]["deepspeed"] > 0
    assert "| toy, new defaults | 3 |" in md
    (toy_breakdown,) = (tmp_path / "res").glob("step_breakdown_perf_toy-cpu-*.json")
    kept = json.loads(toy_breakdown.read_text())["breakdown"]
    assert kept["steps_kept"] == [2] and kept["steps_profiled"] == [3]
    assert "step 3 profiled (trainer.profile_steps), left out" in toy_breakdown.with_suffix(".md").read_text()


def test_update_mfu_zero_overrides_reach_the_actor(tmp_path):
    """`update_mfu.py --zero KEY=VALUE` (the mfupersist stage): the persistence thresholds make every
    parameter persistent in the actor it builds, and bad input is refused; `--linear on`,
    `--checkpointing` and `--compile` (mfumel, mfuckpt, the *compile stages) reach it too, and
    `--deepcompile`'s config section (mfudc) reaches its engine."""
    import argparse

    from benchmarks.gpu.ds_experiments import ds_overrides, zero_override, zero_settings
    from benchmarks.gpu.update_mfu import MODEL_DRY, arg_parser, build
    from colo_rl import dist

    assert zero_override("stage3_param_persistence_threshold=1e12") == ("stage3_param_persistence_threshold", 1e12)
    for bad in ("no_equals", "key=many"):
        with pytest.raises(argparse.ArgumentTypeError, match="--zero"):
            zero_override(bad)
    dist.init()
    args = arg_parser().parse_args(["--dry-run", "--sequences", "4", "--group-size", "2", "--prompt-len", "6",
                                    "--response-len", "8", "--groups-per-micro-batch", "1"])
    persistent, linear, checkpointing, compiled, deepcompile = [], [], [], [], []
    sections = {}
    for overrides in ([], [("stage3_param_persistence_threshold", 1e12), ("stage3_model_persistence_threshold", 1e12)]):
        with zero_settings(overrides, sections):
            actor, _, _ = build(args, MODEL_DRY, tmp_path / f"model{len(overrides)}")
        params = list(actor.module.parameters())
        persistent.append(sum(bool(p.ds_persist) for p in params) / len(params))
        linear.append(actor.memory_efficient_linear)
        checkpointing.append(actor.module.is_gradient_checkpointing)
        compiled.append(all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in actor.module.model.layers))
        deepcompile.append(actor.engine.is_deepcompile_enabled())
        # the mfumel / mfuckpt / *compile stages' options, and mfudc's DeepSpeed config section, on the second
        args.linear, args.checkpointing, args.compile = "on", True, True
        sections = ds_overrides(arg_parser().parse_args(["--deepcompile"]))
    assert persistent[0] < 1.0 and persistent[1] == 1.0
    assert linear == [False, True] and checkpointing == [False, True] and compiled == [False, True]
    assert deepcompile == [False, True]


def test_update_mfu_deepcompile_options_are_checked_before_the_build():
    """`update_mfu.py --deepcompile` (the mfudc stage) runs on a GPU only, not with the compiled layers
    nor ZeRO-0, and warms up past the step where DeepCompile's prefetch passes start (a recompilation)."""
    from deepspeed.compile.init_z3 import WARMUP

    from benchmarks.gpu.update_mfu import arg_parser, check_args, warmup_updates

    parse = arg_parser().parse_args
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        check_args(parse(["--deepcompile"]), on_gpu=False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        check_args(parse(["--deepcompile", "--dry-run"]), on_gpu=True)
    with pytest.raises(SystemExit, match="drop --compile"):
        check_args(parse(["--deepcompile", "--compile"]), on_gpu=True)
    with pytest.raises(SystemExit, match="zero-stage 1, 2 or 3"):
        check_args(parse(["--deepcompile", "--zero-stage", "0"]), on_gpu=True)
    with pytest.raises(SystemExit, match="--warmup 0"):
        check_args(parse(["--warmup", "0"]), on_gpu=True)
    check_args(parse(["--deepcompile", "--attn", "flex_attention"]), on_gpu=True)
    check_args(parse(["--compile"]), on_gpu=False)
    assert warmup_updates(parse([])) == 1 and warmup_updates(parse(["--warmup", "3", "--deepcompile"])) == 3
    assert warmup_updates(parse(["--deepcompile"])) == WARMUP + 1 == 6  # DeepSpeed 0.19.8's


def test_summary_reports_warm_ups_and_an_agreement_that_could_not_run():
    """perf_summary's update table: the first warm-up with the total of several (DeepCompile's two
    compilations), and an agreement check that failed shows as not compared, never as a number."""
    from benchmarks.gpu.perf_summary import markdown

    def mfu_run(warmups, agreement):
        return {"mfu": 0.2, "update_seconds": [1.5, 1.25], "tflops_per_s": 198.0, "busy": {"busy_fraction": 0.6, "busy_us": 1.125e6},
                "first_update_seconds": warmups[0], "warmup_update_seconds": warmups, "compiled_vs_eager": agreement}

    result = {"device": "d", "date": "x", "runs": {}, "mfu": {
        "update_mfu_deepcompile": {**mfu_run([60.0, 2.0, 2.0, 2.0, 2.0, 30.0], {"error": "RuntimeError: no"}),
                                   "host_python": {"error": "ValueError: cProfile did not start"}},
        "update_mfu_compile": mfu_run([20.0], {"max_abs": 0.0078, "mean_abs": 0.001}),
        "update_mfu": {**mfu_run([3.0], None), "micro_batches": 6, "micro_batch_tokens": 18_900,
                       "memory": {"mb_per_token": 2.1, "measured_over_estimate": 1.31},
                       "host_python": {"wall_s": 3.5, "by_package": {"deepspeed": 1.2, "torch": 1.5, "other": 0.3,
                                                                     "colo_rl": 0.05}}}}}
    result["runs"] = {name: {"missing": "-"} for name in RUNS}
    rows = {line.split(" | ")[0]: line for line in markdown(result).splitlines() if line.startswith("| ")}
    dc = next(line for label, line in rows.items() if "DeepCompile" in label)
    assert "| 1.250 |" in dc and "| 60.0 (98.0) |" in dc and dc.endswith("| not compared | - | not measured |")
    compiled = next(line for label, line in rows.items() if label.endswith("decoder layers compiled (model.compile)")
                    and "flex" not in label and "checkpointing" not in label)
    assert "| 20.0 |" in compiled and compiled.endswith("| 7.8e-03 | - | - |") and "| - | 1.250 |" in compiled
    # an auto plan names its budget; the memory column is above the states per token, and over the estimate
    # busy: 1.125 s of kernels over the best timed update's 1.25 s, then over the (slower) profiled one
    assert rows["| sdpa, leaf modules on"].endswith("| 6 (<= 18.9k tokens) | 1.250 | 198.0 | 20.0 % | 90.0 % / 60.0 % "
                                                    "| 3.0 | - | 2.10 (1.31x) | 1.20 / 1.50 / 0.00 / 0.05 of 3.50 |")


def test_update_mfu_checks_the_compiled_layers_against_eager(tmp_path):
    """`update_mfu.py --compile` (the *compile stages) reports the first micro-batch's log-probs from
    the compiled layers against the same layers run eagerly: float32 rounding apart on the CPU. The
    eager pass runs the layers' Python (each MLP's SiLU is called) and compiles nothing."""
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.gpu.update_mfu import MODEL_DRY, arg_parser, build, compiled_vs_eager
    from colo_rl import dist

    dist.init()
    args = arg_parser().parse_args(["--dry-run", "--sequences", "4", "--group-size", "2", "--prompt-len", "6",
                                    "--response-len", "8", "--groups-per-micro-batch", "2", "--compile"])
    actor, mbs, _ = build(args, MODEL_DRY, tmp_path / "model")
    compiled_vs_eager(actor, mbs[0])  # compiles the graph without gradients
    before = dict(counters["frames"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        agreement = compiled_vs_eager(actor, mbs[0])
    assert counters["frames"] == before  # nothing compiled again
    # aten's SiLU, dispatched by each layer's MLP in the eager pass only (inductor's kernel fuses it)
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::silu") == MODEL_DRY["num_hidden_layers"]
    assert 0 <= agreement["mean_abs"] <= agreement["max_abs"] <= 1e-5, agreement


def test_update_mfu_memory_figures_read_the_actor_as_the_budget_does(tmp_path, monkeypatch):
    """`update_mfu.device_memory` (GPU runs): the estimate it compares with is the budget's own
    (`activation_bytes` with the actor's config, dtype, checkpointing and head) for the largest
    micro-batch. The CUDA counters are stood in for; the actor and its micro-batches are real."""
    import torch

    from benchmarks.gpu.mfu_memory import device_memory
    from benchmarks.gpu.update_mfu import MODEL_DRY, arg_parser, build
    from colo_rl import dist
    from colo_rl.train.activation_memory import activation_bytes

    dist.init()
    args = arg_parser().parse_args(["--dry-run", "--sequences", "6", "--group-size", "2", "--prompt-len", "6",
                                    "--response-len", "8", "--groups-per-micro-batch", "2", "--checkpointing"])
    actor, mbs, _ = build(args, MODEL_DRY, tmp_path / "model")
    assert [int(mb.input_ids.shape[0]) for mb in mbs] == [2, 1]
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 4 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * gib}))
    mem = device_memory(actor, mbs, base=gib)
    tokens = int(mbs[0].input_ids.numel())
    assert mem["largest_micro_batch_tokens"] == tokens and mem["over_states_gib"] == 2
    estimate = activation_bytes(actor.config, tokens, 4, True, actor.chunked_lm_head)
    assert estimate < activation_bytes(actor.config, tokens, 4, False, actor.chunked_lm_head)  # checkpointing counted
    assert mem["estimate_gib"] == pytest.approx(estimate / gib)


def test_update_mfu_unpacked_layout_scores_the_same_work(tmp_path):
    """`update_mfu.py --packing false` (the mfunopack stage): a row per sequence instead of a row per
    group, the same response tokens with the same log-probs as the packed rows (so the two runs'
    MFU count the same FLOPs), planned by its own larger token costs; bad switch values are refused."""
    import argparse

    import torch

    from benchmarks.gpu.mfu_work import laid_out, random_groups
    from benchmarks.gpu.update_mfu import MODEL_DRY, arg_parser, build, true_or_false
    from colo_rl import dist

    dist.init()
    args = arg_parser().parse_args(["--dry-run", "--sequences", "6", "--group-size", "3", "--prompt-len", "5",
                                    "--response-len", "7", "--groups-per-micro-batch", "1", "--packing", "false"])
    assert args.packing is False and true_or_false("TRUE") is True
    with pytest.raises(argparse.ArgumentTypeError, match="expected true or false"):
        true_or_false("maybe")
    actor, unpacked, groups = build(args, MODEL_DRY, tmp_path / "model")
    parts = random_groups(args, MODEL_DRY["vocab_size"])
    packed = [actor.to_device(mb) for mb in laid_out(parts, True, 1, actor, torch.float32)]
    assert groups == 2 and [len(mb) for mb in unpacked] == [3, 3] and [mb.input_ids.shape[0] for mb in packed] == [1, 1]
    assert [mb.input_ids.shape[1] for mb in unpacked] == [5 + 7] * 2  # a row: the prompt, one response
    assert [mb.input_ids.shape[1] for mb in packed] == [5 + 3 * 7] * 2  # a row: the prompt once, three responses
    with torch.no_grad():
        for a, b in zip(unpacked, packed):
            logp_a, _ = actor.response_logprobs(a, 1.0, grad=False)
            logp_b, _ = actor.response_logprobs(b, 1.0, grad=False)
            assert a.response_mask.sum() == b.response_mask.sum() == 3 * 7
            assert (logp_a * a.response_mask).sum() == pytest.approx(float((logp_b * b.response_mask).sum()), rel=1e-5)
