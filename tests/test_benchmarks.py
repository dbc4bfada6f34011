"""Benchmark logic that can be wrong without a benchmark run noticing: the results README keeps the
latest table per benchmark, the handoff's ratio to memcpy, the step breakdown's shares, the race's
median over steps 3-8, Hydra override merging, per-phase memory attribution. Fast: no models."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import common, handoff, phase_memory, race_trl, step_breakdown  # noqa: E402


def _fake_result(out: Path, name: str, device: str, date: str, ts: str, marker: str) -> None:
    stem = common.result_stem(name, device, date, out)
    stem.with_suffix(".json").write_text(json.dumps(
        {"benchmark": name, "device": device, "date": date, "meta": {"timestamp": ts}}))
    stem.with_suffix(".md").write_text(f"# {name}\n\n| x |\n|---|\n| {marker} |\n")


def test_readme_keeps_the_latest_table_per_benchmark_and_device(tmp_path):
    _fake_result(tmp_path, "handoff", "cpu", "2026-01-01", "2026-01-01T10:00:00", "OLD-HANDOFF")
    _fake_result(tmp_path, "handoff", "cpu", "2026-02-01", "2026-02-01T10:00:00", "NEW-HANDOFF")
    _fake_result(tmp_path, "step_breakdown", "cpu", "2026-01-15", "2026-01-15T10:00:00", "ONLY-STEP")
    _fake_result(tmp_path, "handoff", "nvidia-h100", "2026-01-10", "2026-01-10T10:00:00", "GPU-HANDOFF")
    (tmp_path / "handoff-cpu-2026-02-01.png").write_bytes(b"png")
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a result: ignored
    text = common.refresh_readme(tmp_path).read_text()
    assert "NEW-HANDOFF" in text and "OLD-HANDOFF" not in text
    assert "ONLY-STEP" in text and "GPU-HANDOFF" in text
    assert "![handoff-cpu-2026-02-01](handoff-cpu-2026-02-01.png)" in text
    # the benchmarks' fixed order: step breakdown before handoff
    assert text.index("ONLY-STEP") < text.index("NEW-HANDOFF")
    assert text.count("# handoff") == 0  # each table's own title is dropped under the section heading
    assert "GPU checks" not in text  # no gpu-check run in the folder: no such section
    (tmp_path / "gpu_check-nvidia-h100-2026-01-10").mkdir()
    (tmp_path / "gpu_check-nvidia-h100-2026-01-10" / "SUMMARY.md").write_text("# what passed\n")
    text = common.refresh_readme(tmp_path).read_text()
    assert "- [`gpu_check-nvidia-h100-2026-01-10`](gpu_check-nvidia-h100-2026-01-10/SUMMARY.md)" in text


def test_the_committed_results_readme_is_what_the_generator_writes():
    """A note written into results/README.md by hand (or a partial rerun taking a full one's place)
    is lost or wrong at the next benchmark: notes go in runs.md or the run's own .md."""
    committed = (common.RESULTS / "README.md").read_text()
    assert common.readme_text(common.RESULTS) == committed, "run benchmarks.common.refresh_readme() and commit"


def test_readme_breaks_same_day_ties_by_timestamp(tmp_path):
    _fake_result(tmp_path, "race_trl", "cpu", "2026-03-01", "2026-03-01T09:00:00", "MORNING")
    latest = common.latest_results(tmp_path)
    assert latest[("race_trl", "cpu")]["meta"]["timestamp"].endswith("09:00:00")
    # a later run the same day overwrites the same files: the newest content wins
    _fake_result(tmp_path, "race_trl", "cpu", "2026-03-01", "2026-03-01T17:00:00", "EVENING")
    text = common.refresh_readme(tmp_path).read_text()
    assert "EVENING" in text and "MORNING" not in text


def test_write_results_records_provenance_and_load(tmp_path):
    stem = common.write_results("demo", {"device": "cpu", "date": "2026-01-02", "x": 1}, "# Demo\n\n| a |\n", tmp_path,
                                argv=[str(ROOT / "benchmarks" / "demo.py"), "--fast"])
    assert stem.name == "demo-cpu-2026-01-02"
    r = json.loads(stem.with_suffix(".json").read_text())
    assert r["benchmark"] == "demo" and r["x"] == 1
    load = r["meta"]["load_avg_1m"]
    assert load["max"] >= load["start"] >= 0 and load["cores"] >= 1
    assert r["meta"]["command"] == "python benchmarks/demo.py --fast"
    assert r["meta"]["versions"]["torch"]
    md = stem.with_suffix(".md").read_text()
    assert "| a |" in md and "- command: `python benchmarks/demo.py --fast`" in md and "load average" in md



def test_write_results_keeps_a_dot_in_the_name(tmp_path):
    # phase_switch_sglang_0.5b: Path.with_suffix wrote it as phase_switch_sglang_0.json on the first GPU run
    stem = common.publish("phase_switch_sglang_0.5b", {"device": "gpu", "date": "2026-11-25"}, "| a |\n", tmp_path,
                          chart=lambda result, png: png.write_bytes(b"png"), readme=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"phase_switch_sglang_0.5b-gpu-2026-11-25{ext}" for ext in (".json", ".md", ".png")]
    assert stem.name == "phase_switch_sglang_0.5b-gpu-2026-11-25"  # what the caller is told, dot kept
    assert json.loads((tmp_path / "phase_switch_sglang_0.5b-gpu-2026-11-25.json").read_text())["device"] == "gpu"

def test_handoff_ratio_to_memcpy():
    # 1 GiB in 0.5 s = 2 GiB/s against a 4 GiB/s memcpy: half the physical limit
    assert handoff.bandwidth_ratio(1 << 30, 0.5, 4 * (1 << 30)) == pytest.approx(0.5)
    assert handoff.bandwidth_ratio(3e9, 1.0, 3e9) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        handoff.bandwidth_ratio(1, 0.0, 1.0)


def test_handoff_sizes_are_one_architecture_at_the_advertised_sizes():
    counts = {k: handoff.parameter_count(d) / 1e6 for k, d in handoff.SIZES.items()}
    assert 25 < counts["30m"] < 35 and 130 < counts["135m"] < 140 and 450 < counts["500m"] < 550
    for d in handoff.SIZES.values():
        assert d["hidden_size"] // d["num_attention_heads"] == 64  # same head size throughout


def _row(step, gen, rew, lp, upd, ho, sw, other):
    return {"step": step, "time/generation": gen, "time/reward": rew, "time/logprobs": lp, "time/update": upd,
            "time/handoff": ho, "time/phase_switch": sw, "time/step": gen + rew + lp + upd + ho + sw + other,
            "throughput/gen_tokens_per_s": 100.0, "throughput/train_tokens": 50.0, "response/len_mean": 10.0,
            "reward/mean": 0.5}


def test_step_breakdown_shares_sum_to_one_and_skip_warmup():
    rows = [{"step": 0, "eval/accuracy": 0.1},  # the step-0 evaluation row has no time/step
            _row(1, 50.0, 1.0, 0.0, 40.0, 0.0, 0.1, 0.5),  # warm-up: dropped
            _row(2, 10.0, 1.0, 2.0, 6.0, 0.5, 0.3, 0.2),
            _row(3, 12.0, 1.0, 2.0, 4.0, 0.7, 0.1, 0.2)]
    b = step_breakdown.breakdown(rows, skip=1)
    assert b["steps_kept"] == [2, 3]
    assert sum(p["share"] for p in b["phases"].values()) == pytest.approx(1.0)
    assert b["step_seconds_mean"] == pytest.approx(20.0)
    assert b["phases"]["generation"]["seconds_mean"] == pytest.approx(11.0)
    assert b["phases"]["other"]["seconds_mean"] == pytest.approx(0.2)
    assert b["colocation_share"] == pytest.approx((0.6 + 0.2) / 20.0)
    assert b["train_response_tokens_per_s"] == pytest.approx((50 / 6 + 50 / 4) / 2)
    # never drop every step
    assert step_breakdown.breakdown(rows[:2], skip=3)["steps_kept"] == [1]
    with pytest.raises(ValueError):
        step_breakdown.breakdown(rows[:1], skip=0)


def test_step_breakdown_reports_the_largest_logprob_gap_over_every_step_and_accuracy_start_to_end():
    rows = [{"step": 0, "eval/accuracy": 0.25, "eval/count": 200.0},
            {"step": 1, "time/step": 5.0},  # the first step follows the evaluation: no handoff to check
            {"step": 2, "time/step": 5.0, "handoff/logprob_diff_mean": 0.004, "handoff/logprob_diff_max": 0.9},
            {"step": 3, "time/step": 5.0, "handoff/logprob_diff_mean": 0.011, "handoff/logprob_diff_max": 0.3},
            {"step": 4, "time/step": 5.0, "handoff/logprob_diff_mean": 0.002, "handoff/logprob_diff_max": 0.1},
            {"step": 4, "eval/accuracy": 0.4, "eval/count": 200.0}]
    c = step_breakdown.run_checks(rows)
    assert c == {"handoff_checked_steps": 3, "logprob_gap_mean_max": 0.011, "logprob_gap_mean_max_step": 3,
                 "logprob_gap_token_max": 0.9, "held_out_accuracy_start": 0.25, "held_out_start_step": 0,
                 "held_out_accuracy_end": 0.4, "held_out_end_step": 4, "held_out_count": 200.0}
    assert step_breakdown.run_checks(rows[1:2]) == {"handoff_checked_steps": 0}


def test_hydra_overrides_merge_user_wins():
    merged = step_breakdown.merge_overrides(["trainer.total_steps=4", "plots=false", "data.eval_size=8"],
                                            ["trainer.total_steps=2", "model=tiny", "+extra.key=1"])
    assert merged == ["plots=false", "data.eval_size=8", "trainer.total_steps=2", "model=tiny", "+extra.key=1"]


def test_race_median_over_steps_3_to_8():
    colo = [100, 90, 10, 11, 12, 13, 14, 15]  # steps 1-2 are warm-up
    trl = [200, 190, 20, 22, 24, 26, 28, 30]
    assert race_trl.median_step(colo, skip=2) == pytest.approx(12.5)
    assert race_trl.race_ratio(colo, trl, skip=2) == pytest.approx(12.5 / 25.0)
    assert race_trl.median_step([5.0], skip=2) == 5.0  # fewer steps than skip: keep the last


def test_phase_memory_attributes_peaks_to_every_open_phase():
    mem = phase_memory.PhaseMemory()
    values = iter([100, 300, 200, 150, 120, 500, 400, 90])
    mem._probe = lambda: next(values)
    with mem.phase("step"):  # 100 at entry
        with mem.phase("generation"):  # 300 at entry
            mem.sample()  # 200
        # 150 at generation's exit
        with mem.phase("update"):  # 120
            mem.sample()  # 500
        # 400 at update's exit
    # 90 at step's exit
    s = mem.summary([0])
    assert s["generation"]["peak_gib"] * common.GIB == 300
    assert s["update"]["peak_gib"] * common.GIB == 500
    assert s["step"]["peak_gib"] * common.GIB == 500
    assert s["step"]["entry_gib"] * common.GIB == 100
    assert mem.summary([1]) == {}


def test_phase_memory_counts_what_its_boundary_samples_cost_the_step():
    """A slow probe at the phase boundaries runs in the recipe's thread: its seconds are reported,
    so a step's unexplained time can be told apart from the harness's own."""
    import time

    mem = phase_memory.PhaseMemory()

    def slow_probe():
        time.sleep(0.02)
        return 1

    mem._probe = slow_probe
    for _ in range(2):
        with mem.phase("step"), mem.phase("update"):
            pass
    # per step: 2 phases x (entry + exit) = 4 samples of >= 20 ms
    assert mem.boundary_seconds_per_step([0, 1]) >= 0.08
    assert mem.boundary_seconds_per_step([5]) == 0.0


def _fake_demo_run(work: Path, name: str, seed: int, end: float, reward: float) -> None:
    run = work / f"{name}-seed{seed}"
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.015}]
    rows += [{"step": i, "reward/mean": reward, "reward/accuracy": reward / 2, "time/step": 10.0 + i,
              "train/clip_frac": 0.01} for i in range(1, 15)]
    rows[-1]["eval/accuracy"] = end
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run / "summary.json").write_text("{}")


def test_algorithm_table_names_the_winner_against_the_seed_spread(tmp_path):
    from benchmarks import algorithms

    for name, end in [("grpo", 0.40), ("rloo", 0.45), ("gspo", 0.30)]:
        _fake_demo_run(tmp_path, name, 7, end, reward=end)
    _fake_demo_run(tmp_path, "grpo", 8, 0.44, reward=0.4)
    result = algorithms.collect(["grpo", "rloo", "gspo", "cispo"], [7, 8, 9], tmp_path, steps=14)
    assert sorted(result["runs"]) == ["grpo-seed7", "grpo-seed8", "gspo-seed7", "rloo-seed7"]  # cispo, seed 9: not run
    spread = result["seed_spread"]
    assert spread["seeds"] == [7, 8] and spread["mean"] == pytest.approx(0.42)
    assert spread["std"] == pytest.approx(0.04 / 2 ** 0.5)  # sample std of 0.40, 0.44
    assert result["runs"]["rloo-seed7"]["heldout_delta"] == pytest.approx(0.435)
    assert result["runs"]["rloo-seed7"]["s_per_step"] == pytest.approx(17.5)  # median of 11..24 s
    assert result["winner"]["variant"] == "rloo"
    # 5 points over grpo seed 7, within 2 x 0.028 = 5.7: one run per variant cannot tell it from seed noise
    assert "beats grpo by 5.0 points, within twice grpo's seed std" in result["winner"]["verdict"]
    md = algorithms.table({**result, "shared": algorithms.SHARED})
    assert "| rloo | 0.015 | 0.450 | +43.5 |" in md and "grpo-seed8" not in md.split("Variants:")[0]
    runs = {**result["runs"], "rloo-seed7": {**result["runs"]["rloo-seed7"], "heldout_end": 0.50}}
    assert algorithms.verdict(runs, spread)[1] == "It beats grpo by 10.0 points, more than twice grpo's seed std."


def test_engine_comparison_judges_the_gap_against_the_seed_spread(tmp_path):
    from benchmarks import engine_compare

    ends = {"hf": [0.40, 0.30, 0.35], "sglang": [0.20, 0.25, 0.24]}
    for engine, values in ends.items():
        for seed, end in zip((7, 8, 9), values):
            _fake_demo_run(tmp_path, engine, seed, end, reward=end)
            with open(tmp_path / f"{engine}-seed{seed}" / "metrics.jsonl", "a") as fh:  # one step's mismatch
                fh.write("\n" + json.dumps({"step": 15, "reward/mean": end, "reward/accuracy": 0.1, "time/step": 9.0,
                                            "mismatch/kl_k3": 0.002 if engine == "sglang" else 0.0}))
    runs = {f"{e}-seed{s}": {"engine": e, "seed": s, **engine_compare.run_summary(tmp_path / f"{e}-seed{s}")}
            for e in ends for s in (7, 8, 9)}
    assert runs["sglang-seed7"]["mismatch/kl_k3_mean"] == pytest.approx(0.002)
    assert runs["hf-seed7"]["handoff/logprob_diff_mean_mean"] is None  # not logged in this fake run
    comparison = engine_compare.compare(runs)
    # means 0.35 and 0.23: -12.0 points; stds 0.05 and 0.0265: twice the larger is 10.0 points
    assert comparison["gap"] == pytest.approx(-0.12)
    # paired: 0.20-0.40, 0.25-0.30, 0.24-0.35 = -20, -5, -11 points; mean -12, sd 7.55, t = -12 / (7.55 / sqrt 3)
    assert comparison["paired_gaps"] == pytest.approx([-0.20, -0.05, -0.11])
    assert comparison["verdict"] == ("SGLang - HF = -12.0 points of held-out accuracy; twice the larger seed std "
                                     "is 10.0 points: beyond the seed spread. Paired by seed: SGLang lower on 3 of 3 "
                                     "seeds (-20.0, -5.0, -11.0 points; mean -12.0, paired t = -2.8 with 2 degrees "
                                     "of freedom).")
    md = engine_compare.table({"seeds": [7, 8, 9], "shared": engine_compare.SHARED, "runs": runs,
                               "comparison": comparison})
    assert "| hf | 0.350 (0.050) | +33.5 |" in md and "| sglang | 7 | 0.015 | 0.200 | +18.5 |" in md
    one = engine_compare.compare({k: v for k, v in runs.items() if k.endswith("seed7")})
    assert "one seed each: no seed spread" in one["verdict"]


@pytest.mark.slow
def test_engine_comparison_smoke_runs_end_to_end(tmp_path):
    """The script end to end on the tiny model, 1 step of the HF engine: run, summary, table. The
    SGLang side's overrides are checked by composing them (next test); SGLang's real CPU runtime
    under the recipe is tests/test_sglang_cpu_recipe.py's (its start alone is ~40 s here)."""
    import subprocess

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import child_env, child_python_path

    proc = subprocess.run([sys.executable, "benchmarks/engine_compare.py", "--smoke", "--seeds", "7", "--engines", "hf",
                           "--work", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=child_env(PYTHONPATH=child_python_path()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| hf | 7 |" in proc.stdout and "| sglang |" not in proc.stdout
    assert "Only one engine ran" in proc.stdout
    assert "engine: hf" in (tmp_path / "hf-seed7" / "config.yaml").read_text()


def test_race_gives_trl_colo_rls_prompts_step_by_step():
    from colo_rl.data.sampler import EpochSampler

    order = race_trl.colo_prompt_order(num_train=10, seed=7, steps=4, prompts=4)  # wraps into a 2nd epoch
    sampler = EpochSampler(10, seed=7)  # what recipes/grpo.py draws, step by step
    assert [order[k * 4:(k + 1) * 4] for k in range(4)] == [sampler.next_global(4) for _ in range(4)]
    assert sorted(order[:8]) != list(range(8)) and len(set(order[:10])) == 10  # shuffled, one epoch = every problem


def _side(rewards, accuracy):
    return {"reward": rewards, "accuracy": accuracy, "step_seconds": [3.0, 2.0, 1.0], "wall_seconds": 60.0,
            "completion_len": [10.0, 20.0, None]}


def test_race_learning_pairs_seeds_and_judges_the_gap_against_their_spread():
    from benchmarks import race_learning

    runs = {("fp32", 1): {"colo_rl": _side([0.1, 0.2, 0.3], [0.0, 0.1, 0.2]),
                          "trl": _side([0.2, 0.3, 0.4], [0.1, 0.1, 0.1])},
            ("fp32", 2): {"colo_rl": _side([0.3, 0.4, 0.5], [0.2, 0.2, 0.2]),
                          "trl": _side([0.2, 0.3, 0.4], [0.0, 0.0, 0.3])},
            ("bf16", 1): {"colo_rl": _side([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])}}  # one side only: left out
    out = race_learning.compare(runs, steps=3)
    assert set(out) == {"fp32"}
    b = out["fp32"]
    assert b["colo_rl"]["reward_mean_per_seed"] == pytest.approx([0.2, 0.4])
    assert b["gap_per_seed"] == pytest.approx([-0.1, 0.1])
    assert b["gap"] == pytest.approx(0.0)
    step2 = b["colo_rl"]["reward_per_step"][1]
    assert step2["mean"] == pytest.approx(0.3) and step2["std"] == pytest.approx(0.1414214, rel=1e-5)
    assert b["trl"]["accuracy_per_step"][2]["mean"] == pytest.approx(0.2)
    assert b["colo_rl"]["completion_len_mean"] == pytest.approx(15.0)  # None (not logged) left out
    # std over seeds of colo_rl's per-seed means is 0.1414 (TRL's 0): twice it bounds the noise
    assert "twice the larger seed std is 0.283: within the seed spread" in b["verdict"]
    runs[("fp32", 2)]["colo_rl"] = _side([0.1, 0.2, 0.3], [0.0, 0.0, 0.0])  # same as seed 1: std 0
    assert "beyond the seed spread" in race_learning.compare(runs, steps=3)["fp32"]["verdict"]


def test_race_dtype_reaches_both_sides():
    args = race_trl.parse_args(["--dtype", "fp32"])
    assert "model.dtype=fp32" in race_trl.colo_overrides(args, Path("/tmp/x"))
    assert not any(o.startswith("model.dtype") for o in race_trl.colo_overrides(race_trl.parse_args([]), Path("/x")))


def test_engine_compare_gives_both_engines_the_demos_work(monkeypatch):
    """rollout=sglang's group sizes a GPU run (64 prompts, 1024 tokens, temperature 1.0): the
    comparison pins the demo's sizing so only the engine differs between its runs."""
    from dataclasses import asdict

    from hydra import compose, initialize_config_dir

    from benchmarks import engine_compare
    from colo_rl.config import register_configs, to_object

    register_configs()
    rollouts = {}
    for engine in ("hf", "sglang"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"rollout={engine}", *engine_compare.demo_rollout()])
        rollouts[engine] = {k: v for k, v in asdict(to_object(cfg).rollout).items() if k != "engine"}
    assert rollouts["sglang"] == rollouts["hf"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):  # what its SGLang runs compose
        monkeypatch.setattr(os, "environ", dict(os.environ))  # sglang_overrides sets the CPU engine's environment
        sglang = to_object(compose("config", overrides=[*engine_compare.sglang_overrides(),
                                                        *engine_compare.demo_rollout()])).rollout
    assert sglang.engine == "sglang" and sglang.prompts_per_step == 8
    if not torch.cuda.is_available():  # the CPU engine's kwargs, a whole step's requests at once
        assert sglang.sglang_kwargs["device"] == "cpu" and sglang.sglang_kwargs["max_running_requests"] == 64
    assert rollouts["sglang"]["prompts_per_step"] == 8 and rollouts["sglang"]["max_new_tokens"] == 40
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):  # what it guards against
        unpinned = to_object(compose("config", overrides=["rollout=sglang"])).rollout
    assert (unpinned.prompts_per_step, unpinned.max_new_tokens) != (8, 40)


def test_race_learning_reads_a_stopped_trl_side_from_its_log(tmp_path):
    from benchmarks import race_learning

    log = tmp_path / "trl.log"
    log.write_text("loading...\n"
                   "{'loss': '0.1', 'completions/mean_length': '38.19', 'reward': '0.01094', 'step_time': '260.8'}\n"
                   "noise {not a dict}\n"
                   "{'loss': '0.2', 'completions/mean_length': '37.8', 'reward': '0.275', 'step_time': '198.9'}\n"
                   "{'train_runtime': '500'}\n")
    trl = race_learning.trl_from_log(log)
    assert trl["reward"] == [0.01094, 0.275] and trl["completion_len"] == [38.19, 37.8]
    assert trl["step_seconds"] == [260.8, 198.9] and trl["accuracy"] == []
    colo = _side([0.1, 0.2, 0.3], [0.0, 0.1, 0.2])
    b = race_learning.compare({("fp32", 1): {"colo_rl": colo, "trl": trl}}, steps=3)["fp32"]
    assert b["steps"] == 2  # the steps both sides have
    assert b["gap"] == pytest.approx((0.1 + 0.2) / 2 - (0.01094 + 0.275) / 2)
    assert b["trl"]["accuracy_per_step"][0]["mean"] is None and b["trl"]["accuracy_mean"]["mean"] is None
    assert "| 1 | 0.100 | 0.011 | 0.000 | n/a |" in race_learning.table(
        {"comparison": {"fp32": b}, "note": ""})


def test_bf16_update_share_on_and_off_the_grid():
    import torch

    from benchmarks import bf16_update_share

    on = torch.full((1000,), 1.5)  # on the bf16 grid; ulp in [1, 2) = 2^-7, half of it = 0.0039
    # k = 1..3: 0.001..0.003 < half an ulp, nothing moves; k = 4: one ulp (0.0078) for 0.004 asked
    shares = bf16_update_share.update_shares([on], lr=1e-3, steps=4, on_grid=True)
    assert shares == pytest.approx([0, 0, 0, 2**-7 / 4e-3])
    # off the grid, residuals spread over the ulp: the rounding follows the update on average
    off = 1.25 + torch.rand(100000, generator=torch.Generator().manual_seed(0)) * 2**-7
    shares = bf16_update_share.update_shares([off], lr=1e-3, steps=2, on_grid=False)
    assert shares == pytest.approx([1.0, 1.0], abs=0.05)


def test_split_pools_reads_idle_shares_staleness_and_the_prediction(tmp_path):
    """benchmarks/split_pools.py: a split run's idle shares are its waits over its step time (the
    pipeline-filling first step left out), a colocated run's switch share and its report's 1 + 1
    prediction; the table puts prediction and measurement side by side."""
    from benchmarks import split_pools
    from colo_rl.bottleneck import bottleneck_report

    runs = {}
    for layout, seed in [(layout, seed) for seed in (7, 8) for layout in ("colocated", "split_k1", "split_k0")]:
        _fake_demo_run(tmp_path, layout, seed, end=0.3 + seed / 100, reward=0.3)
        path = tmp_path / f"{layout}-seed{seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for r in rows[1:]:
            r["time/step"] = 15.0 if layout == "split_k0" else 10.0  # k = 0: generation and update in turn
            if layout == "colocated":  # 6 s generating, 3 s training, 1 s switching
                r.update({"time/generation": 6.0, "time/update": 3.0, "time/phase_switch": 1.0})
            else:  # the trainer waits 2 s for each rollout, the generator 1 s for weights
                r.update({"time/trainer_wait": 2.0, "time/generation_idle": 1.0, "split/staleness_mean": 0.5,
                          "split/staleness_max": 1.0, "split/dropped_groups_total": 0.0, "time/weight_sync": 0.2})
        rows[1]["time/trainer_wait"] = 9.0  # the first step fills the pipeline: not counted
        path.write_text("\n".join(json.dumps(r) for r in rows))
        if layout == "colocated":
            (path.parent / "summary.json").write_text(json.dumps({"bottleneck": bottleneck_report(rows, 2)}))
        runs[f"{layout}-seed{seed}"] = {"layout": layout, "seed": seed, **split_pools.run_summary(path.parent)}
    colo, split = runs["colocated-seed7"], runs["split_k1-seed7"]
    assert colo["switch_share"] == pytest.approx(0.1) and colo["trainer_idle_share"] == 0
    assert split["trainer_idle_share"] == pytest.approx(0.2) and split["generation_idle_share"] == pytest.approx(0.1)
    assert split["staleness_max"] == 1 and split["staleness_mean"] == pytest.approx(0.5)
    # 2 ranks measured 6 s + 3 s: 1 + 1 takes max(12, 6) = 12 s, the trainer idle half of it
    assert colo["predicted_split"]["step_seconds"] == pytest.approx(12.0)
    assert colo["predicted_split"]["training_idle_share"] == pytest.approx(0.5)
    comparison = split_pools.compare(runs, split_pools.DEFAULT_LAYOUTS)
    assert comparison["split_k1_vs_colocated"] == pytest.approx(1.0)
    assert comparison["split_k0_vs_colocated"] == pytest.approx(1.5)
    assert comparison["split_k1_vs_split_k0"] == pytest.approx(10.0 / 15.0)
    assert comparison["measured_vs_predicted"] == pytest.approx(10.0 / 12.0)
    md = split_pools.table({"layouts": split_pools.DEFAULT_LAYOUTS, "seeds": [7, 8], "shared": split_pools.SHARED,
                            "runs": runs, "comparison": comparison})
    assert "split_k0 / colocated seconds per step: 1.50; split_k1 / split_k0 seconds per step: 0.67." in md
    assert "| predicted (colocated runs' report) | 12.0 (0.0) | 0 (0) | 50 (0) |" in md
    assert "| measured (split_k1) | 10.0 (0.0) | 10 (0) | 20 (0) |" in md
    assert "| split_k1 | 7 | 10.0 | 20 % | 10 % | 0 % | 0.50 / 1 | 0 | 0.20 | 0.015 | 0.370 |" in md
