"""Score samples with a reward function: failures are marked and counted, never scored 0.

A reward function takes a `Sample` and returns a `RewardResult(value, parts, error, correct, info)`, or just the
value: a float, an int or a bool (as TRL-style rewards do; numpy scalars and 0-d tensors too). A bool scores
1.0 / 0.0 with part `correct`. `sample.correct` is the result's `correct` when it says (True / False); else a
`correct` part > 0.5 when there is one; else `value > 0`. A reward never writes to the sample: what it wants
kept goes in `RewardResult.info`, merged into `sample.info` here (so it survives `reward.isolate` too). NaN /
Inf, a raised exception or a set `error` mark the sample FAILED with a one-line `reward_error` and the full
`reward_traceback`; it is counted in `reward/errors` and left out of the statistics and the update.

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

A run where every reward of `reward.max_failed_steps` steps in a row failed stops: `RewardFailureGuard`.
"""

from __future__ import annotations

import math
import numbers
import signal
import statistics
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

from rollwise.config import RewardConfig
from rollwise.rewards.verifiers import REWARDS, RewardFn
from rollwise.types import RewardResult, Sample, Status

DEFAULT_TIMEOUT_S = 20.0  # RewardConfig.timeout_s's default, for callers without a config
MAX_ERROR_CHARS = 200


class EnvironmentFailure(RuntimeError):
    """An episode's environment raised: the sample is marked failed like a crashing reward (and counted)."""


class RewardTimeout(TimeoutError):
    """The reward function ran past its time limit."""


class RewardFailure(RuntimeError):
    """The reward function returned something unusable, or set `RewardResult.error`."""


class RemoteRewardError(RuntimeError):
    """The reward function failed in a worker process: `text` is its one-line error, `traceback_text` its trace."""

    def __init__(self, text: str, traceback_text: str) -> None:
        super().__init__(text)
        self.text, self.traceback_text = text, traceback_text


class RewardsFailingError(RuntimeError):
    """Every reward of `reward.max_failed_steps` steps in a row failed; `.traceback` is the first failure's."""

    def __init__(self, message: str, traceback_text: str | None) -> None:
        super().__init__(message)
        self.traceback = traceback_text


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


def _error_message(exc: BaseException) -> str:
    text = error_text(exc)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def traceback_text(exc: BaseException) -> str:
    """The full traceback of a reward failure (the worker's for one that failed in a worker)."""
    if isinstance(exc, RemoteRewardError):
        return exc.traceback_text
    return "".join(traceback.format_exception(exc))


def mark_failed(sample: Sample, exc: BaseException) -> None:
    """Mark the sample FAILED: no reward, a one-line `reward_error` and the full `reward_traceback`."""
    sample.status = Status.FAILED
    sample.reward, sample.reward_parts, sample.correct = None, {}, None
    sample.reward_error = _error_message(exc)
    sample.reward_traceback = traceback_text(exc)


def decide_correct(result: RewardResult) -> bool:
    """The result's `correct` when set; else its part `correct` > 0.5 when present; else `value > 0`."""
    if result.correct is not None:
        return bool(result.correct)
    if "correct" in result.parts:
        return float(result.parts["correct"]) > 0.5
    return float(result.value) > 0


def apply_result(sample: Sample, result: RewardResult) -> None:
    """Set the sample's reward, parts, `correct` (`decide_correct`) and merge `result.info` into `sample.info`."""
    sample.reward = float(result.value)
    sample.reward_parts = {k: float(v) for k, v in result.parts.items()}
    episode = getattr(sample, "episode", None)
    if episode is not None:  # the environment's per-episode parts, for shaping (rollwise.envs.episode)
        sample.reward_parts.update({f"env/{k}": float(v) for k, v in episode.parts.items()})
    sample.reward_error, sample.reward_traceback = None, None
    sample.correct = decide_correct(result)
    sample.info.update(result.info)


def is_isolated(fn: Any) -> bool:
    from rollwise.rewards.isolate import IsolatedReward

    return isinstance(fn, IsolatedReward)


def score_sample(sample: Sample, fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Set the sample's reward, parts and `correct`; on failure mark it FAILED. True when it was scored."""
    return bool(score_batch([sample], fn, timeout_s))


def score_batch(samples: list[Sample], fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> list[Sample]:
    """Score every sample (in the calling thread, or in `fn`'s worker processes); return those scored.

    An `IsolatedReward` with several workers scores samples in parallel; `timeout_s` holds per sample."""
    failed_env = {i: exc for i, exc in ((i, env_failure(s)) for i, s in enumerate(samples)) if exc is not None}
    todo = [s for i, s in enumerate(samples) if i not in failed_env]
    if is_isolated(fn):
        outcomes = fn.score_many(todo, timeout_s) if todo else []  # raises only when a worker cannot load the reward
    else:
        outcomes = [_call_in_process(fn, s, timeout_s) for s in todo]
    outcomes = iter(outcomes)
    outcomes = [failed_env[i] if i in failed_env else next(outcomes) for i in range(len(samples))]
    scored = []
    for sample, outcome in zip(samples, outcomes):
        if isinstance(outcome, RewardResult):
            apply_result(sample, outcome)
            scored.append(sample)
        else:
            mark_failed(sample, outcome)
    return scored


def env_failure(sample: Sample) -> EnvironmentFailure | None:
    """Why the sample's episode cannot be scored: its environment raised, or gave a part that is NaN / Inf
    (summed into `env/<part>` for shaping, it would reach the update); None when it can."""
    episode = getattr(sample, "episode", None)
    if episode is None:
        return None
    if episode.error:
        return EnvironmentFailure(episode.error)
    bad = sorted(k for k, v in episode.parts.items() if not math.isfinite(float(v)))
    if bad:
        return EnvironmentFailure(f"the environment's reward parts {bad} are not finite numbers "
                                  f"({', '.join(f'{k}={episode.parts[k]!r}' for k in bad)})")
    return None


def _call_in_process(fn: RewardFn, sample: Sample, timeout_s: float | None) -> RewardResult | BaseException:
    try:
        return call_reward(fn, sample, timeout_s)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # math-verify's TimeoutException derives from BaseException
        return exc


def reward_metrics(scored: list[Sample], num_samples: int) -> dict[str, float]:
    """`reward/` metrics: mean, std, accuracy over scored samples; error count and fraction; part means."""
    errors = num_samples - len(scored)
    metrics = {"reward/errors": float(errors), "reward/error_frac": errors / num_samples if num_samples else 0.0}
    if not scored:
        return metrics
    values = [s.reward for s in scored if s.reward is not None]
    metrics["reward/mean"] = statistics.fmean(values)
    metrics["reward/std"] = statistics.pstdev(values)
    metrics["reward/accuracy"] = sum(bool(s.correct) for s in scored) / len(scored)
    names = sorted({name for s in scored for name in s.reward_parts})
    for name in names:
        parts = [s.reward_parts[name] for s in scored if name in s.reward_parts]
        metrics[f"reward/part/{name}"] = statistics.fmean(parts)
    return metrics


def score_samples(samples: list[Sample], fn: RewardFn, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> dict[str, float]:
    """Score every sample (see `score_batch`); return `reward/` metrics (mean/std/accuracy omitted if none scored)."""
    return reward_metrics(score_batch(samples, fn, timeout_s), len(samples))


class RewardFailureGuard:
    """Stops a run whose rewards all fail: `observe` raises RewardsFailingError once every reward of
    `max_failed_steps` steps in a row failed (`reward.max_failed_steps`). A step in which one sample was scored
    resets the count; a step with no samples leaves it as it is. The error quotes the streak's first failure.

    State (`state_dict` / `load_state_dict`): the streak and its first failure, so a resumed run keeps counting.
    """

    def __init__(self, max_failed_steps: int) -> None:
        if max_failed_steps < 1:
            raise ValueError(f"reward.max_failed_steps must be at least 1, got {max_failed_steps}")
        self.max_failed_steps = max_failed_steps
        self.streak = 0
        self.first_error: str | None = None
        self.first_traceback: str | None = None

    def observe(self, step: int, samples_scored: int, samples_failed: int,
                first_failed_sample: Sample | None) -> None:
        """Count step `step`: `samples_scored` rewards succeeded, `samples_failed` failed (the first of them
        `first_failed_sample`). Raises RewardsFailingError when the streak of all-failed steps reaches the limit."""
        if samples_scored > 0:
            self.streak, self.first_error, self.first_traceback = 0, None, None
            return
        if samples_failed == 0:
            return
        if self.streak == 0:
            sample = first_failed_sample
            self.first_error = (sample.reward_error if sample is not None else None) or "unknown reward error"
            self.first_traceback = sample.reward_traceback if sample is not None else None
        self.streak += 1
        if self.streak >= self.max_failed_steps:
            raise RewardsFailingError(
                f"reward: every reward failed for {self.streak} steps in a row (step {step}): {self.first_error}; "
                "fix reward.fn (the traceback of that first failure follows)",
                self.first_traceback)

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "first_error": self.first_error, "first_traceback": self.first_traceback}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.first_error, self.first_traceback = state.get("first_error"), state.get("first_traceback")


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a plugin 'pkg.module:fn'."""
    fn = REWARDS.get(name)
    if not callable(fn):
        raise TypeError(f"reward {name!r} is {type(fn).__name__}, not a function of a Sample")
    return fn


def with_format_weight(fn: RewardFn, weight: float) -> RewardFn:
    """`fn` plus `weight` x its `format` part (0 when absent, as for plain-number rewards). Correctness is decided
    on `fn`'s own result (`decide_correct`), before the bonus: a wrong answer in the right format stays wrong."""

    def with_format(sample: Sample) -> RewardResult:
        returned = fn(sample)
        if isinstance(returned, RewardResult) and returned.error is not None:
            return returned
        result = as_result(returned)
        bonus = weight * result.parts.get("format", 0.0)
        return RewardResult(value=result.value + bonus, parts=result.parts, error=None,
                            correct=decide_correct(result), info=result.info)

    with_format.__name__ = f"{getattr(fn, '__name__', 'reward')}_with_format"
    return with_format


def build_reward_fn(cfg: RewardConfig, default_reward: str) -> RewardFn:
    """The configured reward (`reward.fn`, else the prompt source's default), plus `format_weight` * format part.

    With `reward.isolate`, an `IsolatedReward` (worker process; call `.close()` at the end of the run) that
    loads the reward by name in the worker; the name is resolved here first, so a typo fails at once."""
    name = cfg.fn or default_reward
    fn = get_reward_fn(name)
    if cfg.isolate:
        from rollwise.rewards.isolate import IsolatedReward

        return IsolatedReward(name, cfg.format_weight, timeout_s=cfg.timeout_s)
    return fn if cfg.format_weight == 0.0 else with_format_weight(fn, cfg.format_weight)
