"""Metric sinks: `metrics.jsonl` always; TensorBoard, Weights & Biases and MLflow when `run.trackers` names them.

A metrics row is a flat dict: `step` (int), `kind` (`"train"` or `"eval"`) and `prefix/name` keys whose values
are numbers or short strings. A value that was not measured is absent or `null`. A non-finite float (a NaN loss,
an infinite ratio) is written as the string `"nan"`, `"inf"` or `"-inf"`, so every line stays valid JSON and a
run that diverged never reads as one that did not measure; `read_metrics` turns those strings back into floats.

The JSONL file is the run's source of truth: the report and resume read it back. A run killed mid-write leaves
a torn last line; readers skip lines that do not parse, and `truncate_after` drops them on resume.

Trackers (optional extras: `pip install 'rollwise[tensorboard]'`, `[wandb]`, `[mlflow]`) get each row's numeric
values, non-finite ones included, at x = `step`; an eval row's keys go under `eval/` when not already there. Each
logs the config once, flattened to `section.key` hyperparameters (secrets, the API keys, as `***`), and a resumed
run appends to the same run:

- tensorboard: event files in `RUN_DIR/tensorboard`; on resume, events a killed run wrote after its checkpoint
  are purged (`purge_step`).
- wandb: offline (files only, `RUN_DIR/wandb`, upload later with `wandb sync`) unless `WANDB_API_KEY` is set;
  the run id is kept in `RUN_DIR/wandb-run-id` and reused with `resume="allow"`.
- mlflow: a file store in `RUN_DIR/mlruns` unless `MLFLOW_TRACKING_URI` is set (experiment
  `MLFLOW_EXPERIMENT_NAME`, default `rollwise`); the run id is kept in `RUN_DIR/mlflow-run-id`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}  # how non-finite floats are spelled in JSONL
WANDB_ID_FILE = "wandb-run-id"
MLFLOW_ID_FILE = "mlflow-run-id"


class Sink(Protocol):
    """Anything that takes metrics rows."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def nonfinite_name(value: float) -> str:
    """`"nan"`, `"inf"` or `"-inf"`: how a non-finite float is written in `metrics.jsonl`."""
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def clean_value(value: Any) -> Any:
    """A JSON-safe scalar: NaN/inf become `"nan"`/`"inf"`/`"-inf"`, numpy/torch scalars become Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return nonfinite_name(value)
    return value


def restore_value(value: Any) -> Any:
    """The inverse of `clean_value` for non-finite floats: `"nan"`/`"inf"`/`"-inf"` become floats again."""
    if isinstance(value, str) and value in NONFINITE:
        return NONFINITE[value]
    return value


def as_number(value: Any) -> float | None:
    """`value` as a float when it is a number (bools excluded; NaN/inf and their JSONL spellings kept), else None."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    value = restore_value(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of `row` with every value passed through `clean_value`."""
    return {str(key): clean_value(value) for key, value in row.items()}


def row_kind(row: dict[str, Any]) -> str:
    """`"eval"` or `"train"`: the row's `kind`, else inferred from its keys."""
    kind = row.get("kind")
    if isinstance(kind, str):
        return kind
    return "eval" if any(key.startswith("eval/") for key in row) else "train"


def tracker_scalars(row: dict[str, Any]) -> dict[str, float]:
    """`name -> value` of every numeric value of `row` for a tracker; an eval row's names get an `eval/` prefix.

    `step`, `kind` and string values are left out; NaN and inf stay (a tracker shows a diverged value as such).
    """
    prefix = "eval/" if row_kind(row) == "eval" else ""
    out: dict[str, float] = {}
    for key, value in row.items():
        number = as_number(value)
        if key in ("step", "kind") or number is None:
            continue
        out[key if key.startswith(prefix) else prefix + key] = number
    return out


def row_step(row: dict[str, Any]) -> int:
    """The row's `step` as an int (0 when missing)."""
    step = as_number(row.get("step"))
    return int(step) if step is not None and math.isfinite(step) else 0


def flatten_config(config: dict[str, Any] | None, prefix: str = "") -> dict[str, bool | int | float | str]:
    """`{"train": {"lr": 1e-6}}` -> `{"train.lr": 1e-6}`; lists, tables in lists and None become JSON text.

    A secret of the config (`rollwise.config.secret_keys()`: the API keys) is logged as `***` whatever the dict
    holds (a JSON dump of the config masks it already; a hand-made dict may not)."""
    from rollwise.config import SECRET_MASK, secret_keys

    secrets = secret_keys()
    out: dict[str, bool | int | float | str] = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if name in secrets and value is not None:
            out[name] = SECRET_MASK
        elif isinstance(value, dict) and value:
            out.update(flatten_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


class MetricsWriter:
    """Appends one JSON object per line to `run_dir/metrics.jsonl`, flushed after each row."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = _ends_torn(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if needs_newline:  # keep the next row off a torn line left by a killed run
            self._file.write("\n")

    def write(self, row: dict[str, Any]) -> None:
        """Append `row` as one line and flush it to the OS."""
        line = json.dumps(clean_row(row), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_torn(path: Path) -> bool:
    """True when `path` is non-empty and its last byte is not a newline."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _parse_lines(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn line from a killed run
        if isinstance(row, dict):
            rows.append({key: restore_value(value) for key, value in row.items()})
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of `run_dir/metrics.jsonl` in file order; lines that do not parse are skipped.

    Values written as `"nan"`, `"inf"` or `"-inf"` come back as the float they stand for.

    Raises FileNotFoundError naming the file when it does not exist.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"metrics file not found: {path}")
    return _parse_lines(path.read_text(encoding="utf-8", errors="replace"))


def truncate_after(run_dir: str | Path, step: int) -> int:
    """Keep only rows with `step <= step` (and rows without a step); rewrite atomically. Returns rows dropped.

    Used on resume: rows a killed run logged after its last checkpoint describe steps that will run again.
    A missing file is left missing.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    rows = read_metrics(run_dir)
    kept = [row for row in rows if not isinstance(row.get("step"), (int, float)) or row["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in kept:
            f.write(json.dumps(clean_row(row), allow_nan=False, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return len(rows) - len(kept)


def _import_tracker(module: str, extra: str) -> Any:
    """Import a tracker's library, or fail naming the pip command that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"the {extra} tracker needs '{module}': pip install 'rollwise[{extra}]'") from exc


class TensorBoardSink:
    """Writes numeric values as TensorBoard scalars (tag = metric key, x = step) under `run_dir/tensorboard`.

    The config goes once into the hparams plugin (when the log directory is new). With `resume_step`, events that
    an earlier process wrote for steps after it are purged, so a resumed run's curves do not double back.
    """

    def __init__(self, run_dir: str | Path, run_name: str | None = None, config: dict[str, Any] | None = None,
                 resume_step: int | None = None):
        _import_tracker("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(run_dir) / "tensorboard"
        fresh = not any(log_dir.glob("events.out.tfevents.*"))
        purge_step = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if config and fresh:
            self._write_hparams(flatten_config(config))

    def _write_hparams(self, params: dict[str, bool | int | float | str]) -> None:
        from torch.utils.tensorboard.summary import hparams

        file_writer = self._writer._get_file_writer()
        for summary in hparams(params, {}):  # experiment, session start and end: one hparams "trial"
            file_writer.add_summary(summary)

    def write(self, row: dict[str, Any]) -> None:
        """Add every numeric value of `row` as a scalar at `row["step"]`."""
        step = row_step(row)
        for key, value in tracker_scalars(row).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        self._writer.close()


# W&B without an API key: write files only, never open a connection, never read git or the code
WANDB_OFFLINE_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                     "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off", "WANDB_ERROR_REPORTING": "false"}


class WandbSink:
    """Logs rows to a Weights & Biases run: online when `WANDB_API_KEY` is set, else offline under `run_dir/wandb`.

    The run id is kept in `run_dir/wandb-run-id` so a resumed training run continues the same W&B run
    (`resume="allow"`); `WANDB_PROJECT` names the project (default `rollwise`). W&B never wraps the console.
    """

    def __init__(self, run_dir: str | Path, run_name: str | None = None, config: dict[str, Any] | None = None,
                 resume_step: int | None = None):
        wandb = _import_tracker("wandb", "wandb")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.offline = not os.environ.get("WANDB_API_KEY")
        if self.offline:
            os.environ.update(WANDB_OFFLINE_ENV)
        settings = wandb.Settings(console="off", disable_git=True, save_code=False, silent=True,
                                  x_disable_stats=True, disable_job_creation=True)
        self.run_id = _stored_id(run_dir / WANDB_ID_FILE, lambda: uuid.uuid4().hex[:16])
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "rollwise"), name=run_name, id=self.run_id,
                               resume="allow", dir=str(run_dir), mode="offline" if self.offline else "online",
                               config=flatten_config(config), settings=settings)
        self._finished = False
        if self.offline:
            print(f"rollwise: W&B is offline (no WANDB_API_KEY); upload later with "
                  f"`wandb sync {run_dir / 'wandb'}/offline-run-*`", flush=True)

    def write(self, row: dict[str, Any]) -> None:
        """Log the row's numeric values at `step` (W&B keeps one history row per step)."""
        values = tracker_scalars(row)
        if values:
            self._run.log(values, step=row_step(row))

    def close(self) -> None:
        """Finish the W&B run and, when no other run is open, stop W&B's service process (idempotent).

        `finish()` can return before the service has written the run file (seen with wandb 0.31 offline); the
        teardown waits for it, so the files are complete when training returns.
        """
        if not self._finished:
            self._finished = True
            self._run.finish()
            import wandb

            if wandb.run is None:
                wandb.teardown()


MLFLOW_KEY_BAD_CHARS = re.compile(r"[^\w\-./ :]")  # MLflow names allow letters, digits, _ - . / space and :
MLFLOW_PARAM_CHARS = 6000  # the limit on a parameter value (mlflow.utils.validation, MLflow >= 2.16)
MLFLOW_BATCH = 100  # log_batch takes at most 100 params and 1000 metrics per call


class MlflowSink:
    """Logs rows to an MLflow run: a file store in `run_dir/mlruns` unless `MLFLOW_TRACKING_URI` is set.

    The run id is kept in `run_dir/mlflow-run-id`; a resumed training run reopens that run and appends to it.
    The config is logged as params when the run is created (MLflow refuses to change a param afterwards).
    MLflow's usage telemetry is off unless `MLFLOW_DISABLE_TELEMETRY` says otherwise.
    """

    def __init__(self, run_dir: str | Path, run_name: str | None = None, config: dict[str, Any] | None = None,
                 resume_step: int | None = None):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:"):  # MLflow >= 3.7 refuses the file store without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # MLflow 3 phones home at import otherwise
        _import_tracker("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id = self._reopen(run_dir / MLFLOW_ID_FILE)
        if self.run_id is None:
            self.run_id = self._create(run_name, flatten_config(config))
            (run_dir / MLFLOW_ID_FILE).write_text(self.run_id + "\n")
        self._finished = False

    def _reopen(self, id_path: Path) -> str | None:
        """The stored run's id, marked running again, or None when there is none in this tracking store."""
        from mlflow.exceptions import MlflowException

        if not id_path.exists():
            return None
        run_id = id_path.read_text().strip()
        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException:
            return None  # the store changed (another MLFLOW_TRACKING_URI): start a new run there
        return run_id

    def _create(self, run_name: str | None, params: dict[str, bool | int | float | str]) -> str:
        from mlflow.entities import Param

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "rollwise")
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        items = [Param(mlflow_key(key), str(value)[:MLFLOW_PARAM_CHARS]) for key, value in params.items()]
        for start in range(0, len(items), MLFLOW_BATCH):
            self._client.log_batch(run_id, params=items[start:start + MLFLOW_BATCH])
        return run_id

    def write(self, row: dict[str, Any]) -> None:
        """Log the row's numeric values at `step`, in one batch per 100 metrics."""
        from mlflow.entities import Metric

        now_ms, step = int(time.time() * 1000), row_step(row)
        metrics = [Metric(mlflow_key(key), value, now_ms, step) for key, value in tracker_scalars(row).items()]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + MLFLOW_BATCH])

    def close(self) -> None:
        """Mark the MLflow run finished (idempotent)."""
        if not self._finished:
            self._finished = True
            self._client.set_terminated(self.run_id)


def mlflow_key(key: str) -> str:
    """`key` with the characters MLflow refuses in metric and param names replaced by `_`."""
    return MLFLOW_KEY_BAD_CHARS.sub("_", key)


def _stored_id(path: Path, new_id: Any) -> str:
    """The id kept in `path`, or a fresh `new_id()` written there (a resumed run finds it again)."""
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    run_id = new_id()
    path.write_text(run_id + "\n")
    return run_id


def _jsonl(run_dir: str | Path, run_name: str | None = None, config: dict[str, Any] | None = None,
           resume_step: int | None = None) -> MetricsWriter:
    return MetricsWriter(run_dir)


SINKS: dict[str, Any] = {"jsonl": _jsonl, "tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


class MultiSink:
    """Fans each row out to several sinks, the JSONL writer first (a row is on disk before any tracker sees it)."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def write(self, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        """Close every sink, also when one of them fails; the first failure is raised after all are closed."""
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - the others must still close
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_sinks(names: list[str], run_dir: str | Path, run_name: str | None = None,
                config_dict: dict[str, Any] | None = None, resume_step: int | None = None) -> MultiSink:
    """Sinks by name (`jsonl`, `tensorboard`, `wandb`, `mlflow`); the JSONL sink is always included, first.

    `run_name` names the tracker run, `config_dict` (nested, as `Config.model_dump(mode="json")`) is logged once
    as `section.key` hyperparameters, and `resume_step` is the checkpoint step a resumed run restarts after.
    """
    unknown = [name for name in names if name not in SINKS]
    if unknown:
        raise ValueError(f"unknown metric sink(s) {unknown}; valid sinks: {', '.join(SINKS)}")
    ordered = ["jsonl"] + [name for name in dict.fromkeys(names) if name != "jsonl"]
    sinks: list[Sink] = []
    try:
        for name in ordered:
            sinks.append(SINKS[name](run_dir, run_name, config_dict, resume_step))
    except BaseException:
        MultiSink(sinks).close()  # do not leave metrics.jsonl open when an optional sink is missing
        raise
    return MultiSink(sinks)
