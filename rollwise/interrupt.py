"""Ctrl-C during training: finish the step, save a checkpoint, then stop; a second Ctrl-C stops at once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C: the run stopped; `checkpoint` is the newest complete checkpoint (None: none yet)."""

    def __init__(self, step: int, checkpoint: Path | None):
        super().__init__(f"interrupted during step {step + 1}")
        self.step, self.checkpoint = step, checkpoint


class StopOnInterrupt:
    """Ctrl-C during an RL step (its logs, and an evaluation or checkpoint due after it, included) finishes that
    iteration, saves a checkpoint and then stops (`requested`); Ctrl-C outside one, or a second one, stops at once. Only installed in the main thread. `phase` names what the
    loop is doing, for the one-line error of anything that fails."""

    def __init__(self) -> None:
        self.in_step = False
        self.requested = False
        self.phase = "start"  # what the loop is doing, for error messages ("step 3", "evaluation at step 10")
        self._previous = None

    def __enter__(self) -> "StopOnInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        if not self.in_step or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nrollwise: Ctrl-C: finishing this step and saving a checkpoint, then stopping "
              "(Ctrl-C again stops at once)", flush=True)
