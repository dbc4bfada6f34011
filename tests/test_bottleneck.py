"""The bottleneck report's arithmetic on hand-made step rows."""

from __future__ import annotations

import json

import pytest

from colo_rl.bottleneck import bottleneck_report, charged_steps, format_report, main, split_layout


def rows(gen: float, logprobs: float, update: float, handoff: float, switch: float, reward: float, n: int = 4):
    step = gen + logprobs + update + handoff + switch + reward
    return [{"step": 0, "eval/accuracy": 0.1}] + [
        {"step": i + 1, "time/generation": gen, "time/logprobs": logprobs, "time/update": update,
         "time/handoff": handoff, "time/phase_switch": switch, "time/reward": reward, "time/step": step}
        for i in range(n)]


def test_rollout_bound_run_and_the_balanced_split():
    report = bottleneck_report(rows(gen=6.0, logprobs=0.5, update=1.5, handoff=0.3, switch=0.2, reward=0.5), n_gpus=8)
    assert report["bound"] == "rollout"
    assert report["shares"]["generation"] == pytest.approx(6.0 / 9.0)
    assert report["colocated"]["switch_share"] == pytest.approx(0.5 / 9.0)
    assert report["balanced_generation_gpus"] == pytest.approx(8 * 6 / 8)  # g* = N W_g / (W_g + W_t) = 6
    best = report["best_split"]
    assert (best["generation_gpus"], best["training_gpus"]) == (6, 2)
    # W_g / g = 6*8/6 = 8 s, W_t / (N-g) = 2*8/2 = 8 s: balanced, no idle pool, + 0.5 s other
    assert best["step_seconds"] == pytest.approx(8.5)
    assert best["generation_idle_share"] == pytest.approx(0.0) and best["training_idle_share"] == pytest.approx(0.0)
    assert report["split_vs_colocated"] == pytest.approx(8.5 / 9.0)
    assert "rollout-bound" in format_report(report)


def test_train_bound_run_with_a_split_that_cannot_balance():
    report = bottleneck_report(rows(gen=1.0, logprobs=1.0, update=2.0, handoff=0.1, switch=0.1, reward=0.0), n_gpus=2)
    assert report["bound"] == "train"
    assert report["balanced_generation_gpus"] == pytest.approx(2 * 1 / 4)  # 0.5: at least one GPU each
    best = report["best_split"]
    assert (best["generation_gpus"], best["training_gpus"]) == (1, 1)
    # generation 1*2/1 = 2 s, training 3*2/1 = 6 s: the generation pool idles 2/3 of the step
    assert best["step_seconds"] == pytest.approx(6.0)
    assert best["generation_idle_share"] == pytest.approx(2 / 3)


def test_one_gpu_has_no_split_and_warm_up_steps_are_dropped():
    r = rows(gen=1.0, logprobs=0.0, update=1.0, handoff=0.0, switch=0.0, reward=0.0, n=3)
    r[1]["time/generation"], r[1]["time/step"] = 50.0, 51.0  # the first step carries warm-up
    report = bottleneck_report(r, n_gpus=1, skip=1)
    assert report["splits"] == [] and "best_split" not in report
    assert report["seconds_per_step"]["generation"] == pytest.approx(1.0)
    assert split_layout(1.0, 1.0, 0.0, 4, 2)["step_seconds"] == pytest.approx(2.0)


def test_the_command_reports_a_run_directory_and_names_what_is_missing(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows(gen=6.0, logprobs=0.5, update=1.5, handoff=0.3, switch=0.2, reward=0.5)))
    with pytest.raises(SystemExit, match="2"):
        main([str(tmp_path)])  # no summary.json, no --gpus
    assert "give --gpus N" in capsys.readouterr().err
    assert main([str(tmp_path), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "rollout-bound" in out and "best split 6 gen / 2 train would take 8.50 s/step" in out
    assert "from a run of an unknown number of rank(s)" in out and "the projection assumes" in out
    (tmp_path / "summary.json").write_text(json.dumps({"bottleneck": {"gpus": 2}}))
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(3 steps, 2 ranks)" in out and "assumes" not in out  # world size from summary.json; step 1 dropped
    assert main([str(tmp_path), "--gpus", "8"]) == 0  # a 2-rank run relabelled as 8 devices says so
    out = capsys.readouterr().out
    assert "(3 steps, projected to 8 devices from a run of 2 rank(s))" in out
    assert "the projection assumes each phase takes the measured seconds per step on 8 devices" in out
    with pytest.raises(SystemExit, match="2"):
        main([str(tmp_path / "nowhere")])
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
    split = tmp_path / "split"  # its pools overlap: the shares of one step would sum past 1
    split.mkdir()
    (split / "metrics.jsonl").write_text("\n".join(json.dumps({**r, "split/policy_version": 1}) for r in rows(
        gen=6.0, logprobs=0.5, update=1.5, handoff=0.3, switch=0.2, reward=0.5)))
    with pytest.raises(SystemExit, match="2"):
        main([str(split), "--gpus", "8"])
    assert "is a split run" in capsys.readouterr().err


def test_other_is_the_rest_of_the_step_so_the_shares_sum_to_one():
    """Host work between the timed phases (untimed) counts as other, beside the verifiers' time."""
    r = rows(gen=2.5, logprobs=0.0, update=2.9, handoff=0.03, switch=0.12, reward=0.2)
    for row in r[1:]:
        row["time/step"] += 1.1  # bookkeeping outside every timer
    report = bottleneck_report(r, n_gpus=8)
    assert report["seconds_per_step"]["other"] == pytest.approx(0.2 + 1.1)
    assert sum(report["shares"].values()) == pytest.approx(1.0)
    assert report["best_split"]["step_seconds"] >= 1.3  # a split layout pays it too


def test_an_evaluations_switch_is_charged_to_the_step_after_it():
    """With an evaluation after every step, each evaluation hands the engine the new weights and the
    next step pays no handoff: the report charges the evaluation's switch to that step, so the
    colocation share is the one a run without those evaluations would show."""
    every = rows(gen=2.0, logprobs=0.0, update=2.0, handoff=0.0, switch=0.1, reward=0.0, n=3)
    every[0].update({"time/eval_handoff": 0.5, "time/eval_phase_switch": 0.2})  # step 0's evaluation
    every[1].update({"time/eval_handoff": 0.5, "time/eval_phase_switch": 0.2})
    every[3].update({"time/eval_handoff": 0.5, "time/eval_phase_switch": 0.2})  # the last: no step after it
    steps = charged_steps(every)
    assert [r["time/handoff"] for r in steps] == [0.5, 0.5, 0.0]  # no evaluation after step 2
    assert [r["time/phase_switch"] for r in steps] == pytest.approx([0.3, 0.3, 0.1])
    assert [r["time/step"] for r in steps] == pytest.approx([4.8, 4.8, 4.1])
    assert every[1]["time/handoff"] == 0.0  # the logged rows are left as they were
    assert bottleneck_report(every, n_gpus=1, skip=0)["shares"]["switch"] == pytest.approx(
        (0.8 + 0.8 + 0.1) / (4.8 + 4.8 + 4.1))


def test_an_evaluations_switch_is_its_own_when_a_save_switched_back():
    """Evaluate, then save: the save switches back to the update phase and the next step pays its
    own handoff; charging the evaluation's switch to it too would count a switch twice."""
    r = rows(gen=2.0, logprobs=0.0, update=2.0, handoff=0.5, switch=0.3, reward=0.0, n=2)
    r[1].update({"time/eval_handoff": 0.5, "time/eval_phase_switch": 0.2, "time/save": 1.0,
                 "time/save_phase_switch": 0.1})
    steps = charged_steps(r)
    assert [x["time/handoff"] for x in steps] == [0.5, 0.5]
    assert [x["time/step"] for x in steps] == pytest.approx([4.8, 4.8])


def test_a_profiled_step_is_left_out_while_others_remain():
    """trainer.profile_steps: both profilers slow the step they watch (its row has time/profile_write);
    the report's means are of the other steps, and of the profiled ones only when nothing else is left."""
    r = rows(gen=2.0, logprobs=0.0, update=2.0, handoff=0.5, switch=0.3, reward=0.0, n=3)
    r[2].update({"time/step": 9.0, "time/update": 7.0, "time/profile_write": 1.5})
    assert [x["step"] for x in charged_steps(r)] == [1, 3]
    assert bottleneck_report(r, n_gpus=1, skip=0)["seconds_per_step"]["train"] == pytest.approx(2.0)
    only = [r[0], r[2]]  # step 0 (evaluation) and the profiled step
    assert [x["step"] for x in charged_steps(only)] == [2]
