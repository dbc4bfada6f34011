"""Where a run's metrics go: one writer per name in `logger=[...]`, behind a registry.

    jsonl        <run_dir>/metrics.jsonl, one row per step (always on: the run reads it back for its
                 summary, plots and resume); the resolved config is <run_dir>/config.yaml beside it
    tensorboard  <run_dir>/tensorboard/ event files; the resolved config as a text entry
    wandb        Weights & Biases (optional extra `pip install -e '.[wandb]'`); the resolved config as
                 the run's config; offline (files under <run_dir>/wandb/, `wandb sync` later) unless
                 an API key is set or WANDB_MODE says otherwise
    mlflow       MLflow (optional extra `pip install -e '.[mlflow]'`): MLFLOW_TRACKING_URI's server or
                 store, else <run_dir>/mlflow.db (SQLite); the resolved config as the run's params

A writer is built with (run_dir, resolved config as a plain dict) and has `write(step, row)` and
`close()`; `MetricsLogger` (colo_rl/metrics.py) builds them on rank 0 only. A registered writer
becomes a valid `logger` value with no other change.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import netrc
import os
import re
import time
from pathlib import Path
from typing import Any, Optional, Protocol

from colo_rl.registry import Registry

log = logging.getLogger("colo_rl")


class MetricsWriter(Protocol):
    def write(self, step: int, row: dict[str, Any]) -> None:
        """One step's row (`step` included; non-finite values already None)."""

    def close(self) -> None: ...


LOGGERS: Registry = Registry("logger")
# Writers that need a package colo_rl does not depend on: name -> (module, the extra to install).
# mlflow: the local store is SQLite (MLflow 3 refuses its file store), which needs SQLAlchemy + Alembic.
OPTIONAL_PACKAGES = {"wandb": (("wandb",), "wandb"), "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow")}
REQUIRED = "jsonl"  # the run reads metrics.jsonl back (summary, plots, resume): always listed


def unavailable(names: list[str]) -> Optional[str]:
    """Why `logger=names` cannot run (a missing optional package), or None."""
    for name in names:
        modules, extra = OPTIONAL_PACKAGES.get(name, ((), None))
        for module in modules:
            if importlib.util.find_spec(module) is None:
                return (f"logger=[..., {name}] needs the `{module}` package, which is not installed: "
                        f"pip install -e '.[{extra}]' (or remove {name} from logger)")
    return None


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {"a.b.c": leaf}."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers (what a metrics tracker plots): strings, lists and None are left out."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}


class JsonlWriter:
    def __init__(self, run_dir: Path, config: dict):
        self.path = Path(run_dir) / "metrics.jsonl"

    def write(self, step: int, row: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Opened at the first row, with that row's step as TensorBoard's purge step: a resumed run's
    first row is the step after its checkpoint, and the rows the interrupted run wrote from there
    on (redone now, as metrics.jsonl's are cut back) are hidden from the older event files."""

    def __init__(self, run_dir: Path, config: dict):
        self.dir, self.config, self.writer = Path(run_dir) / "tensorboard", config, None

    def write(self, step: int, row: dict[str, Any]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when listed

            self.writer = SummaryWriter(str(self.dir), purge_step=step)
            if self.config:  # indented: TensorBoard's text tab renders Markdown, and this keeps it a code block
                text = "\n".join("    " + line for line in json.dumps(self.config, indent=2).splitlines())
                self.writer.add_text("config", text, step)
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def wandb_mode(environ: Optional[dict] = None, netrc_path: Optional[Path] = None) -> str:
    """WANDB_MODE when set; else online when an API key is known (WANDB_API_KEY, or `wandb login`'s
    entry in ~/.netrc), offline otherwise: a run never stops to ask for a key."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    host = env.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    path = netrc_path or Path(env.get("NETRC", Path(env.get("HOME", Path.home())) / ".netrc"))
    try:
        return "online" if netrc.netrc(str(path)).authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def parse_rows(lines: list[str], path) -> list[Optional[dict]]:
    """Each line of a metrics.jsonl as its row; None for a blank line and for a torn one (a write cut
    by a full disk or a kill), which is logged, not raised: the rows around it stay readable."""
    rows: list[Optional[dict]] = []
    for n, line in enumerate(lines, 1):
        row = None
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                log.warning("%s:%d: not a JSON row (a write cut short?), skipped: %.80s", path, n, line)
        rows.append(row)
    return rows


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [row for row in parse_rows(path.read_text().splitlines(), path) if row is not None]


def rows_before(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """metrics.jsonl's rows before `step`: what a writer that continues in a new run starts with."""
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r.get("step", 0) < step]


class WandbWriter:
    """One wandb run per run directory: its id follows the directory, so resume=auto continues it.

    wandb drops a row whose step is at or below one the run holds. When the first row to write
    has such a step (a resumed run redoes the steps after its checkpoint; a fresh start in the same
    directory begins at 0 again), the writer leaves that run as it is and continues in a new one
    (`<id>-<n>`, the id a later resume continues) that starts with metrics.jsonl's rows before the
    redo, and names the old run in its config: no step keeps the interrupted run's value.
    The id and the last step logged are kept in <run_dir>/wandb/colo_rl_run.json: an offline run
    cannot ask wandb's server what it holds. A directory copied or moved elsewhere starts a run of
    its own (its path, hence its id, differs), as before that file existed."""

    STATE = "colo_rl_run.json"

    def __init__(self, run_dir: Path, config: dict):
        import wandb  # the optional extra [wandb]: imported only when logger lists it

        self.wandb, self.config, self.mode = wandb, config, wandb_mode()
        self.run_dir = run_dir = Path(run_dir)
        self.state_file = run_dir / "wandb" / self.STATE
        state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        self.base_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
        if not re.fullmatch(re.escape(self.base_id) + r"(-\d+)?", str(state.get("id", ""))):
            state = {}  # a copied or moved directory's: its wandb run is the original directory's, not this one's
        self.last_step: Optional[int] = state.get("last_step")  # None: this directory's run holds no row
        self.run_id, self.run = state.get("id", self.base_id), None
        if self.last_step is None:  # a new run starts now (a bad key fails at start-up); a continued one
            self.run = self._init(self.run_id, {})  # at its first row, which says whether it redoes steps
        if self.mode == "offline":
            log.info("wandb: offline (no API key); upload later with `wandb sync %s/offline-run-*`",
                     run_dir / "wandb")

    def _init(self, run_id: str, extra_config: dict):
        self.run_id = run_id
        return self.wandb.init(project=os.environ.get("WANDB_PROJECT", "colo_rl"), name=self.run_dir.name,
                               id=run_id, resume="allow", dir=str(self.run_dir),
                               config={**self.config, **extra_config}, mode=self.mode,
                               # no stdout capture (the progress bar owns the terminal), no banners
                               settings=self.wandb.Settings(console="off", silent=True))

    def _start_over(self, step: int) -> None:
        old = self.run_id
        n = int(old[len(self.base_id) + 1:]) + 1 if old != self.base_id else 1
        self.run = self._init(f"{self.base_id}-{n}", {"colo_rl_previous_run": old, "colo_rl_continued_at_step": step})
        for r in rows_before(self.run_dir, step):
            self.run.log(scalars(r), step=r["step"])
        log.info("wandb: run %s held steps from %d on (an interrupted or earlier run): continued in a new run %s "
                 "with metrics.jsonl's rows before them", old, step, self.run_id)

    def write(self, step: int, row: dict[str, Any]) -> None:
        if self.run is None:
            if self.last_step is not None and step <= self.last_step:
                self._start_over(step)
            else:
                self.run = self._init(self.run_id, {})
        self.run.log(scalars(row), step=step)
        self.last_step = step
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps({"id": self.run_id, "last_step": step}))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
        # Stop wandb's service process now: left to atexit, it is already gone once SGLang's exit hook
        # has killed this process's children, and wandb's teardown prints a ConnectionResetError trace.
        self.wandb.teardown()


class MlflowWriter:
    """One MLflow run per run directory (tagged with it, so resume=auto continues the same run); the
    flattened config as params (on the run's first start: MLflow params cannot change later).

    MLflow cannot delete a metric's points: when the first row to write has a step the run already
    holds (a resumed run redoes the steps after its checkpoint; a fresh start in the same directory
    begins again at 0), the writer starts a new MLflow run for the directory (the newest is the one a
    later resume finds), replays metrics.jsonl's rows before that step into it, and marks the old one
    killed: no step holds two values."""

    RUN_DIR_TAG = "colo_rl.run_dir"

    def __init__(self, run_dir: Path, config: dict):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports unless the user asks
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store set-up logs at INFO
        from mlflow import MlflowClient  # the optional extra [mlflow]: imported only when logger lists it
        from mlflow.entities import Param, RunStatus

        self.run_dir = run_dir = Path(run_dir).resolve()
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self._params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "colo_rl")
        exp = self.client.get_experiment_by_name(name)
        self.exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        found = self.client.search_runs([self.exp_id], filter_string=f"tags.`{self.RUN_DIR_TAG}` = '{run_dir}'",
                                        max_results=1, order_by=["attributes.start_time DESC"])
        self.continued = bool(found)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            self.run_id = self._new_run({})
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, name, self.uri)

    def _new_run(self, tags: dict[str, str]) -> str:
        run_id = self.client.create_run(self.exp_id, run_name=self.run_dir.name,
                                        tags={self.RUN_DIR_TAG: str(self.run_dir), **tags}).info.run_id
        for i in range(0, len(self._params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=self._params[i:i + 100])
        return run_id

    def _holds_step(self, step: int, row: dict[str, Any]) -> bool:
        """Does the run hold a value at `step` or later for any of the row's keys (once per start)?"""
        return any(m.step >= step for key in scalars(row) for m in self.client.get_metric_history(self.run_id, key))

    def _start_over(self, step: int) -> None:
        from mlflow.entities import RunStatus

        old, self.run_id = self.run_id, self._new_run({"colo_rl.previous_run": self.run_id,
                                                        "colo_rl.continued_at_step": str(step)})
        self.client.set_terminated(old, status=RunStatus.to_string(RunStatus.KILLED))
        for r in rows_before(self.run_dir, step):
            self._log(r["step"], r)
        log.info("mlflow: run %s held steps from %d on (an interrupted or earlier run): continued in a new run %s "
                 "with metrics.jsonl's rows before them", old, step, self.run_id)

    def write(self, step: int, row: dict[str, Any]) -> None:
        if self.continued:
            self.continued = False
            if self._holds_step(step, row):
                self._start_over(step)
        self._log(step, row)

    def _log(self, step: int, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars(row).items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


LOGGERS.register("jsonl")(JsonlWriter)
LOGGERS.register("tensorboard")(TensorBoardWriter)
LOGGERS.register("wandb")(WandbWriter)
LOGGERS.register("mlflow")(MlflowWriter)
