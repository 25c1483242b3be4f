"""Tinker's futures: every training and sampling call is queued and answered `{"request_id"}` at once; the SDK
then polls `POST /api/v1/retrieve_future` until the result is there.

One `FutureWorker` thread runs the calls in the order they arrived (the SDK sends a training client's calls in
its own order, one after another), so forward_backward, optim_step, save and sample never overlap on the device.
Sample calls of one sampling client queued next to each other run as one engine call (continuous batching across
HTTP requests, as `rollwise serve` does), except two with the same seed, which would share a generator.
A call's outcome is an `Outcome`: a JSON result, a protocol-buffer result (forward/backward and sampling, which
the SDK asks for as `application/x-protobuf`), or an error with Tinker's category (`user`: the request was
wrong, the message says what to change; `server`: rollwise failed, the traceback goes to stderr). Outcomes are
kept `ttl_s` after they finish (a minute once retrieved), so a client that polls again after a dropped connection
still finds its result.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from rollwise.errors import UserError, one_line
from rollwise.serve.jobs import QueueFull, ServerStopped
from rollwise.serve.protocol import BadRequest


@dataclass
class Outcome:
    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"  # Tinker's RequestErrorCategory: user, server, unknown


@dataclass
class Call:
    """One queued call. `batch` (a key) marks calls that may run together: consecutive queued calls with the same
    key and no seed in common go to ONE `run_batch(items)` (their `item`s), which returns an Outcome per item."""

    request_id: str
    what: str
    fn: Callable[[], Outcome] | None
    future: Future
    batch: Hashable | None = None
    item: Any = None
    run_batch: Callable[[list], list[Outcome]] | None = None
    seeds: frozenset = frozenset()


class FutureWorker:
    """A thread that runs queued calls one at a time (or a batch of sample calls at a time) and keeps their
    outcomes by request id."""

    def __init__(self, max_queued: int = 256, ttl_s: float = 3600.0, max_batch: int = 256):
        self.max_queued, self.ttl_s, self.max_batch = max_queued, ttl_s, max_batch
        self._queue: deque[Call] = deque()
        self._ready = threading.Condition()
        self._futures: dict[str, Future] = {}
        self._done_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self.running: str | None = None
        self._thread = threading.Thread(target=self._loop, name="rollwise-tinker-worker", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[], Outcome] | None = None, *, batch: Hashable | None = None,
               item: Any = None, run_batch: Callable[[list], list[Outcome]] | None = None,
               seeds: frozenset = frozenset()) -> str:
        """Queue `fn` (named `what` in error lines), or `item` for `run_batch` with the calls of the same `batch`
        key next to it; returns the request id the SDK polls."""
        request_id = f"req-{uuid.uuid4().hex}"
        future: Future = Future()
        with self._ready:
            if self._stopped:
                raise ServerStopped("the server is stopping")
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"serve.max_queued_requests = {self.max_queued} calls are waiting for the device; "
                                "retry later")
            with self._lock:
                self._prune()
                self._futures[request_id] = future
            self._queue.append(Call(request_id, what, fn, future, batch, item, run_batch, seeds))
            self._ready.notify()
        return request_id

    def get(self, request_id: str) -> Future | None:
        with self._lock:
            return self._futures.get(request_id)

    def retrieved(self, request_id: str, keep_s: float = 60.0) -> None:
        """The SDK has the result: keep it only `keep_s` more (for a poll repeated after a dropped connection)."""
        with self._lock:
            if request_id in self._done_at:
                self._done_at[request_id] = min(self._done_at[request_id], time.monotonic() - self.ttl_s + keep_s)

    def queued(self) -> int:
        return len(self._queue)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._ready:
            self._stopped = True
            self._ready.notify()
        self._thread.join(timeout_s)

    def _prune(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._done_at.items() if now - t > self.ttl_s]:
            self._futures.pop(rid, None)
            self._done_at.pop(rid, None)

    def _next(self) -> list[Call] | None:
        """The next call, with the batchable calls queued right behind it; None once stopped."""
        with self._ready:
            while not self._queue and not self._stopped:
                self._ready.wait()
            if self._stopped:
                return None
            calls = [self._queue.popleft()]
            seeds = set(calls[0].seeds)
            while (calls[0].batch is not None and self._queue and self._queue[0].batch == calls[0].batch
                   and not seeds & self._queue[0].seeds and len(calls) < self.max_batch):
                seeds |= self._queue[0].seeds
                calls.append(self._queue.popleft())
            return calls

    def _loop(self) -> None:
        while (calls := self._next()) is not None:
            head = calls[0]
            self.running = head.what
            if head.run_batch is None:
                outcomes = [run_call(head.what, head.fn)]
            else:
                outcomes = run_call(head.what, lambda: head.run_batch([c.item for c in calls]), len(calls))
            for call, outcome in zip(calls, outcomes):
                call.future.set_result(outcome)
            self.running = None
            with self._lock:
                for call in calls:
                    self._done_at[call.request_id] = time.monotonic()
        with self._ready:  # stopping: answer what is left
            left, self._queue = list(self._queue), deque()
        for call in left:
            call.future.set_result(Outcome(error="the server stopped before this call ran", category="server"))


def run_call(what: str, fn: Callable, calls: int | None = None):
    """`fn()`, its exceptions turned into an error Outcome (one per call of a batch when `calls` is given): a
    user's mistake in one line, anything else one line here and the traceback on stderr."""
    try:
        return fn()
    except (BadRequest, UserError) as exc:
        failed = Outcome(error=f"{what}: {one_line(str(exc))}", category="user")
    except Exception as exc:  # rollwise failed on a valid request
        print(f"rollwise serve: {what} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        failed = Outcome(error=f"{what}: {type(exc).__name__}: {one_line(str(exc))}", category="server")
    return failed if calls is None else [failed] * calls
