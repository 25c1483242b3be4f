"""How a command ends on an error: one `error:` line, a non-zero exit code, and the full traceback on file.

`guard(run_dir, debug)` wraps a command. Every exception leaves it as one line on stderr that names what
failed (the key, file, row, checkpoint or step, from the exception's own message) and what to do, and exit
code 2 (an input or state the user can fix), 1 (an internal error: a bug report) or 130 (Ctrl-C). The full
traceback goes to `RUN_DIR/error.log` when the run directory exists, and to stderr with `--debug`.
"""

from __future__ import annotations

import errno
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer

EXIT_USER, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 1, 130
ERROR_LOG = "error.log"


class UserError(Exception):
    """Base of the errors a user can fix (a bad config, data, model, checkpoint, reward, a NaN run...): the CLI
    shows its message as the one `error:` line with exit code 2. Each such error class also derives from the
    builtin it is (`class ConfigError(UserError, ValueError)`), so callers may catch either."""


def is_disk_full(exc: BaseException) -> bool:
    """True for "no space left" (or over quota / file-size limit), whichever library raised it."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return True
    text = str(exc)
    return "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text


USER_ERRORS = (UserError, FileNotFoundError)


def one_line(text: str) -> str:
    """Join a multi-line message into one line (config errors list one problem per line)."""
    parts = [line.strip() for line in str(text).splitlines() if line.strip()]
    return "; ".join(parts) if parts else "(no message)"


def describe(exc: BaseException, user_types: tuple[type[BaseException], ...] = USER_ERRORS) -> tuple[str, int]:
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
        message, code = describe(exc)
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
