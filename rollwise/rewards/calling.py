"""Calling one reward function and checking what it returned: the layer under scoring and its worker processes.

`call_reward(fn, sample, timeout_s) -> RewardResult` runs `fn` under the time limit and turns its return value
(a `RewardResult`, a float, an int or a bool; numpy scalars and 0-d tensors too) into a checked `RewardResult`
of finite floats (`as_result`), or raises. `rollwise.rewards.scoring` calls it in this process and
`rollwise.rewards.isolate` in a worker process; both load rewards by name with `get_reward_fn`.

Time limit (`reward.timeout_s`, default 20 s). In-process scoring (the default) arms a SIGALRM timer around each
call (main thread only; math-verify inside the reward replaces it with its own bounded timer) and also checks
the elapsed time afterwards. The alarm raises `RewardTimeout` at the next point where the interpreter runs
Python signal handlers, so it stops:

- Python code: loops, recursion, sympy / math-verify work, `time.sleep`;
- blocking system calls that return on a signal: sockets, pipes, subprocess waits, `libc.sleep`;
- C code that checks for signals itself, such as `re` matching (catastrophic backtracking included).

It cannot stop, in-process:

- one long C call that never returns to the interpreter: a builtin looping in C (`sum(range(10**12))`), big-int
  or huge-string arithmetic, a C extension (numpy, a solver, a tokenizer) that does not check signals, C code
  that blocks SIGALRM; the call is marked failed (over the limit) only once it returns, which may be never;
- a reward that catches the `RewardTimeout` itself (`except BaseException:` / bare `except:`) and carries on;
  it is marked failed by the elapsed-time check when it returns;
- scoring outside the main thread: no timer there, only the check after the call.

`reward.isolate = true` runs the reward in a worker process (`rollwise.rewards.isolate.IsolatedReward`) that is
killed (SIGKILL) `KILL_GRACE_S` after `timeout_s` and replaced by a fresh one; that stops everything above.
"""

from __future__ import annotations

import math
import numbers
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

from rollwise.rewards.verifiers import REWARDS, RewardFn
from rollwise.types import RewardResult, Sample


class RewardTimeout(TimeoutError):
    """The reward function ran past its time limit."""


class RewardFailure(RuntimeError):
    """The reward function returned something unusable, or set `RewardResult.error`."""


class RemoteRewardError(RuntimeError):
    """The reward function failed in a worker process: `text` is its one-line error, `traceback_text` its trace."""

    def __init__(self, text: str, traceback_text: str) -> None:
        super().__init__(text)
        self.text, self.traceback_text = text, traceback_text


@contextmanager
def time_limit(timeout_s: float | None) -> Iterator[None]:
    """Raise RewardTimeout in the block after `timeout_s` seconds (main thread with SIGALRM only).

    An outer timer (e.g. pytest-timeout) is saved and re-armed with its remaining time afterwards.
    """
    usable = timeout_s and timeout_s > 0 and hasattr(signal, "setitimer")
    if not usable or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise RewardTimeout(f"reward function ran longer than {timeout_s} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            remaining = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, old_interval)


def _unwrap_scalar(value: Any) -> Any:
    """A numpy scalar or 0-d array / tensor as the Python number it holds; anything else unchanged."""
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return value.item()
    return value


def as_number(value: Any, what: str) -> float:
    """`value` as a finite float: bool -> 1.0 / 0.0, any real number (numpy's too); TypeError / ValueError else.

    `what` names the value in the error ("reward value", "reward part 'format' =")."""
    value = _unwrap_scalar(value)
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy numbers, Fraction, sympy's numbers
        raise TypeError(f"{what} is {type(value).__name__}, expected a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} {number!r} is not a finite number")
    return number


def as_result(returned: Any) -> RewardResult:
    """What a reward function returned, as a checked RewardResult of finite floats.

    RewardResult: checked (`error` set -> RewardFailure; `correct` True / False / None, `info` a dict, else
    TypeError), `correct` and `info` kept. bool: value 1.0 / 0.0, part `correct` the same. int / float / numpy
    scalar: the value, no parts. Anything else: TypeError. Non-finite: ValueError."""
    if isinstance(returned, RewardResult):
        if returned.error is not None:
            raise RewardFailure(str(returned.error))
        if not isinstance(returned.parts, dict):
            raise TypeError(f"RewardResult.parts is {type(returned.parts).__name__}, expected a dict of numbers")
        if not isinstance(returned.info, dict):
            raise TypeError(f"RewardResult.info is {type(returned.info).__name__}, expected a dict")
        correct = _unwrap_scalar(returned.correct)
        if correct is not None and not isinstance(correct, bool):
            raise TypeError(f"RewardResult.correct is {type(returned.correct).__name__}, expected True, False or None")
        value = as_number(returned.value, "reward value")
        parts = {str(name): as_number(part, f"reward part {name!r} =") for name, part in returned.parts.items()}
        info = {str(k): v for k, v in returned.info.items()}
        return RewardResult(value=value, parts=parts, correct=correct, info=info)
    scalar = _unwrap_scalar(returned)
    if isinstance(scalar, bool):
        return RewardResult(value=float(scalar), parts={"correct": float(scalar)})
    if not isinstance(scalar, numbers.Real):
        raise TypeError(f"reward function returned {type(returned).__name__}, expected a number, a bool or RewardResult")
    return RewardResult(value=as_number(scalar, "reward value"))


def call_reward(fn: RewardFn, sample: Sample, timeout_s: float | None) -> RewardResult:
    """Run `fn(sample)` under the time limit (in this process) and check what it returned."""
    start = time.monotonic()
    with time_limit(timeout_s):
        result = fn(sample)
    elapsed_s = time.monotonic() - start
    if timeout_s and elapsed_s > timeout_s:
        raise RewardTimeout(f"reward function took {elapsed_s:.1f} s, over the {timeout_s} s limit")
    return as_result(result)


def error_text(exc: BaseException) -> str:
    """'Type: message' of a reward failure (the worker's own text for one that failed in a worker)."""
    return exc.text if isinstance(exc, RemoteRewardError) else f"{type(exc).__name__}: {exc}"


def traceback_text(exc: BaseException) -> str:
    """The full traceback of a reward failure (the worker's for one that failed in a worker)."""
    if isinstance(exc, RemoteRewardError):
        return exc.traceback_text
    return "".join(traceback.format_exception(exc))


def decide_correct(result: RewardResult) -> bool:
    """The result's `correct` when set; else its part `correct` > 0.5 when present; else `value > 0`."""
    if result.correct is not None:
        return bool(result.correct)
    if "correct" in result.parts:
        return float(result.parts["correct"]) > 0.5
    return float(result.value) > 0


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a plugin 'pkg.module:fn'."""
    fn = REWARDS.get(name)
    if not callable(fn):
        raise TypeError(f"reward {name!r} is {type(fn).__name__}, not a function of a Sample")
    return fn


def with_format_weight(fn: RewardFn, weight: float) -> RewardFn:
    """`fn` plus `weight` x its `format` part (0 when absent, as for plain-number rewards). Correctness is decided
    on `fn`'s own result (`decide_correct`), before the bonus: a wrong answer in the right format stays wrong."""

    def add_bonus(returned: Any) -> Any:
        if isinstance(returned, BaseException) or (isinstance(returned, RewardResult) and returned.error is not None):
            return returned
        result = as_result(returned)
        bonus = weight * result.parts.get("format", 0.0)
        return RewardResult(value=result.value + bonus, parts=result.parts, error=None,
                            correct=decide_correct(result), info=result.info)

    def with_format(sample: Sample) -> RewardResult:
        return add_bonus(fn(sample))

    with_format.__name__ = f"{getattr(fn, '__name__', 'reward')}_with_format"
    many = getattr(fn, "score_many", None)
    if callable(many):  # keep the batch hook (rollwise.rewards.scoring)
        def score_many(samples: list[Sample], timeout_s: float | None) -> list[Any]:
            out = []
            for outcome in many(samples, timeout_s):
                try:
                    out.append(add_bonus(outcome))
                except Exception as exc:  # an unusable result fails its sample only
                    out.append(exc)
            return out

        with_format.score_many = score_many
        with_format.close = getattr(fn, "close", lambda: None)
    return with_format
