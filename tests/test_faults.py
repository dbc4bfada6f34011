"""Faults in the trainer itself: non-finite loss / gradient (real DeepSpeed under torchrun), ZeRO
stage / optimizer combinations DeepSpeed cannot page, the stop-signal flag."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import WORKERS, read_json, run_torchrun

from colo_rl.config import ConfigError, ModelConfig, RunConfig, TrainerConfig
from colo_rl.phase import PhaseGuard
from colo_rl import stop_signal
from colo_rl.stop_signal import StopSignal
from colo_rl.train.actor import DeepSpeedActor
from colo_rl.train.ds_config import build_ds_config, check_pageable


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite") / "report"
    run_torchrun(WORKERS / "nonfinite_worker.py", [str(out), "3,2,0"], nproc=2, timeout=600)
    return [read_json(f"{out}.rank{r}.json") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["3", "2", "0"])
def test_nonfinite_loss_or_gradient_on_one_rank_skips_the_step_on_every_rank(nonfinite, stage):
    for report in nonfinite:
        r = report[stage]
        assert r["clean"] == {**r["clean"], "skipped": 0.0, "changed": True, "in_a_row": 0}
        # NaN loss on rank 1 only / inf gradient on rank 0 only (its loss finite): both ranks skip
        for name in ("nan_loss_rank1", "inf_grad_rank0"):
            assert r[name]["skipped"] == 1.0 and r[name]["changed"] is False and r[name]["finite"] is True, name
        assert r["nan_loss_rank1"]["in_a_row"] == 1 and r["nan_loss_rank1"]["total"] == 1
        assert r["clean_again"]["skipped"] == 0.0 and r["clean_again"]["in_a_row"] == 0  # a clean step resets
        assert r["inf_grad_rank0"]["in_a_row"] == 1 and r["nan_loss_2"]["in_a_row"] == 2
        # the same init and batch on every stage: the same (pre-clipping) global gradient norm, which
        # colo_rl computes itself for stage 0 (DeepSpeed reports none there)
        assert r["clean"]["grad_norm"] > 0
        assert r["clean"]["grad_norm"] == pytest.approx(report["3"]["clean"]["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["3", "2", "0"])
def test_max_nonfinite_steps_in_a_row_stops_every_rank_with_a_clear_error(nonfinite, stage):
    for report in nonfinite:
        r = report[stage]["nan_loss_3"]
        assert r["in_a_row"] == 3 and r["total"] == 4
        assert r["error"].startswith("3 optimizer steps in a row had a non-finite loss")
        assert "trainer.max_nonfinite_steps=3" in r["error"] and "Lower trainer.lr" in r["error"]
        assert "resume=auto" in r["error"]


def trainer(**kw) -> TrainerConfig:
    return TrainerConfig(**kw)


def test_pageable_combination_passes():
    check_pageable(3, build_ds_config(trainer(zero_stage=3), torch.bfloat16, with_optimizer=True))


@pytest.mark.parametrize("stage, patch, expected", [
    (0, None, r"trainer.zero_stage=0 cannot be paged: DeepSpeed has no offload_states for stage-0 optimizers"),
    (2, None, r"trainer.zero_stage=2 is not paged by colo_rl .* Use trainer.zero_stage=3"),
    (3, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
     r"optimizer 'SGD' cannot be paged: .*only for its FusedAdam. Use the optimizer type 'AdamW'"),
    (3, {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, r"optimizer 'AdamW' \(torch_adam\)"),
    (3, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     r"zero_optimization.offload_optimizer.device='cpu' cannot be combined with paging"),
])
def test_unpageable_stage_or_optimizer_is_refused_with_what_to_use(stage, patch, expected):
    ds_config = {**build_ds_config(trainer(zero_stage=stage), torch.float32, with_optimizer=True), **(patch or {})}
    with pytest.raises(ConfigError, match=expected):
        check_pageable(stage, ds_config)


def test_colocated_gpu_actor_checks_paging_before_loading_anything(monkeypatch):
    """On a GPU a colocated (guarded) actor must page; the check runs before the model loads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("colo_rl.train.actor.load_model", lambda *a, **k: pytest.fail("model loaded before the check"))
    cfg = RunConfig(model=ModelConfig(random_init=True, hidden_size=64, num_layers=2, dtype="fp32"),
                    trainer=TrainerConfig(zero_stage=1))
    with pytest.raises(ConfigError, match="trainer.zero_stage=1 is not paged"):
        DeepSpeedActor(cfg, torch.float32, total_steps=1, guard=PhaseGuard())


def test_stop_signal_sets_a_flag_instead_of_killing_and_restores_handlers(monkeypatch):
    monkeypatch.setattr(stop_signal, "_RECEIVED", None)  # the process-wide record, restored after
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal()
    try:
        assert stop.requested() is None and stop_signal.received() is None
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test process without the handler
        os.kill(os.getpid(), signal.SIGTERM)  # a forwarded copy right after: still only the flag
        assert stop.requested() == "SIGTERM" and stop.exit_code("SIGTERM") == 143
        assert stop_signal.received() == "SIGTERM"  # what a child's failure after it reports
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before
