"""Metric sinks: `metrics.jsonl` always, TensorBoard when installed.

A metrics row is a flat dict: `step` (int), `kind` (`"train"` or `"eval"`) and `prefix/name` keys whose values
are numbers or short strings. Non-finite floats are written as `null` so every line stays valid JSON.

The JSONL file is the run's source of truth: the report and resume read it back. A run killed mid-write leaves
a torn last line; readers skip lines that do not parse, and `truncate_after` drops them on resume.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"


class Sink(Protocol):
    """Anything that takes metrics rows."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def clean_value(value: Any) -> Any:
    """A JSON-safe scalar: NaN/inf become None, numpy/torch scalars become Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def clean_row(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of `row` with every value passed through `clean_value`."""
    return {str(key): clean_value(value) for key, value in row.items()}


def row_kind(row: dict[str, Any]) -> str:
    """`"eval"` or `"train"`: the row's `kind`, else inferred from its keys."""
    kind = row.get("kind")
    if isinstance(kind, str):
        return kind
    return "eval" if any(key.startswith("eval/") for key in row) else "train"


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
            rows.append(row)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All rows of `run_dir/metrics.jsonl` in file order; lines that do not parse are skipped.

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
            f.write(json.dumps(row, allow_nan=False, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return len(rows) - len(kept)


class TensorBoardSink:
    """Writes numeric values as TensorBoard scalars (tag = metric key, x = step) under `run_dir/tensorboard`."""

    def __init__(self, run_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "the tensorboard sink needs the 'tensorboard' package: pip install rollwise[tensorboard]"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        """Add every finite numeric value of `row` as a scalar at `row["step"]`."""
        step = int(row.get("step", 0))
        for key, value in clean_row(row).items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


SINKS = {"jsonl": MetricsWriter, "tensorboard": TensorBoardSink}


class MultiSink:
    """Fans each row out to several sinks."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def write(self, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_sinks(names: list[str], run_dir: str | Path) -> MultiSink:
    """Sinks by name (`jsonl`, `tensorboard`); the JSONL sink is always included, first."""
    unknown = [name for name in names if name not in SINKS]
    if unknown:
        raise ValueError(f"unknown metric sink(s) {unknown}; valid sinks: {', '.join(SINKS)}")
    ordered = ["jsonl"] + [name for name in dict.fromkeys(names) if name != "jsonl"]
    sinks: list[Sink] = []
    try:
        for name in ordered:
            sinks.append(SINKS[name](run_dir))
    except BaseException:
        MultiSink(sinks).close()  # do not leave metrics.jsonl open when an optional sink is missing
        raise
    return MultiSink(sinks)
