"""Requests handed to an engine's running `generate` call (engines with `caps.request_feed`).

Multi-turn episodes need this: an episode's next turn exists only once its environment has answered, which
happens while the engine is still decoding other sequences. With a feed, the next turn joins the running batch
(continuous batching across turns) instead of waiting for a new `generate` call.

The engine calls the feed on the thread that runs `generate`, once per iteration of its decode loop:

    new = feed.take(idle)   # requests to admit now; with idle=True (nothing running or waiting), it may block
    ...                     # until it has one or is done
    feed.done               # True: no request will come any more; generate returns once the running ones finish

`take` runs on the engine's thread, so a feed may do its own bookkeeping there (the episode runner does:
`rollwise.envs.episode`). `RequestFeed` is the plain version: a thread-safe queue that other threads `put` into.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

from rollwise.types import GenerationRequest

WAIT_S = 0.05  # an idle engine re-checks the feed this often (a Ctrl-C gets through)


class Feed(Protocol):
    """What `generate(..., feed=)` reads (see the module docstring)."""

    @property
    def done(self) -> bool: ...

    def take(self, idle: bool) -> list[GenerationRequest]: ...


class RequestFeed:
    """A thread-safe queue of requests for a running `generate` call: any thread `put`s; `close()` says no more
    will come; `fail(exc)` makes the engine's next `take` raise `exc` (a producer crashed)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[GenerationRequest] = deque()
        self._closed = False
        self._error: BaseException | None = None

    def put(self, request: GenerationRequest) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("RequestFeed.put after close()")
            self._queue.append(request)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error, self._closed = error, True
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        with self._cond:  # a failed feed is not done: the engine's next `take` raises its error
            return self._closed and not self._queue and self._error is None

    def take(self, idle: bool) -> list[GenerationRequest]:
        """Every request put so far; when `idle`, wait until there is one or the feed is closed."""
        with self._cond:
            while idle and not self._queue and not self._closed:
                self._cond.wait(WAIT_S)
            if self._error is not None:
                raise self._error
            out = list(self._queue)
            self._queue.clear()
            return out
