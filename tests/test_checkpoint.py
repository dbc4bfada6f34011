"""Checkpoint bookkeeping in one process (no torchrun): atomic save, which checkpoint resume picks,
config compatibility, RNG capture, a kill in the middle of a save."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from colo_rl.checkpoint import (COMPLETE, CheckpointError, CheckpointManager, capture_rng, compare_configs,
                                complete_checkpoints,
                                config_container, newest_checkpoint, resolve_resume, restore_rng)
from colo_rl.config import RunConfig, TrainerConfig
from colo_rl.data.sampler import EpochSampler
from colo_rl.rollout.base import Capabilities
from conftest import ROOT, child_env, child_python_path


class FakeActor:
    """What CheckpointManager needs from an actor; `save_checkpoint` can stall or fail mid-write."""

    def __init__(self, stall: float = 0.0, fail: bool = False):
        self.dtype = torch.float32
        self.stall, self.fail = stall, fail
        self.loaded = None
        self.nonfinite = {"nonfinite_total": 0, "nonfinite_in_a_row": 0}

    def save_checkpoint(self, directory, tag):
        d = Path(directory) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "zero_pp_rank_0_optim_states.pt").write_bytes(b"x" * 1000)
        if self.stall:
            print("SAVING", flush=True)
            time.sleep(self.stall)
        if self.fail:
            raise OSError("disk full")

    def load_checkpoint(self, directory, tag):
        self.loaded = (directory, tag)

    def counters(self):
        return dict(self.nonfinite)

    def load_counters(self, state):
        self.nonfinite = dict(state)


def make_cfg(run_dir: Path, **trainer) -> RunConfig:
    return RunConfig(run_dir=str(run_dir), trainer=TrainerConfig(**trainer))


def save_steps(run_dir: Path, steps, **trainer) -> CheckpointManager:
    mgr = CheckpointManager(run_dir, make_cfg(run_dir, **trainer))
    sampler = EpochSampler(10, seed=1)
    for s in steps:
        sampler.next_global(4)
        mgr.save(s, FakeActor(), sampler)
    return mgr


def test_save_is_complete_and_keeps_the_last_k(tmp_path):
    save_steps(tmp_path, [1, 2, 3, 4], keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000003", "step-000004"]
    ckpt = tmp_path / "checkpoints" / "step-000004"
    for name in [COMPLETE, "state.json", "config.yaml", "rank00000.pt", "ds/zero_pp_rank_0_optim_states.pt"]:
        assert (ckpt / name).exists(), name
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 4 and state["world_size"] == 1
    assert state["sampler"] == {"epoch": 1, "position": 6, "seed": 1, "num_items": 10}


def test_resume_auto_picks_the_newest_complete_and_ignores_partial_ones(tmp_path):
    save_steps(tmp_path, [2, 4], keep_last=0)
    root = tmp_path / "checkpoints"
    (root / "step-000006.tmp").mkdir()  # killed mid-save
    (root / "step-000008").mkdir()  # final name but no COMPLETE marker (copied by hand, say)
    assert resolve_resume("auto", tmp_path) == root / "step-000004"
    assert newest_checkpoint(root).name == "step-000004"
    assert resolve_resume(None, tmp_path) is None and resolve_resume("null", tmp_path) is None
    assert resolve_resume(str(tmp_path), tmp_path) == (root / "step-000004").resolve()  # a run dir: its newest
    assert resolve_resume(str(root / "step-000002"), tmp_path) == (root / "step-000002").resolve()


def test_resume_names_an_incomplete_or_missing_checkpoint(tmp_path):
    save_steps(tmp_path, [2], keep_last=0)
    partial = tmp_path / "checkpoints" / "step-000004.tmp"
    partial.mkdir()
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint .*interrupted.*step-000002"):
        resolve_resume(str(partial), tmp_path)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_manager_resumes_sampler_and_counters_and_removes_stale_tmp(tmp_path):
    save_steps(tmp_path, [3], keep_last=2)
    (tmp_path / "checkpoints" / "step-000004.tmp").mkdir()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps({"step": s, "moves": []}) + "\n" for s in range(5)))
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps({"step": s, "sample": i}) + "\n"
                                                     for s in range(1, 6) for i in range(2)))
    cfg = make_cfg(tmp_path, keep_last=2)
    cfg.resume = "auto"
    mgr = CheckpointManager(tmp_path, cfg)
    assert not (tmp_path / "checkpoints" / "step-000004.tmp").exists()
    actor, sampler = FakeActor(), EpochSampler(10, seed=1)
    assert mgr.maybe_resume(actor, sampler) == 3
    assert actor.loaded[1] == "ds" and (sampler.epoch, sampler.position) == (0, 4)
    # rows an interrupted run logged after its last checkpoint are redone by the resumed run
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    # and the phase switches of those steps (the ledger counts steps from 0: steps 0-2 are done)
    assert [json.loads(l)["step"] for l in (tmp_path / "ledger.jsonl").read_text().splitlines()] == [0, 1, 2]
    # and the completions they trained on (rollouts.jsonl names steps as metrics.jsonl does)
    assert [json.loads(l)["step"] for l in (tmp_path / "rollouts.jsonl").read_text().splitlines()] == [1, 1, 2, 2, 3, 3]


def test_a_kill_between_the_checkpoint_and_its_row_loses_no_row(tmp_path):
    """The loop saves before it logs the step's row (the row carries the save's time): killed right
    after the checkpoint, the run had no row for that step, and a resume does not redo it. The
    checkpoint keeps the row, and the resume writes it back."""
    cfg = make_cfg(tmp_path, keep_last=2)
    mgr = CheckpointManager(tmp_path, cfg)
    mgr.step_row = {"train/loss": 0.5, "train/grad_norm": float("nan"), "step": 99}
    mgr.save(2, FakeActor(), EpochSampler(10, seed=1))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(2)))  # killed
    cfg.resume = "auto"
    assert CheckpointManager(tmp_path, cfg).maybe_resume(FakeActor(), EpochSampler(10, seed=1)) == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1] == {"train/loss": 0.5, "train/grad_norm": None, "step": 2} and len(rows) == 3
    # logged before the kill: not written twice
    cfg2 = make_cfg(tmp_path, keep_last=2)
    cfg2.resume = "auto"
    CheckpointManager(tmp_path, cfg2).maybe_resume(FakeActor(), EpochSampler(10, seed=1))
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_a_torn_metrics_line_is_skipped_not_a_crash_on_resume(tmp_path, caplog):
    """A full disk can cut a metrics row mid-write; the checkpoint code tells the user to resume=auto."""
    save_steps(tmp_path, [2], keep_last=2)
    rows = "".join(json.dumps({"step": s, "x": 0.5}) + "\n" for s in range(4))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 4, "metric/1')
    cfg = make_cfg(tmp_path, keep_last=2)
    cfg.resume = "auto"
    assert CheckpointManager(tmp_path, cfg).maybe_resume(FakeActor(), EpochSampler(10, seed=1)) == 2
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert "metrics.jsonl:5: not a JSON row" in caplog.text


def test_resuming_an_older_checkpoint_beside_newer_ones_is_refused(tmp_path):
    """Branching from step 2 with steps 4 and 6 in the same run dir would mix two runs: pruning would
    keep the old run's higher steps and resume=auto would later pick them."""
    save_steps(tmp_path, [2, 4, 6], keep_last=0)
    root = tmp_path / "checkpoints"
    cfg = make_cfg(tmp_path, keep_last=0)
    cfg.resume = str(root / "step-000002")
    with pytest.raises(CheckpointError, match=r"holds newer checkpoint\(s\) of the run that went on from it "
                                              r"\(step-000004, step-000006\).*move the newer ones out"):
        CheckpointManager(tmp_path, cfg)
    cfg.resume = str(root / "step-000006")  # the newest: continuing is fine
    assert CheckpointManager(tmp_path, cfg).checkpoint == (root / "step-000006").resolve()
    for newer in ("step-000004", "step-000006"):  # moved aside: the branch may start
        (root / newer).rename(tmp_path / newer)
    cfg.resume = str(root / "step-000002")
    assert CheckpointManager(tmp_path, cfg).checkpoint == (root / "step-000002").resolve()


def test_a_save_cut_between_its_renames_is_recovered_not_lost(tmp_path):
    """Re-saving step 2: the old one renamed aside (.old), the new one complete under .tmp, killed
    before the second rename: resume=auto finds step 2, and nothing is left aside."""
    import shutil

    save_steps(tmp_path, [2], keep_last=0)
    root = tmp_path / "checkpoints"
    shutil.copytree(root / "step-000002", root / "step-000002.tmp")
    (root / "step-000002").rename(root / "step-000002.old")
    cfg = make_cfg(tmp_path, keep_last=0)
    cfg.resume = "auto"
    assert CheckpointManager(tmp_path, cfg).checkpoint == root / "step-000002"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    mgr = save_steps(tmp_path, [2], keep_last=0)
    mgr.last_saved_step = None  # a re-run of the same step
    mgr.save(2, FakeActor(), EpochSampler(10, seed=1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]
    assert (tmp_path / "checkpoints" / "step-000002" / COMPLETE).is_file()


def test_a_training_set_that_changed_size_is_refused_before_deepspeed_loads(tmp_path):
    save_steps(tmp_path, [2], keep_last=2)  # 10 records
    cfg = make_cfg(tmp_path, keep_last=2)
    cfg.resume = "auto"
    actor = FakeActor()
    with pytest.raises(CheckpointError, match=r"cannot resume from .*step-000002: its data order \(10 records, seed 1\) "
                                              r"is not this run's \(14 records.*the data file\(s\).*changed.*"
                                              r"Restore the data.*python -m colo_rl.checkpoint .*step-000002 <out_dir>"):
        CheckpointManager(tmp_path, cfg).maybe_resume(actor, EpochSampler(14, seed=1))
    assert actor.loaded is None


def test_existing_checkpoints_without_resume_are_not_overwritten(tmp_path):
    save_steps(tmp_path, [2])
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest: step-000002\).*resume=auto"):
        CheckpointManager(tmp_path, make_cfg(tmp_path))


def test_config_change_that_breaks_the_state_is_refused_naming_the_key(tmp_path):
    save_steps(tmp_path, [2])
    cfg = make_cfg(tmp_path, zero_stage=2)
    cfg.resume = "auto"
    cfg.rollout.group_size = 4
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(tmp_path, cfg)
    msg = str(e.value)
    assert "rollout.group_size: checkpoint 8, now 4" in msg
    assert "trainer.zero_stage: checkpoint 3, now 2" in msg
    assert "Set them back" in msg


def test_harmless_changes_resume_silently_and_others_with_a_warning(tmp_path, caplog):
    save_steps(tmp_path, [2])
    cfg = make_cfg(tmp_path, total_steps=50, save_every=5, keep_last=4, eval_every=3)
    cfg.resume, cfg.debug, cfg.logger = "auto", True, ["jsonl"]
    assert CheckpointManager(tmp_path, cfg).checkpoint.name == "step-000002"
    assert "changed config" not in caplog.text
    cfg.algo.kl_coef = 0.05
    CheckpointManager(tmp_path, cfg)
    assert "algo.kl_coef: checkpoint 0.0, now 0.05" in caplog.text


def test_compare_configs_refuses_model_data_seeds_and_optimizer_values():
    base = config_container(RunConfig())
    for key, value in [("model.path", "/other"), ("data.seed", 7), ("trainer.seed", 1), ("rollout.seed", 3),
                       ("trainer.lr", 1.0), ("model.dtype", "bf16"), ("rollout.prompts_per_step", 16)]:
        changed = json.loads(json.dumps(base))
        section, name = key.split(".")
        changed[section][name] = value
        refusals, _ = compare_configs(base, changed)
        assert len(refusals) == 1 and refusals[0].startswith(f"{key}: checkpoint"), (key, refusals)


def test_a_split_runs_generators_cannot_change_on_resume_a_colocated_runs_may():
    """placement.generation_ranks and rollout.tp_size decide a split run's generators, whose data
    positions the checkpoint holds: changed, they are refused; in a colocated run, a warning."""
    for mode, refused in (("split", True), ("colocated", False)):
        base = config_container(RunConfig())
        base["placement"]["mode"] = mode
        for section, name, value in (("placement", "generation_ranks", "2"), ("rollout", "tp_size", 2)):
            changed = json.loads(json.dumps(base))
            changed[section][name] = value
            refusals, warnings = compare_configs(base, changed)
            assert (len(refusals), len(warnings)) == ((1, 0) if refused else (0, 1)), (mode, name, refusals)
            assert (refusals or warnings)[0].startswith(f"{section}.{name}: checkpoint")
            assert not refused or "prompts skipped or repeated" in refusals[0]


def test_world_size_change_is_refused(tmp_path, monkeypatch):
    save_steps(tmp_path, [2])
    monkeypatch.setattr("colo_rl.checkpoint.manager.dist.job_world_size", lambda: 4)  # the job's ranks
    cfg = make_cfg(tmp_path)
    cfg.resume = "auto"
    with pytest.raises(CheckpointError, match=r"written by 1 rank\(s\), this run has 4.*--nproc_per_node=1"):
        CheckpointManager(tmp_path, cfg)


class SeededEngine:
    capabilities = Capabilities(sampling_rng=True)

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)

    def rng_state(self):
        return self.generator.get_state()

    def set_rng_state(self, state):
        self.generator.set_state(state)


def test_rng_states_round_trip_including_the_engine_and_tolerate_engines_without_one():
    engine = SeededEngine(5)
    state = capture_rng(engine)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)),
                float(torch.rand(1, generator=engine.generator)))
    for _ in range(3):
        random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=engine.generator)
    assert restore_rng(state, engine) == []
    assert (random.random(), float(np.random.rand()), float(torch.rand(1)),
            float(torch.rand(1, generator=engine.generator))) == expected
    # an engine without rng_state (SGLang's): saved as None, restored with a note, no error
    no_rng = object()
    state = capture_rng(no_rng)
    assert state["engine_sampling"] is None
    assert restore_rng(state, no_rng) == ["object keeps no sampling RNG state a checkpoint can hold: its sampling "
                                          "restarts from its seed"]
    assert restore_rng(state) == []  # no engine (a split run's trainer): nothing to say
    notes = restore_rng(capture_rng(engine), no_rng)
    assert notes and "no set_rng_state" in notes[0]
    wrapped = SimpleNamespace(inner=engine, capabilities=Capabilities(wraps_engine=True))  # as TPGroupEngine
    assert capture_rng(wrapped)["engine_sampling"] is not None


def test_a_failed_save_leaves_no_checkpoint_that_looks_complete(tmp_path):
    mgr = save_steps(tmp_path, [2])
    with pytest.raises(OSError, match="disk full"):
        mgr.save(4, FakeActor(fail=True), EpochSampler(10, seed=1))
    assert resolve_resume("auto", tmp_path).name == "step-000002"


KILL_MID_SAVE = r"""
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_checkpoint import FakeActor, save_steps
from colo_rl.data.sampler import EpochSampler
mgr = save_steps(Path({run!r}), [2])
mgr.save(4, FakeActor(stall=60), EpochSampler(10, seed=1))
"""


def test_sigkill_in_the_middle_of_a_save(tmp_path):
    """A real process killed with SIGKILL while it writes checkpoint 4: resume picks checkpoint 2."""
    code = KILL_MID_SAVE.format(tests=str(ROOT / "tests"), run=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=child_env(PYTHONPATH=child_python_path()))
    try:
        assert proc.stdout.readline().strip() == "SAVING"  # inside the save, shards half written
        assert (tmp_path / "checkpoints" / "step-000004.tmp" / "ds").is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert resolve_resume("auto", tmp_path).name == "step-000002"
    cfg = make_cfg(tmp_path)
    cfg.resume = "auto"
    mgr = CheckpointManager(tmp_path, cfg)  # the next run cleans the debris up and resumes from 2
    assert mgr.checkpoint.name == "step-000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002"]


def test_export_errors_speak_of_export_in_one_line(tmp_path, capsys):
    from colo_rl.checkpoint import main as export_main

    (tmp_path / "checkpoints" / "step-000002.tmp").mkdir(parents=True)  # an interrupted save only
    for target, message in [(tmp_path / "missing", "does not exist"),
                            (tmp_path, "no complete checkpoint in"),
                            (tmp_path / "checkpoints" / "step-000002.tmp", "is not a complete checkpoint")]:
        with pytest.raises(SystemExit) as e:
            export_main([str(target), str(tmp_path / "out")])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: export: ") and message in err[0], err
        assert "resume=" not in err[0]


def test_export_never_replaces_the_run_directory_or_a_folder_that_is_not_a_model(tmp_path):
    """The export replaces its out_dir whole: `export <run> <run>` once left only the HF files."""
    from colo_rl.checkpoint.export import check_out_dir

    save_steps(tmp_path / "run", [2])
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    for out in (tmp_path / "run", ckpt):
        with pytest.raises(CheckpointError, match="holds the checkpoint"):
            check_out_dir(ckpt, out)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not an HF model directory"):
        check_out_dir(ckpt, notes)
    model = tmp_path / "exported"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for fine in (model, tmp_path / "new", notes / "sub"):  # an earlier export, a new folder
        check_out_dir(ckpt, fine)


# ---- a full disk: said before the save, the last complete checkpoint kept
@pytest.fixture
def free(monkeypatch):
    """The checkpoint filesystem's free bytes, as the test sets them."""
    from colo_rl.checkpoint import manager

    space = SimpleNamespace(bytes=10**12)
    monkeypatch.setattr(manager, "free_bytes", lambda path: space.bytes)
    return space


def test_a_save_without_room_is_refused_before_writing_and_the_last_checkpoint_stays(tmp_path, free):
    mgr = save_steps(tmp_path, [1])
    size = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "step-000001").rglob("*") if f.is_file())
    free.bytes = size // 2
    with pytest.raises(CheckpointError, match=rf"no space left on {tmp_path / 'checkpoints'}: needs ~0.0 MB, 0.0 MB "
                                              rf"free; lower trainer.keep_last \(now 2\) or free space \(the last "
                                              rf"complete checkpoint, step-000001, is intact"):
        mgr.save(2, FakeActor(), EpochSampler(10, seed=1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]  # no partial one
    assert resolve_resume("auto", tmp_path).name == "step-000001"


def test_short_of_room_the_checkpoints_the_save_would_prune_go_first(tmp_path, free):
    mgr = save_steps(tmp_path, [1, 2], keep_last=2)
    free.bytes = 1  # room appears once step-000001 (pruned after this save anyway) is gone
    real_prune = mgr._prune

    def prune(keep=None):
        real_prune(keep)
        free.bytes = 10**12
    mgr._prune = prune
    mgr.save(3, FakeActor(), EpochSampler(10, seed=1))
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step-000002", "step-000003"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter "
                                                "failed writing file data/0: file write failed")])
def test_a_disk_that_fills_during_the_save_is_one_clean_error_and_the_partial_checkpoint_goes(tmp_path, free, error):
    mgr = save_steps(tmp_path, [1])

    class FillsTheDisk(FakeActor):
        def save_checkpoint(self, directory, tag):
            super().save_checkpoint(directory, tag)
            free.bytes = 4096
            raise error

    with pytest.raises(CheckpointError, match=r"no space left on .*: needs ~.* free; lower trainer.keep_last"):
        mgr.save(2, FillsTheDisk(), EpochSampler(10, seed=1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
