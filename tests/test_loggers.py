"""logger=[jsonl,tensorboard,wandb,mlflow]: each writer gets every step's numbers and the resolved
config (real TensorBoard event files, real wandb offline files read back record by record, a real
MLflow SQLite store read back with MLflow's client)."""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from colo_rl.config import ConfigError, RunConfig, validate
from colo_rl.loggers import LOGGERS, read_jsonl, wandb_mode
from colo_rl.metrics import MetricsLogger

CONFIG = {"trainer": {"lr": 0.001, "seed": 7}, "logger": ["jsonl", "tensorboard", "wandb"]}
ROWS = [(0, {"eval/accuracy": 0.25, "note": "text is kept in jsonl only"}),
        (1, {"reward/mean": 1.5, "eval/accuracy": 0.5, "train/grad_norm": float("nan")})]


def wandb_records(run_file: Path) -> list:
    """The protobuf records of a wandb offline `.wandb` file: a 7-byte file header, then LevelDB
    log blocks of 32 KiB whose chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)
    carry one serialized wandb Record each (wandb 0.31 no longer ships a Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    try:
        metrics = MetricsLogger(run_dir, ["jsonl", "tensorboard", "wandb"], config=CONFIG)
        for step, row in ROWS:
            metrics.log(step, row, console=False)
        metrics.close()
    finally:
        mp.undo()
    return run_dir


def test_jsonl_has_every_row_with_non_finite_values_as_null(logged):
    assert read_jsonl(logged / "metrics.jsonl") == [
        {"step": 0, "eval/accuracy": 0.25, "note": "text is kept in jsonl only"},
        {"step": 1, "reward/mean": 1.5, "eval/accuracy": 0.5, "train/grad_norm": None}]


def test_tensorboard_has_the_scalars_and_the_config(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logged / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(0, 0.25), (1, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 1.5)]
    assert "train/grad_norm" not in acc.Tags()["scalars"] and "note" not in acc.Tags()["scalars"]
    (text,) = acc.Tensors("config/text_summary")
    shown = text.tensor_proto.string_val[0].decode()
    assert json.loads("\n".join(line[4:] for line in shown.splitlines())) == CONFIG


def test_tensorboard_hides_the_rows_a_resumed_run_redoes(tmp_path):
    """Steps 1-7 logged, the run resumed from its step-5 checkpoint: TensorBoard shows 1-5 of the
    first run and 6-8 of the second, not both runs' 6 and 7."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, ["tensorboard"], config=CONFIG)
    for step in range(1, 8):
        first.log(step, {"train/loss": float(step)}, console=False)
    first.close()
    time.sleep(1.1)  # event files are named by the second they were opened in
    resumed = MetricsLogger(tmp_path, ["tensorboard"], config=CONFIG)
    for step in range(6, 9):
        resumed.log(step, {"train/loss": 100.0 + step}, console=False)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 106.0), (7, 107.0), (8, 108.0)]


def test_wandb_offline_run_holds_the_config_and_every_step(logged):
    (run_file,) = (logged / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == CONFIG
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.append({k: v for k, v in items.items() if not k.startswith("_") or k == "_step"})
    assert history == [{"_step": 0, "eval/accuracy": 0.25},
                       {"_step": 1, "reward/mean": 1.5, "eval/accuracy": 0.5}]


def test_wandb_is_offline_without_an_api_key(tmp_path):
    netrc = tmp_path / "netrc"
    assert wandb_mode({}, netrc) == "offline"  # no key, no netrc
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    netrc.chmod(0o600)
    assert wandb_mode({}, netrc) == "online"  # `wandb login` wrote it
    assert wandb_mode({"WANDB_API_KEY": "k"}, tmp_path / "none") == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, netrc) == "disabled"  # the user's word wins


def checked(**logger) -> None:
    cfg = OmegaConf.structured(RunConfig)
    cfg.logger = logger["names"]
    validate(cfg, "grpo")


def test_logger_values_are_checked_at_start_up():
    checked(names=["jsonl", "wandb", "mlflow"])
    with pytest.raises(ConfigError, match=r"logger: 'comet' is not one of \['jsonl', 'tensorboard', 'wandb', 'mlflow'\]"):
        checked(names=["jsonl", "comet"])
    with pytest.raises(ConfigError, match="must include jsonl"):
        checked(names=["tensorboard"])
    assert LOGGERS.names() == ["jsonl", "tensorboard", "wandb", "mlflow"]


def mlflow_run(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "colo_rl"]
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_mlflow_run_holds_the_config_and_every_step_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLogger(run_dir, ["jsonl", "mlflow"], config=CONFIG)
    for step, row in ROWS:
        metrics.log(step, row, console=False)
    metrics.close()
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client, run = mlflow_run(uri)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params == {"trainer.lr": "0.001", "trainer.seed": "7", "logger": str(CONFIG["logger"])}
    history = lambda key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]  # noqa: E731
    assert history("eval/accuracy") == [(0, 0.25), (1, 0.5)] and history("reward/mean") == [(1, 1.5)]
    assert history("train/grad_norm") == [] and "note" not in run.data.metrics  # NaN and text stay out
    # resume=auto: the same run directory continues the same MLflow run (its params kept)
    resumed = MetricsLogger(run_dir, ["jsonl", "mlflow"], config={**CONFIG, "trainer": {"lr": 0.001, "seed": 7,
                                                                                          "total_steps": 9}})
    resumed.log(2, {"eval/accuracy": 0.75}, console=False)
    resumed.close()
    client, again = mlflow_run(uri)
    assert again.info.run_id == run.info.run_id and "trainer.total_steps" not in again.data.params
    assert history("eval/accuracy") == [(0, 0.25), (1, 0.5), (2, 0.75)]


def test_mlflow_follows_the_tracking_uri_the_user_sets(tmp_path, monkeypatch):
    elsewhere = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = MetricsLogger(run_dir, ["jsonl", "mlflow"], config=CONFIG)
    metrics.log(0, {"eval/accuracy": 0.25}, console=False)
    metrics.close()
    assert not (run_dir / "mlflow.db").exists()
    _, run = mlflow_run(elsewhere)
    assert run.data.metrics == {"eval/accuracy": 0.25}


@pytest.mark.parametrize("logger, missing", [("wandb", "wandb"), ("mlflow", "sqlalchemy")])
def test_a_missing_optional_package_is_named_with_its_extra(monkeypatch, logger, missing):
    """mlflow's local SQLite store needs SQLAlchemy too: each package the writer needs is checked."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ConfigError, match=rf"needs the `{missing}` package.*pip install -e '\.\[{logger}\]'"):
        checked(names=["jsonl", logger])


def test_a_logger_that_fails_mid_run_is_dropped_not_the_run(tmp_path, caplog):
    """wandb's process killed or an MLflow server down raised out of metrics.log and ended the run; a
    writer listed before jsonl also cost metrics.jsonl the row."""
    import logging

    class Flaky:
        def __init__(self, run_dir, config):
            self.rows = []

        def write(self, step, row):
            if step == 2:
                raise ConnectionResetError("Connection lost")
            self.rows.append(step)

        def close(self):
            raise ConnectionResetError("Connection lost")

    LOGGERS.register("flaky_test")(Flaky)
    try:
        metrics = MetricsLogger(tmp_path, ["flaky_test", "jsonl"])
        with caplog.at_level(logging.WARNING, logger="colo_rl"):
            for step in (1, 2, 3):
                metrics.log(step, {"train/loss": 0.5}, console=False)
            metrics.close()
    finally:
        LOGGERS._entries.pop("flaky_test", None)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "logger flaky_test failed (ConnectionResetError: Connection lost) at step 2" in warnings[0]


def test_the_terminal_progress_bar_has_an_eta_for_steps_longer_than_30_s(monkeypatch):
    """rich estimates speed over a 30-s window by default: with a GRPO step of minutes it held no
    sample and the ETA stayed -:--:--."""
    from colo_rl import metrics as metrics_module

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    progress = metrics_module.Progress(10, "grpo", terminal=True)
    try:
        progress.bar.get_time = lambda: now[0]
        for _ in range(3):
            now[0] += 45.0
            progress.advance()
        task = progress.bar.tasks[0]
        assert task.time_remaining == pytest.approx(7 * 45.0)
    finally:
        progress.close()


def test_summary_json_is_json_and_the_console_shows_nan(tmp_path, caplog):
    """summary.json held NaN (no JSON: jq and JavaScript refuse it) where metrics.jsonl holds null;
    the console line printed None for a non-finite loss."""
    import logging

    from colo_rl.metrics import json_text

    text = json_text({"end": {"eval/loss": float("nan"), "steps": 3, "x": [1.5, float("inf")]}})
    assert json.loads(text) == {"end": {"eval/loss": None, "steps": 3, "x": [1.5, None]}}
    metrics = MetricsLogger(tmp_path, ["jsonl"], console_keys=["train/loss"])
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        metrics.log(1, {"train/loss": float("nan")})
    assert "loss=nan" in caplog.records[-1].getMessage()
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["train/loss"] is None


def test_mlflow_never_holds_two_values_for_a_redone_step(tmp_path, monkeypatch):
    """A resume redoes the steps after its checkpoint (and a fresh start in the same directory begins
    at 0 again): the continued MLflow run held both the interrupted run's values and the new ones.
    The writer now continues in a new run that starts with metrics.jsonl's rows before the redo."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = MetricsLogger(run_dir, ["jsonl", "mlflow"], config=CONFIG)
    for step in (1, 2, 3):  # interrupted after step 3; its checkpoint is step 1's
        first.log(step, {"reward/mean": float(step)}, console=False)
    first.close()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] <= 1]  # what resume's cut-back leaves
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    resumed = MetricsLogger(run_dir, ["jsonl", "mlflow"], config=CONFIG)
    for step in (2, 3):
        resumed.log(step, {"reward/mean": 10.0 * step}, console=False)
    resumed.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("colo_rl").experiment_id],
                              order_by=["attributes.start_time DESC"])
    assert [r.info.status for r in runs] == ["FINISHED", "KILLED"]
    newest = [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "reward/mean")]
    assert sorted(newest) == [(1, 1.0), (2, 20.0), (3, 30.0)]
    assert runs[0].data.tags["colo_rl.previous_run"] == runs[1].info.run_id
    assert runs[0].data.params == runs[1].data.params  # the config logged again


def wandb_history(run_file: Path) -> list[tuple[int, float]]:
    """(step, reward/mean) of every history record of an offline run file."""
    out = []
    for r in wandb_records(run_file):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            out.append((items["_step"], items["reward/mean"]))
    return out


def test_wandb_never_keeps_the_interrupted_runs_value_for_a_redone_step(tmp_path, monkeypatch):
    """wandb drops a step at or below one its run holds: a resume that redoes logged steps kept the
    interrupted run's values. The writer now continues in a new run that starts with metrics.jsonl's
    rows before the redo; a later resume continues that new run, and one that redoes nothing continues
    the same run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def run_ids() -> list[str]:  # offline-run-<date>_<time>-<id>, oldest first
        return [d.name.split("-", 3)[3] for d in sorted((run_dir / "wandb").glob("offline-run-*"))]

    def log_steps(steps, scale):
        metrics = MetricsLogger(run_dir, ["jsonl", "wandb"], config=CONFIG)
        for step in steps:
            metrics.log(step, {"reward/mean": scale * step}, console=False)
        metrics.close()

    log_steps((1, 2, 3), 1.0)  # interrupted after step 3; its checkpoint is step 1's
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] <= 1]  # resume's cut-back
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    time.sleep(1.1)  # offline run directories are named by the second they start in
    log_steps((2, 3), 10.0)
    first, second = run_ids()
    assert second == f"{first}-1"
    old_file, new_file = (next((run_dir / "wandb").glob(f"offline-run-*/run-{i}.wandb")) for i in (first, second))
    assert wandb_history(old_file) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert wandb_history(new_file) == [(1, 1.0), (2, 20.0), (3, 30.0)]
    (run,) = [r.run for r in wandb_records(new_file) if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    assert config == {**CONFIG, "colo_rl_previous_run": first, "colo_rl_continued_at_step": 2}
    time.sleep(1.1)
    log_steps((4,), 10.0)  # a resume from step 3's checkpoint redoes nothing: the same (new) run goes on
    assert run_ids() == [first, second, second]

    # a copy of the directory is a run of its own: it neither fails on nor continues the original's run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    metrics = MetricsLogger(copy, ["jsonl", "wandb"], config=CONFIG)
    metrics.log(2, {"reward/mean": 7.0}, console=False)
    assert [name for name, _ in metrics.writers] == ["jsonl", "wandb"]  # not dropped for a failure
    metrics.close()
    state = json.loads((copy / "wandb" / "colo_rl_run.json").read_text())
    assert state["id"] not in (first, second) and state["last_step"] == 2
