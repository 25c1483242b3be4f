"""One clear error for a Ray actor of rollwise (an engine worker or a trainer rank) that failed or died."""

from __future__ import annotations

import re

_MAX_LINE = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the actor's name in its error text


class WorkerError(RuntimeError):
    """An engine worker or trainer rank failed (its method raised) or died (its process is gone).

    `label` names it ("engine worker 1", "trainer rank 2"); `remote_traceback` is Ray's full text of the
    remote error (the message shows only its last line).
    """

    def __init__(self, label: str, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.label = label
        self.remote_traceback = remote_traceback


def last_line(text: str) -> str:
    """The last non-empty line of a traceback or of Ray's error text (the exception, or why the actor died)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = lines[-1] if lines else "no message"
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."  # Ray's death notes run long


def worker_error(label: str, err: BaseException) -> WorkerError:
    """`err` (a Ray error from `label`'s call) as one line: '<label> died: ...' or '<label> failed: ...'."""
    import ray.exceptions as rex

    text = _ANSI.sub("", str(err))
    if isinstance(err, rex.RayActorError) and not isinstance(err, rex.RayTaskError):
        what = "died"
    else:
        what = "failed"
    message = (f"{label} {what}: {last_line(text)} (the full remote traceback is in this error's "
               "remote_traceback and in the Ray logs)")
    return WorkerError(label, message, text)
