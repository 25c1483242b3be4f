"""Rewards in worker processes with a hard deadline (`reward.isolate = true`).

    fn = IsolatedReward("pkg.module:fn", format_weight=0.0, timeout_s=20.0, workers=1)
    metrics = score_samples(samples, fn, timeout_s)   # samples go to the workers, results come back
    fn.close()                                         # at the end of the run (also on errors)

Why: the in-process limit is a SIGALRM timer (`rollwise.rewards.calling`), which cannot stop one long C call
that never returns to the interpreter (a C loop holding the GIL, an extension that blocks signals).

How: each worker is a fresh interpreter (`sys.executable -c BOOTSTRAP`, the same as multiprocessing's 'spawn'
start but without re-running the parent's `__main__`, so an unguarded user script or a notebook works; never a
fork of the torch-threaded trainer). It gets the parent's `sys.path`, loads the reward by NAME (built-in or
`pkg.module:fn`) and scores one pickled `Sample` at a time under its own SIGALRM limit, so a Python-level
overrun comes back as an ordinary `RewardTimeout` with its traceback and the worker lives on. A worker still
busy `KILL_GRACE_S` after `timeout_s` is killed (SIGKILL), its sample fails with "reward function ran longer
than X s (worker killed)", and a fresh worker is started. A worker that dies (segfault, `os._exit`) fails its
sample the same way. Workers run in their own session (Ctrl-C reaches only the parent, which closes them) and,
on Linux, die with the thread that started them. Changes the reward makes to the sample in the worker are not
sent back; only its result is (`correct` and `info` included: rewards report through it, never the sample).
"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from rollwise.errors import UserError
from rollwise.rewards.calling import (
    RemoteRewardError,
    RewardFailure,
    RewardTimeout,
    call_reward,
    error_text,
    get_reward_fn,
    traceback_text,
    with_format_weight,
)
from rollwise.types import RewardResult, Sample

KILL_GRACE_S = 0.5  # a worker gets this long past timeout_s to report its own RewardTimeout before SIGKILL
START_TIMEOUT_S = 120.0  # a fresh worker must have imported the reward by then


class RewardWorkerError(UserError, RuntimeError):
    """A worker process could not start or could not load the reward function."""


def worker_main(conn: Connection, name: str, format_weight: float) -> None:
    """The worker: load reward `name`, report ("ready",), then answer each (sample, timeout_s) with
    ("ok", RewardResult) or ("error", one-line text, traceback) until it receives None."""
    try:
        fn = get_reward_fn(name)
        if format_weight != 0.0:
            fn = with_format_weight(fn, format_weight)
    except BaseException as exc:
        conn.send(("load_error", error_text(exc), traceback_text(exc)))
        return
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent went away
            return
        if job is None:
            return
        sample, timeout_s = job
        try:
            reply: tuple = ("ok", call_reward(fn, sample, timeout_s))
        except BaseException as exc:  # math-verify's TimeoutException derives from BaseException
            reply = ("error", error_text(exc), traceback_text(exc))
        try:
            conn.send(reply)
        except Exception as exc:  # the result would not pickle
            conn.send(("error", error_text(exc), "".join(traceback.format_exception(exc))))


# Run by `python -c` in the worker: take the pipe's fd from argv, read (sys.path, name, format_weight) with the
# standard library only (rollwise may be importable only through the parent's sys.path), then serve.
BOOTSTRAP = """
import sys
from multiprocessing.connection import Connection
try:  # Linux: the worker dies with the parent, even when the parent is SIGKILLed mid-call
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass
conn = Connection(int(sys.argv[1]))
sys.path[:], name, format_weight = conn.recv()
from rollwise.rewards.isolate import worker_main
worker_main(conn, name, format_weight)
"""


class _Worker:
    """One worker process (a fresh interpreter: no fork of the trainer, no re-run of the parent's `__main__`)
    and the parent's end of its socket pair."""

    def __init__(self, name: str, format_weight: float) -> None:
        self.conn, child_conn = Pipe(duplex=True)
        fd = child_conn.fileno()
        self.process = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, str(fd)], pass_fds=[fd],
                                        start_new_session=True)  # Ctrl-C in the terminal goes to the parent only
        child_conn.close()
        self.conn.send((list(sys.path), name, format_weight))
        self.ready = False

    def wait_ready(self, name: str) -> None:
        """Block until the worker has loaded the reward; RewardWorkerError when it cannot."""
        if self.ready:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            raise RewardWorkerError(f"reward.isolate: the worker for reward {name!r} did not start within "
                                    f"{START_TIMEOUT_S:g} s")
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            raise RewardWorkerError(f"reward.isolate: the worker for reward {name!r} exited at start "
                                    f"(exit code {self.process.wait(5.0)})") from None
        if message[0] == "load_error":
            raise RewardWorkerError(f"reward.isolate: the worker process cannot load reward {name!r}: {message[1]}; "
                                    "give reward.fn as a built-in name or 'package.module:function' importable "
                                    "from sys.path")
        self.ready = True

    def kill(self) -> None:
        """SIGKILL the process and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()

    def stop(self) -> None:
        """Ask the process to exit; kill it if it does not within a second."""
        try:
            self.conn.send(None)
            self.process.wait(timeout=1.0)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
    workers.clear()


class IsolatedReward:
    """A reward function run in a pool of `workers` spawned processes, each sample under a hard deadline.

    Callable like any `RewardFn` (one sample, `timeout_s` of the constructor; raises on failure);
    `score_batch` / `score_samples` use `score_many`, which spreads samples over the workers. Call `close()`
    when the run ends (a finalizer also stops the workers when the object is collected or at exit).
    """

    def __init__(self, name: str, format_weight: float = 0.0, timeout_s: float | None = 20.0,
                 workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"IsolatedReward needs at least one worker, got {workers}")
        self.name, self.format_weight, self.timeout_s = name, format_weight, timeout_s
        self.__name__ = f"isolated[{name}]"
        self._workers: list[_Worker] = [self._start() for _ in range(workers)]  # started now, awaited on use
        self.restarts = 0  # workers killed or found dead and replaced
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def _start(self) -> _Worker:
        return _Worker(self.name, self.format_weight)

    def _replace(self, index: int) -> None:
        self._workers[index].kill()
        self._workers[index] = self._start()
        self.restarts += 1

    def __call__(self, sample: Sample) -> RewardResult:
        outcome = self.score_many([sample], self.timeout_s)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def score_many(self, samples: list[Sample], timeout_s: float | None) -> list[RewardResult | BaseException]:
        """Each sample's checked RewardResult or the exception it failed with, in order.

        Raises RewardWorkerError only when a worker cannot load the reward (a config error, not a sample's)."""
        if not self._workers:
            raise RuntimeError(f"IsolatedReward {self.name!r} is closed")
        outcomes: list[RewardResult | BaseException | None] = [None] * len(samples)
        todo = deque(enumerate(samples))
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (sample index, kill deadline)
        try:
            while todo or busy:
                self._dispatch(todo, busy, outcomes, timeout_s)
                self._collect(busy, outcomes, timeout_s)
        except BaseException:  # Ctrl-C or a start failure: busy workers hold answers nobody will read
            for index in list(busy):
                self._replace(index)
            raise
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, todo: deque, busy: dict, outcomes: list, timeout_s: float | None) -> None:
        """Send the next samples to idle workers (waiting for a fresh worker to load the reward first)."""
        for index, worker in enumerate(self._workers):
            if not todo:
                return
            if index in busy:
                continue
            worker.wait_ready(self.name)
            position, sample = todo.popleft()
            try:
                worker.conn.send((sample, timeout_s))
            except (OSError, EOFError) as exc:  # the worker died while idle
                self._replace(index)
                outcomes[position] = RewardFailure(f"reward worker process was gone ({exc}); a fresh one was started")
                continue
            except Exception as exc:  # the sample would not pickle; nothing was written to the pipe
                outcomes[position] = TypeError(f"cannot send the sample to the reward worker: {error_text(exc)}")
                continue
            deadline = time.monotonic() + timeout_s + KILL_GRACE_S if timeout_s else float("inf")
            busy[index] = (position, deadline)

    def _collect(self, busy: dict, outcomes: list, timeout_s: float | None) -> None:
        """Wait for the first answer or deadline; record answers, kill and replace workers past their deadline."""
        if not busy:
            return
        wait_s = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
        conns = {self._workers[index].conn: index for index in busy}
        ready = wait(list(conns), timeout=None if wait_s == float("inf") else wait_s)
        for conn in ready:
            index = conns[conn]
            position, _ = busy.pop(index)
            outcomes[position] = self._receive(index)
        now = time.monotonic()
        for index, (position, deadline) in list(busy.items()):
            if now >= deadline:
                del busy[index]
                self._replace(index)
                outcomes[position] = RewardTimeout(f"reward function ran longer than {timeout_s} s (worker killed)")

    def _receive(self, index: int) -> RewardResult | BaseException:
        worker = self._workers[index]
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.process.wait()
            self._replace(index)
            return RewardFailure(f"reward worker process died (exit code {code}) while scoring; "
                                 "a fresh one was started")
        if reply[0] == "ok":
            return reply[1]
        return RemoteRewardError(reply[1], reply[2])

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._finalizer()

    def __enter__(self) -> IsolatedReward:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict:
        raise TypeError("an IsolatedReward holds worker processes and cannot be pickled; pass its name instead")
