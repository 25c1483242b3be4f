"""How a command ends on an error: one `error:` line, a non-zero exit code, and the full traceback on file.

`guard(run_dir, debug)` wraps a command. Every exception leaves it as one line on stderr that names what
failed (the key, file, row, checkpoint or step, from the exception's own message) and what to do, and exit
code 2 (an input or state the user can fix), 1 (an internal error: a bug report) or 130 (Ctrl-C). The full
traceback goes to `RUN_DIR/error.log` when the run directory exists, and to stderr with `--debug`.
"""

from __future__ import annotations

import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer

EXIT_USER, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 1, 130
ERROR_LOG = "error.log"


def is_disk_full(exc: BaseException) -> bool:
    from rollwise.train.checkpoint import is_disk_full as check

    return check(exc)


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is meant for the user: bad config, data, model, checkpoint, reward, NaN."""
    from rollwise.config import ConfigError
    from rollwise.data.files import DatasetError
    from rollwise.metrics.report import ReportError
    from rollwise.models import ModelNotFoundError
    from rollwise.train.checkpoint import CheckpointError
    from rollwise.train.trainer import NonFiniteError

    types: list[type[BaseException]] = [ConfigError, DatasetError, ReportError, ModelNotFoundError,
                                        CheckpointError, NonFiniteError, FileNotFoundError]
    try:
        from rollwise.rewards.scoring import RewardsFailingError
        types.append(RewardsFailingError)
    except ImportError:
        pass
    from rollwise.generate.factory import MissingExtraError
    from rollwise.generate.http_engine import ServerEngineError
    from rollwise.sync import SyncError

    from rollwise.distill.guards import CollapseError
    from rollwise.distill.teacher import TeacherError

    types += [MissingExtraError, ServerEngineError, SyncError, TeacherError, CollapseError]
    return tuple(types)


def one_line(text: str) -> str:
    """Join a multi-line message into one line (config errors list one problem per line)."""
    parts = [line.strip() for line in str(text).splitlines() if line.strip()]
    return "; ".join(parts) if parts else "(no message)"


def describe(exc: BaseException, user_types: tuple[type[BaseException], ...]) -> tuple[str, int]:
    """(the error line without `error: `, exit code) for `exc`."""
    phase = getattr(exc, "rollwise_where", None)
    where = f"{phase}: " if phase else ""
    if isinstance(exc, KeyboardInterrupt):
        return _interrupted(exc), EXIT_INTERRUPTED
    if is_disk_full(exc) and not isinstance(exc, user_types):
        name = f" writing {exc.filename}" if exc.filename else ""
        return f"{where}disk full{name}: free some space and resume with --resume RUN_DIR", EXIT_USER
    if isinstance(exc, user_types):
        message = one_line(str(exc))
        return (message if message.startswith(("step ", phase or "\0")) else where + message), EXIT_USER
    if isinstance(exc, MemoryError):
        return f"{where}out of memory: lower train.micro_batch_tokens or rollout.max_batch_size", EXIT_USER
    return f"{where}{type(exc).__name__}: {one_line(str(exc))} (an internal error: please report it)", EXIT_INTERNAL


def _interrupted(exc: BaseException) -> str:
    step = getattr(exc, "step", None)
    checkpoint = getattr(exc, "checkpoint", None)
    head = "interrupted (Ctrl-C)" if step is None else f"interrupted (Ctrl-C) after step {step}"
    if checkpoint is None:
        return f"{head}; no checkpoint was written yet: start the run again"
    run_dir = Path(checkpoint).parent.parent
    return f"{head}; newest checkpoint {checkpoint}: continue with rollwise train --resume {run_dir}"


def write_error_log(run_dir: Path | None, exc: BaseException) -> Path | None:
    """Append the traceback of `exc` to `RUN_DIR/error.log` (when the run directory exists)."""
    if run_dir is None or not Path(run_dir).is_dir():
        return None
    path = Path(run_dir) / ERROR_LOG
    try:
        with path.open("a") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            fh.write("".join(traceback.format_exception(exc)))
    except OSError:  # the disk may be the problem: the one-line error still goes out
        return None
    return path


@contextmanager
def guard(run_dir: Path | None, debug: bool = False) -> Iterator[None]:
    """Turn any exception in the block into one `error:` line and an exit code (see the module docstring)."""
    try:
        yield
    except typer.Exit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every error ends the same way
        if isinstance(exc, SystemExit):
            raise
        message, code = describe(exc, _user_error_types())
        log = write_error_log(run_dir, exc)
        details = getattr(exc, "traceback", None)  # e.g. the reward function's own traceback
        if details:
            typer.echo(str(details).rstrip(), err=True)
        if debug:
            typer.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
        elif log is not None and code != EXIT_INTERRUPTED:
            message += f" (traceback in {log})"
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=code) from None
